"""keep_freed_host_memory: glibc keeps step-sized buffers mapped instead of page-faulting them back.

The baseline is glibc with a fixed mmap threshold (``MALLOC_MMAP_THRESHOLD_`` at its 128 KiB default,
which turns off its dynamic threshold): every 8 MiB buffer is mmap'ed afresh and faulted in each step.
glibc's default dynamic threshold sits between the two and depends on the heap's history (it may or may
not trim the freed buffers), so it is not the comparison. Fault counts depend on the kernel's page and
folio sizes; the assertions are relative, plus the heap and mmap'ed bytes glibc reports through
``mallinfo2`` (deterministic: the first 8 MiB blocks of a fresh process are mmap'ed unless the call raised
the threshold).
"""

import json
import os
import subprocess
import sys

import pytest

STEPS = 10
SCRIPT = r"""
import ctypes, json, resource, sys, torch
from hybridflow.utils.host_memory import keep_freed_host_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                 "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "keep":
    assert keep_freed_host_memory()
faults, free_heap, mmapped = [], [], []
for _ in range(int(sys.argv[2])):  # the same 8 x 8 MiB buffers every step (a per-rollout KV cache)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    bufs = [torch.full((2 * 2**20,), 1.0) for _ in range(8)]  # written, so no zero-page sharing
    mmapped.append(libc.mallinfo2().hblkhd)
    del bufs
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    free_heap.append(libc.mallinfo2().fordblks)
print(json.dumps({"faults": faults, "free_heap_bytes": free_heap, "mmapped_bytes": mmapped}))
"""


def _run(mode: str, env: dict) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode, str(STEPS)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        env=env,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_freed_buffers_are_reused_without_page_faults():
    import ctypes

    if not hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2"):
        pytest.skip("needs glibc >= 2.33 (mallinfo2)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    baseline = _run("default", {**env, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)})
    default = _run("default", env)
    kept = _run("keep", env)
    steady = slice(STEPS - 4, STEPS)  # after the heap has grown to the step's size
    step_bytes = 64 * 2**20
    # glibc's first 8 MiB blocks are mmap'ed (threshold 128 KiB); with the call they come from the heap
    assert default["mmapped_bytes"][0] >= step_bytes, default
    assert kept["mmapped_bytes"][0] < step_bytes / 8, kept
    assert min(kept["free_heap_bytes"][steady]) >= step_bytes, kept  # freed, but kept mapped for reuse
    assert max(baseline["free_heap_bytes"][steady]) < step_bytes, baseline  # handed back each step
    assert sum(kept["faults"][steady]) * 10 < sum(baseline["faults"][steady]), (baseline, kept)
