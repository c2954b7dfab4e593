"""End to end through Ray: GRPO and PPO steps on a tiny model with 2-rank FSDP2 worker groups,
exact resume, and the model merger's export matching the trained actor.

One set of colocated worker processes (actor+rollout+ref, critic) serves every run here; each run
reloads the initial weights (``init_model``), so runs are independent.
"""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from hybridflow.protocol import DataProto
from hybridflow.trainer.config import load_config
from hybridflow.trainer.main_ppo import run_ppo
from hybridflow.trainer.ppo.workers_setup import build_worker_groups
from tests.tiny_run import PPO_EXTRA, as_overrides, tiny_run_values

COMPARED_KEYS = [
    "actor/pg_loss",
    "actor/ppo_kl",
    "actor/kl_loss",
    "actor/entropy",
    "actor/grad_norm",
    "critic/score/mean",
    "critic/advantages/mean",
    "response_length/mean",
]


def _overrides(tiny_model_dir, arithmetic_data, tmp_path, **extra) -> list[str]:
    values = tiny_run_values(
        tiny_model_dir,
        arithmetic_data,
        tmp_path / "ckpt",
        **{**PPO_EXTRA, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 1, **extra},
    )
    return as_overrides(values)


def _config(*args, **kwargs):
    config = load_config(_overrides(*args, **kwargs))
    OmegaConf.resolve(config)
    return config


def _metrics(log_dir: Path) -> dict[int, dict]:
    lines = (log_dir / "metrics.jsonl").read_text().splitlines()
    return {record["step"]: record for record in map(json.loads, lines)}


@pytest.fixture(scope="module")
def worker_groups(ray_session, tiny_model_dir, arithmetic_data, tmp_path_factory):
    """Colocated 2-rank groups built from the shared worker-side settings used by every run below."""
    config = _config(
        tiny_model_dir,
        arithmetic_data,
        tmp_path_factory.mktemp("wg"),
        **{"reward_model.enable": True, "reward_model.model.path": tiny_model_dir},
    )
    groups = build_worker_groups(config, use_critic=True, use_reference=True)
    yield groups
    groups.shutdown()


@pytest.fixture(scope="module")
def reference_run(worker_groups, tiny_model_dir, arithmetic_data, tmp_path_factory):
    """A 4-step GRPO run saving at steps 2 and 4; also records the actor's greedy output at the end."""
    tmp = tmp_path_factory.mktemp("reference")
    config = _config(
        tiny_model_dir,
        arithmetic_data,
        tmp,
        **{
            "trainer.total_training_steps": 4,
            "trainer.save_freq": 2,
            "trainer.experiment_name": "reference",
            "trainer.val_before_train": True,
            "trainer.test_freq": 4,
            "critic.enable": False,
        },
    )
    import contextlib
    import io

    said = io.StringIO()  # what the driver tells its user (the run summary's lines)
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(said):
        patch.chdir(tmp)
        last = run_ppo(config, worker_groups=worker_groups)
    prompts = _greedy_prompts(tiny_model_dir)
    greedy = worker_groups.actor_rollout.generate_sequences(prompts)
    return {"dir": tmp, "last": last, "prompts": prompts, "greedy": greedy, "said": said.getvalue()}


def test_the_run_says_where_its_outputs_go_and_whether_it_resumes(reference_run):
    """issue 46 item 3: the start names the folders, a fresh start (and that the same command would
    resume, or that resuming is off), the model family and backend; the end names the step and where
    the outputs are."""
    said = reference_run["said"]
    assert "hybridflow: outputs: metrics and curves in outputs/hybridflow/reference" in said
    assert "hybridflow: starting fresh (trainer.resume_mode=disable" in said  # the tiny runs disable it
    assert "(qwen2); rollout engine (sync) on cpu" in said
    assert "hybridflow: stopped after step 4: metrics outputs/hybridflow/reference/metrics.jsonl" in said
    assert f"hybridflow: checkpoints: {reference_run['dir'] / 'ckpt' / 'global_step_4'}" in said


def _greedy_prompts(model_dir: str) -> DataProto:
    from hybridflow.models.loading import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    rows = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"What is {a} + {b}?"}], add_generation_prompt=True, tokenize=True
        )["input_ids"]
        for a, b in ((12, 34), (56, 7))
    ]
    width = max(len(r) for r in rows)
    input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(r)) + list(r) for r in rows])
    mask = (torch.arange(width).unsqueeze(0) >= torch.tensor([[width - len(r)] for r in rows])).long()
    data = DataProto.from_dict(
        {"input_ids": input_ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}
    )
    data.meta_info = {"validate": True, "do_sample": False}
    return data


