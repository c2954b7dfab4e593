"""A CPU decode-attention kernel that reads the KV block pool in place (no gather), built on first use.

Decode attention over a paged cache needs each row's keys from the blocks of its table. Gathering
them into a contiguous span with torch costs as much memory traffic as the attention itself (measured
on the 2-core AVX2 machine, SmolLM2's 9/3 heads of 64, B = 64, 160 positions, 2 threads: attention
over contiguous slots 1.9 ms, gather 1.0 ms more, and the gathered layout's attention 2.5 ms). This
kernel walks each row's table instead, as vLLM-CPU's paged attention does: for each (row, kv head),
in parallel over OpenMP threads (torch's own runtime: the library links ``libgomp.so.1``, the soname
torch has loaded), the scores of the group's query heads against the row's valid keys, a softmax, and
the weighted sum of the values. It reads only the ``lengths[b]`` valid keys of each row.

Rounding is a blocked matmul's, as the trainer's forward has it: each dot product over 8 fp32 lanes
summed as a tree, the softmax's sum in fp64, each block's weighted sum of values in fp32 and the
blocks' in fp64, so the engine's log-probs stay within 1e-5 of the trainer's. The dot products run
four keys at a time in GCC/Clang vector extensions (AVX2 registers here, SSE/NEON pairs elsewhere):
measured on the 2-core AVX2 AMD EPYC, 32 rows x 2 KV heads of 64 x 70 positions, one thread, 450 us
per call with one fp64 running sum per dot product, 210 us with these (``-fno-math-errno`` lets
``expf`` inline, ~50 us of it). In the engine the pool is not in cache (4 layers' keys and values,
the weights between them): there a call reads at DRAM speed, and a block is a 4 KiB page (16 fp32
positions of 64), where hardware prefetchers stop. So while one (row, kv head) is computed, the next
one's keys and values are prefetched into L2, and with head sizes that are a multiple of 64 each
block's weighted sum of values is kept in eight registers per 64 lanes (the same additions in the same
order: the same bits). Measured alternating on the 2-core AVX2 AMD EPYC, 32 rows x 2 KV heads of 64 x
~110 positions, one thread: in cache 290-440 -> 255-280 us, with 8 pools cycled (out of cache)
1.06-1.33 -> 0.78-0.95 ms per call.

The C source below is compiled with the system C compiler (``cc -O3 -march=native -fopenmp``) into
``$HYBRIDFLOW_KERNEL_CACHE`` (default ``~/.cache/hybridflow/kernels``), named by a digest of the
source, the compiler command and this CPU's flags, so a cache shared between machines never hands
an AVX-512 build to an AVX2 CPU. :func:`paged_kernel` returns None where no compiler works (said
once, with the reason, in ``KERNEL_ERROR``), or with ``HYBRIDFLOW_PAGED_KERNEL=0``: attention then
gathers the span with torch (:func:`.attention.gathered_decode_attention`), slower but the same math.

Keys and values are fp32 or bf16 (``uint16``, widened exactly); queries and the output are fp32.

A sliding window (Mistral, Gemma) passes each row's first key (``starts``, (B,)): the row reads keys
``starts[b] .. lengths[b]`` only, its first block from the window's offset in it, with the same rounding
(NULL: from 0, as before). A logit softcap (Gemma 2) maps the scaled scores to ``cap * tanh(s / cap)``
before the softmax (0: none). Neither touches the dot-product or accumulation loops.
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

/* GCC/Clang vector extensions: 8 fp32 lanes (one AVX2 register; two SSE/NEON ones elsewhere) */
typedef float v8f __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));

static inline float widen_f32(float x) { return x; }
static inline float widen_bf16(uint16_t x) {
    uint32_t u = ((uint32_t)x) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
/* eight consecutive elements as fp32 lanes (unaligned; bf16 widened exactly) */
static inline v8f load8_f32(const float* p) {
    v8f x;
    memcpy(&x, p, 32);
    return x;
}
static inline v8f load8_bf16(const uint16_t* p) {
    v8h h;
    memcpy(&h, p, 16);
    v8u u = __builtin_convertvector(h, v8u) << 16;
    v8f x;
    memcpy(&x, &u, 32);
    return x;
}
/* bytes from p into the cache ahead of their use (locality 2: L2; 1: the outer caches) */
#define prefetch_range(p, bytes, locality)                                                              \
    do {                                                                                               \
        const char* from_ = (const char*)(p);                                                          \
        for (int64_t at_ = 0; at_ < (bytes); at_ += 64) __builtin_prefetch(from_ + at_, 0, (locality)); \
    } while (0)
static inline float reduce8(v8f a) {
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

/* SCORES: one query head q (hd) against n keys k (n, hd) into s (n), times scale. Four keys at a
   time, each over 8 fp32 lanes added as a tree (a blocked matmul's rounding), so four independent
   chains keep the FMA units busy; the hd % 8 tail in one more lane sum.
   ACCUMULATE: part (hd) += w * v (hd). */
#define PAGED_DECODE(NAME, T, WIDEN, LOAD8)                                                            \
static void NAME##_scores(const float* q, const T* k, int64_t n, int64_t hd, float scale, float* s) {   \
    const int64_t hd8 = hd & ~(int64_t)7;                                                              \
    int64_t t = 0;                                                                                     \
    for (; t + 4 <= n; t += 4) {                                                                       \
        const T *k0 = k + t * hd, *k1 = k0 + hd, *k2 = k1 + hd, *k3 = k2 + hd;                         \
        v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};                                                    \
        for (int64_t d = 0; d < hd8; d += 8) {                                                         \
            const v8f x = load8_f32(q + d);                                                            \
            a0 += x * LOAD8(k0 + d);                                                                   \
            a1 += x * LOAD8(k1 + d);                                                                   \
            a2 += x * LOAD8(k2 + d);                                                                   \
            a3 += x * LOAD8(k3 + d);                                                                   \
        }                                                                                              \
        float r0 = 0, r1 = 0, r2 = 0, r3 = 0;                                                          \
        for (int64_t d = hd8; d < hd; d++) {                                                           \
            r0 += q[d] * WIDEN(k0[d]);                                                                 \
            r1 += q[d] * WIDEN(k1[d]);                                                                 \
            r2 += q[d] * WIDEN(k2[d]);                                                                 \
            r3 += q[d] * WIDEN(k3[d]);                                                                 \
        }                                                                                              \
        s[t] = (reduce8(a0) + r0) * scale;                                                             \
        s[t + 1] = (reduce8(a1) + r1) * scale;                                                         \
        s[t + 2] = (reduce8(a2) + r2) * scale;                                                         \
        s[t + 3] = (reduce8(a3) + r3) * scale;                                                         \
    }                                                                                                  \
    for (; t < n; t++) {                                                                               \
        const T* k0 = k + t * hd;                                                                      \
        v8f a0 = {0};                                                                                  \
        for (int64_t d = 0; d < hd8; d += 8) a0 += load8_f32(q + d) * LOAD8(k0 + d);                   \
        float r0 = 0;                                                                                  \
        for (int64_t d = hd8; d < hd; d++) r0 += q[d] * WIDEN(k0[d]);                                  \
        s[t] = (reduce8(a0) + r0) * scale;                                                             \
    }                                                                                                  \
}                                                                                                      \
static inline void NAME##_accumulate(float* part, float w, const T* v, int64_t hd) {                   \
    const int64_t hd8 = hd & ~(int64_t)7;                                                              \
    const v8f wv = {w, w, w, w, w, w, w, w};                                                           \
    for (int64_t d = 0; d < hd8; d += 8) {                                                             \
        v8f o = load8_f32(part + d) + wv * LOAD8(v + d);                                               \
        memcpy(part + d, &o, 32);                                                                      \
    }                                                                                                  \
    for (int64_t d = hd8; d < hd; d++) part[d] += w * WIDEN(v[d]);                                     \
}                                                                                                      \
/* part (hd) = sum over t < n of w[t] * v[t] (n, hd), hd % 64 == 0: each 64-lane slice summed over t   \
   in eight registers, in the order NAME##_accumulate adds them (the same bits) */                     \
static inline void NAME##_accumulate64(float* part, const float* w, const T* v, int64_t n, int64_t hd) {\
    for (int64_t d = 0; d < hd; d += 64) {                                                             \
        v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};            \
        for (int64_t t = 0; t < n; t++) {                                                              \
            const v8f wv = {w[t], w[t], w[t], w[t], w[t], w[t], w[t], w[t]};                           \
            const T* vt = v + t * hd + d;                                                              \
            a0 += wv * LOAD8(vt);                                                                      \
            a1 += wv * LOAD8(vt + 8);                                                                  \
            a2 += wv * LOAD8(vt + 16);                                                                 \
            a3 += wv * LOAD8(vt + 24);                                                                 \
            a4 += wv * LOAD8(vt + 32);                                                                 \
            a5 += wv * LOAD8(vt + 40);                                                                 \
            a6 += wv * LOAD8(vt + 48);                                                                 \
            a7 += wv * LOAD8(vt + 56);                                                                 \
        }                                                                                              \
        memcpy(part + d, &a0, 32);                                                                     \
        memcpy(part + d + 8, &a1, 32);                                                                 \
        memcpy(part + d + 16, &a2, 32);                                                                \
        memcpy(part + d + 24, &a3, 32);                                                                \
        memcpy(part + d + 32, &a4, 32);                                                                \
        memcpy(part + d + 40, &a5, 32);                                                                \
        memcpy(part + d + 48, &a6, 32);                                                                \
        memcpy(part + d + 56, &a7, 32);                                                                \
    }                                                                                                  \
}                                                                                                      \
void NAME(const float* q, const T* kpool, const T* vpool, const int64_t* table, const int64_t* lengths, \
          float* out, int64_t B, int64_t nh, int64_t nkv, int64_t hd, int64_t num_blocks, int64_t bs,  \
          int64_t width, float scale, int64_t max_len, int64_t threads, const int64_t* starts,         \
          float softcap) {                                                                             \
    const int64_t g = nh / nkv;                                                                        \
    _Pragma("omp parallel num_threads(threads)")                                                       \
    {                                                                                                  \
        float* scores = (float*)malloc(sizeof(float) * g * (max_len + 1));                             \
        double* acc_out = (double*)malloc(sizeof(double) * g * hd);                                    \
        float* part = (float*)malloc(sizeof(float) * g * hd);                                          \
        _Pragma("omp for schedule(static)")                                                            \
        for (int64_t item = 0; item < B * nkv; item++) {                                               \
            const int64_t b = item / nkv, h = item % nkv, len = lengths[b];                            \
            /* a sliding window: the row's keys lo..len-1 (lo = 0 without one); cnt of them */         \
            const int64_t lo = starts ? starts[b] : 0, cnt = len - lo;                                 \
            const float* qb = q + (b * nh + h * g) * hd;                                               \
            const int64_t* row = table + b * width;                                                    \
            if (item + 1 < B * nkv) {  /* the next item's keys and values into L2 while this one runs:  \
                                          its blocks are pages apart, where hardware prefetchers stop */ \
                const int64_t b1 = (item + 1) / nkv, h1 = (item + 1) % nkv, len1 = lengths[b1];        \
                const int64_t* row1 = table + b1 * width;                                              \
                for (int64_t first = starts ? starts[b1] : 0, n = 0; first < len1; first += n) {       \
                    const int64_t off = first % bs;                                                    \
                    const int64_t at = (h1 * num_blocks + row1[first / bs]) * bs + off;                \
                    n = first - off + bs < len1 ? bs - off : len1 - first;                             \
                    prefetch_range(kpool + at * hd, n * hd * (int64_t)sizeof(T), 2);                    \
                    prefetch_range(vpool + at * hd, n * hd * (int64_t)sizeof(T), 1);                    \
                }                                                                                      \
            }                                                                                          \
            for (int64_t first = lo, n = 0; first < len; first += n) {  /* n: keys in first's block */ \
                const int64_t off = first % bs;                                                        \
                const int64_t at = (h * num_blocks + row[first / bs]) * bs + off;                      \
                const T* kb = kpool + at * hd;                                                         \
                n = first - off + bs < len ? bs - off : len - first;                                   \
                for (int64_t j = 0; j < g; j++)                                                        \
                    NAME##_scores(qb + j * hd, kb, n, hd, scale, scores + j * cnt + first - lo);       \
            }                                                                                          \
            if (softcap > 0)  /* cap * tanh(s / cap) before the softmax (Gemma 2) */                   \
                for (int64_t t = 0; t < g * cnt; t++) scores[t] = tanhf(scores[t] / softcap) * softcap; \
            for (int64_t j = 0; j < g; j++) {  /* softmax: fp32 exps, their sum in fp64 */             \
                float* sc = scores + j * cnt;                                                          \
                float m = -INFINITY;                                                                   \
                for (int64_t t = 0; t < cnt; t++) m = sc[t] > m ? sc[t] : m;                           \
                for (int64_t t = 0; t < cnt; t++) sc[t] = expf(sc[t] - m);                             \
                double sum = 0.0;                                                                      \
                for (int64_t t = 0; t < cnt; t++) sum += sc[t];                                        \
                const float inv = (float)(1.0 / sum);                                                  \
                for (int64_t t = 0; t < cnt; t++) sc[t] *= inv;                                        \
            }                                                                                          \
            memset(acc_out, 0, sizeof(double) * g * hd);                                               \
            for (int64_t first = lo, n = 0; first < len; first += n) {  /* a block's sum: fp32, fp64 */\
                const int64_t off = first % bs;                                                        \
                const T* vb = vpool + ((h * num_blocks + row[first / bs]) * bs + off) * hd;            \
                n = first - off + bs < len ? bs - off : len - first;                                   \
                const float* sc0 = scores + first - lo;  /* the block's first weight */                \
                if (hd % 64 == 0) {  /* 64 lanes at a time in registers: the same sums, same order */  \
                    for (int64_t j = 0; j < g; j++)                                                    \
                        NAME##_accumulate64(part + j * hd, sc0 + j * cnt, vb, n, hd);                  \
                } else {                                                                               \
                    memset(part, 0, sizeof(float) * g * hd);                                           \
                    for (int64_t t = 0; t < n; t++)                                                    \
                        for (int64_t j = 0; j < g; j++)                                                \
                            NAME##_accumulate(part + j * hd, sc0[j * cnt + t], vb + t * hd, hd);       \
                }                                                                                      \
                for (int64_t i = 0; i < g * hd; i++) acc_out[i] += part[i];                            \
            }                                                                                          \
            for (int64_t j = 0; j < g; j++)                                                            \
                for (int64_t d = 0; d < hd; d++)                                                       \
                    out[(b * nh + h * g + j) * hd + d] = (float)acc_out[j * hd + d];                   \
        }                                                                                              \
        free(scores);                                                                                  \
        free(acc_out);                                                                                 \
        free(part);                                                                                    \
    }                                                                                                  \
}

PAGED_DECODE(paged_decode_f32, float, widen_f32, load8_f32)
PAGED_DECODE(paged_decode_bf16, uint16_t, widen_bf16, load8_bf16)
"""

