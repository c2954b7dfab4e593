"""The trainer's rollout-side phases on a real hybrid worker in this process (world size 1, gloo):

- ``rollout.do_sample=false`` gives greedy training rollouts (engine and hf);
- training log-probs (old, ref, update) use ``rollout.temperature`` only, whatever rollout ran before;
- ``use_rollout_log_probs`` re-checks parity every ``log_prob_parity_check_freq`` steps, falls back to the
  recompute when a check fails, and a resumed run trusts/re-checks exactly as the uninterrupted one;
- ReMax's ``reward_baselines``: the reward of one greedy response per prompt, on that prompt's rows.

The worker group is :class:`InProcessGroup`: the backend-neutral ``WorkerGroup`` (same dispatch and
collect as the Ray group) over one worker object in this process; the Ray path is covered end to end
in ``test_remax_e2e.py``."""

import contextlib

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from hybridflow import keys
from hybridflow.protocol import DataProto
from hybridflow.single_controller.base import WorkerGroup
from hybridflow.trainer.config import load_config
from hybridflow.trainer.ppo.ray_trainer import RayPPOTrainer
from hybridflow.trainer.ppo.rollouts import rollout_with_uids
from hybridflow.trainer.ppo.workers_setup import WorkerGroups
from hybridflow.workers.fsdp_workers import ActorRolloutRefWorker
from tests.utils.checkpoint.fsdp_toy import gloo_group

RESPONSE_LENGTH = 6


def _config(tiny_model_dir, arithmetic_data, tmp_path, **extra):
    train, test = arithmetic_data
    values = {
        "data.train_files": train,
        "data.val_files": test,
        "actor_rollout_ref.model.path": tiny_model_dir,
        "data.train_batch_size": 4,
        "data.max_prompt_length": 40,
        "data.max_response_length": RESPONSE_LENGTH,
        "data.shuffle": False,
        "actor_rollout_ref.rollout.n": 2,
        "actor_rollout_ref.rollout.kv_cache_memory_gb": 0.01,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 4,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 8,
        "actor_rollout_ref.actor.use_kl_loss": True,
        "trainer.default_local_dir": str(tmp_path / "ckpt"),
        "trainer.resume_mode": "disable",
        **extra,
    }
    config = load_config([f"{k}={v}" for k, v in values.items()])
    OmegaConf.resolve(config)
    return config


class InProcessGroup(WorkerGroup):
    """A one-rank worker group whose worker lives in this process."""

    def __init__(self, worker) -> None:
        super().__init__("in_process")
        self.worker = worker
        self._bind_worker_methods(type(worker))

    @property
    def world_size(self) -> int:
        return 1

    def _submit(self, rank: int, method: str, args: tuple, kwargs: dict):
        return getattr(self.worker, method)(*args, **kwargs)  # runs now; the "future" is the output

    def _gather(self, futures: dict, method: str) -> dict:
        return dict(futures)


@contextlib.contextmanager
def _trainer(config, reward_fn=None, worker=None):
    """A trainer whose actor_rollout group is an in-process ActorRolloutRefWorker (built unless given)."""
    from hybridflow.trainer.main_ppo import build_dataloaders
    from hybridflow.workers.reward_manager import build_reward_manager

    tokenizer = _tokenizer(config)
    train, val = build_dataloaders(config, tokenizer)
    if worker is None:
        worker = ActorRolloutRefWorker(config.actor_rollout_ref, role="actor_rollout_ref")
        worker.init_model()
    group = InProcessGroup(worker)
    reward_fn = reward_fn or build_reward_manager(
        config.reward_model, config.custom_reward_function, tokenizer, 0
    )
    groups = WorkerGroups(actor_rollout=group, critic=None, reward_model=None, base=None)
    yield RayPPOTrainer(config, tokenizer, train, val, reward_fn, reward_fn, worker_groups=groups)


def _tokenizer(config):
    from hybridflow.models.loading import load_tokenizer

    return load_tokenizer(config.actor_rollout_ref.model.path)


def _prompts(trainer) -> DataProto:
    return next(trainer._batches())


def _groups(responses: torch.Tensor, n: int) -> list[torch.Tensor]:
    return list(responses.view(-1, n, responses.shape[-1]))


# ------------------------------------------------------------------ do_sample=false (item 14)
@pytest.mark.parametrize("rollout_name", ["engine", "hf"])
def test_do_sample_false_gives_n_identical_greedy_responses(
    tiny_model_dir, arithmetic_data, tmp_path, rollout_name
):
    n = 3
    with gloo_group():
        for do_sample in (True, False):
            config = _config(
                tiny_model_dir,
                arithmetic_data,
                tmp_path,
                **{
                    "actor_rollout_ref.rollout.name": rollout_name,
                    "actor_rollout_ref.rollout.n": n,
                    "actor_rollout_ref.rollout.do_sample": do_sample,
                },
            )
            with _trainer(config) as trainer:
                trainer.global_steps = 1
                batch = trainer.generate(_prompts(trainer), timing={})
            groups = _groups(batch.batch[keys.RESPONSES], n)
            identical = [bool((g == g[0]).all()) for g in groups]
            if do_sample:  # the same prompts do get different samples when sampling is on
                assert not all(identical)
            else:
                assert all(identical)
                greedy = _argmax_decode(tiny_model_dir, batch[:1])[0]
                assert groups[0][0, : len(greedy)].tolist() == greedy


