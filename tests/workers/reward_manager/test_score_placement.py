"""Where a sequence-level score lands: the last generated token (``response_mask == 1``), for every
manager. A multi-turn response truncated inside a tool turn ends on masked tool tokens; a score there
is multiplied away by the response mask in every estimator, so the sample would train on reward 0."""

import pytest
import torch

from hybridflow.models.tiny import build_tokenizer
from hybridflow.tasks.arithmetic import task_texts
from hybridflow.workers.reward_manager import (
    BatchRewardManager,
    DAPORewardManager,
    NaiveRewardManager,
    PrimeRewardManager,
)
from tests.workers.reward_manager.test_reward_managers import constant_one, make_batch


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(task_texts(n=300))


def batch_constant_one(data_sources, solution_strs, ground_truths, extra_infos, **kwargs):
    return [1.0] * len(data_sources)


def _multi_turn_batch(tokenizer):
    """Three 8-token responses ("12345678": one token per digit), every token attended:
    row 0: 3 generated tokens, then a tool turn cut off by the length limit   -> last generated: 2
    row 1: generated, tool, generated again, then a truncated tool turn       -> last generated: 5
    row 2: nothing generated (the whole response is a tool turn)              -> position 0 (empty)"""
    data = make_batch(tokenizer, ["12345678"] * 3, ["0"] * 3, t_r=8)
    assert data.batch["responses"][0].ne(tokenizer.pad_token_id).sum() == 8
    data.batch["response_mask"] = torch.tensor(
        [[1, 1, 1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0, 0, 0]]
    )
    return data


MANAGERS = [
    lambda tok: NaiveRewardManager(tok, 0, compute_score=constant_one),
    lambda tok: BatchRewardManager(tok, 0, compute_score=batch_constant_one),
    lambda tok: DAPORewardManager(tok, 0, compute_score=constant_one),
    lambda tok: PrimeRewardManager(tok, 0, compute_score=constant_one, num_processes=1),
]


@pytest.mark.parametrize("build", MANAGERS, ids=["naive", "batch", "dapo", "prime"])
def test_score_lands_on_the_last_generated_token(tokenizer, build):
    reward = build(tokenizer)(_multi_turn_batch(tokenizer))
    expected = torch.zeros(3, 8)
    expected[0, 2] = 1.0  # not 7 (the last attended token, a masked tool token)
    expected[1, 5] = 1.0
    expected[2, 0] = 1.0  # empty response: position 0 keeps the score in the tensor
    assert torch.equal(reward, expected)


def test_score_survives_the_response_mask(tokenizer):
    """What the estimators see: reward x response_mask keeps the whole score on every non-empty row."""
    data = _multi_turn_batch(tokenizer)
    reward = NaiveRewardManager(tokenizer, 0, compute_score=constant_one)(data)
    assert (reward * data.batch["response_mask"]).sum(-1).tolist() == [1.0, 1.0, 0.0]


def test_dapo_penalty_still_counts_every_response_token(tokenizer):
    """The overlong penalty measures the whole response (8 tokens, tool turns included, as in verl);
    only where the shaped score is written changes."""
    cfg = {"enable": True, "len": 4, "penalty_factor": 0.5}
    manager = DAPORewardManager(
        tokenizer, 0, compute_score=constant_one, max_resp_len=8, overlong_buffer_cfg=cfg
    )
    reward = manager(_multi_turn_batch(tokenizer))
    assert reward[0, 2].item() == 0.5 and reward[1, 5].item() == 0.5  # 1 - (8 - 4) / 4 * 0.5
    assert reward.count_nonzero() == 3