_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared"]
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
        function.argtypes = [pointer] * 6 + [integer] * 7 + [ctypes.c_float, integer, integer, pointer]
        function.argtypes += [ctypes.c_float]
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
    counts: torch.Tensor | None = None,
    starts: torch.Tensor | None = None,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q (B, nh, 1, hd); keys, values (nkv, num_blocks, block_size, hd) (the pool of one layer);
    table (B, W) int64 block ids; lengths (B,) int64: row b attends to its positions ``0..lengths[b]``
    (``lengths[b] + 1`` keys, within its table; ``counts``: those counts, contiguous, with ``table``
    contiguous too) → (B, nh, 1, hd) in q's dtype. ``starts`` (B,) int64 contiguous: each row's first
    key instead of 0 (a sliding window: ``max(0, lengths + 1 - window)``); ``scale``: the scores'
    (default hd ** -0.5); ``softcap``: scores ``cap * tanh(s / cap)`` before the softmax."""
    batch, num_heads, _, head_dim = q.shape
    num_kv_heads, num_blocks, block_size, _ = keys.shape
    query = q.reshape(batch, num_heads, head_dim).float().contiguous()
    out = torch.empty(batch, num_heads, head_dim, dtype=torch.float32)
    if counts is None:  # a decode step passes them made once for all its layers
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
        head_dim**-0.5 if scale is None else scale,
        table.shape[1] * block_size,
        torch.get_num_threads(),
        None if starts is None else starts.data_ptr(),
        softcap or 0.0,
    )
    return out.view(batch, num_heads, 1, head_dim).to(q.dtype)
