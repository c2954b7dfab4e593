"""A CPU decode-attention kernel that reads the KV block pool in place (no gather), built on first use.

Decode attention over a paged cache needs each row's keys from the blocks of its table. Gathering
them into a contiguous span with torch costs as much memory traffic as the attention itself (measured
on the 2-core AVX2 machine, SmolLM2's 9/3 heads of 64, B = 64, 160 positions, 2 threads: attention
over contiguous slots 1.9 ms, gather 1.0 ms more, and the gathered layout's attention 2.5 ms). This
kernel walks each row's table instead, as vLLM-CPU's paged attention does: for each (row, kv head),
in parallel over OpenMP threads (torch's own runtime: the library links ``libgomp.so.1``, the soname
torch has loaded), the scores of the group's query heads against the row's valid keys, a softmax, and
the weighted sum of the values (dot products summed in fp64, each block's weighted sum in fp32 and the
blocks' in fp64: the engine's log-probs stay within 1e-5 of the trainer's forward, as with matmuls).
It reads only the ``lengths[b]`` valid keys of each row.

The C source below is compiled with the system C compiler (``cc -O3 -march=native -fopenmp``) into
``$HYBRIDFLOW_KERNEL_CACHE`` (default ``~/.cache/hybridflow/kernels``), named by a digest of the
source, the compiler command and this CPU's flags, so a cache shared between machines never hands
an AVX-512 build to an AVX2 CPU. :func:`paged_kernel` returns None where no compiler works (said
once, with the reason, in ``KERNEL_ERROR``), or with ``HYBRIDFLOW_PAGED_KERNEL=0``: attention then
gathers the span with torch (:func:`.attention.gathered_decode_attention`), slower but the same math.

Keys and values are fp32 or bf16 (``uint16``, widened exactly); queries and the output are fp32.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float widen_f32(float x) { return x; }
static inline float widen_bf16(uint16_t x) {
    uint32_t u = ((uint32_t)x) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#define PAGED_DECODE(NAME, T, WIDEN)                                                                   \
void NAME(const float* q, const T* kpool, const T* vpool, const int64_t* table, const int64_t* lengths, \
          float* out, int64_t B, int64_t nh, int64_t nkv, int64_t hd, int64_t num_blocks, int64_t bs,  \
          int64_t width, float scale, int64_t max_len, int64_t threads) {                              \
    const int64_t g = nh / nkv;                                                                        \
    _Pragma("omp parallel num_threads(threads)")                                                       \
    {                                                                                                  \
        float* scores = (float*)malloc(sizeof(float) * g * (max_len + 1));                             \
        float* maxes = (float*)malloc(sizeof(float) * g);                                              \
        double* acc_out = (double*)malloc(sizeof(double) * g * hd);                                    \
        float* part = (float*)malloc(sizeof(float) * g * hd);                                          \
        _Pragma("omp for schedule(static)")                                                            \
        for (int64_t item = 0; item < B * nkv; item++) {                                               \
            const int64_t b = item / nkv, h = item % nkv, len = lengths[b];                            \
            const float* qb = q + (b * nh + h * g) * hd;                                               \
            const int64_t* row = table + b * width;                                                    \
            for (int64_t j = 0; j < g; j++) maxes[j] = -INFINITY;                                      \
            for (int64_t t = 0; t < len; t++) {                                                        \
                const T* k = kpool + ((h * num_blocks + row[t / bs]) * bs + t % bs) * hd;              \
                for (int64_t j = 0; j < g; j++) {                                                      \
                    const float* qj = qb + j * hd;                                                     \
                    double acc[4] = {0, 0, 0, 0};                                                      \
                    int64_t d = 0;                                                                     \
                    for (; d + 4 <= hd; d += 4)                                                        \
                        for (int u = 0; u < 4; u++) acc[u] += (double)qj[d + u] * WIDEN(k[d + u]);     \
                    double sum = (acc[0] + acc[2]) + (acc[1] + acc[3]);                                \
                    for (; d < hd; d++) sum += (double)qj[d] * WIDEN(k[d]);                            \
                    const float s = (float)(sum * scale);                                              \
                    scores[j * len + t] = s;                                                           \
                    if (s > maxes[j]) maxes[j] = s;                                                    \
                }                                                                                      \
            }                                                                                          \
            for (int64_t j = 0; j < g; j++) {                                                          \
                double sum = 0.0;                                                                      \
                float* sc = scores + j * len;                                                          \
                for (int64_t t = 0; t < len; t++) { sc[t] = expf(sc[t] - maxes[j]); sum += sc[t]; }    \
                const float inv = (float)(1.0 / sum);                                                  \
                for (int64_t t = 0; t < len; t++) sc[t] *= inv;                                        \
            }                                                                                          \
            memset(acc_out, 0, sizeof(double) * g * hd);                                               \
            for (int64_t first = 0; first < len; first += bs) {  /* a block's sum in fp32, then fp64 */ \
                memset(part, 0, sizeof(float) * g * hd);                                               \
                const int64_t last = first + bs < len ? first + bs : len;                              \
                for (int64_t t = first; t < last; t++) {                                               \
                    const T* v = vpool + ((h * num_blocks + row[t / bs]) * bs + t % bs) * hd;          \
                    for (int64_t j = 0; j < g; j++) {                                                  \
                        const float w = scores[j * len + t];                                           \
                        float* o = part + j * hd;                                                      \
                        for (int64_t d = 0; d < hd; d++) o[d] += w * WIDEN(v[d]);                      \
                    }                                                                                  \
                }                                                                                      \
                for (int64_t i = 0; i < g * hd; i++) acc_out[i] += part[i];                            \
            }                                                                                          \
            for (int64_t j = 0; j < g; j++)                                                            \
                for (int64_t d = 0; d < hd; d++)                                                       \
                    out[(b * nh + h * g + j) * hd + d] = (float)acc_out[j * hd + d];                   \
        }                                                                                              \
        free(scores);                                                                                  \
        free(maxes);                                                                                   \
        free(acc_out);                                                                                 \
        free(part);                                                                                    \
    }                                                                                                  \
}

PAGED_DECODE(paged_decode_f32, float, widen_f32)
PAGED_DECODE(paged_decode_bf16, uint16_t, widen_bf16)
"""

