"""Keep freed host memory in the process for the next step instead of handing it back to the OS.

A training step allocates and frees the same large host buffers every time: activations, gradients,
the rollout's KV cache (re-created per call with ``free_cache_engine``), logits. glibc's malloc serves
blocks above a dynamic threshold (128 KiB at first) with ``mmap`` and returns freed heap tops above
``M_TRIM_THRESHOLD`` to the OS, so the next step page-faults the same memory back in and the kernel
zeroes it again. On the 2-core VM this project measures on, re-creating a 100 MiB KV cache took
25-100 ms that way and ~5 ms from memory the process kept (PLATFORM_NOTES-style numbers in
docs/benchmarks.md).

:func:`keep_freed_host_memory` raises both thresholds (``mallopt``) for the calling process: blocks up
to ``mmap_threshold`` come from the heap, and up to ``trim_threshold`` of free heap top stays mapped.
The peak resident set is unchanged (the memory is reused, not added); the process just does not shrink
back between steps. Variables the user set (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``) win;
other C libraries (musl, macOS) are left alone.
"""

from __future__ import annotations

import ctypes
import os
import sys

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc caps M_MMAP_THRESHOLD at 32 MiB on 64-bit hosts (HEAP_MAX_SIZE / 2)
MMAP_THRESHOLD_BYTES = 32 * 2**20
TRIM_THRESHOLD_BYTES = 1 * 2**30


def keep_freed_host_memory(
    mmap_threshold: int = MMAP_THRESHOLD_BYTES, trim_threshold: int = TRIM_THRESHOLD_BYTES
) -> bool:
    """Raise glibc's mmap and trim thresholds for this process; True if they were set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    done = True
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        done = bool(mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold))) and done
    if "MALLOC_TRIM_THRESHOLD_" not in os.environ:
        done = bool(mallopt(_M_TRIM_THRESHOLD, int(trim_threshold))) and done
    return done
