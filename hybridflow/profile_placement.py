"""The short profiling run that calibrates the planner::

    python -m hybridflow.profile_placement --out profile.json [--workers 1 2] [--steps 3] key=value ...

The ``key=value`` overrides describe the run to plan for (as for ``main_ppo``). It is trained for
``--steps`` steps colocated on each worker count, with the phases one at a time
(``trainer.concurrent_phases=false``) so each phase's ``timing_s`` is its own; the median of each phase
over the steps after the first (warm-up) is stored with the run's workload (model sizes, rows, lengths)
as JSON. :func:`measure_run` also times any other placement (the planner's test runs candidates).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict

from hybridflow.placement.cost_model import PHASES

PROFILE_RUN_OVERRIDES = [
    "trainer.logger=[jsonl]",
    "trainer.progress_bar=false",
    "trainer.plot_curves=false",
    "trainer.val_before_train=false",
    "trainer.test_freq=-1",
    "trainer.save_freq=-1",
    "trainer.save_on_preempt=false",
    "trainer.resume_mode=disable",
]


def measure_run(overrides: list[str], steps: int, experiment: str, worker_groups=None) -> dict:
    """Train ``steps`` steps of the run ``overrides`` describe (on ``worker_groups`` when given: built
    for the same placement, reloaded by the run); the median ``timing_s`` of each phase and of the
    whole step over the steps after the first. Returns ``{"seconds", "step_s", "steps_s", "config"}``."""
    from hybridflow.trainer.config import load_config
    from hybridflow.trainer.main_ppo import log_dir, run_ppo

    config = load_config(
        [
            *overrides,
            *PROFILE_RUN_OVERRIDES,
            f"trainer.total_training_steps={steps}",
            f"trainer.experiment_name={experiment}",
        ]
    )
    run_ppo(config, worker_groups=worker_groups)
    with open(os.path.join(log_dir(config), "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    timed = records[1:] or records  # the first step compiles, allocates, warms caches

    def median(key: str) -> float | None:
        values = [r[key] for r in timed if key in r]
        return statistics.median(values) if values else None

    seconds = {phase: median(f"timing_s/{phase}") for phase in PHASES}
    return {
        "seconds": {phase: s for phase, s in seconds.items() if s is not None},
        "step_s": median("timing_s/step"),
        "steps_s": [r["timing_s/step"] for r in timed],
        "config": config,
    }


def profile_overrides(overrides: list[str], workers: int) -> list[str]:
    """The profiling run at ``workers`` workers: colocated, phases one at a time."""
    placement = ["trainer.placement=colocated", "trainer.concurrent_phases=false"]
    return [*overrides, f"trainer.n_gpus_per_node={workers}", "trainer.nnodes=1", *placement]


def profile(overrides: list[str], worker_counts: list[int], steps: int = 3, worker_groups=None) -> dict:
    """The profile JSON: one sample per worker count (colocated, phases one at a time).
    ``worker_groups``: optional ``{workers: WorkerGroups}`` to run on (else each run builds its own)."""
    from hybridflow.placement.planner import workload_from_config

    samples = []
    for workers in worker_counts:
        groups = (worker_groups or {}).get(workers)
        run = measure_run(
            profile_overrides(overrides, workers), steps, f"placement_profile_w{workers}", groups
        )
        load = workload_from_config(run["config"])
        samples.append(
            {
                "workers": {role: workers for role in load.params},
                "workload": asdict(load),
                "seconds": run["seconds"],
                "step_s": run["step_s"],
            }
        )
    return {
        "version": 1,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "device": str(run["config"].trainer.device),
        "device_memory_gb": _device_memory_gb(run["config"]),
        "samples": samples,
    }


def _device_memory_gb(config) -> float | None:
    """CPU: this machine's memory shared by the workers of a node; CUDA: unknown here (the driver
    looks up no GPU) — pass ``--device-memory-gb`` to the planner."""
    if str(config.trainer.device) != "cpu":
        return None
    import psutil

    return psutil.virtual_memory().total / 2**30 / max(int(config.trainer.n_gpus_per_node), 1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="where to write the profile JSON")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts to time")
    parser.add_argument("--steps", type=int, default=3, help="steps per worker count (the first is not used)")
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value (as for main_ppo)")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be >= 2: the first step is warm-up and is not used")
    from hybridflow.trainer.config import load_config
    from hybridflow.trainer.ppo.workers_setup import ensure_ray, shutdown_ray

    started = ensure_ray(load_config(args.overrides).ray_init)  # one Ray for all the runs
    try:
        result = profile(args.overrides, args.workers, args.steps)
    finally:
        if started:
            shutdown_ray()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    for sample in result["samples"]:
        times = ", ".join(f"{k} {v:.3f}" for k, v in sample["seconds"].items())
        workers = max(sample["workers"].values())
        print(f"{workers} worker(s): step {sample['step_s']:.3f} s ({times})")
    print(f"profile: {args.out}")


if __name__ == "__main__":
    main()
