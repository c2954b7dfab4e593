"""Ulysses sequence parallelism for the actor, reference, critic and reward model (verl's
``ulysses_sequence_parallel_size``).

A worker group of ``world`` processes forms ``dp = world / sp`` sequence-parallel groups of ``sp``
consecutive ranks (verl's ``("dp", "sp")`` device mesh). The ranks of a group receive the same rows
(they dispatch as one dp rank) and FSDP2 still shards the parameters over all ``world`` ranks.

What SP slices: the packed-rows layout (:mod:`hybridflow.workers.packed_rows`), always — a micro-batch
is one row of its ``N`` real tokens (each shared prompt once, no padding), padded to ``S``, a multiple
of ``sp``, and cut into ``sp`` slices of ``L = S / sp`` tokens. Each rank runs embeddings, norms, MLPs and
the LM head on its ``L`` tokens only; attention exchanges heads all-to-all
(:func:`hybridflow.utils.ulysses.ulysses_attention`). verl slices its padding-free layout the same
way (``use_remove_padding``); here that layout is always on, so ``use_remove_padding`` is not required.

Outputs go back to whole sequences before anything above sees them: per token, each rank computes the
log-normaliser and entropy of its ``L`` positions (never the (S, V) logits) and all-gathers those
(``(1, S)``); the logit of each response token is picked on the rank that holds its predicting position
and summed over the group. The log-probs, entropies and values handed to the trainer are the
``(b, T_r)`` tensors of SP = 1; every rank of the group computes the same loss from them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from hybridflow import keys
from hybridflow.protocol import DataProto
from hybridflow.utils.torch_functional import entropy_from_logits
from hybridflow.utils.ulysses import SequenceSlice, gather_sequence, padded_length, sum_over_sequence
from hybridflow.utils.ulysses_rules import SP_KEY, configured_sp_size  # noqa: F401 (re-exported)
from hybridflow.workers.forward import tally_rows
from hybridflow.workers.lora import unwrap_peft
from hybridflow.workers.packed_rows import PackedInputs, gather_packed_outputs, plan_packed_rows
from hybridflow.workers.router_replay import prepare_forward
from hybridflow.workers.shared_prefix import split_rows


@dataclass(frozen=True)
class SequenceParallelState:
    """A model's sequence-parallel group (``sp`` consecutive ranks) and its data-parallel group (the
    ranks with the same place in their SP group: the loss is normalised over these)."""

    sp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    sp_rank: int
    sp_size: int


_STATE_ATTR = "_hybridflow_sequence_parallel"
_GROUPS: dict[tuple[int, int, str], SequenceParallelState] = {}


def sequence_parallel_groups(world: int, sp: int, device_type: str) -> SequenceParallelState:
    """This rank's SP and DP groups for ``sp`` (a collective the first time: every rank calls it with the
    same arguments, in the same order; cached afterwards, so models with the same ``sp`` share groups)."""
    from torch.distributed.device_mesh import init_device_mesh

    if sp < 1 or world % sp:
        raise ValueError(f"{SP_KEY}={sp} does not divide the {world} worker processes")
    key = (world, sp, device_type)
    if key not in _GROUPS:
        mesh = init_device_mesh(device_type, (world // sp, sp), mesh_dim_names=("dp", "sp"))
        _GROUPS[key] = SequenceParallelState(
            mesh["sp"].get_group(), mesh["dp"].get_group(), mesh["sp"].get_local_rank(), sp
        )
    return _GROUPS[key]


def apply_sequence_parallel(model: nn.Module, state: SequenceParallelState) -> nn.Module:
    """Mark ``model`` to run its forwards split over ``state.sp_group``; checks the heads split
    (:func:`hybridflow.utils.ulysses.head_split_problem`) and the attention (the CPU attention's
    packed rows carry the slices)."""
    from hybridflow.models.attention import CPU_ATTENTION
    from hybridflow.utils.ulysses import head_split_problem

    config = unwrap_peft(model).config
    heads = int(config.num_attention_heads)
    problem = head_split_problem(
        heads, int(getattr(config, "num_key_value_heads", None) or heads), state.sp_size
    )
    if problem:
        raise ValueError(f"sequence parallelism: {problem}")
    attention = getattr(config, "_attn_implementation", None)
    if attention != CPU_ATTENTION:
        raise ValueError(
            f"sequence parallelism runs in hybridflow's attention ({CPU_ATTENTION!r}), not {attention!r}: "
            "leave model.override_config.attn_implementation unset"
        )
    setattr(unwrap_peft(model), _STATE_ATTR, state)
    return model


def sequence_parallel_state(model: nn.Module) -> SequenceParallelState | None:
    """The state :func:`apply_sequence_parallel` attached (None: the model is not sequence-parallel)."""
    return getattr(unwrap_peft(model), _STATE_ATTR, None)


def loss_dp_group(model: nn.Module) -> dist.ProcessGroup | None:
    """The group a model's loss is normalised over: the dp ranks of its SP or TP layout (None: world)."""
    from hybridflow.workers.tensor_parallel import dp_group_of

    state = sequence_parallel_state(model)
    return state.dp_group if state is not None else dp_group_of(model)


