"""The distillation keys are checked before Ray starts: each bad setting is refused with its reason."""

import pytest

from hybridflow.trainer.config import load_config
from hybridflow.trainer.config.distill_honesty import distill_problems

TEACHER = ["actor_rollout_ref.teacher.server_ip=127.0.0.1"]


def _problems(overrides: list[str]) -> list[str]:
    return distill_problems(load_config(overrides))


def test_the_defaults_and_a_teacher_pass():
    assert _problems([]) == []
    assert _problems([*TEACHER, "trainer.scheduler=two_step_off"]) == []
    assert _problems([*TEACHER, "actor_rollout_ref.actor.distill_loss.use_policy_loss=true"]) == []


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["trainer.scheduler=three_step_off"], "is not one of"),
        (["trainer.scheduler=one_step_off"], "no teacher is set"),
        (["actor_rollout_ref.actor.distill_loss.loss_coef=0.5"], "it would do nothing"),
        ([*TEACHER, "actor_rollout_ref.actor.distill_loss.name=jsd"], "not implemented"),
        ([*TEACHER, "actor_rollout_ref.actor.distill_loss.loss_coef=-1"], "must be >= 0"),
        ([*TEACHER, "actor_rollout_ref.teacher.n_logprobs=2000"], "n_logprobs=2000 must be an integer"),
        ([*TEACHER, "actor_rollout_ref.teacher.n_server_workers=0"], "n_server_workers=0"),
        ([*TEACHER, "actor_rollout_ref.teacher.timeout_s=0"], "timeout_s=0 must be > 0"),
        ([*TEACHER, "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"], "whole-vocabulary logits"),
        # verl's newer key: the distill forward bypasses SP, so it must be refused too (issue 44 item 8)
        (
            [*TEACHER, "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=2"],
            "whole-vocabulary logits",
        ),
        ([*TEACHER, "algorithm.filter_groups.enable=true"], "dynamic sampling"),
        ([*TEACHER, "trainer.scheduler=one_step_off", "trainer.save_freq=5"], "a resumed run"),
    ],
)
def test_refused(overrides, words):
    problems = _problems(overrides)
    assert any(words in p for p in problems), problems
