"""A GRPO run through ``main_ppo`` with a save and an exact resume, on any device; one JSON line.

Runs ``--steps`` GRPO steps on the arithmetic task and the tiny model twice: once straight through,
once stopped after ``--save-at`` steps (a checkpoint) and started again with ``resume_mode=auto``. The
resumed run's later steps must repeat the straight run's: it reports the largest relative difference
of each compared metric over those steps and ``exact`` (all of them within ``--rtol``).

    python benchmarks/resume_check.py --device cuda            # scripts/gpu_check.sh's 6-step check
    python benchmarks/resume_check.py --device cpu --steps 4 --save-at 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

COMPARED = ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/entropy", "actor/grad_norm")


def overrides(model: str, data: Path, ckpt: Path, name: str, steps: int, args) -> list[str]:
    return [
        "algorithm.adv_estimator=grpo",
        f"data.train_files={data / 'train.parquet'}",
        f"data.val_files={data / 'test.parquet'}",
        "data.train_batch_size=8",
        "data.max_response_length=16",
        f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.rollout.n=4",
        f"trainer.device={args.device}",
        "trainer.n_gpus_per_node=1",
        f"trainer.experiment_name={name}",
        f"trainer.default_local_dir={ckpt}",
        f"trainer.total_training_steps={steps}",
        f"trainer.save_freq={args.save_at}",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "trainer.resume_mode=auto",
        "trainer.logger=[jsonl]",
        "trainer.progress_bar=false",
        "trainer.plot_curves=false",
    ]


def run(work: Path, args_list: list[str]) -> None:
    """One ``main_ppo`` process in ``work`` (its own Ray); its output goes to ``work/main_ppo.log``."""
    with (work / "main_ppo.log").open("ab") as log:
        subprocess.run(
            [sys.executable, "-m", "hybridflow.trainer.main_ppo", *args_list],
            cwd=work,
            stdout=log,
            stderr=subprocess.STDOUT,
            check=True,
        )


def metrics(work: Path, name: str) -> dict[int, dict]:
    lines = (work / "outputs" / "hybridflow" / name / "metrics.jsonl").read_text().splitlines()
    return {record["step"]: record for record in map(json.loads, lines)}


def rel_diff(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-at", type=int, default=3)
    parser.add_argument("--rtol", type=float, default=1e-6)
    args = parser.parse_args(argv)
    if not 0 < args.save_at < args.steps:
        parser.error("--save-at must lie between 0 and --steps")
    from hybridflow.models.tiny import build_tiny_model
    from hybridflow.tasks.arithmetic import write_rl_dataset

    start = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        write_rl_dataset(work / "data")
        model = str(build_tiny_model(work / "model"))
        straight, resumed = work / "straight", work / "resumed"
        for path in (straight, resumed):
            path.mkdir()
        run(straight, overrides(model, work / "data", straight / "ckpt", "straight", args.steps, args))
        run(resumed, overrides(model, work / "data", resumed / "ckpt", "resumed", args.save_at, args))
        run(resumed, overrides(model, work / "data", resumed / "ckpt", "resumed", args.steps, args))
        a, b = metrics(straight, "straight"), metrics(resumed, "resumed")
        later = range(args.save_at + 1, args.steps + 1)
        worst = {key: max(rel_diff(a[s][key], b[s][key]) for s in later) for key in COMPARED}
        result = {
            "benchmark": "resume_check",
            "device": args.device,
            "steps": args.steps,
            "saved_at": args.save_at,
            "steps_logged_resumed": sorted(b),
            "max_rel_diff": worst,
            "exact": sorted(b) == list(range(1, args.steps + 1))
            and all(value <= args.rtol for value in worst.values()),
            "wall_s": round(time.time() - start, 1),
        }
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
