"""Router replay for mixture-of-experts actors (verl's ``actor_rollout_ref.actor.router_replay``).

The rollout engine and the trainer can route a token to different experts (bf16 rounding, other
kernels), so the trainer's log-probs drift from the ones the tokens were sampled with. Replay makes the
trainer's forward use recorded expert ids instead of its own top-k, with the semantics of verl's
``verl/utils/megatron/router_replay_patch.py`` (after slime's ``routing_replay.py``): each replayed MoE
layer takes the recorded ids and **gathers its own router's softmax probabilities at them**
(renormalised over the k where the family renormalises: ``norm_topk_prob``, Mixtral always), so the
experts' weights, and the router's gradient, still come from the trainer's router.

- **R3** (``mode: R3`` with ``rollout.enable_rollout_routing_replay``): the engine records the ids of
  every prompt and generated token (``routed_experts`` in the batch); the old-log-prob pass, the update
  (and the reference with ``ref.router_replay.mode: R3``) replay them.
- **R2** (``mode: R2``): the old-log-prob pass records the trainer's own routing, the update's
  micro-batches replay it (the update's weights change between its mini-batches; routing does not).

``routed_experts`` is ``(B, T, L, k)`` small ints (uint8 when there are at most 256 experts, else int16)
in the columns of ``input_ids`` (verl's layout: ``agent_loop.py`` places the engine's ``(length, L, k)``
at the prompt's first column), ``L`` the MoE layers in order, 0 on padding. A forward's layout (the
trimmed padded rows, the packed rows of :mod:`hybridflow.workers.packed_rows`, the shared-prompt rows of
:mod:`hybridflow.workers.shared_prefix`) gets the ids of exactly its tokens (:func:`prepare_forward`);
routing is per token with no capacity limit, so micro-batches and dynamic batches, which move whole
rows, carry their rows' ids with them.

The hooks are installed only when replay is configured (:func:`install`): with ``mode: disabled`` no
model is touched and nothing runs. With Ulysses sequence parallelism each rank replays the ids of its
slice of the packed row (R3; R2's recording is not built there); image rows are refused (not built).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from hybridflow import keys
from hybridflow.models.moe import routed_ids_dtype
from hybridflow.protocol import DataProto
from hybridflow.workers.lora import unwrap_peft
from hybridflow.workers.shared_prefix import prompt_groups, split_rows

MODES = ("disabled", "R2", "R3")
REPLAY, RECORD = "replay", "record"


def replay_mode(section) -> str:
    """``router_replay.mode`` of a config section (``actor`` or ``ref``); ``disabled`` when absent."""
    replay = section.get("router_replay") if section is not None else None
    mode = str((replay or {}).get("mode", "disabled") or "disabled")
    if mode not in MODES:
        raise ValueError(f"router_replay.mode={mode!r}: use one of {MODES}")
    return mode


def _router_modules(model: nn.Module) -> list[nn.Module]:
    """The MoE routers in layer order: transformers' ``*TopKRouter`` modules (Qwen2/3-MoE, Mixtral),
    which return ``(router_logits (N, E), top-k weights (N, k), expert ids (N, k))``."""
    return [
        module
        for module in model.modules()
        if type(module).__name__.endswith("TopKRouter") and hasattr(module, "top_k")
    ]


@dataclass
class RouterReplay:
    """One model's routers and what they do now: ``action`` None (route as usual), ``"record"`` (route,
    keep the ids) or ``"replay"`` (route with ``targets``). ``targets`` (N, L, k) small ints: the ids of
    the N tokens of the forward about to run, in its flattened (rows, columns) order; they stay set until
    the next forward is prepared, so a gradient-checkpointed layer recomputed in the backward replays
    them again."""

    routers: list[nn.Module]
    num_experts: int
    top_k: int
    action: str | None = None
    targets: torch.Tensor | None = None
    recorded: list[torch.Tensor] | None = None
    layout: tuple | None = None  # (micro, input_ids, layout) of the last prepared forward

    @property
    def num_layers(self) -> int:
        return len(self.routers)

    def hook(self, layer: int):
        def run(module, args, output):
            if self.action == RECORD:
                self.recorded.append(output[2].detach())
                return output
            if self.action != REPLAY:
                return output
            logits, scores = output[0], output[1]
            if self.targets is None:
                raise RuntimeError(
                    "router replay: this forward's layout carries no routed_experts (image rows are not "
                    "built for replay)"
                )
            ids = self.targets[:, layer].to(device=logits.device, dtype=torch.long)
            if ids.shape[0] != logits.shape[0]:
                raise RuntimeError(
                    f"router replay: {ids.shape[0]} recorded tokens for a forward of {logits.shape[0]}"
                )
            probs = torch.softmax(logits.float(), dim=-1)
            top = probs.gather(1, ids)  # (N, k): the router's own probabilities at the recorded ids
            if getattr(module, "norm_topk_prob", True):  # Mixtral's router always renormalises
                top = top / top.sum(dim=-1, keepdim=True)
            return logits, top.to(scores.dtype), ids

        return run


def install(model: nn.Module) -> RouterReplay:
    """Put replay hooks on ``model``'s routers (once: a LoRA reference shares the actor's module) and
    return its :class:`RouterReplay`. A model without routers is refused (replay on a dense model)."""
    base = unwrap_peft(model)
    found = getattr(base, "_router_replay", None)
    if found is not None:
        return found
    routers = _router_modules(base)
    if not routers:
        raise ValueError(
            f"router_replay: {type(base).__name__} has no mixture-of-experts router (a dense model); "
            "set router_replay.mode=disabled"
        )
    replay = RouterReplay(routers, int(routers[0].num_experts), int(routers[0].top_k))
    for layer, router in enumerate(routers):
        router.register_forward_hook(replay.hook(layer))
    base._router_replay = replay
    return replay


def state(model: nn.Module) -> RouterReplay | None:
    """The model's :class:`RouterReplay` when it has one and it records or replays now."""
    replay = getattr(unwrap_peft(model), "_router_replay", None)
    return replay if replay is not None and replay.action is not None else None


