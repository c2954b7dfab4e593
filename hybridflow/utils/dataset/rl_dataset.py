"""RLHFDataset: prompts from verl-schema parquet files, chat-templated and left-padded.

Each parquet row holds ``data_source``, ``prompt`` (a list of ``{"role", "content"}`` messages),
``ability``, ``reward_model`` (``{"style", "ground_truth"}``) and ``extra_info`` (a dict). An item is::

    input_ids       (T_p,) int64  left-padded prompt ids (T_p = data.max_prompt_length)
    attention_mask  (T_p,) int64  0 on the left padding, 1 on prompt tokens
    position_ids    (T_p,) int64  cumsum(attention_mask) - 1, clipped at 0
    raw_prompt_ids  list[int]     unpadded (truncated) prompt ids, for rollout engines
    raw_prompt      list[dict]    the messages (only with data.return_raw_chat)
    full_prompts    str           the templated prompt (only with data.return_full_prompt)
    index, tools_kwargs, interaction_kwargs, and every other parquet column (data_source, ...)

Config keys follow verl's ``data.*`` section; ``cache_dir`` is accepted and ignored (files are local).
Image rows (an ``image_key`` column, read with the model's processor) add ``multi_modal_data`` and
``multi_modal_inputs`` (:mod:`hybridflow.utils.dataset.multimodal`); a ``video_key`` column is refused.
"""

from __future__ import annotations

import copy
import logging
from collections import defaultdict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from hybridflow.utils.dataset.multimodal import ImageRows

logger = logging.getLogger(__name__)

DEFAULTS: dict[str, Any] = {
    "prompt_key": "prompt",
    "max_prompt_length": 512,
    "filter_overlong_prompts": False,
    "truncation": "error",
    "return_raw_chat": False,
    "return_full_prompt": False,
    "reward_fn_key": "data_source",
    "image_key": "images",
    "video_key": "videos",
    "return_multi_modal_inputs": True,
    "cache_dir": None,
    "apply_chat_template_kwargs": None,  # verl's: extra chat-template variables ({enable_thinking: false})
}


def _keep_left(ids: list[int], n: int) -> list[int]:
    return ids[-n:]


def _keep_right(ids: list[int], n: int) -> list[int]:
    return ids[:n]


def _keep_middle_out(ids: list[int], n: int) -> list[int]:
    """Keep the first ``n // 2`` and the last ``n - n // 2`` tokens (drop the middle)."""
    head = n // 2
    return ids[:head] + ids[len(ids) - (n - head) :]


# data.truncation -> how an over-long prompt is cut ("error" raises instead).
TRUNCATIONS: dict[str, Callable[[list[int], int], list[int]] | None] = {
    "left": _keep_left,
    "right": _keep_right,
    "middle": _keep_middle_out,
    "error": None,
}


PROMPT_TENSOR_KEYS = ("input_ids", "attention_mask", "position_ids")


