"""The served reward model main_ppo starts (RewardModelServers.from_config): the reward_model.rollout keys
become server flags; a colocated judge sleeps (its KV cache released: the bytes the cache held, asked
for again at wake) and wakes to the same greedy answers; sleep and wake sit behind the API key; a
replica that dies is named by the watcher and by check_alive."""

import asyncio
import os
import signal
import time

import httpx
import pytest
from omegaconf import OmegaConf

from hybridflow.trainer.config import load_config
from hybridflow.utils.served_client import chat_complete
from hybridflow.workers.reward_loop.servers import RewardModelServers

KEY = "sk-judge-sleep"


def _config(model_dir: str, *extra: str):
    config = load_config(
        [
            "reward_model.use_reward_loop=true",
            "reward_model.enable=true",
            f"reward_model.model.path={model_dir}",
            "reward_model.rollout.kv_cache_memory_gb=0.01",
            "reward_model.rollout.max_num_seqs=4",
            "reward_model.rollout.prompt_length=64",
            "reward_model.rollout.response_length=16",
            "trainer.n_gpus_per_node=1",
            *extra,
        ]
    )
    OmegaConf.resolve(config)
    return config


def test_the_pool_and_engine_keys_become_server_flags(tiny_model_dir):
    colocated = RewardModelServers.from_config(_config(tiny_model_dir, "trainer.n_gpus_per_node=2"))
    assert colocated.replicas == 2 and colocated.served_name == tiny_model_dir  # verl's served name
    flags = dict(zip(colocated.server_args[::2], colocated.server_args[1::2], strict=True))
    assert flags == {
        "--backend": "engine",
        "--max-model-len": "80",  # prompt_length + response_length
        "--max-num-seqs": "4",
        "--max-num-batched-tokens": "8192",
        "--kv-cache-memory-gb": "0.01",
    }
    pool = [
        "reward_model.enable_resource_pool=true",
        "reward_model.n_gpus_per_node=3",
        "reward_model.nnodes=1",
    ]
    standalone = RewardModelServers.from_config(
        _config(tiny_model_dir, *pool, "reward_model.rollout.dtype=bfloat16")
    )
    assert standalone.replicas == 3 and standalone.server_args[-2:] == ("--dtype", "bf16")
    uncached = RewardModelServers.from_config(
        _config(tiny_model_dir, "reward_model.rollout.enable_prefix_caching=false")
    )
    assert "--no-enable-prefix-caching" in uncached.server_args  # verl's key reaches the judge's server

    # verl's gpu_memory_utilization sizes the cache when kv_cache_memory_gb is null (its default now):
    # 0.5 of the free memory for the node's two replicas together, 0.25 each (issue 44 item 5)
    verl_budget = RewardModelServers.from_config(
        _config(tiny_model_dir, "trainer.n_gpus_per_node=2", "reward_model.rollout.kv_cache_memory_gb=null")
    )
    flags = dict(zip(verl_budget.server_args[::2], verl_budget.server_args[1::2], strict=True))
    assert flags["--gpu-memory-utilization"] == "0.25" and "--kv-cache-memory-gb" not in flags
    on_gpu = _config(tiny_model_dir, "trainer.device=cuda")
    on_gpu.trainer.device = (
        "cuda"  # (validation would refuse it on this CPU machine; the flags are what count)
    )
    flags = RewardModelServers.from_config(on_gpu).server_args
    assert flags[flags.index("--device") + 1] == "cuda"  # the judge is not left on the CPU


def _ask(address: str) -> str:
    request = {
        "model": "judge",
        "messages": [{"role": "user", "content": "3+4="}],
        "max_tokens": 6,
        "temperature": 0,
    }
    answer = asyncio.run(chat_complete(address, request, timeout_s=60, max_retries=20, api_key=KEY))
    return answer.choices[0].message.content


def _kv_bytes(model_dir: str, slots: int = 256, positions: int = 64) -> int:
    """layers x (K, V) x KV heads x (slots x positions + the pool's scratch block of 16) x head size x 4
    bytes (fp32): one replica's cache (blocks for ``slots`` sequences of ``positions``)."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir)
    head = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return c.num_hidden_layers * 2 * c.num_key_value_heads * (slots * positions + 16) * head * 4


def test_a_colocated_judge_sleeps_wakes_and_a_dead_replica_is_named(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDFLOW_API_KEY", KEY)  # the servers inherit it; sleep/wake send it
    servers = RewardModelServers(
        tiny_model_dir,
        replicas=1,
        served_name="judge",
        server_args=("--kv-cache-memory-gb", "0.05", "--max-model-len", "64", "--max-num-seqs", "256"),
        log_dir=str(tmp_path),
    )
    reported = []
    with servers:
        servers.watch(interval_s=0.1, report=reported.append)
        replica = servers.urls[0]
        awake = _ask(servers.address)
        assert httpx.post(f"{replica}/sleep").status_code == 401  # no key: refused, nothing released
        freed = servers.sleep()
        assert freed["freed_kv_gb"] * 2**30 == _kv_bytes(tiny_model_dir)  # to the byte
        assert freed["rss_freed_gb"] > 0.8 * freed["freed_kv_gb"]  # the pages went back to the OS
        headers = {"Authorization": f"Bearer {KEY}"}
        assert httpx.get(f"{replica}/is_sleeping", headers=headers).json() == {"is_sleeping": True}
        asleep = httpx.post(
            f"{replica}/v1/chat/completions",
            headers=headers,
            json={"model": "judge", "messages": [{"role": "user", "content": "1"}]},
        )
        assert asleep.status_code == 503 and "asleep" in asleep.text  # chat_complete retries it
        assert servers.wake_up()["kv_gb"] * 2**30 == _kv_bytes(tiny_model_dir)
        assert _ask(servers.address) == awake  # the same greedy verdict after a sleep
        assert reported == []
        victim = servers.processes[0][0]
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait()
        with pytest.raises(RuntimeError, match=r"rm-replica-0 \(http://127\.0\.0\.1:\d+\): exit code -9"):
            servers.check_alive()
        deadline = time.monotonic() + 5
        while not reported and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(reported) == 1 and "rm-replica-0" in reported[0] and "exit code -9" in reported[0]
        with pytest.raises(RuntimeError, match="lost a process"):
            servers.wake_up()  # a colocated reward phase stops here, naming it
