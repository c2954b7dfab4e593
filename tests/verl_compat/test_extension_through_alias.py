"""A verl-style extension file (extension_written_for_verl.py: a registered estimator, a custom reward
function, a metric) runs unchanged on hybridflow through the verl alias, reaching our trainer's
registry and reward manager. Numbers by hand."""

from pathlib import Path

import numpy as np
import pytest
import torch

from hybridflow import verl_compat
from hybridflow.algorithms import ADV_ESTIMATORS, AdvantageInputs, compute_advantage
from hybridflow.models.tiny import build_tokenizer
from hybridflow.protocol import DataProto
from hybridflow.tasks.arithmetic import task_texts
from hybridflow.workers.reward_manager import build_reward_manager, load_custom_reward_function

EXTENSION = str(Path(__file__).with_name("extension_written_for_verl.py"))


@pytest.fixture(scope="module")
def extension():
    saved = dict(ADV_ESTIMATORS._entries)
    assert verl_compat.install()
    load_custom_reward_function(EXTENSION)  # imports the file (once per process), registering its estimator
    module = next(
        m for m in list(__import__("sys").modules.values()) if getattr(m, "__file__", None) == EXTENSION
    )
    yield module
    verl_compat.uninstall()
    ADV_ESTIMATORS._entries.clear()
    ADV_ESTIMATORS._entries.update(saved)


def test_registered_estimator_runs_through_our_dispatcher(extension):
    # prompt a: scores 1, 0, 0.5 -> 1 - max(0, 0.5) = 0.5; 0 - max(1, 0.5) = -1; 0.5 - max(1, 0) = -0.5
    # prompt b: a single response has no others: its score 2 stays.
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.5, 0.0], [0.0, 2.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    out = compute_advantage(
        "best_of_rest", AdvantageInputs(rewards, mask, index=np.array(["a", "a", "a", "b"]))
    )
    assert out.advantages.tolist() == [[0.5, 0.5], [-1.0, -1.0], [-0.5, 0.0], [2.0, 2.0]]


def test_custom_reward_function_scores_through_our_reward_manager(extension):
    tokenizer = build_tokenizer(task_texts(n=300))
    pad = tokenizer.pad_token_id
    responses = [
        tokenizer("4", add_special_tokens=False)["input_ids"],
        tokenizer("5", add_special_tokens=False)["input_ids"],
    ]
    t_r = max(map(len, responses)) + 1
    batch = DataProto.from_dict(
        tensors={
            "prompts": torch.full((2, 2), pad),
            "responses": torch.tensor([r + [pad] * (t_r - len(r)) for r in responses]),
            "attention_mask": torch.tensor([[0, 0] + [1] * len(r) + [0] * (t_r - len(r)) for r in responses]),
        },
        non_tensors={
            "data_source": ["my/arith", "my/arith"],
            "reward_model": [{"ground_truth": "4"}, {"ground_truth": "4"}],
            "extra_info": [{}, {}],
        },
    )
    manager = build_reward_manager({"reward_manager": "naive"}, {"path": EXTENSION}, tokenizer, num_examine=0)
    scores = manager(batch)
    assert scores.sum(dim=-1).tolist() == [1.0, 0.0]  # "4" is right, "5" is not


def test_metric_function_reduces_with_our_metric_classes(extension):
    batch = DataProto.from_dict(
        {
            "responses": torch.tensor([[7, 1, 0], [3, 1, 1]]),
            "response_mask": torch.tensor([[1, 1, 0], [1, 1, 1]]),
            "token_level_scores": torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.5]]),
        }
    )
    # lengths 2 and 3 -> mean 2.5; scores 1 + 0.5 = 1.5 summed; first tokens 7 and 3 -> mean 5
    assert extension.response_metrics(batch) == {
        "my/response_length": 2.5,
        "my/score_total": 1.5,
        "my/first_token_mean": 5.0,
    }
