"""``python -m hybridflow.serve`` flags reach what they name (issue 44 items 4, 5): the vLLM backend gets
the KV budget and batched tokens as vLLM's own flags (they were dropped: the cache was always 1 GiB),
and ``--device cuda`` without a GPU is refused in one line."""

import subprocess
import sys

import pytest

from hybridflow.serve.__main__ import parse_args, vllm_command, vllm_kv_bytes


def _flags(command: list[str]) -> dict[str, str]:
    return {a: b for a, b in zip(command, command[1:], strict=False) if a.startswith("--")}


def test_the_vllm_server_gets_the_budget_and_batched_tokens(tiny_model_dir):
    args = parse_args(["--model", tiny_model_dir, "--backend", "vllm", "--kv-cache-memory-gb", "0.5"])
    flags = _flags(vllm_command(args))
    assert flags["--kv-cache-memory-bytes"] == str(2**29)
    assert flags["--max-num-batched-tokens"] == "8192"
    fraction = parse_args(["--model", tiny_model_dir, "--gpu-memory-utilization", "0.25"])
    from hybridflow.workers.rollout.engine_rollout import available_ram_bytes

    assert vllm_kv_bytes(fraction) == pytest.approx(0.25 * available_ram_bytes(), rel=0.05)
    wide = parse_args(["--model", tiny_model_dir, "--max-num-batched-tokens", "64", "--max-model-len", "128"])
    assert _flags(vllm_command(wide))["--max-num-batched-tokens"] == "128"  # a whole prompt fits


def test_device_cuda_without_a_gpu_is_refused_in_one_line(tiny_model_dir):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here")
    run = subprocess.run(
        [sys.executable, "-m", "hybridflow.serve", "--model", tiny_model_dir, "--device", "cuda"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 2
    assert run.stderr.strip() == "hybridflow.serve: error: --device cuda: no CUDA GPU is visible here"