def test_grpo_run_logs_finite_verl_metrics(reference_run):
    metrics = _metrics(reference_run["dir"] / "outputs" / "hybridflow" / "reference")
    assert sorted(metrics) == [0, 1, 2, 3, 4]
    assert "val-core/hybridflow/arithmetic/reward/mean@1" in metrics[0]
    step = metrics[4]
    for key in (
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/pg_clipfrac_lower",
        "actor/ppo_kl",
        "actor/entropy",
        "actor/kl_loss",
        "actor/kl_coef",
        "actor/grad_norm",
        "actor/lr",
        "critic/score/mean",
        "critic/rewards/max",
        "critic/advantages/min",
        "critic/returns/mean",
        "response_length/mean",
        "response_length/clip_ratio",
        "prompt_length/mean",
        "global_seqlen/minmax_diff",
        "global_seqlen/balanced_max",
        "timing_s/gen",
        "timing_s/update_actor",
        "timing_per_token_ms/gen",
        "perf/time_per_step",
        "perf/total_num_tokens",
        "perf/throughput",
        "perf/mfu/actor",
        "perf/shared_prompt_saved_frac",
        "perf/cpu_peak_rss_gb",
        "val-core/hybridflow/arithmetic/reward/mean@1",
        "timing_s/update_weights",
        "perf/update_weights_peak_extra_mb",
        "training/rollout_probs_diff_max",
        "training/rollout_log_probs_diff_max",
    ):
        assert key in step, key
        assert math.isfinite(step[key]), key
    assert "critic/vf_loss" not in step  # GRPO: no critic
    assert step["timing_s/testing"] > 0  # verl's validation time, at the steps that validate only
    assert "timing_s/testing" not in metrics[3]
    # the engine (2 ranks, weights synced from the sharded actor) agrees with the actor's recompute
    for record in metrics.values():
        if "training/rollout_log_probs_diff_max" in record:
            assert record["training/rollout_log_probs_diff_max"] <= 1e-5
    # one FSDP unit gathered at a time, never a second full copy of the weights
    assert 0 < step["perf/update_weights_peak_extra_mb"] < step["perf/update_weights_mb"] / 2


