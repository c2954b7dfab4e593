"""The driver's generate call, shared by training (:mod:`.ray_trainer`) and validation
(:mod:`.validation`): prompts go out tagged with a ``uid``, responses come back joined to their rows."""

from __future__ import annotations

import uuid

import numpy as np

from hybridflow import keys
from hybridflow.protocol import DataProto
from hybridflow.utils.timer import marked_timer

PROMPT_INPUT_KEYS = [keys.INPUT_IDS, keys.ATTENTION_MASK, keys.POSITION_IDS]


def rollout_with_uids(
    actor_rollout, prompts: DataProto, n: int, meta_info: dict, timing: dict, metrics: dict | None = None
) -> DataProto:
    """Give each prompt a ``uid``, repeat it ``n`` times, generate, and join responses to the prompt rows.

    Only the prompt tensors travel to the rollout workers; the rest of the batch (ground truths, data
    sources, ...) stays on the controller and is re-attached to the output."""
    prompts, gen_input = rollout_input(
        prompts, n, meta_info, getattr(actor_rollout, "needs_all_fields", False)
    )
    with marked_timer("generate_call", timing):  # the driver's wall for the call (dispatch included)
        output = actor_rollout.generate_sequences(gen_input)
    for key, values in output.meta_info.pop("metrics", {}).items():
        if "/" not in key:  # phase seconds, averaged over ranks -> timing_s/<key>
            timing[key] = sum(values) / len(values)
        elif metrics is not None:  # e.g. perf/update_weights_peak_extra_mb: the worst rank
            metrics[key] = max(values)
    return join_rollout(prompts, output)


def chat_template_meta(config) -> dict:
    """``data.apply_chat_template_kwargs`` (verl's, e.g. ``{enable_thinking: false}``) as generate-call meta
    info, for the templates a rollout renders itself (a multi-turn rollout's tool and user turns); empty
    when unset. The dataset applies the same kwargs to the prompts."""
    from omegaconf import OmegaConf

    kwargs = config.data.get("apply_chat_template_kwargs") or {}
    if OmegaConf.is_config(kwargs):
        kwargs = OmegaConf.to_container(kwargs, resolve=True)
    return {"apply_chat_template_kwargs": dict(kwargs)} if kwargs else {}


def rollout_input(
    prompts: DataProto, n: int, meta_info: dict, all_fields: bool
) -> tuple[DataProto, DataProto]:
    """``(the prompt rows with a uid each, repeated n times; what goes to the rollout)``. Agent loops
    (``all_fields``) get every dataset field; rollout workers the prompt, the multi-turn tools, the
    interaction's kwargs and chat, and the dataset index (the sampling streams)."""
    uids = [str(uuid.uuid4()) for _ in range(len(prompts))]
    prompts.non_tensor_batch[keys.UID] = np.array(uids, dtype=object)
    prompts = prompts.repeat(n, interleave=True)
    if all_fields:
        fields = list(prompts.non_tensor_batch)
    else:
        # and image rows' pixels and grids; an interaction's kwargs and the chat it reads
        wanted = ("tools_kwargs", "index", keys.MULTI_MODAL_INPUTS, "interaction_kwargs", "raw_prompt")
        fields = [key for key in wanted if key in prompts.non_tensor_batch]
    gen_input = prompts.select(batch_keys=PROMPT_INPUT_KEYS, non_tensor_batch_keys=fields, meta_info_keys=[])
    gen_input.meta_info = dict(meta_info)
    return prompts, gen_input


def join_rollout(prompts: DataProto, output: DataProto) -> DataProto:
    """The repeated prompt rows with the rollout's output joined in (its prompt tensors replace the
    rows'; a field the rows already hold is the rows')."""
    prompts.pop(batch_keys=PROMPT_INPUT_KEYS)
    for key in list(output.non_tensor_batch):
        if key in prompts.non_tensor_batch:  # the agent loops' copy of a field the driver kept
            output.non_tensor_batch.pop(key)
    return prompts.union(output)