@dataclass
class SlicedForward:
    """One micro-batch's sequence-parallel forward: the packed plan and this rank's slice of it."""

    packed: PackedInputs
    where: SequenceSlice
    outputs: torch.Tensor  # (1, L, C) this rank's model outputs (logits or values), fp32


def sliced_forward(model: nn.Module, micro: DataProto, state: SequenceParallelState) -> SlicedForward:
    """Pack ``micro`` (always), pad it to a multiple of sp, and run this rank's slice through ``model``."""
    packed = plan_packed_rows(micro, micro.batch[keys.INPUT_IDS].shape[1], always=True)
    if packed is None:
        raise ValueError(_unpackable_rows(micro))
    tally_rows(micro, packed.repeated_prompts)
    total = packed.input_ids.shape[1]
    where = SequenceSlice(
        state.sp_group, state.sp_rank, state.sp_size, total, padded_length(total, state.sp_size)
    )
    span = slice(where.start, where.start + where.local)

    def mine(tokens: torch.Tensor) -> torch.Tensor:  # (1, N) → this rank's (1, L), padded with 0
        return torch.nn.functional.pad(tokens, (0, where.padded - total))[:, span]

    # router replay (no-op when off): this rank's slice of the packed row's recorded expert ids
    prepare_forward(
        model, micro, packed.input_ids, packed, select=lambda ids: _pad_tokens(ids, where)[:, span]
    )
    mask = packed.attention_mask
    mask.sequence_slice = where  # the attention reads it (hybridflow.models.attention)
    output = model(
        input_ids=mine(packed.input_ids),
        attention_mask=mask,
        position_ids=mine(packed.position_ids),
        use_cache=False,
    )
    return SlicedForward(packed, where, output.logits.float())


def _pad_tokens(values: torch.Tensor, where: SequenceSlice) -> torch.Tensor:
    """(1, N, ...) per packed token → (1, padded, ...), zeros after the N tokens."""
    padded = values.new_zeros(values.shape[0], where.padded, *values.shape[2:])
    padded[:, : values.shape[1]] = values
    return padded


def _unpackable_rows(micro: DataProto) -> str:
    rows = split_rows(micro)
    empty = [i for i, row in enumerate(rows) if not row.prompt]
    if empty:
        return f"sequence parallelism: rows {empty[:8]} of the micro-batch have an empty prompt"
    return (
        "sequence parallelism: a row's response has an unattended column before its last attended one "
        "(attention_mask with a gap); the packed layout SP slices needs prefix attention"
    )


def _whole_sequence(per_token: torch.Tensor, run: SlicedForward) -> torch.Tensor:
    """(1, L) per token on this rank → (b, T_k) per response token of each row (0 where none)."""
    gathered = gather_sequence(per_token, run.where.group, dim=1)[:, : run.where.num_tokens]
    return gather_packed_outputs(gathered.unsqueeze(-1), run.packed, at_kept=False)[..., 0]


