"""An extension module written the way verl's docs write one: a registered advantage estimator, a
custom reward function and a metric, importing verl's names. hybridflow runs it unchanged through
the verl alias (tests/verl_compat/test_extension_through_alias.py), or as a script with
``python -m hybridflow.verl_compat tests/verl_compat/extension_written_for_verl.py``."""

import numpy as np
import torch
from verl import DataProto
from verl.trainer.ppo.core_algos import register_adv_est
from verl.utils.metric import Metric, reduce_metrics
from verl.utils.torch_functional import masked_mean


@register_adv_est("best_of_rest")
def compute_best_of_rest_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    config=None,
    **kwargs,
):
    """Each response's score minus the best score among the other responses to its prompt."""
    scores = token_level_rewards.sum(dim=-1)
    baseline = torch.zeros_like(scores)
    for uid in np.unique(index):
        rows = np.flatnonzero(index == uid)
        for i in rows:
            others = [j for j in rows if j != i]
            baseline[i] = scores[others].max() if others else 0.0
    advantages = (scores - baseline).unsqueeze(-1) * response_mask
    return advantages, advantages


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's custom reward function signature: 1 for the exact answer, else 0."""
    return 1.0 if solution_str.strip() == str(ground_truth) else 0.0


def response_metrics(batch: DataProto) -> dict:
    """Mean response length and the total of the scores of one batch."""
    mask = batch.batch["response_mask"].float()
    lengths = mask.sum(dim=-1)
    metrics = {
        "my/response_length": Metric("mean", lengths.tolist()),
        "my/score_total": Metric("sum", batch.batch["token_level_scores"].sum(dim=-1).tolist()),
        "my/first_token_mean": [masked_mean(batch.batch["responses"][:, 0].float(), mask[:, 0]).item()],
    }
    return reduce_metrics(metrics)


if __name__ == "__main__":
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.5, 0.0]])
    advantages, _ = compute_best_of_rest_advantage(rewards, torch.ones_like(rewards), np.array([0, 0, 0]))
    print("best_of_rest", advantages[:, 0].tolist())
