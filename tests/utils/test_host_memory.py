"""keep_freed_host_memory: glibc keeps step-sized buffers in the heap instead of handing them back.

What the call changes is glibc's behaviour, asserted through the bytes glibc reports (``mallinfo2``):
a fresh process mmaps its first 8 MiB blocks (threshold 128 KiB) unless the call raised the threshold,
and with the call the freed buffers stay in the heap for the next step. The baseline for the steady state
is glibc with a fixed mmap threshold (``MALLOC_MMAP_THRESHOLD_`` at its 128 KiB default, which turns off
the dynamic threshold): every buffer is mmap'ed afresh and handed back each step. glibc's default dynamic
threshold sits between the two, depending on the heap's history. The page faults this saves depend on the
kernel (page and folio sizes, reclaim: CI's kernel counted 2048 faults either way where this machine
counts 16k against 0), so they are not asserted.
"""

import json
import os
import subprocess
import sys

import pytest

STEPS = 10
SCRIPT = r"""
import ctypes, json, sys, torch
from hybridflow.utils.host_memory import keep_freed_host_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                 "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "keep":
    assert keep_freed_host_memory()
free_heap, mmapped = [], []
for _ in range(int(sys.argv[2])):  # the same 8 x 8 MiB buffers every step (a per-rollout KV cache)
    bufs = [torch.full((2 * 2**20,), 1.0) for _ in range(8)]
    mmapped.append(libc.mallinfo2().hblkhd)
    del bufs
    free_heap.append(libc.mallinfo2().fordblks)
print(json.dumps({"free_heap_bytes": free_heap, "mmapped_bytes": mmapped}))
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
def test_freed_buffers_stay_in_the_heap_for_the_next_step():
    import ctypes

    if not hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2"):
        pytest.skip("needs glibc >= 2.33 (mallinfo2)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    baseline = _run("default", {**env, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)})
    default = _run("default", env)
    kept = _run("keep", env)
    step_bytes = 64 * 2**20
    # a fresh process mmaps its first 8 MiB blocks; with the call they come from the heap
    assert default["mmapped_bytes"][0] >= step_bytes, default
    assert kept["mmapped_bytes"][0] < step_bytes / 8, kept
    steady = slice(STEPS - 4, STEPS)  # after the heap has grown to the step's size
    assert min(kept["free_heap_bytes"][steady]) >= step_bytes, kept  # freed, but kept for reuse
    assert max(baseline["free_heap_bytes"][steady]) < step_bytes, baseline  # handed back each step
