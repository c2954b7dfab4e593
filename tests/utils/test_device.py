"""The device layer: ``trainer.device`` decides (not the hardware), data meets the worker on its
device once and goes back to the controller on the CPU, and impossible layouts are config errors."""

import pytest
import torch
import torch.distributed as dist

from hybridflow.protocol import DataProto
from hybridflow.single_controller import Dispatch, Worker, register
from hybridflow.trainer.config import device_problems
from hybridflow.utils import device
from tests.utils.checkpoint.fsdp_toy import gloo_group


def test_configured_device_wins_over_the_hardware(monkeypatch):
    monkeypatch.setenv("HYBRIDFLOW_DEVICE", "cpu")
    assert device.device_type() == "cpu" and device.current_device() == torch.device("cpu")
    assert device.dist_backend() == "gloo" and device.dist_backend("cuda") == "nccl"
    monkeypatch.setenv("HYBRIDFLOW_DEVICE", "tpu")
    with pytest.raises(ValueError, match="HYBRIDFLOW_DEVICE='tpu'"):
        device.device_type()


def test_unconfigured_process_follows_its_process_group(monkeypatch):
    monkeypatch.delenv("HYBRIDFLOW_DEVICE")
    with gloo_group():
        assert dist.is_initialized() and device.device_type() == "cpu"  # gloo: CPU, even with a GPU visible


def test_cpu_workers_hide_gpus():
    assert device.worker_env("cpu") == {"HYBRIDFLOW_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    assert device.worker_env("cuda") == {"HYBRIDFLOW_DEVICE": "cuda"}
    with pytest.raises(ValueError):
        device.worker_env("gpu")


class _MetaWorker(Worker):
    """A worker whose compute device is not the CPU: the ``meta`` device stands for an accelerator
    (real tensor placement, no GPU needed)."""

    compute_device = torch.device("meta")

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def shapes(self, data: DataProto) -> DataProto:
        self.seen_device = data.batch["x"].device
        return DataProto.from_dict({"y": torch.ones(len(data), 1)})


def test_registered_methods_get_data_on_the_worker_device_and_return_cpu_data():
    worker = _MetaWorker()
    out = worker.shapes(DataProto.from_dict({"x": torch.zeros(3, 2)}))
    assert worker.seen_device.type == "meta"  # moved once on entry
    assert out.batch["y"].device.type == "cpu"  # back to the controller's side


def test_cuda_layouts_are_checked_before_anything_starts(monkeypatch):
    assert device_problems("cpu", 4) == []
    assert "cpu or cuda" in device_problems("xpu")[0]
    assert device_problems("cuda", None) == []  # workers on other nodes: the driver's GPUs say nothing
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "no CUDA device is visible" in device_problems("cuda", 1)[0]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert device_problems("cuda", 1) == []
    (problem,) = device_problems("cuda", 2)
    assert "n_gpus_per_node=2 worker processes need one GPU each, but 1 GPU(s) are visible" in problem


def test_a_phase_reports_its_own_peak_and_the_process_peak_keeps_the_largest():
    import numpy as np

    from hybridflow.utils.device import memory_metrics, phase_peak_rss

    size = 256 * 2**20
    with phase_peak_rss() as big:
        block = np.ones(size // 8)  # 256 MiB touched, then freed
        del block
    with phase_peak_rss() as small:
        pass
    assert big["gb"] - small["gb"] >= 0.9 * size / 2**30  # the reset forgot the first phase's block
    assert memory_metrics()["perf/cpu_peak_rss_gb"] >= big["gb"]  # the whole-process peak did not