def test_rollout_log_probs_replace_the_recompute_once_they_match(
    worker_groups, tiny_model_dir, arithmetic_data, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    config = _config(
        tiny_model_dir,
        arithmetic_data,
        tmp_path,
        **{
            "critic.enable": False,
            "trainer.total_training_steps": 3,
            "trainer.experiment_name": "bypass",
            "actor_rollout_ref.rollout.use_rollout_log_probs": True,
        },
    )
    run_ppo(config, worker_groups=worker_groups)
    metrics = _metrics(tmp_path / "outputs" / "hybridflow" / "bypass")
    assert metrics[1]["training/rollout_log_probs_diff_max"] <= 1e-5  # checked against a recompute
    for step in (2, 3):  # then the recompute (and its entropy) is skipped
        assert "training/rollout_log_probs_diff_max" not in metrics[step]
        assert "actor/entropy" not in metrics[step]
        assert math.isfinite(metrics[step]["actor/pg_loss"])


def test_checkpoints_written_atomically_with_tracker(reference_run):
    ckpt = reference_run["dir"] / "ckpt"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    for step in (2, 4):
        assert (ckpt / f"global_step_{step}" / "actor" / "checkpoint_meta.json").exists()
        assert (ckpt / f"global_step_{step}" / "data.pt").exists()
    assert not list(ckpt.glob("**/*.tmp"))


def test_merged_model_matches_actor_and_changed(reference_run, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from hybridflow.model_merger import main as merger_main

    target = tmp_path / "merged"
    merger_main(
        [
            "merge",
            "--backend",
            "fsdp",
            "--local_dir",
            str(reference_run["dir"] / "ckpt" / "global_step_4" / "actor"),
            "--target_dir",
            str(target),
        ]
    )
    merged = AutoModelForCausalLM.from_pretrained(target)
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    changed = [n for n, p in merged.named_parameters() if not torch.equal(p, initial.get_parameter(n))]
    assert changed, "training did not change any parameter"
    prompts = reference_run["prompts"]
    expected = reference_run["greedy"].batch["responses"]
    out = merged.generate(
        input_ids=prompts.batch["input_ids"],
        attention_mask=prompts.batch["attention_mask"],
        max_new_tokens=expected.shape[1],
        do_sample=False,
        eos_token_id=merged.generation_config.eos_token_id,
        pad_token_id=3,
    )
    generated = out[:, prompts.batch["input_ids"].shape[1] :]
    for row, want in zip(generated, expected, strict=True):
        n = int((want != 3).sum())
        assert row[:n].tolist() == want[:n].tolist()


def test_resume_reproduces_the_uninterrupted_run(
    reference_run, worker_groups, tiny_model_dir, arithmetic_data, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    config = _config(
        tiny_model_dir,
        arithmetic_data,
        tmp_path,
        **{
            "trainer.total_training_steps": 4,
            "trainer.experiment_name": "resumed",
            "critic.enable": False,
            "trainer.resume_mode": "resume_path",
            "trainer.test_freq": 4,
            "trainer.resume_from_path": str(reference_run["dir"] / "ckpt" / "global_step_2"),
        },
    )
    run_ppo(config, worker_groups=worker_groups)
    resumed = _metrics(tmp_path / "outputs" / "hybridflow" / "resumed")
    reference = _metrics(reference_run["dir"] / "outputs" / "hybridflow" / "reference")
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        for key in COMPARED_KEYS:
            assert resumed[step][key] == pytest.approx(reference[step][key], abs=1e-6), (step, key)


def test_auto_resume_skips_a_truncated_shard_in_the_latest_step(
    reference_run, worker_groups, tiny_model_dir, arithmetic_data, tmp_path, monkeypatch, capsys
):
    """Issue 32: step 4's actor shard cut short. ``resume_mode=auto`` names the step, the file and the
    damage in one line, resumes from step 2, and steps 3 and 4 repeat the uninterrupted run."""
    shutil.copytree(reference_run["dir"] / "ckpt", tmp_path / "ckpt")
    shard = tmp_path / "ckpt" / "global_step_4" / "actor" / "model" / "__0_0.distcp"
    size = shard.stat().st_size
    with shard.open("r+b") as f:
        f.truncate(size // 2)
    monkeypatch.chdir(tmp_path)
    config = _config(
        tiny_model_dir,
        arithmetic_data,
        tmp_path,
        **{
            "trainer.total_training_steps": 4,
            "trainer.experiment_name": "fallback",
            "critic.enable": False,
            "trainer.resume_mode": "auto",
            "trainer.test_freq": 4,
        },
    )
    run_ppo(config, worker_groups=worker_groups)
    out = capsys.readouterr().out
    damaged = [line for line in out.splitlines() if "damaged" in line]
    step4, step2 = tmp_path / "ckpt" / "global_step_4", tmp_path / "ckpt" / "global_step_2"
    assert damaged == [
        f"hybridflow: checkpoint step 4 is damaged (step 4 ({step4}): actor/model/__0_0.distcp: "
        f"{size // 2} bytes, the manifest says {size} (truncated)); resuming from step 2 ({step2}) instead"
    ]
    assert f"resumed from {step2} (step 2)" in out
    resumed = _metrics(tmp_path / "outputs" / "hybridflow" / "fallback")
    reference = _metrics(reference_run["dir"] / "outputs" / "hybridflow" / "reference")
    assert sorted(resumed) == [3, 4]
    for key in COMPARED_KEYS:
        assert resumed[3][key] == pytest.approx(reference[3][key], abs=1e-6), key


def test_ppo_with_critic_runs_and_logs_value_metrics(
    worker_groups, tiny_model_dir, arithmetic_data, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    config = _config(
        tiny_model_dir,
        arithmetic_data,
        tmp_path,
        **{
            "algorithm.adv_estimator": "gae",
            "algorithm.use_kl_in_reward": True,
            "algorithm.kl_ctrl.type": "adaptive",
            "trainer.experiment_name": "ppo",
            **PROFILE_STEP_2,
        },
    )
    last = run_ppo(config, worker_groups=worker_groups)
    _check_profile(tmp_path / "outputs" / "profile")
    for key in (
        "critic/vf_loss",
        "critic/vf_clipfrac",
        "critic/grad_norm",
        "critic/lr",
        "critic/values/mean",
        "critic/vf_explained_var",
        "actor/reward_kl_penalty",
        "actor/reward_kl_penalty_coeff",
    ):
        assert key in last and math.isfinite(last[key]), key


# verl's profiler on this run (docs/profiling.md): step 2 only; the actor (and the rollout, which follows
# it) on rank 1, the critic on every rank; the reference, in use, not enabled.
PROFILE_STEP_2 = {
    "global_profiler.tool": "torch",
    "global_profiler.steps": "[2]",
    "actor_rollout_ref.actor.profiler.enable": True,
    "actor_rollout_ref.actor.profiler.ranks": "[1]",
    "critic.profiler.enable": True,
    "critic.profiler.all_ranks": True,
}


def _check_profile(profile: Path) -> None:
    """A torch-profiler trace of step 2 for each enabled role on its ranks, and nothing else; the
    colocated process's trace names every phase of the step as ``timing_s/*`` does."""
    import gzip

    files = sorted(str(path.relative_to(profile)) for path in profile.rglob("*") if path.is_file())
    assert files == [
        "actor/step2_prof_rank-1.json.gz",
        "critic/step2_prof_rank-0.json.gz",
        "critic/step2_prof_rank-1.json.gz",
        "rollout/step2_prof_rank-1.json.gz",
    ]
    for name in ("critic/step2_prof_rank-0.json.gz", "actor/step2_prof_rank-1.json.gz"):
        with gzip.open(profile / name, "rt") as f:
            events = {event.get("name") for event in json.load(f)["traceEvents"]}
        phases = {"gen", "old_log_prob", "ref", "values", "update_critic", "update_actor"}
        assert phases <= events, (name, phases - events)


def test_reward_model_scores_the_last_response_token(worker_groups, reference_run, tiny_model_dir):
    from transformers import AutoModelForTokenClassification

    rollout = reference_run["greedy"]
    rollout.meta_info = {}
    scores = worker_groups.reward_model.compute_rm_score(rollout).batch["rm_scores"]
    lengths = rollout.batch["response_mask"].sum(-1)
    torch.manual_seed(0)  # the workers seed the freshly initialised score head the same way
    reference = AutoModelForTokenClassification.from_pretrained(tiny_model_dir, num_labels=1)
    expected = reference(
        input_ids=rollout.batch["input_ids"],
        attention_mask=rollout.batch["attention_mask"],
        position_ids=rollout.batch["position_ids"],
    ).logits[..., 0]
    prompt_len = rollout.batch["prompts"].shape[1]
    for row, length in enumerate(lengths.tolist()):  # single-turn: no gaps, last attended = last response
        assert scores[row].nonzero().flatten().tolist() in ([length - 1], [])
        assert scores[row, length - 1].item() == pytest.approx(
            expected[row, prompt_len + length - 1].item(), abs=1e-4
        )


@pytest.mark.slow  # a whole main_ppo run with tools (~60 s); parts: tests/workers/rollout/test_multi_turn.py
def test_multi_turn_grpo_runs_through_main_ppo_with_tools(
    ray_session, tiny_model_dir, arithmetic_data, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    tools = Path(__file__).parents[3] / "examples" / "tools" / "gsm8k_tool_config.yaml"
    config = _config(
        tiny_model_dir,
        arithmetic_data,
        tmp_path,
        **{
            "critic.enable": False,
            "actor_rollout_ref.actor.use_kl_loss": False,
            "trainer.total_training_steps": 2,
            "trainer.experiment_name": "multi_turn",
            "data.max_response_length": 24,
            "actor_rollout_ref.rollout.multi_turn.enable": True,
            "actor_rollout_ref.rollout.multi_turn.tool_config_path": str(tools),
            "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": 3,
        },
    )
    run_ppo(config)
    metrics = _metrics(tmp_path / "outputs" / "hybridflow" / "multi_turn")
    for key in (
        "num_turns/mean",
        "tool_calls/mean",
        "tool_failures/mean",
        "tool_rewards/mean",
        "actor/pg_loss",
    ):
        assert math.isfinite(metrics[2][key]), key
    assert metrics[2]["num_turns/min"] >= 1


@pytest.mark.slow  # a whole run; its parts are checked in the fast tier (make test <= 15 min)
def test_lora_grpo_trains_the_adapter_on_two_ranks(
    ray_session, tiny_model_dir, arithmetic_data, tmp_path, monkeypatch
):
    """LoRA through main_ppo on 2-rank FSDP2: the engine's merged weights match the actor's forward,
    the reference (adapter off) drifts from the actor, and the adapter-only checkpoint merges."""
    from transformers import AutoModelForCausalLM

    from hybridflow.model_merger import merge_fsdp_checkpoint

    monkeypatch.chdir(tmp_path)
    config = _config(
        tiny_model_dir,
        arithmetic_data,
        tmp_path,
        **{
            "critic.enable": False,
            "actor_rollout_ref.model.lora_rank": 8,
            "actor_rollout_ref.model.lora_alpha": 16,
            "actor_rollout_ref.actor.optim.lr": 1e-2,
            # the random tiny model earns no reward: the entropy bonus gives the adapter a gradient
            "actor_rollout_ref.actor.entropy_coeff": 0.01,
            "trainer.total_training_steps": 2,
            "trainer.save_freq": 2,
            "trainer.experiment_name": "lora",
        },
    )
    run_ppo(config)
    metrics = _metrics(tmp_path / "outputs" / "hybridflow" / "lora")
    assert metrics[2]["training/rollout_log_probs_diff_max"] < 1e-4  # merged engine == peft actor
    assert metrics[1]["actor/grad_norm"] > 0
    assert metrics[2]["actor/kl_loss"] > 0  # the reference (adapter off) stays behind
    actor_dir = tmp_path / "ckpt" / "global_step_2" / "actor"
    assert json.loads((actor_dir / "checkpoint_meta.json").read_text())["trainable_only"] is True
    merged = AutoModelForCausalLM.from_pretrained(merge_fsdp_checkpoint(actor_dir, tmp_path / "merged"))
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    changed = [name for name, p in merged.named_parameters() if not torch.equal(p, base.get_parameter(name))]
    assert changed and all("proj" in name for name in changed)


def test_generation_dumps_logs_timeline_and_checkpoint_limits(
    worker_groups, tiny_model_dir, arithmetic_data, tmp_path, monkeypatch
):
    """trainer.rollout_data_dir / validation_data_dir (verl's {step}.jsonl), log_val_generations,
    ray_init.timeline_json_file and max_actor/critic_ckpt_to_keep through main_ppo."""
    monkeypatch.chdir(tmp_path)
    config = _config(
        tiny_model_dir,
        arithmetic_data,
        tmp_path,
        **{
            "critic.enable": False,
            "trainer.experiment_name": "dumps",
            "trainer.val_before_train": True,
            "trainer.test_freq": 2,
            "trainer.save_freq": 1,
            "trainer.max_actor_ckpt_to_keep": 1,
            "trainer.max_critic_ckpt_to_keep": 1,  # the shared worker groups hold a critic: it is saved
            "trainer.log_val_generations": 2,
            "trainer.rollout_data_dir": str(tmp_path / "rollouts"),
            "trainer.validation_data_dir": str(tmp_path / "validation"),
            "ray_init.timeline_json_file": str(tmp_path / "timeline.json"),
        },
    )
    run_ppo(config, worker_groups=worker_groups)
    metrics = _metrics(tmp_path / "outputs" / "hybridflow" / "dumps")
    for step in (1, 2):  # 4 prompts x 2 responses, scored as the step's critic/score says
        rows = [
            json.loads(line) for line in (tmp_path / "rollouts" / f"{step}.jsonl").read_text().splitlines()
        ]
        assert len(rows) == 8 and all(r["step"] == step for r in rows)
        assert {"input", "output", "gts", "score"} <= rows[0].keys() and rows[0]["input"] and rows[0]["gts"]
        mean = sum(r["score"] for r in rows) / len(rows)
        assert mean == pytest.approx(metrics[step]["critic/score/mean"], abs=1e-6)
    val_key = "val-core/hybridflow/arithmetic/reward/mean@1"
    for step in (0, 2):  # before training and at test_freq
        rows = [
            json.loads(line) for line in (tmp_path / "validation" / f"{step}.jsonl").read_text().splitlines()
        ]
        assert len(rows) == 6
        assert sum(r["score"] for r in rows) / 6 == pytest.approx(metrics[step][val_key], abs=1e-6)
    logged = (
        (tmp_path / "outputs" / "hybridflow" / "dumps" / "val_generations.jsonl").read_text().splitlines()
    )
    assert [json.loads(line)["step"] for line in logged] == [0, 0, 2, 2]
    assert isinstance(json.loads((tmp_path / "timeline.json").read_text()), list)
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("global_step_*")) == ["global_step_2"]