def sequence_parallel_log_probs(
    model: nn.Module,
    micro: DataProto,
    temperature: float,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(log_probs (b, T_k), entropy (b, T_k) | None)`` of the response tokens, computed split over the
    model's SP group; the same on every rank of it (see the module docstring)."""
    state = sequence_parallel_state(model)
    run = sliced_forward(model, micro, state)
    logits = run.outputs[0]  # (L, V)
    if temperature not in (0, 1.0):
        logits = logits / temperature
    packed, where = run.packed, run.where
    normaliser = _whole_sequence(torch.logsumexp(logits, dim=-1).unsqueeze(0), run)
    # the logit of response token t of row r, taken on the rank holding its predicting position
    position = packed.kept_positions[packed.predictor] - where.start  # (b, T_k)
    labels = micro.batch[keys.RESPONSES][:, : position.shape[1]]
    here = packed.valid & (position >= 0) & (position < where.local)
    picked = logits[position.clamp(0, where.local - 1), labels]
    picked = sum_over_sequence(torch.where(here, picked, torch.zeros_like(picked)), where.group)
    log_probs = (picked - normaliser) * packed.valid
    entropy = None
    if with_entropy:
        kept = logits if entropy_grad else logits.detach()
        entropy = _whole_sequence(entropy_from_logits(kept).unsqueeze(0), run)
    return log_probs, entropy


def sequence_parallel_values(model: nn.Module, micro: DataProto) -> torch.Tensor:
    """Per-response-token outputs of a one-unit head (a critic's values): (b, T_k)."""
    run = sliced_forward(model, micro, sequence_parallel_state(model))
    return _whole_sequence(run.outputs[..., 0], run)


def enable_sequence_parallel(model: nn.Module, sp: int, world: int, device_type: str) -> nn.Module:
    """A worker's model under ``sp`` (nothing when 1): the groups, then :func:`apply_sequence_parallel`."""
    if sp > 1:
        apply_sequence_parallel(model, sequence_parallel_groups(world, sp, device_type))
    return model


def scale_token_budgets(section, sp: int, names: tuple[str, ...]) -> None:
    """verl multiplies each ``*_max_token_len_per_gpu`` by sp: a rank holds 1/sp of each sequence, so a
    dynamic micro-batch of sp times the tokens costs it what an SP = 1 micro-batch does. Edits
    ``section`` (a writable config) in place."""
    from omegaconf import open_dict

    with open_dict(section):
        for name in names:
            if sp > 1 and section.get(name):
                section[name] = int(section[name]) * sp


def sequence_parallel_scores(model: nn.Module, micro: DataProto) -> torch.Tensor:
    """(b,) a one-unit head at each row's last attended token (a reward model's score), computed split
    over the model's SP group. ``micro`` holds ``input_ids``, ``attention_mask``, ``position_ids`` (b, T):
    each row is packed whole (as a prompt with an empty response), rows with an empty mask excepted."""
    mask = micro.batch[keys.ATTENTION_MASK]
    empty = torch.nonzero(mask.sum(dim=-1) == 0).flatten().tolist()
    if empty:
        raise ValueError(f"sequence parallelism: rows {empty[:8]} of the micro-batch attend to no token")
    whole_rows = DataProto.from_dict(
        {
            keys.INPUT_IDS: micro.batch[keys.INPUT_IDS],
            keys.ATTENTION_MASK: mask,
            keys.POSITION_IDS: micro.batch[keys.POSITION_IDS],
            keys.RESPONSES: micro.batch[keys.INPUT_IDS][:, :0],
        }
    )
    run = sliced_forward(model, whole_rows, sequence_parallel_state(model))
    values = gather_sequence(run.outputs[..., 0], run.where.group, dim=1)[0, : run.where.num_tokens]
    key_index = run.packed.attention_mask.packed_rows.key_index  # (b, K): each row's tokens in order
    last = key_index[torch.arange(len(mask)), mask.sum(dim=-1).long() - 1]
    return values[last]
