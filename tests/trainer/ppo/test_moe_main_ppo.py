"""A mixture-of-experts policy through ``main_ppo`` (issue 48 item 1, end to end): a tiny Qwen3-MoE (every
layer sparse, 4 experts, top-2) takes 2 GRPO steps on Ray with 2-rank FSDP2 actor and reference, the actor
split by Ulysses SP = 2 over padding-free packed rows with dynamic batching, generating with
the embedded engine (its grouped experts, weights synced in place from the FSDP2 actor). Both steps'
losses are finite, the
step-2 checkpoint merges into a model whose experts and routers moved and that generates. (SP = 2's
log-probs against one process's: ``tests/workers/test_moe_training.py``.)"""

import json
import math

import pytest
import torch
from omegaconf import OmegaConf

from hybridflow.trainer.config import load_config
from hybridflow.trainer.main_ppo import run_ppo
from tests.tiny_run import as_overrides, tiny_run_values


@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory):
    from hybridflow.models.tiny import build_tiny_model

    return str(
        build_tiny_model(
            tmp_path_factory.mktemp("moe_model") / "model",
            arch="qwen3_moe",
            hidden_size=64,
            num_layers=2,
            intermediate_size=64,
        )
    )


@pytest.mark.slow  # a whole run on Ray; its parts: the fast tier's tests/workers/test_moe_training.py
def test_qwen3_moe_trains_two_grpo_steps_with_ulysses_and_merges(
    ray_session, moe_model_dir, arithmetic_data, tmp_path, monkeypatch
):
    from transformers import AutoModelForCausalLM

    from hybridflow.model_merger import merge_fsdp_checkpoint

    monkeypatch.chdir(tmp_path)
    values = tiny_run_values(
        moe_model_dir,
        arithmetic_data,
        tmp_path / "ckpt",
        **{
            "algorithm.adv_estimator": "grpo",
            "actor_rollout_ref.rollout.name": "engine",
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size": 2,
            "actor_rollout_ref.actor.use_dynamic_bsz": True,
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 128,
            "actor_rollout_ref.actor.use_kl_loss": True,
            "actor_rollout_ref.actor.entropy_coeff": 0.01,  # a gradient even when no answer is right
            "actor_rollout_ref.actor.optim.lr": 1e-2,
            "trainer.resume_mode": "disable",
            "trainer.total_training_steps": 2,
            "trainer.save_freq": 2,
            "trainer.experiment_name": "moe",
        },
    )
    config = load_config(as_overrides(values))
    OmegaConf.resolve(config)
    run_ppo(config)
    lines = (tmp_path / "outputs" / "hybridflow" / "moe" / "metrics.jsonl").read_text().splitlines()
    metrics = {record["step"]: record for record in map(json.loads, lines)}
    assert sorted(metrics) == [1, 2]
    for step in (1, 2):
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "actor/entropy"):
            assert math.isfinite(metrics[step][key]), (step, key)
    assert metrics[1]["actor/grad_norm"] > 0 and metrics[2]["actor/kl_loss"] > 0
    merged = AutoModelForCausalLM.from_pretrained(
        merge_fsdp_checkpoint(tmp_path / "ckpt" / "global_step_2" / "actor", tmp_path / "merged")
    )
    base = AutoModelForCausalLM.from_pretrained(moe_model_dir)
    moved = [n for n, p in merged.named_parameters() if not torch.equal(p, base.get_parameter(n))]
    assert any(".mlp.experts." in n for n in moved) and any(".mlp.gate." in n for n in moved)
    assert merged.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, do_sample=False).shape == (1, 6)