def _argmax_decode(model_dir: str, rows: DataProto) -> list[list[int]]:
    """Greedy responses (up to and including EOS) from full forwards of a fresh HF model, per row of
    ``rows`` (its prompts)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    eos = set(model.generation_config.eos_token_id)
    prompts = rows.batch[keys.PROMPTS]
    ids, mask = prompts, rows.batch[keys.ATTENTION_MASK][:, : prompts.shape[1]]
    out = []
    with torch.no_grad():
        for _ in range(RESPONSE_LENGTH):
            position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
            token = (
                model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits[:, -1].argmax(-1)
            )
            out.append(token)
            ids = torch.cat([ids, token[:, None]], dim=1)
            mask = torch.cat([mask, torch.ones_like(token[:, None])], dim=1)
    responses = torch.stack(out, dim=1).tolist()
    return [r[: next((i + 1 for i, t in enumerate(r) if t in eos), len(r))] for r in responses]


# ------------------------------------------------------------------ one temperature (item 10)
def _float64_log_probs(model_dir: str, batch: DataProto, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) of each response token, the whole forward in float64."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    with torch.no_grad():
        logits = model(
            input_ids=batch.batch[keys.INPUT_IDS],
            attention_mask=batch.batch[keys.ATTENTION_MASK],
            position_ids=batch.batch[keys.POSITION_IDS],
        ).logits
    responses = batch.batch[keys.RESPONSES]
    logits = logits[:, -responses.shape[1] - 1 : -1] / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, responses[..., None]).squeeze(-1)


def test_training_log_probs_use_rollout_temperature_after_greedy_validation(
    tiny_model_dir, arithmetic_data, tmp_path
):
    config = _config(
        tiny_model_dir,
        arithmetic_data,
        tmp_path,
        **{
            "actor_rollout_ref.rollout.temperature": 0.7,
            # the separate old-log-prob pass is what is checked here (not the on-policy shortcut)
            "actor_rollout_ref.actor.reuse_update_log_probs": False,
        },
    )
    assert config.actor_rollout_ref.rollout.val_kwargs.temperature == 0
    with gloo_group(), _trainer(config) as trainer:
        trainer.global_steps = 1
        validation_meta = {"validate": True, "do_sample": False, "global_steps": 1}
        greedy = rollout_with_uids(trainer.wg.actor_rollout, _prompts(trainer), 1, validation_meta, timing={})
        trainer.validate()  # a T = 0 rollout of the validation set
        sampled = trainer.generate(_prompts(trainer), timing={})
        for batch in (greedy, sampled):
            mask = batch.batch[keys.RESPONSE_MASK].bool()
            expected = _float64_log_probs(tiny_model_dir, batch, 0.7)
            at_one = _float64_log_probs(tiny_model_dir, batch, 1.0)
            assert (expected - at_one)[mask].abs().max() > 1e-2  # the temperature is visible
            old = trainer.compute_old_log_prob(batch, {}).batch[keys.OLD_LOG_PROBS]
            ref = trainer.compute_ref_log_prob(batch).batch[keys.REF_LOG_PROB]
            torch.testing.assert_close(old[mask].double(), expected[mask], atol=1e-5, rtol=0)
            torch.testing.assert_close(ref[mask].double(), expected[mask], atol=1e-5, rtol=0)
        # the update recomputes at the same temperature: before the first optimizer step the ratio is 1
        sampled = trainer.compute_reward(sampled, {}, {})
        sampled = trainer.compute_advantage(sampled, {})
        metrics = trainer.update_actor(sampled)
        assert abs(metrics["actor/ppo_kl"]) < 1e-6
        assert metrics["actor/pg_clipfrac"] == 0.0


# ------------------------------------------------------------------ parity re-checks (item 11)
def _steps_recomputed(trainer, batch: DataProto, steps, tamper_at=()) -> list[int]:
    """Run compute_old_log_prob on a copy of ``batch`` at each step; the steps that recomputed."""
    recomputed = []
    for step in steps:
        trainer.global_steps = step
        data = batch.select(deepcopy=True)
        if step in tamper_at:  # an engine that drifted from the actor
            data.batch[keys.ROLLOUT_LOG_PROBS] += 0.01 * data.batch[keys.RESPONSE_MASK]
        metrics = {}
        out = trainer.compute_old_log_prob(data, metrics)
        old, rollout = out.batch[keys.OLD_LOG_PROBS], data.batch[keys.ROLLOUT_LOG_PROBS]
        if "training/rollout_log_probs_diff_max" in metrics:
            recomputed.append(step)
        if step in tamper_at:  # a failed check: the recompute trains, never the drifted log-probs
            assert metrics["training/rollout_log_probs_verified"] == 0.0
            assert not torch.equal(old, rollout)
        elif step not in recomputed:
            assert torch.equal(old, rollout)
    return recomputed


def _parity_config(tiny_model_dir, arithmetic_data, tmp_path, freq: int, **extra):
    return _config(
        tiny_model_dir,
        arithmetic_data,
        tmp_path,
        **{
            "actor_rollout_ref.rollout.use_rollout_log_probs": True,
            "actor_rollout_ref.rollout.log_prob_parity_check_freq": freq,
            **extra,
        },
    )


def test_parity_is_checked_again_every_freq_steps_and_a_failure_recomputes(
    tiny_model_dir, arithmetic_data, tmp_path
):
    config = _parity_config(tiny_model_dir, arithmetic_data, tmp_path, freq=3)
    with gloo_group(), _trainer(config) as trainer:
        trainer.global_steps = 1
        batch = trainer.generate(_prompts(trainer), timing={})
        # checks at 1, then every 3 steps: 4, 7
        assert _steps_recomputed(trainer, batch, range(1, 9)) == [1, 4, 7]
        # the check at 10 fails: recompute at 10, and at 11 (still unverified, passes), trust 12, 13
        assert _steps_recomputed(trainer, batch, range(10, 15), tamper_at=(10,)) == [10, 11, 14]


def test_resume_restores_the_parity_state(tiny_model_dir, arithmetic_data, tmp_path):
    resume = {"trainer.resume_mode": "auto"}
    config = _parity_config(tiny_model_dir, arithmetic_data, tmp_path, freq=10, **resume)
    with gloo_group(), _trainer(config) as trainer:
        trainer.global_steps = 1
        batch = trainer.generate(_prompts(trainer), timing={})
        assert _steps_recomputed(trainer, batch, [1, 2, 3]) == [1]
        trainer.checkpointer.save(trainer)  # at step 3
        state = torch.load(tmp_path / "ckpt" / "global_step_3" / "data.pt", weights_only=False)
        assert state["rollout_log_probs_verified"] is True and state["rollout_log_probs_checked_at"] == 1
        with _trainer(config, worker=trainer.wg.actor_rollout.worker) as resumed:
            assert resumed.checkpointer.load(resumed) == 3
            # as the uninterrupted run: trusted until the check due at step 11
            assert _steps_recomputed(resumed, batch, range(4, 13)) == [11]


def test_parity_check_freq_must_be_positive(tiny_model_dir, arithmetic_data, tmp_path):
    from hybridflow.trainer.config import ConfigError, validate_config

    config = _parity_config(tiny_model_dir, arithmetic_data, tmp_path, freq=0)
    with pytest.raises(ConfigError, match="log_prob_parity_check_freq must be >= 1"):
        validate_config(config)


# ------------------------------------------------------------------ ReMax baseline (item 7)
def response_length_score(data_source, solution_str, ground_truth, extra_info=None):
    """A reward the untrained model's responses differ in: characters in the decoded response."""
    return float(len(solution_str))


