"""Two GRPO steps with long responses through ``main_ppo``, verl's command line, at SP = 1 and SP = 2 on the
same world size (4 workers) and micro-batch: the per-rank peak memory each run reports.

Responses reach ``--response-length`` tokens with ``rollout.ignore_eos=true``. The model is the tiny
model family of ``hybridflow.models.tiny`` with ``max_position_embeddings`` covering prompt + response.
Each run prints one JSON line: its step times, the actor update's peak resident memory on the largest
rank (``perf/update_actor_max_rss_gb``: the update's own high-water mark, reset as it starts) and the
workers' whole-process peak (``perf/cpu_peak_rss_gb``, the mean over the ranks: generation included).

    python benchmarks/sp_long_response.py --response-length 2048 --work /tmp/sp_long
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def prepare(work: Path, args) -> tuple[str, str, str]:
    from hybridflow.models.tiny import build_tiny_model
    from hybridflow.tasks.arithmetic import ArithmeticTaskConfig, write_rl_dataset

    model = work / "model"
    if not (model / "config.json").exists():
        build_tiny_model(
            model,
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=args.hidden * 11 // 4,
            max_position_embeddings=args.response_length + 256,
        )
    train, test = write_rl_dataset(work / "data", ArithmeticTaskConfig(num_train=64, num_test=4))
    return str(model), str(train), str(test)


def command(model: str, train: str, test: str, sp: int, work: Path, args) -> list[str]:
    """verl's key names throughout; only the SP size differs between the two runs."""
    return [
        sys.executable,
        "-m",
        "hybridflow.trainer.main_ppo",
        "algorithm.adv_estimator=grpo",
        f"data.train_files={train}",
        f"data.val_files={test}",
        f"data.train_batch_size={args.prompts}",
        "data.max_prompt_length=64",
        f"data.max_response_length={args.response_length}",
        f"actor_rollout_ref.model.path={model}",
        f"actor_rollout_ref.rollout.n={args.n}",
        "actor_rollout_ref.rollout.ignore_eos=true",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.micro_batch}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={args.micro_batch}",
        "actor_rollout_ref.actor.use_dynamic_bsz=false",
        "actor_rollout_ref.actor.reuse_update_log_probs=false",
        f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={sp}",
        "trainer.n_gpus_per_node=4",
        "trainer.total_training_steps=2",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.logger=[jsonl]",
        "trainer.progress_bar=false",
        "trainer.plot_curves=false",
        f"trainer.default_local_dir={work / f'sp{sp}' / 'ckpt'}",
        f"trainer.experiment_name=sp{sp}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", default="/tmp/sp_long_response")
    parser.add_argument("--response-length", type=int, default=2048)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument(
        "--micro-batch",
        type=int,
        default=1,
        help="rows per micro-batch per worker (1: one sequence a micro-batch, as the issue compares memory)",
    )
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--sp", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model, train, test = prepare(work, args)
    for sp in args.sp:
        run_dir = work / f"sp{sp}"
        run_dir.mkdir(exist_ok=True)
        start = time.perf_counter()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1"}
        with open(run_dir / "log.txt", "w") as log:
            subprocess.run(
                command(model, train, test, sp, work, args),
                cwd=run_dir,
                env=env,
                stdout=log,
                stderr=log,
                check=True,
            )
        records = [json.loads(line) for line in next(run_dir.rglob("metrics.jsonl")).read_text().splitlines()]
        print(
            json.dumps(
                {
                    "benchmark": "sp_long_response",
                    "sp": sp,
                    "workers": 4,
                    "response_length": args.response_length,
                    "response_length_mean": [r.get("response_length/mean") for r in records],
                    "update_peak_rss_gb_max_rank": [r.get("perf/update_actor_max_rss_gb") for r in records],
                    "process_peak_rss_gb_mean_rank": [r.get("perf/cpu_peak_rss_gb") for r in records],
                    "step_s": [r.get("timing_s/step") for r in records],
                    "wall_s": round(time.perf_counter() - start, 1),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
