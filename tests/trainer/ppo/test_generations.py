"""verl's generation dumps (``{step}.jsonl``) and the choice of samples for ``log_val_generations``."""

import json

import numpy as np
import torch

from hybridflow import keys
from hybridflow.protocol import DataProto
from hybridflow.trainer.ppo.generations import (
    decode_generations,
    dump_generations,
    ground_truths,
    pick_samples,
)


def test_dump_writes_verls_fields_per_sample(tmp_path):
    path = dump_generations(
        str(tmp_path / "dumps"),
        step=7,
        inputs=["1+2=", "3+4="],
        outputs=["3", "8"],
        scores=[1.0, 0.0],
        gts=["3", "7"],
        extra={"acc": [True, np.bool_(False)], "pred": [np.int64(3), np.int64(8)], "group_mean": [0.5]},
    )
    assert path == str(tmp_path / "dumps" / "7.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "dumps" / "7.jsonl").read_text().splitlines()]
    assert rows == [
        {"input": "1+2=", "output": "3", "gts": "3", "score": 1.0, "step": 7, "acc": True, "pred": 3},
        {"input": "3+4=", "output": "8", "gts": "7", "score": 0.0, "step": 7, "acc": False, "pred": 8},
    ]  # group_mean (1 value for 2 samples) is not per-sample: left out, as verl does


def test_pick_samples_is_a_fixed_choice_whatever_the_order():
    inputs = [f"q{i}" for i in range(10)]
    outputs = [f"a{i}" for i in range(10)]
    scores = [float(i) for i in range(10)]
    picked = pick_samples(inputs, outputs, scores, 3)
    reversed_order = pick_samples(inputs[::-1], outputs[::-1], scores[::-1], 3)
    assert picked == reversed_order and len(picked) == 3
    assert all(int(i[1:]) == int(o[1:]) == s for i, o, s in picked)  # triples stay together
    assert pick_samples(inputs, outputs, scores, 5)[:3] == picked  # more samples: the same first three
    assert pick_samples(inputs, outputs, scores, 0) == []


def test_decode_uses_the_attention_mask_and_ground_truths(tiny_model_dir):
    from hybridflow.models.loading import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)
    hello, world = (tokenizer(t, add_special_tokens=False)["input_ids"] for t in ("12+34", "46"))
    pad = tokenizer.pad_token_id
    prompts = torch.tensor([[pad] * 2 + hello])
    responses = torch.tensor([world + [pad] * 3])
    mask = torch.cat(
        [torch.tensor([[0, 0] + [1] * len(hello)]), torch.tensor([[1] * len(world) + [0] * 3])], 1
    )
    batch = DataProto.from_dict(
        {keys.PROMPTS: prompts, keys.RESPONSES: responses, keys.ATTENTION_MASK: mask},
        non_tensors={"reward_model": np.array([{"ground_truth": "46"}], dtype=object)},
    )
    assert decode_generations(batch, tokenizer) == (["12+34"], ["46"])
    assert ground_truths(batch) == ["46"]
    assert ground_truths(DataProto.from_dict({keys.PROMPTS: prompts})) == [None]
