"""Supervised fine-tuning data: chat prompt + response, loss on the response tokens only.

Parquet columns (verl's SFT keys): ``prompt`` (chat messages, or a plain string turned into one user
message) and ``response`` (the assistant text). Each row becomes
``chat_template(prompt, add_generation_prompt=True) + response + eos``, right-padded to
``max_length``; ``loss_mask`` is 1 on the response and eos tokens.
"""

from __future__ import annotations

import os

import pandas as pd
import torch


class SFTDataset:
    """Rows of ``input_ids``, ``attention_mask``, ``position_ids``, ``loss_mask`` — all (max_length,)."""

    def __init__(
        self,
        files: str | list[str],
        tokenizer,
        max_length: int,
        prompt_key: str = "prompt",
        response_key: str = "response",
        truncation: str = "error",
    ) -> None:
        files = [files] if isinstance(files, str) else list(files)
        frames = []
        for path in files:
            frame = pd.read_parquet(os.path.expanduser(path))
            for column in (prompt_key, response_key):
                if column not in frame.columns:
                    raise KeyError(f"{path}: missing column {column!r}; columns: {list(frame.columns)}")
            frames.append(frame)
        self.frame = pd.concat(frames, ignore_index=True)
        self.tokenizer = tokenizer
        self.max_length = int(max_length)
        self.prompt_key, self.response_key, self.truncation = prompt_key, response_key, truncation

    def __len__(self) -> int:
        return len(self.frame)

    def _prompt_ids(self, prompt) -> list[int]:
        messages = (
            [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        )
        encoded = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = self.frame.iloc[index]
        prompt_ids = self._prompt_ids(row[self.prompt_key])
        response_ids = self.tokenizer(str(row[self.response_key]), add_special_tokens=False)["input_ids"]
        response_ids = list(response_ids) + [self.tokenizer.eos_token_id]
        ids = prompt_ids + response_ids
        if len(ids) > self.max_length:
            if self.truncation == "error":
                raise ValueError(
                    f"SFT row {index}: {len(ids)} tokens exceed data.max_length={self.max_length}"
                )
            ids = ids[: self.max_length]
        pad = self.max_length - len(ids)
        loss_mask = [0] * len(prompt_ids) + [1] * len(response_ids)
        return {
            "input_ids": torch.tensor(ids + [self.tokenizer.pad_token_id] * pad, dtype=torch.long),
            "attention_mask": torch.tensor([1] * len(ids) + [0] * pad, dtype=torch.long),
            "position_ids": torch.tensor(list(range(len(ids))) + [0] * pad, dtype=torch.long),
            "loss_mask": torch.tensor(loss_mask[: len(ids)] + [0] * pad, dtype=torch.long),
        }


def collate_sft(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack rows and drop trailing columns that are padding in every row (the batch is as wide as
    its longest example, not ``max_length``)."""
    batch = {key: torch.stack([row[key] for row in rows]) for key in rows[0]}
    width = int(batch["attention_mask"].sum(dim=-1).max())
    return {key: value[:, :width] for key, value in batch.items()}
