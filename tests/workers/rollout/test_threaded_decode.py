"""Decoding in threads inside one CPU worker: greedy output equals one engine's, every row is decoded
once in the input order, and the split keeps prompt groups whole."""

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

from hybridflow.trainer.config import ConfigError, load_config, validate_config
from hybridflow.workers.rollout.engine import EngineModel, LLMEngine, SamplingParams
from hybridflow.workers.rollout.engine.threaded import decode_shards, generate_threaded, split_groups


def test_split_keeps_groups_whole_and_balances_rows():
    groups = [([1], 4), ([2], 4), ([3], 1), ([4], 3)]  # 12 rows
    shards = split_groups(groups, 2)
    assert shards == [[([1], 4), ([2], 4)], [([3], 1), ([4], 3)]]
    assert split_groups(groups[:1], 3) == [[([1], 4)]]  # never an empty shard


def test_shard_count_follows_the_config_and_the_device():
    cpu = torch.device("cpu")
    assert decode_shards(3, cpu, groups=8, can_split=True) == 3
    assert decode_shards(3, cpu, groups=2, can_split=True) == 2  # at most one shard per prompt group
    assert decode_shards(3, torch.device("meta"), groups=8, can_split=True) == 1  # not a CPU
    assert decode_shards(3, cpu, groups=8, can_split=False) == 1  # multi-turn or generation TP
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert decode_shards(None, cpu, groups=8, can_split=True) == 2  # null: the worker's threads
    finally:
        torch.set_num_threads(saved)


def test_threaded_greedy_equals_one_engine(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    engine_model = EngineModel.from_hf_module(model, 64, dtype=torch.float32)
    prompts = [([5, 6, 7], 2), ([8, 9], 3), ([10, 11, 12, 13], 1), ([14], 2)]
    params = SamplingParams(max_new_tokens=10, do_sample=False)
    one = LLMEngine(engine_model, max_num_seqs=8, max_model_len=64, eos_token_ids=[])
    requests = [one.add_request(p, params, n) for p, n in prompts]
    while one.has_unfinished():
        one.step()
    want = [c.token_ids for r in requests for c in r.completions]
    engines = [LLMEngine(engine_model, max_num_seqs=4, max_model_len=64, eos_token_ids=[]) for _ in range(2)]
    threads_before = torch.get_num_threads()
    got = generate_threaded(engines, prompts, params, seed=0)
    assert [c.token_ids for c in got] == want  # 8 rows, in order
    assert torch.get_num_threads() == threads_before  # the one-thread setting is undone


def test_each_decode_thread_runs_its_kernels_on_one_openmp_thread(tiny_model_dir, monkeypatch):
    """OpenMP's thread count is per thread: a new thread starts at OMP_NUM_THREADS (the worker's
    threads), which oneDNN's bf16 kernels follow, so unset it ran 2 decode threads x 2 OpenMP threads
    on 2 cores. Each decode thread must set its own."""
    import ctypes
    import os

    libgomp = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp.so.1"))
    seen = []
    real_step = LLMEngine.step

    def step(self):
        seen.append(libgomp.omp_get_max_threads())
        return real_step(self)

    monkeypatch.setattr(LLMEngine, "step", step)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    engine_model = EngineModel.from_hf_module(model, 32, dtype=torch.float32)
    engines = [LLMEngine(engine_model, max_num_seqs=4, max_model_len=32, eos_token_ids=[]) for _ in range(2)]
    saved = torch.get_num_threads()
    torch.set_num_threads(2)  # the worker's setting; new threads start from OMP_NUM_THREADS
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    try:
        generate_threaded(engines, [([5, 6], 2), ([7, 8], 2)], SamplingParams(max_new_tokens=3), seed=0)
    finally:
        torch.set_num_threads(saved)
    assert seen and set(seen) == {1}


def test_decode_threads_is_validated(tiny_model_dir, arithmetic_data):
    train, test = arithmetic_data
    base = [
        f"data.train_files={train}",
        f"data.val_files={test}",
        f"actor_rollout_ref.model.path={tiny_model_dir}",
    ]
    validate_config(load_config([*base, "actor_rollout_ref.rollout.decode_threads=2"]))
    with pytest.raises(ConfigError, match="decode_threads must be null or an integer >= 1"):
        validate_config(load_config([*base, "actor_rollout_ref.rollout.decode_threads=0"]))
    assert OmegaConf.select(load_config(base), "actor_rollout_ref.rollout.decode_threads") is None
