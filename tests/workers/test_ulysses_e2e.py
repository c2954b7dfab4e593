"""GRPO through ``run_ppo`` (verl's keys) on 2 worker processes: the actor and the reference with
``ulysses_sequence_parallel_size=2`` (one SP group, dp = 1) against SP = 1 (dp = 2), 3 steps.

Generation is per rank in both (the engines are seeded per rank and hold the same weights), so each
step samples the same responses as long as the updates agree; the updates see the same batch split
differently (2 ranks x 4 rows vs one group of 8 rows, each sequence split over 2 ranks). A small
learning rate keeps Adam's first step, ``lr * g / (|g| + eps)``, from turning fp32 rounding in near-zero
gradients into different samples, so the metrics match step by step."""

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

from hybridflow.model_merger import merge_fsdp_checkpoint
from hybridflow.trainer.config import load_config
from hybridflow.trainer.main_ppo import run_ppo
from tests.tiny_run import as_overrides, tiny_run_values

SCORER = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """A reward in [0, 1] that varies with every sampled token (a random model rarely answers right)."""
    return (sum(map(ord, solution_str)) % 11) / 10
'''


def _run(tmp: Path, model_dir: str, data, sp: int, **extra) -> dict[int, dict]:
    tmp.mkdir(parents=True, exist_ok=True)
    scorer = tmp / "scorer.py"
    scorer.write_text(SCORER)
    values = tiny_run_values(
        model_dir,
        data,
        tmp / "ckpt",
        **{
            "actor_rollout_ref.actor.ppo_mini_batch_size": 4,
            "actor_rollout_ref.actor.reuse_update_log_probs": False,
            "actor_rollout_ref.actor.optim.lr": 1e-4,
            "actor_rollout_ref.actor.use_kl_loss": True,
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size": sp,
            "custom_reward_function.path": str(scorer),
            "trainer.resume_mode": "disable",
            "trainer.total_training_steps": 3,
            "trainer.save_freq": 3,
            "trainer.experiment_name": f"sp{sp}",
            **extra,
        },
    )
    config = load_config(as_overrides(values))
    OmegaConf.resolve(config)
    assert config.actor_rollout_ref.ref.ulysses_sequence_parallel_size == sp  # verl: the actor's by default
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp)
        run_ppo(config)
    lines = next(tmp.rglob("metrics.jsonl")).read_text().splitlines()
    return {record["step"]: record for record in map(json.loads, lines)}


def test_grpo_with_sp2_repeats_the_sp1_run_step_by_step(
    ray_session, tiny_model_dir, arithmetic_data, tmp_path
):
    base = _run(tmp_path / "sp1", tiny_model_dir, arithmetic_data, 1)
    split = _run(tmp_path / "sp2", tiny_model_dir, arithmetic_data, 2)
    assert sorted(split) == sorted(base) == [1, 2, 3]
    for step in (1, 2, 3):
        for key in ("critic/score/mean", "response_length/mean"):
            assert split[step][key] == base[step][key], (step, key)  # the same samples
        for key in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/grad_norm"):
            assert split[step][key] == pytest.approx(base[step][key], rel=1e-4, abs=1e-6), (step, key)
        assert split[step]["actor/grad_norm"] > 0
    # SP changes no parameter's layout (FSDP2 shards over both workers at every sp; DCP files): the SP = 2
    # checkpoint is the one SP = 1 writes, for the same world size, so either run resumes from the other's
    actor_dirs = [tmp_path / run / "ckpt" / "global_step_3" / "actor" for run in ("sp1", "sp2")]
    metas = [json.loads((actor / "checkpoint_meta.json").read_text()) for actor in actor_dirs]
    assert metas[0]["world_size"] == metas[1]["world_size"] == 2
    assert metas[0]["contents"] == metas[1]["contents"]
    merged = [merge_fsdp_checkpoint(actor, actor.parent / "merged") for actor in actor_dirs]
    weights = [AutoModelForCausalLM.from_pretrained(path).state_dict() for path in merged]
    assert weights[0].keys() == weights[1].keys()
    for name, value in weights[0].items():
        assert value.shape == weights[1][name].shape, name
        assert torch.allclose(value, weights[1][name], atol=1e-3), name  # 3 Adam steps of lr 1e-4 apart


@pytest.mark.slow  # make test-slow (34 s): SP exactness and an SP = 2 GRPO run stay in the fast tier
def test_lora_under_sp2_samples_from_the_merged_adapter_and_keeps_the_reference_behind(
    ray_session, tiny_model_dir, arithmetic_data, tmp_path
):
    """LoRA with SP = 2: the actor's split forward through the peft model gives the log-probs the engine
    (the adapter merged into its weights) sampled with, and the reference (the same module, adapter off,
    also split) falls behind the trained actor."""
    runs = _run(
        tmp_path / "lora_sp2",
        tiny_model_dir,
        arithmetic_data,
        2,
        **{
            "actor_rollout_ref.model.lora_rank": 8,
            "actor_rollout_ref.model.lora_alpha": 16,
            "actor_rollout_ref.actor.optim.lr": 1e-2,
            "actor_rollout_ref.rollout.calculate_log_probs": True,
            "trainer.total_training_steps": 2,
            "trainer.save_freq": -1,
        },
    )
    assert sorted(runs) == [1, 2]
    assert runs[1]["actor/grad_norm"] > 0
    assert runs[2]["training/rollout_log_probs_diff_max"] < 1e-4  # the merged engine == the split peft actor
    assert runs[2]["actor/kl_loss"] > 0  # the adapter-off reference stays behind
