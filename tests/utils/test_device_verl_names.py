"""verl's device helpers: on the CPU get_torch_device() answers torch.cuda's calls, the backend is gloo."""

import torch

from hybridflow.utils import device


def test_cpu_answers_what_torch_cuda_answers(monkeypatch):
    monkeypatch.setenv(device.DEVICE_ENV, "cpu")
    assert device.get_device_name() == "cpu" and device.get_nccl_backend() == "gloo"
    mod = device.get_torch_device()
    mod.set_device(3)  # no-op
    assert mod.current_device() == 0 and device.get_device_id() == 0 and mod.device_count() == 1
    assert mod.is_available() and mod.memory_allocated() == 0 and mod.max_memory_reserved() == 0
    mod.synchronize()
    mod.empty_cache()
    mod.reset_peak_memory_stats()
    free, total = mod.mem_get_info()
    assert 0 < free <= total
    mod.manual_seed(5)
    first = torch.rand(2)
    mod.manual_seed(5)
    assert torch.equal(first, torch.rand(2))
    assert mod.Stream is torch.cpu.Stream  # the rest comes from torch.cpu


def test_cuda_process_gets_torch_cuda(monkeypatch):
    monkeypatch.setenv(device.DEVICE_ENV, "cuda")
    assert device.get_torch_device() is torch.cuda and device.get_nccl_backend() == "nccl"