def test_remax_baseline_is_the_greedy_response_reward_on_its_prompts_rows(
    tiny_model_dir, arithmetic_data, tmp_path
):
    from hybridflow.workers.reward_manager import NaiveRewardManager

    n = 2
    config = _config(
        tiny_model_dir,
        arithmetic_data,
        tmp_path,
        **{"algorithm.adv_estimator": "remax", "actor_rollout_ref.rollout.n": n},
    )
    tokenizer = _tokenizer(config)
    reward_fn = NaiveRewardManager(tokenizer, 0, compute_score=response_length_score)
    with gloo_group(), _trainer(config, reward_fn=reward_fn) as trainer:
        trainer.global_steps = 1
        prompts = _prompts(trainer)
        timing = {}
        batch = trainer.generate_and_score(prompts, {}, timing)
    assert len(batch) == len(prompts) * n  # the greedy rows are gone
    assert "gen_max" in timing
    greedy = _argmax_decode(tiny_model_dir, batch[::n])
    expected = [float(len(tokenizer.decode(r, skip_special_tokens=True))) for r in greedy]
    baselines = batch.batch[keys.REWARD_BASELINES]
    assert baselines.shape == (len(prompts) * n,)
    assert baselines.tolist() == np.repeat(expected, n).tolist()
    uids = batch.non_tensor_batch[keys.UID]
    assert all(uids[i] == uids[i - i % n] for i in range(len(batch)))
