"""keep_freed_host_memory: glibc keeps step-sized buffers mapped instead of page-faulting them back."""

import subprocess
import sys

import pytest

SCRIPT = r"""
import resource, sys, torch
from hybridflow.utils.host_memory import keep_freed_host_memory
if sys.argv[1] == "keep":
    assert keep_freed_host_memory()
faults = []
for _ in range(6):  # the same 8 x 8 MiB buffers every step, as a KV cache re-created per rollout
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    bufs = [torch.zeros(2 * 2**20) for _ in range(8)]
    del bufs
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sum(faults[2:]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_freed_buffers_are_reused_without_page_faults():
    def faults(mode: str) -> int:
        out = subprocess.run(
            [sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True, timeout=120
        )
        return int(out.stdout.strip())

    default, kept = faults("default"), faults("keep")
    # 4 steps x 64 MiB is 65536 pages of faults when every buffer is mmap'ed afresh
    assert kept < default / 10, (default, kept)
