"""Shared by the engine-rollout and LoRA tests: three left-padded prompts and HF's greedy answer."""

import torch

from hybridflow.protocol import DataProto

PAD, EOS = 3, 2


def tiny_prompts(n: int = 1, do_sample: bool = False) -> DataProto:
    rows = [[1, 9, 14, 22, 5], [1, 30, 7], [1, 11, 12, 13, 40, 41, 42]]
    width = max(map(len, rows))
    ids = torch.tensor([[PAD] * (width - len(r)) + r for r in rows]).repeat_interleave(n, dim=0)
    mask = (ids != PAD).long()
    data = DataProto.from_dict(
        {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}
    )
    data.meta_info = {"eos_token_id": [EOS], "pad_token_id": PAD, "do_sample": do_sample, "global_steps": 1}
    return data


def hf_greedy(model, data: DataProto, new_tokens: int) -> torch.Tensor:
    out = model.generate(
        input_ids=data.batch["input_ids"],
        attention_mask=data.batch["attention_mask"],
        do_sample=False,
        max_new_tokens=new_tokens,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    generated = out[:, data.batch["input_ids"].shape[1] :]
    return torch.nn.functional.pad(generated, (0, new_tokens - generated.shape[1]), value=PAD)