_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared"]
KERNEL_ERROR: str | None = None  # why the kernel is not in use (None: built, or not asked for yet)


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        return ""


def _cache_dir() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hybridflow" / "kernels"
    return Path(os.environ.get("HYBRIDFLOW_KERNEL_CACHE") or default)


def _build() -> ctypes.CDLL:
    compiler = os.environ.get("CC", "cc")
    digest = hashlib.sha256("\n".join([_SOURCE, compiler, *_FLAGS, _cpu_flags()]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"paged_decode_{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as work:
            source = Path(work) / "paged_decode.c"
            source.write_text(_SOURCE)
            built = Path(work) / target.name
            done = subprocess.run(
                [compiler, *_FLAGS, str(source), "-o", str(built), "-lm"],
                capture_output=True,
                text=True,
                timeout=120,
            )
            if done.returncode != 0:
                raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-400:]}")
            os.replace(built, target)  # atomic: a concurrent builder finds a whole library or none
    library = ctypes.CDLL(str(target))
    pointer, integer = ctypes.c_void_p, ctypes.c_int64
    for name in ("paged_decode_f32", "paged_decode_bf16"):
        function = getattr(library, name)
        function.restype = None
        function.argtypes = [pointer] * 6 + [integer] * 7 + [ctypes.c_float, integer, integer]
    return library


@functools.cache
def paged_kernel() -> ctypes.CDLL | None:
    """The built kernel library, or None (``KERNEL_ERROR`` says why; torch's gathered path is used)."""
    global KERNEL_ERROR
    if os.environ.get("HYBRIDFLOW_PAGED_KERNEL", "1") == "0":
        KERNEL_ERROR = "HYBRIDFLOW_PAGED_KERNEL=0"
        return None
    try:
        return _build()
    except Exception as error:  # noqa: BLE001 - no compiler: the torch path computes the same attention
        KERNEL_ERROR = f"{type(error).__name__}: {error}"
        warnings.warn(
            f"the paged decode-attention kernel could not be built ({KERNEL_ERROR}); decoding with torch's "
            "gathered span (slower)",
            stacklevel=2,
        )
        return None


def kernel_handles(dtype: torch.dtype) -> bool:
    """Whether the kernel reads a pool of ``dtype`` (fp32, bf16) and is available."""
    return dtype in (torch.float32, torch.bfloat16) and paged_kernel() is not None


def paged_decode(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    table: torch.Tensor,
    lengths: torch.Tensor,
) -> torch.Tensor:
    """q (B, nh, 1, hd); keys, values (nkv, num_blocks, block_size, hd) (the pool of one layer);
    table (B, W) int64 block ids; lengths (B,) int64: row b attends to its positions ``0..lengths[b]``
    (``lengths[b] + 1`` keys, within its table) → (B, nh, 1, hd) in q's dtype."""
    batch, num_heads, _, head_dim = q.shape
    num_kv_heads, num_blocks, block_size, _ = keys.shape
    query = q.reshape(batch, num_heads, head_dim).float().contiguous()
    out = torch.empty(batch, num_heads, head_dim, dtype=torch.float32)
    counts = (lengths + 1).contiguous()
    table = table.contiguous()
    library = paged_kernel()
    function = library.paged_decode_f32 if keys.dtype == torch.float32 else library.paged_decode_bf16
    function(
        query.data_ptr(),
        keys.data_ptr(),
        values.data_ptr(),
        table.data_ptr(),
        counts.data_ptr(),
        out.data_ptr(),
        batch,
        num_heads,
        num_kv_heads,
        head_dim,
        num_blocks,
        block_size,
        table.shape[1],
        head_dim**-0.5,
        table.shape[1] * block_size,
        torch.get_num_threads(),
    )
    return out.view(batch, num_heads, 1, head_dim).to(q.dtype)