def trim_shared_left_padding(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop leading columns where ``attention_mask`` is 0 in every row (all tensors ``(B, T)``)."""
    mask = tensors.get("attention_mask")
    if mask is None or mask.numel() == 0:
        return tensors
    used = mask.any(dim=0).nonzero()
    start = int(used[0]) if len(used) else 0
    return {key: value[:, start:] for key, value in tensors.items()}


def collate_fn(rows: list[dict]) -> dict:
    """Stack tensor fields to ``(B, ...)``; every other field becomes a 1-D numpy object array ``(B,)``.

    The result feeds ``DataProto.from_single_dict``. Lists (e.g. ``raw_prompt_ids`` of equal lengths)
    stay one object per row instead of becoming a 2-D array. Columns of left padding shared by every
    row are dropped (prompts are as wide as the batch's longest, at most ``max_prompt_length``): every
    forward pass of the step would otherwise pay for them.
    """
    tensors: dict[str, list] = defaultdict(list)
    others: dict[str, list] = defaultdict(list)
    for row in rows:
        for key, value in row.items():
            (tensors if isinstance(value, torch.Tensor) else others)[key].append(value)
    out: dict[str, Any] = {key: torch.stack(values) for key, values in tensors.items()}
    out.update(trim_shared_left_padding({k: out[k] for k in PROMPT_TENSOR_KEYS if k in out}))
    for key, values in others.items():
        array = np.empty(len(values), dtype=object)
        for i, value in enumerate(values):
            array[i] = value
        out[key] = array
    return out


class RLHFDataset(Dataset):
    """verl's RL prompt dataset over one or more local parquet files (see the module docstring)."""

    def __init__(
        self, data_files: str | Path | list, tokenizer, config: Mapping | None = None, processor=None
    ):
        is_list = isinstance(data_files, (list, tuple)) or _is_list_config(data_files)
        self.data_files = [str(f) for f in (data_files if is_list else [data_files])]
        self.tokenizer = tokenizer
        cfg = {key: (config or {}).get(key, default) for key, default in DEFAULTS.items()}
        self.prompt_key: str = cfg["prompt_key"]
        self.max_prompt_length = int(cfg["max_prompt_length"])
        self.filter_overlong_prompts = bool(cfg["filter_overlong_prompts"])
        self.truncation: str = cfg["truncation"]
        self.return_raw_chat = bool(cfg["return_raw_chat"])
        self.return_full_prompt = bool(cfg["return_full_prompt"])
        self.reward_fn_key: str = cfg["reward_fn_key"]
        self.chat_template_kwargs = dict(cfg["apply_chat_template_kwargs"] or {})
        self.multimodal_keys = (cfg["image_key"], cfg["video_key"])
        self.images = ImageRows(processor, cfg["image_key"], bool(cfg["return_multi_modal_inputs"]))
        if self.truncation not in TRUNCATIONS:
            raise ValueError(f"data.truncation={self.truncation!r}; choose one of {list(TRUNCATIONS)}")
        if tokenizer.pad_token_id is None:
            raise ValueError(
                "RLHFDataset: tokenizer has no pad_token_id (hybridflow.models.load_tokenizer sets one)"
            )
        self.rows: list[dict] = []
        self.origins: list[tuple[str, int]] = []  # (file, row number in that file) per item
        for path in self.data_files:
            self._read_file(path)
        self.global_index = list(range(len(self.rows)))  # row number across all files, before filtering
        if self.filter_overlong_prompts:
            self._filter_overlong()

    def _read_file(self, path: str) -> None:
        import pyarrow.parquet as pq

        if not Path(path).is_file():
            raise FileNotFoundError(f"RLHFDataset: data file {path!r} does not exist")
        table = pq.read_table(path)
        for column in (self.prompt_key, self.reward_fn_key):
            if column not in table.column_names:
                raise ValueError(
                    f"RLHFDataset: {path} has no required column {column!r} (columns: {table.column_names})"
                )
        self.images.check_columns(path, table.column_names, self.multimodal_keys[1])
        for row_number, row in enumerate(table.to_pylist()):
            _check_messages(row[self.prompt_key], f"{path} row {row_number} column {self.prompt_key!r}")
            self.images.check_row(row, row[self.prompt_key], f"RLHFDataset: {path} row {row_number}")
            self.rows.append(row)
            self.origins.append((path, row_number))

    def _filter_overlong(self) -> None:
        limit = self.max_prompt_length
        texts = [self._prompt_text(row) for row in self.rows]
        lengths = [
            len(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        ]  # one batch
        for i, row in enumerate(self.rows):  # image rows: their length after the image tokens' expansion
            if self.images.has_images(row):
                lengths[i] = self.images.prompt_length(row, row[self.prompt_key], self._where(i))
        keep = [i for i, n in enumerate(lengths) if n <= limit]
        dropped = len(self.rows) - len(keep)
        named = [
            f"{self._where(i)[len('RLHFDataset: ') :]} ({n})" for i, n in enumerate(lengths) if n > limit
        ]
        logger.info(
            "RLHFDataset: filtered %d of %d prompts longer than %d tokens%s",
            dropped,
            len(self.rows),
            limit,
            f": {', '.join(named[:5])}{' ...' if len(named) > 5 else ''}" if named else "",
        )
        self.filtered_overlong = dropped
        self.global_index = keep
        self.rows = [self.rows[i] for i in keep]
        self.origins = [self.origins[i] for i in keep]

    def __len__(self) -> int:
        return len(self.rows)

    def _where(self, item: int) -> str:
        path, row_number = self.origins[item]
        return f"RLHFDataset: {path} row {row_number}"

    def _prompt_text(self, row: dict) -> str:
        """The chat template on the row's messages, with ``data.apply_chat_template_kwargs`` (verl's:
        a Qwen3 run turns thinking off with ``{enable_thinking: false}``)."""
        if self.images.processor is not None:  # the processor's template (typed content for <image>)
            return self.images.processor.template(row[self.prompt_key], **self.chat_template_kwargs)
        return self.tokenizer.apply_chat_template(
            row[self.prompt_key], add_generation_prompt=True, tokenize=False, **self.chat_template_kwargs
        )

    def _prompt_ids(self, row: dict) -> tuple[str, list[int]]:
        """The chat-templated prompt string and its ids (no special tokens added beyond the template)."""
        text = self._prompt_text(row)
        return text, self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _truncate(self, ids: list[int], item: int) -> list[int]:
        if len(ids) <= self.max_prompt_length:
            return ids
        cut = TRUNCATIONS[self.truncation]
        if cut is None:
            path, row_number = self.origins[item]
            raise ValueError(
                f"RLHFDataset: {path} row {row_number}: prompt is {len(ids)} tokens after the chat template, "
                f"longer than data.max_prompt_length={self.max_prompt_length}; set data.truncation to "
                "left/right/middle or data.filter_overlong_prompts=True"
            )
        return cut(ids, self.max_prompt_length)

    def __getitem__(self, item: int) -> dict:
        row = self.rows[item]
        vision = self.images.encode(row, row[self.prompt_key], self._where(item))
        text, ids = self._prompt_ids(row) if vision is None else (vision.text, vision.ids)
        if vision is not None and vision.images:
            self.images.check_length(len(ids), self.max_prompt_length, self._where(item))
        else:
            ids = self._truncate(ids, item)
        skipped = (self.prompt_key, self.images.image_key)
        out = {k: copy.deepcopy(v) for k, v in row.items() if k not in skipped}
        out.update(self.images.fields(vision))
        out.update(_left_pad(ids, self.max_prompt_length, self.tokenizer.pad_token_id))
        out["raw_prompt_ids"] = ids
        if self.return_raw_chat:
            out["raw_prompt"] = copy.deepcopy(row[self.prompt_key])
        if self.return_full_prompt:
            out["full_prompts"] = text
        extra = out.get("extra_info") or {}
        out["extra_info"] = extra
        index = extra.get("index")
        out["index"] = index if index is not None else self.global_index[item]
        out["tools_kwargs"] = extra.get("tools_kwargs") or {}
        out["interaction_kwargs"] = extra.get("interaction_kwargs") or {}
        return out


def _left_pad(ids: list[int], length: int, pad_id: int) -> dict[str, torch.Tensor]:
    """``input_ids``, ``attention_mask``, ``position_ids``, each ``(length,)`` int64, left-padded."""
    pad = length - len(ids)
    input_ids = torch.tensor([pad_id] * pad + list(ids), dtype=torch.long)
    attention_mask = torch.tensor([0] * pad + [1] * len(ids), dtype=torch.long)
    position_ids = torch.clamp(torch.cumsum(attention_mask, dim=0) - 1, min=0)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}


def _check_messages(messages: Any, where: str) -> None:
    """Raise ValueError unless ``messages`` is a non-empty list of ``{"role": str, "content": str}``."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(
            f"RLHFDataset: {where} must be a non-empty list of chat messages, got {messages!r:.200}"
        )
    for message in messages:
        is_message = isinstance(message, dict) and all(
            isinstance(message.get(k), str) for k in ("role", "content")
        )
        if not is_message:
            raise ValueError(
                f"RLHFDataset: {where}: each message needs string 'role' and 'content', got {message!r:.200}"
            )


def _is_list_config(value: Any) -> bool:
    return type(value).__name__ == "ListConfig"
