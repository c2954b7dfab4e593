"""A step's time under a placement, from per-phase times measured in a short profiling run.

HybridFlow §6 estimates each stage with a simulator of the parallel strategy; here every phase is
fitted from measurements instead, with one shape for all of them::

    t(phase) = alpha * serial + beta * work / workers + gamma * comm * (workers - 1) / workers

``serial`` counts what does not shrink with more workers (decode steps x layers for generation, layers
for one forward or update pass: per-call and per-module overhead), ``work`` what splits over the
data-parallel workers (rows x tokens x parameters), ``comm`` what FSDP moves between them (the role's
parameters; each worker gathers the ``(workers - 1) / workers`` it does not hold). ``alpha, beta, gamma
>= 0`` are fitted per phase by least squares over the profile's runs at different worker counts. Two
counts determine a phase's time at every count, but not which term explains it: the simplest exact
fit wins (``alpha`` with ``beta`` when more workers were faster, ``alpha`` with ``gamma`` when they were
slower, as for a small model whose collectives cost more than its compute). A model measured at 1 and
2 workers on this machine predicts 1 and 2 workers exactly and extrapolates linearly in layers, tokens
and parameters.

A step (:func:`step_seconds`) is the dataflow's stages in order (HybridFlow's ``d_cost``): generation;
the preparation stage (old log-probs, reference log-probs, values, reward); the advantage; the update
stage (critic and actor). Within a stage, phases on one pool queue behind each other and phases on
different pools (and the driver's rule reward) run at the same time: the stage takes the longest lane.

Ulysses sequence parallelism (sp > 1 for a role) changes no fitted term: the ``dp = workers / sp``
groups each take ``rows / dp`` rows and every rank computes ``1 / sp`` of their tokens, so each rank's
work is still ``work / workers``, and FSDP still shards over all the workers. What it adds is the
all-to-all of attention (:meth:`Workload.alltoall_bytes`: the DeepSpeed-Ulysses volume, forward and,
for an update, backward), timed over ``CostModel.link_gb_per_s``; it shows in the phase's stage. What
it buys is memory (:mod:`.memory`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from hybridflow.utils.ulysses_rules import alltoall_bytes_per_layer

# phase -> (role that runs it, stage). "driver" phases run in the driver process.
PHASES: dict[str, tuple[str, str]] = {
    "gen": ("actor_rollout", "gen"),
    "old_log_prob": ("actor_rollout", "prepare"),
    "ref": ("ref", "prepare"),
    "values": ("critic", "prepare"),
    "reward": ("driver", "prepare"),  # the reward model's pool when one is used
    "adv": ("driver", "adv"),
    "update_critic": ("critic", "update"),
    "update_actor": ("actor_rollout", "update"),
}
STAGES = ("gen", "prepare", "adv", "update")
# 1e9 bytes per second of one rank's link for the all-to-alls when the profile names none: PCIe 4.0
# x16's order, a stated default, not a measurement (NVLink is several times faster, so it overstates
# SP's cost there). ``link_gb_per_s`` in the profile JSON, or plan_placement's --link-gb-per-s,
# replaces it.
DEFAULT_LINK_GB_PER_S = 25.0
ACTIVATION_BYTES = 4  # fp32 activations (what this repository trains in on the CPU; bf16 halves it)


@dataclass(frozen=True)
class Workload:
    """What one step computes: model sizes (parameters, layers) per role and the batch's shape.

    ``shapes``, ``micro_rows``, ``batch_rows``, ``token_budget`` and ``checkpointing`` describe what sequence
    parallelism needs (the all-to-all here, activation memory in :mod:`.memory`); a profile written
    before they existed loads without them (they default to empty: no role can then use SP)."""

    params: dict[str, float]  # role -> parameters (actor_rollout, ref, critic, rm)
    layers: dict[str, int]
    rows: int  # prompts x responses per prompt
    prompt_length: int
    response_length: int
    reward_model: bool = False
    old_log_prob: bool = True  # False: the update's own forward gives them (on-policy shortcut)
    # role -> {"hidden", "heads", "kv_heads", "head_dim", "vocab", "vision"} of its model (config.json)
    shapes: dict[str, dict[str, int]] = field(default_factory=dict)
    # role -> sequences per micro-batch per data-parallel rank of its heaviest pass (the update for the
    # actor and critic, the forward for the reference and reward model); 0: dynamic batch size (then
    # token_budget); None: no micro-batch size, the rank's whole share of batch_rows
    micro_rows: dict[str, int | None] = field(default_factory=dict)
    batch_rows: dict[str, int] = field(default_factory=dict)  # role -> rows its pass splits over dp ranks
    token_budget: dict[str, int] = field(default_factory=dict)  # role -> *_max_token_len_per_gpu
    checkpointing: dict[str, bool] = field(default_factory=dict)  # role -> gradient checkpointing on

    @property
    def sequence_tokens(self) -> int:
        """The longest sequence: prompt + response."""
        return self.prompt_length + self.response_length

    def phases(self) -> list[str]:
        """The phases this workload runs."""
        out = ["gen", "reward", "adv", "update_actor"]
        out += ["old_log_prob"] if self.old_log_prob else []
        out += ["ref"] if "ref" in self.params else []
        out += ["values", "update_critic"] if "critic" in self.params else []
        return out

    def role_of(self, phase: str) -> str:
        if phase == "reward" and self.reward_model:
            return "rm"
        return PHASES[phase][0]

    def serial(self, phase: str) -> float:
        """Units of the part that does not split over workers."""
        role = self.role_of(phase)
        if role == "driver":
            return 0.0
        steps = self.response_length if phase == "gen" else 1
        return float(steps * self.layers[role])

    def work(self, phase: str) -> float:
        """Units of the part that splits over the data-parallel workers (rows x tokens x params)."""
        role = self.role_of(phase)
        if role == "driver":
            return float(self.rows)
        tokens = self.prompt_length + self.response_length
        return float(self.rows) * tokens * self.params[role]

    def comm(self, phase: str) -> float:
        """Units of what the workers exchange (the role's parameters; none for the driver)."""
        role = self.role_of(phase)
        return 0.0 if role == "driver" else float(self.params[role])

    def alltoall_bytes(self, phase: str, workers: int, sp: int) -> float:
        """Bytes one rank sends through Ulysses' all-to-alls in ``phase`` at SP size ``sp``: the rows
        of its data-parallel group (``rows / (workers / sp)``, each ``sequence_tokens`` long), every
        layer, one pass for a forward and two (forward + backward) for an update
        (:func:`hybridflow.utils.ulysses_rules.alltoall_bytes_per_layer`). Generation never runs
        under SP (each rank decodes whole sequences)."""
        role = self.role_of(phase)
        if sp <= 1 or role == "driver" or phase == "gen":
            return 0.0
        shape = self.shapes[role]
        tokens = self.rows * self.sequence_tokens / (max(int(workers), 1) // sp)
        passes = 2 if phase.startswith("update") else 1
        per_layer = alltoall_bytes_per_layer(
            tokens, sp, shape["heads"], shape["kv_heads"], shape["head_dim"], ACTIVATION_BYTES
        )
        return passes * self.layers[role] * per_layer

    def features(self, phase: str, workers: int) -> tuple[float, float, float]:
        """``(serial, work / workers, comm * (workers - 1) / workers)``: what alpha, beta, gamma scale."""
        w = max(int(workers), 1)
        return self.serial(phase), self.work(phase) / w, self.comm(phase) * (w - 1) / w


@dataclass
class PhaseFit:
    alpha: float
    beta: float
    gamma: float = 0.0

    def seconds(self, features: tuple[float, float, float]) -> float:
        return self.alpha * features[0] + self.beta * features[1] + self.gamma * features[2]


@dataclass
class CostModel:
    """Fitted phases, plus the per-step time outside the phases (``overhead_s``)."""

    fits: dict[str, PhaseFit]
    overhead_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    link_gb_per_s: float = DEFAULT_LINK_GB_PER_S  # the all-to-alls' bandwidth per rank (1e9 bytes/s)

    @classmethod
    def calibrate(cls, samples: list[dict]) -> CostModel:
        """``samples``: one per profiled run, ``{"workload": Workload, "workers": {role: n},
        "seconds": {phase: s}, "step_s": s}`` (phase times measured one by one, not overlapped)."""
        fits, overheads = {}, []
        for phase in PHASES:
            rows = []
            for sample in samples:
                load: Workload = sample["workload"]
                if phase in sample["seconds"] and phase in load.phases():
                    role = load.role_of(phase)
                    workers = 1 if role == "driver" else sample["workers"][role]
                    rows.append((*load.features(phase, workers), sample["seconds"][phase]))
            if rows:
                fits[phase] = PhaseFit(*_simplest_nonnegative_fit(rows))
        for sample in samples:
            measured = sum(sample["seconds"].get(p, 0.0) for p in sample["workload"].phases())
            overheads.append(max(sample["step_s"] - measured, 0.0))
        return cls(fits, overhead_s=sum(overheads) / max(len(overheads), 1))

    def phase_seconds(self, load: Workload, phase: str, workers: int, sp: int = 1) -> float:
        """The fitted time at ``workers``, plus the all-to-alls' time at SP size ``sp``."""
        if phase not in self.fits:
            raise KeyError(f"the profile has no measurement of phase {phase!r}: profile a run that has it")
        alltoall = load.alltoall_bytes(phase, workers, sp) / (self.link_gb_per_s * 1e9)
        return self.fits[phase].seconds(load.features(phase, workers)) + alltoall


def step_seconds(
    model: CostModel,
    load: Workload,
    pool_of: dict[str, str],
    workers: dict[str, int],
    concurrent: bool = True,
    sp: dict[str, int] | None = None,
) -> tuple[float, dict[str, float]]:
    """Predicted seconds of one step, and of each stage. ``pool_of``: role -> pool (roles on one pool
    share its processes); ``workers``: pool -> worker processes; ``sp``: role -> Ulysses SP size
    (default 1)."""
    lanes_by_stage: dict[str, dict[str, float]] = {stage: {} for stage in STAGES}
    for phase in load.phases():
        role = load.role_of(phase)
        lane = "driver" if role == "driver" else pool_of[role]
        n = 1 if role == "driver" else workers[lane]
        lanes = lanes_by_stage[PHASES[phase][1]]
        size = (sp or {}).get(role, 1)
        lanes[lane] = lanes.get(lane, 0.0) + model.phase_seconds(load, phase, n, size)
    stages = {
        stage: (max(lanes.values()) if concurrent else sum(lanes.values())) if lanes else 0.0
        for stage, lanes in lanes_by_stage.items()
    }
    return sum(stages.values()) + model.overhead_s, stages


# Which terms may explain a phase, simplest first (the first exact fit wins; see the module docstring).
_TERM_SETS = [(0, 1), (0, 2), (0,), (1,), (2,), (1, 2), (0, 1, 2)]


def _simplest_nonnegative_fit(rows: list[tuple[float, float, float, float]]) -> tuple[float, float, float]:
    """``(alpha, beta, gamma) >= 0`` minimising the squared error of ``alpha*x + beta*y + gamma*z`` to
    ``t`` over rows ``(x, y, z, t)``; among fits within rounding of the best, the first of
    :data:`_TERM_SETS`."""
    features = np.array([r[:3] for r in rows], dtype=np.float64)
    target = np.array([r[3] for r in rows], dtype=np.float64)
    fits = []
    for order, terms in enumerate(_TERM_SETS):
        columns = features[:, terms]
        if not columns.any(axis=0).all():  # a term with no signal in any row
            continue
        coef, *_ = np.linalg.lstsq(columns, target, rcond=None)
        if (coef < 0).any():
            continue
        full = np.zeros(3)
        full[list(terms)] = coef
        fits.append((float(((features @ full - target) ** 2).sum()), order, full))
    if not fits:
        return 0.0, 0.0, 0.0
    best = min(f[0] for f in fits)
    tolerance = 1e-9 * float((target**2).sum()) + 1e-18
    _, _, chosen = min((f for f in fits if f[0] <= best + tolerance), key=lambda f: f[1])
    return float(chosen[0]), float(chosen[1]), float(chosen[2])