@contextlib.contextmanager
def acting(model: nn.Module, action: str | None):
    """Record or replay (``action``) in every forward of ``model`` inside the block; None: nothing."""
    replay = getattr(unwrap_peft(model), "_router_replay", None) if action else None
    if replay is None:
        yield None
        return
    replay.action, replay.targets, replay.recorded = action, None, []
    try:
        yield replay
    finally:
        replay.action, replay.targets, replay.recorded, replay.layout = None, None, None, None


# ---------------------------------------------------------------------- layouts
def _columns(micro: DataProto) -> list[tuple[list[int], list[int]]]:
    """Per row: its attended prompt columns and its response columns (through its last attended one),
    the columns :func:`hybridflow.workers.shared_prefix.split_rows` takes its tokens from."""
    mask = micro.batch[keys.ATTENTION_MASK].tolist()
    prompt_len = micro.batch[keys.INPUT_IDS].shape[1] - micro.batch[keys.RESPONSES].shape[1]
    out = []
    for attended in mask:
        prompt = [c for c in range(prompt_len) if attended[c]]
        response = [c for c in range(prompt_len, len(attended)) if attended[c]]
        end = response[-1] + 1 if response else prompt_len
        out.append((prompt, list(range(prompt_len, end))))
    return out


def packed_sources(micro: DataProto) -> list[list[int]]:
    """Per packed group (the order of :func:`~hybridflow.workers.shared_prefix.prompt_groups`, which both
    packed layouts follow): the flat ``row * T + column`` index of each of its tokens in ``micro`` (the
    first member's prompt, then each member's response)."""
    width = micro.batch[keys.INPUT_IDS].shape[1]
    columns = _columns(micro)
    groups = []
    for members in prompt_groups(split_rows(micro)):
        first = members[0]
        flat = [first * width + c for c in columns[first][0]]
        for i in members:
            flat += [i * width + c for c in columns[i][1]]
        groups.append(flat)
    return groups


def _micro_ids(micro: DataProto, replay: RouterReplay) -> torch.Tensor:
    ids = micro.batch.get(keys.ROUTED_EXPERTS, None)
    if ids is None:
        raise ValueError(
            "router replay: the batch has no routed_experts (R3 needs "
            "actor_rollout_ref.rollout.enable_rollout_routing_replay=true)"
        )
    if tuple(ids.shape[2:]) != (replay.num_layers, replay.top_k):
        raise ValueError(
            f"router replay: routed_experts {tuple(ids.shape)} does not match the model's "
            f"{replay.num_layers} MoE layers x top-{replay.top_k}"
        )
    return ids


