"""The quickstart: a tiny model learns 2-digit addition with GRPO on a laptop CPU, end to end.

``python -m hybridflow.quickstart [--out DIR]`` (the README's ``make demo``):

1. writes the built-in arithmetic task to parquet (verl's schema) and a supervised warm-start set;
2. builds a tiny Qwen2-architecture model with a byte-level BPE tokenizer trained on the task text;
3. warm-starts it with supervised fine-tuning on a deliberately *weak teacher*: on problems that need a
   carry, the teacher usually writes the carry-free answer (47 + 85 -> "22" instead of "132"), so the
   warm-started model gets the format right but carries wrongly — an imperfect policy, as after real SFT;
4. trains it with GRPO against the rule reward (exact answer = 1), validating greedily before and
   during training, and writes ``quickstart_curves.png`` (reward and validation accuracy per step) and
   ``summary.json``.

Everything runs through the real stack: Ray worker groups, FSDP2 over gloo, HF models, parquet.
``--arch qwen3_moe`` (or another of :mod:`hybridflow.models.tiny`'s) runs the same task with that
architecture; ``--override KEY=VALUE`` adds GRPO config keys (e.g. router replay, docs/model_support.md).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

VAL_KEY = "val-core/hybridflow/arithmetic/reward/mean@1"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--out", default="outputs/quickstart", help="working directory for data, models, logs"
    )
    parser.add_argument("--b-digits", type=int, default=1, help="digits of the second operand (first: 2)")
    parser.add_argument("--sft-examples", type=int, default=12800)
    parser.add_argument("--sft-steps", type=int, default=450)
    parser.add_argument("--sft-lr", type=float, default=1e-3)
    parser.add_argument("--teacher-carry-error-rate", type=float, default=0.7)
    parser.add_argument("--grpo-steps", type=int, default=40)
    parser.add_argument("--prompts-per-step", type=int, default=32)
    parser.add_argument("--n", type=int, default=8, help="responses per prompt (GRPO group size)")
    parser.add_argument("--lr", type=float, default=2e-4, help="GRPO learning rate")
    parser.add_argument("--num-test", type=int, default=200)
    parser.add_argument("--hidden-size", type=int, default=192)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2, help="worker processes (one per CPU core)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the task data, the model init and SFT")
    parser.add_argument("--sft-model", help="reuse this warm-started model directory instead of running SFT")
    parser.add_argument(
        "--arch",
        default="qwen2",
        help="the tiny model's architecture (hybridflow.models.tiny: qwen2, llama, qwen3_moe, ...)",
    )
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one more GRPO config override (repeatable), e.g. actor_rollout_ref.actor.router_replay.mode=R3",
    )
    return parser.parse_args(argv)


def prepare(args: argparse.Namespace, out: Path) -> tuple[Path, Path, Path, Path]:
    """Task data (RL train/test + SFT) and the untrained tiny model."""
    from hybridflow.models.tiny import build_tiny_model
    from hybridflow.tasks.arithmetic import (
        ArithmeticTaskConfig,
        task_texts,
        write_rl_dataset,
        write_sft_dataset,
    )

    task = ArithmeticTaskConfig(
        num_test=args.num_test, b_digits=(args.b_digits, args.b_digits), instruction="", seed=args.seed
    )
    train, test = write_rl_dataset(out / "data", task)
    sft = write_sft_dataset(
        out / "data",
        task,
        num_examples=args.sft_examples,
        teacher_carry_error_rate=args.teacher_carry_error_rate,
        seed=args.seed + 1,
    )
    model = build_tiny_model(
        out / "base_model",
        texts=task_texts(task),
        arch=args.arch,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        intermediate_size=args.hidden_size * 3,
        seed=args.seed,
    )
    return Path(train), Path(test), Path(sft), Path(model)


def warm_start(args: argparse.Namespace, out: Path, sft_file: Path, base_model: Path) -> Path:
    from hybridflow.trainer.config import load_config
    from hybridflow.trainer.sft_trainer import run_sft

    target = out / "sft_model"
    config = load_config(
        [
            f"data.train_files={sft_file}",
            f"model.path={base_model}",
            f"trainer.default_local_dir={target}",
            f"trainer.total_training_steps={args.sft_steps}",
            f"trainer.n_gpus_per_node={args.workers}",
            "data.train_batch_size=128",
            f"data.micro_batch_size_per_gpu={128 // args.workers}",
            f"optim.lr={args.sft_lr}",
            f"data.seed={args.seed + 1}",
        ],
        config_name="sft_trainer",
    )
    run_sft(config)
    return target


def grpo(args: argparse.Namespace, out: Path, train: Path, test: Path, model: Path) -> dict:
    from hybridflow.trainer.config import load_config
    from hybridflow.trainer.main_ppo import run_ppo

    rows_per_worker = args.prompts_per_step * args.n // args.workers
    config = load_config(
        [
            f"data.train_files={train}",
            f"data.val_files={test}",
            f"actor_rollout_ref.model.path={model}",
            f"data.train_batch_size={args.prompts_per_step}",
            "data.max_prompt_length=40",
            "data.max_response_length=6",
            f"actor_rollout_ref.rollout.n={args.n}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts_per_step}",
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={rows_per_worker}",
            f"actor_rollout_ref.actor.optim.lr={args.lr}",
            "algorithm.adv_estimator=grpo",
            f"trainer.total_training_steps={args.grpo_steps}",
            f"trainer.test_freq={max(1, args.grpo_steps // 10)}",
            f"trainer.n_gpus_per_node={args.workers}",
            "trainer.logger=[console,jsonl]",
            f"trainer.default_local_dir={out / 'checkpoints'}",
            "trainer.project_name=quickstart",
            "trainer.experiment_name=grpo",
            "trainer.resume_mode=disable",
            *args.override,
        ]
    )
    os.chdir(out)  # logs go to outputs/quickstart/grpo under --out
    return run_ppo(config)


def summarise(out: Path, seconds: float) -> dict:
    """Accuracy before/after from the metrics log; a compact curves PNG of reward and accuracy."""
    from hybridflow.utils.plot_metrics import plot_metrics

    log = out / "outputs" / "quickstart" / "grpo" / "metrics.jsonl"
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    val = [(r["step"], r[VAL_KEY]) for r in records if VAL_KEY in r]
    png = plot_metrics(log, out / "quickstart_curves.png", keys=["critic/score/mean", VAL_KEY])
    summary = {
        "accuracy_before": val[0][1],
        "accuracy_after": val[-1][1],
        "gain_points": 100 * (val[-1][1] - val[0][1]),
        "validation": val,
        "wall_time_s": round(seconds, 1),
        "curves_png": str(png),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    start = time.time()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(f"[quickstart] writing task data and the tiny model under {out}")
    train, test, sft_file, base_model = prepare(args, out)
    print("[quickstart] supervised warm start (weak teacher)")
    sft_model = Path(args.sft_model) if args.sft_model else warm_start(args, out, sft_file, base_model)
    print("[quickstart] GRPO")
    grpo(args, out, train, test, sft_model)
    summary = summarise(out, time.time() - start)
    print(
        f"[quickstart] greedy test accuracy: warm start {summary['accuracy_before']:.1%} -> after GRPO "
        f"{summary['accuracy_after']:.1%} ({summary['gain_points']:+.1f} points) "
        f"in {summary['wall_time_s']:.0f}s; "
        f"curves: {summary['curves_png']}"
    )
    return summary


if __name__ == "__main__":
    main()
