"""A worker's memory under a placement, and the Ulysses SP size each role needs to fit.

Per worker of a pool: the resident part, every role's parameters, gradients, optimizer state and the
rollout's copy as FSDP shards (:data:`BYTES_PER_PARAM` x parameters / workers, whatever the SP size:
FSDP shards over all the pool's workers), plus the activations of the heaviest pass among the pool's
roles (they run one after another in the same process, each freeing its activations).

Activations per rank (:func:`activation_bytes`) of one micro-batch, of ``t`` tokens per rank (the
micro-batch's sequences, S = prompt + response tokens each, split over sp ranks: ``rows x S / sp``;
with dynamic batch size ``max(token budget, S / sp)``, the budget scaled by sp as verl does)::

    trained role (actor, critic):  124 x t x hidden x layers       +  47 616 x t x sp
      with gradient checkpointing: (4 x layers + 124) x t x hidden  +  47 616 x t x sp
    frozen role (reference, RM):   (124 x hidden + 4 x vocab) x t

The first term splits with sp, the second does not. Both constants come from our measurement
(``benchmarks/sp_memory.py``, docs/placement_and_scaling.md "Long contexts", 2026-11-27, 2-core AVX2
CPU, 24 GiB): one PPO update of one 8192-token sequence per data-parallel rank of a Qwen2 with hidden
256, 4 layers, vocabulary 4096, fp32, rose each rank's peak by 1364 MiB at SP = 1 x DP = 2 (8192 tokens
through each rank's layers) and by 868 MiB at SP = 2 x DP = 1 (4096). Halving the tokens saved 496 MiB,
so the part that splits was 992 MiB at SP = 1: 992 MiB / (8192 tokens x 256 hidden x 4 layers) = 124
bytes per token x hidden x layer (31 fp32 values: the layer's saved activations, and the tiny model's
logits, folded in: its vocabulary is 4 x hidden x layers, so the constant errs large for a model with
a smaller ratio, small for a larger one). The 1364 - 992 = 372 MiB that did not split, 47 616 bytes
per token of the sequence, is what every rank holds whole: the gathered per-token log-normaliser,
entropy and log-prob, the gradients and optimizer-step temporaries of the parameters, the allocator's
slack. Checked against the other measurements (the docs' table): -2% to +11% at sp 1 and 2 from 4k to
32k tokens (so the unsplit part does grow with the tokens), +60% at sp 4 (the peak fell faster than
this two-term form), +32% / +39% at vocabulary 1024. Derived, not measured: gradient checkpointing
keeps each layer's input (4 bytes x hidden per token) and one layer's activations during its
recomputation; a frozen role's forward (no gradients, no optimizer step) holds one layer's activations
at a time and its logits (4 bytes x vocab per token), and gathers a few values per token. Not
modelled: bf16 activations (about half), the actor's forward log-prob pass (less than its update
unless its micro-batch is much larger), the rollout's KV cache (the :data:`MEMORY_HEADROOM` left over
covers it and the allocator's slack)."""

from __future__ import annotations

from hybridflow.placement.cost_model import ACTIVATION_BYTES, Workload
from hybridflow.placement.spec import Placement

# Resident bytes per parameter (fp32 master weights): the trained actor holds weights, gradients,
# two Adam moments and the rollout engine's copy; the critic the first four; frozen models weights only.
BYTES_PER_PARAM = {"actor_rollout": 20, "critic": 16, "ref": 4, "rm": 4}
MEMORY_HEADROOM = 0.9  # of a device's memory, for the KV cache and allocator slack
LAYER_ACTIVATION_BYTES = 124  # per token x hidden x layer, split by sp (module docstring)
UNSPLIT_TOKEN_BYTES = 47_616  # per token of the whole sequence, on every rank of the SP group
TRAINED_ROLES = ("actor_rollout", "critic")


def tokens_per_rank(load: Workload, role: str, sp: int, workers: int) -> float:
    """Tokens one rank holds in the role's heaviest micro-batch at SP size ``sp`` on ``workers``: its
    micro-batch's rows (at most the data-parallel rank's share of the pass's rows) x S / sp."""
    sequence = load.sequence_tokens
    rows = load.micro_rows.get(role, 1)
    if rows == 0:  # dynamic batch size: a budget of tokens per rank, one longer sequence alone
        return max(float(load.token_budget[role]), sequence / sp)
    share = -(-load.batch_rows.get(role, 1) // max(workers // sp, 1))  # rows per data-parallel rank
    return min(rows or share, share) * sequence / sp


def activation_bytes(load: Workload, role: str, sp: int, workers: int) -> float:
    """Peak activation bytes per rank of the role's heaviest pass (module docstring); 0 for a role
    whose model shape the workload does not know."""
    if role not in load.shapes:
        return 0.0
    shape, layers = load.shapes[role], load.layers[role]
    tokens = tokens_per_rank(load, role, sp, workers)
    if role not in TRAINED_ROLES:
        return (LAYER_ACTIVATION_BYTES * shape["hidden"] + ACTIVATION_BYTES * shape["vocab"]) * tokens
    if load.checkpointing.get(role):
        per_token = (ACTIVATION_BYTES * layers + LAYER_ACTIVATION_BYTES) * shape["hidden"]
    else:
        per_token = LAYER_ACTIVATION_BYTES * shape["hidden"] * layers
    return per_token * tokens + UNSPLIT_TOKEN_BYTES * tokens * sp


def resident_bytes(placement: Placement, params: dict[str, float], pool: str) -> float:
    """Per worker of ``pool``: its roles' parameters, gradients and optimizer state (FSDP shards)."""
    total = sum(BYTES_PER_PARAM[role] * params[role] for role in placement.roles_on(pool))
    return total / sum(placement.pools[pool])


def usable_bytes(device_memory_gb: float) -> float:
    return device_memory_gb * 2**30 * MEMORY_HEADROOM


def choose_sequence_parallel(
    placement: Placement,
    load: Workload,
    options: dict[str, list[int]],
    device_memory_gb: float | None,
    tied: dict[str, str] | None = None,
) -> tuple[dict[str, int], dict[str, float]] | None:
    """Each role's SP size, and each pool's predicted peak bytes per worker; None when a pool does not
    fit. ``options``: role -> the SP sizes it may take on its pool, ascending (the rules already
    applied; one size when the user fixed it). The smallest size that fits is taken: a larger one only
    adds all-to-all time (:meth:`Workload.alltoall_bytes`). Without a memory limit every role takes
    its first option. ``tied``: role -> the role whose size it must take (LoRA's reference is the
    actor's own module), decided first."""
    budget = usable_bytes(device_memory_gb) if device_memory_gb else None
    peaks = {pool: resident_bytes(placement, load.params, pool) for pool in placement.pools}
    if budget is not None and max(peaks.values()) > budget:
        return None
    chosen: dict[str, int] = {}
    for role in sorted(placement.mapping, key=lambda r: r in (tied or {})):
        pool = placement.pool_of(role)
        workers, resident = sum(placement.pools[pool]), resident_bytes(placement, load.params, pool)
        sizes = [1] if role not in load.shapes else options.get(role, [1])
        if role in (tied or {}):
            sizes = [sp for sp in sizes if sp == chosen[tied[role]]]
        needed = {sp: resident + activation_bytes(load, role, sp, workers) for sp in sizes}
        fitting = [sp for sp in sizes if budget is None or needed[sp] <= budget]
        if not fitting:
            return None
        chosen[role] = fitting[0]
        peaks[pool] = max(peaks[pool], needed[fitting[0]])
    return chosen, peaks
