"""DAPO dynamic sampling keeps only prompt groups whose responses disagree, generating more as needed."""

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from hybridflow.protocol import DataProto
from hybridflow.trainer.ppo.dynamic_sampling import GroupFilter, informative_rows


def scored(uids: list[str], scores: list[float]) -> DataProto:
    token_scores = torch.zeros(len(scores), 3)
    token_scores[:, -1] = torch.tensor(scores)
    return DataProto.from_dict({"token_level_scores": token_scores}, {"uid": uids, "acc": scores})


def test_informative_rows_drop_groups_with_equal_rewards():
    batch = scored(["a", "a", "b", "b", "c", "c"], [1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    assert informative_rows(batch, "acc").tolist() == [0, 1]
    assert informative_rows(batch, "seq_reward").tolist() == [0, 1]


def test_fill_generates_until_enough_groups_and_truncates():
    cfg = OmegaConf.create({"metric": "acc", "max_num_gen_batches": 5})
    batches = iter([scored(["c", "c", "d", "d"], [1.0, 0.0, 0.0, 1.0]), scored(["e", "e"], [0.0, 1.0])])
    metrics: dict = {}
    first = scored(["a", "a", "b", "b"], [1.0, 1.0, 0.0, 1.0])
    out = GroupFilter(cfg).fill(first, lambda: next(batches), num_prompts=2, metrics=metrics)
    assert list(out.non_tensor_batch["uid"]) == ["b", "b", "c", "c"]
    assert metrics["train/num_gen_batches"] == 2
    assert np.allclose(out.batch["token_level_scores"].sum(-1).numpy(), [0.0, 1.0, 1.0, 0.0])


def test_fill_gives_up_with_a_clear_error():
    cfg = OmegaConf.create({"metric": "acc", "max_num_gen_batches": 2})
    same = scored(["a", "a"], [1.0, 1.0])
    with pytest.raises(RuntimeError, match="only 0 of 1 prompt groups had non-zero 'acc' std after 2"):
        GroupFilter(cfg).fill(same, lambda: scored(["b", "b"], [0.0, 0.0]), num_prompts=1, metrics={})


def test_batches_with_different_prompt_widths_are_aligned():
    from hybridflow.trainer.ppo.dynamic_sampling import align_prompt_widths

    def gen(width: int) -> DataProto:
        prompt = torch.ones(2, width, dtype=torch.long)
        full = torch.cat([prompt, torch.full((2, 3), 7)], dim=1)
        return DataProto.from_dict(
            {
                "prompts": prompt,
                "input_ids": full,
                "attention_mask": torch.ones_like(full),
                "position_ids": torch.arange(width + 3).expand(2, -1).clone(),
            }
        )

    joined = DataProto.concat(align_prompt_widths([gen(2), gen(4)]))
    assert joined.batch["input_ids"].shape == (4, 7)
    assert joined.batch["attention_mask"][:2].tolist() == [[0, 0, 1, 1, 1, 1, 1]] * 2
    assert joined.batch["input_ids"][:2, -3:].tolist() == [[7, 7, 7]] * 2