def prepare_forward(
    model: nn.Module, micro: DataProto, input_ids: torch.Tensor, layout=None, select=None
) -> None:
    """Before the forward of ``input_ids`` (b', S') built from ``micro``: set the replay targets of
    exactly those tokens. ``layout``: a ``(first, end)`` column range of the padded rows, a
    :class:`~hybridflow.workers.packed_rows.PackedInputs` (one packed row) or a
    :class:`~hybridflow.workers.shared_prefix.PackedBatch` (one row per prompt group). ``select``: the
    part of the layout this rank's forward runs (Ulysses: its slice of the packed row), a function of
    the targets (b', S', L, k). Nothing to do (no replay state) returns at once."""
    replay = state(model)
    if replay is None:
        return
    if replay.action == RECORD and select is not None:
        raise ValueError("router_replay.mode=R2 with Ulysses sequence parallelism is not built (use R3)")
    replay.layout = (micro, input_ids, layout)
    if replay.action != REPLAY:
        return
    ids = _micro_ids(micro, replay)
    if isinstance(layout, tuple):
        first, end = layout
        targets = ids[:, first:end]
    else:
        sources = _layout_sources(micro, input_ids)
        flat = ids.reshape(-1, *ids.shape[2:])
        targets = flat[sources.clamp(min=0)].view(*input_ids.shape, *ids.shape[2:])
    if select is not None:
        targets = select(targets)
    replay.targets = targets.reshape(-1, *ids.shape[2:])


def _layout_sources(micro: DataProto, input_ids: torch.Tensor) -> torch.Tensor:
    """(b', S') flat index into ``micro``'s (b, T) tokens of each token of a packed layout (-1 on its
    padding), checked against the layout's own token ids."""
    groups = packed_sources(micro)
    device = input_ids.device
    if input_ids.shape[0] == 1:  # one packed row (packed_rows; or a single shared-prompt group)
        flat = [i for g in groups for i in g]
        sources = torch.full((1, input_ids.shape[1]), -1, dtype=torch.long)
        sources[0, : len(flat)] = torch.tensor(flat, dtype=torch.long)
    else:
        sources = torch.full(tuple(input_ids.shape), -1, dtype=torch.long)
        for g, flat in enumerate(groups):
            sources[g, : len(flat)] = torch.tensor(flat, dtype=torch.long)
    sources = sources.to(device)
    real = sources >= 0
    expected = micro.batch[keys.INPUT_IDS].reshape(-1)[sources.clamp(min=0)]
    if not torch.equal(expected[real], input_ids[real]):
        raise RuntimeError("router replay: the packed layout's tokens are not the batch's (layouts differ)")
    return sources


def recorded_ids(replay: RouterReplay, micro: DataProto) -> torch.Tensor:
    """After a recording forward of ``micro``: its routing as ``routed_experts`` (b, T, L, k), 0 on the
    columns the forward did not compute (padding)."""
    _, input_ids, layout = replay.layout
    per_layer = replay.recorded[-replay.num_layers :]
    found = torch.stack(per_layer, dim=1).view(*input_ids.shape, replay.num_layers, replay.top_k)
    b, width = micro.batch[keys.INPUT_IDS].shape
    out = torch.zeros(b, width, replay.num_layers, replay.top_k, dtype=routed_ids_dtype(replay.num_experts))
    if isinstance(layout, tuple):
        first, end = layout
        out[:, first:end] = found.to(out.dtype).cpu()
        out[~micro.batch[keys.ATTENTION_MASK].bool().cpu()] = 0  # padding computed in the rows: 0
        replay.recorded = []
        return out
    sources = _layout_sources(micro, input_ids).cpu()
    found = found.to(out.dtype).cpu()
    flat = out.view(b * width, *out.shape[2:])
    real = sources >= 0
    flat[sources[real]] = found[real]
    # rows sharing a prompt were computed once: their prompt columns take the first member's ids
    columns = _columns(micro)
    for members in prompt_groups(split_rows(micro)):
        first_cols = columns[members[0]][0]
        for i in members[1:]:
            out[i, columns[i][0]] = out[members[0], first_cols]
    replay.recorded = []
    return out
