"""Time N GRPO steps through the full stack and print one JSON line.

    python benchmarks/grpo_step.py --model DIR --train-file train.parquet [--steps 5 --prompts 16 --n 4
        --max-prompt-length 64 --max-response-length 64 --lr 1e-6 --kl-coef 0.001 --workers 2]

Without ``--model``/``--train-file`` it builds the arithmetic task and a randomly initialised model
first: the tiny one, or with ``--shape smollm2`` one of SmolLM2-135M's shape (llama, 30 layers, hidden
576, GQA 9/3, tied embeddings) with the task's tokenizer. ``--device cuda`` trains on the GPU (one
worker per GPU; bf16 compute over fp32 master weights and a bf16 engine, the device's defaults) and
reports the peak GPU memory; issue 26's workload is
``--device cuda --workers 1 --shape smollm2 --prompts 64 --n 8 --max-response-length 256``.
``tokens_per_s`` counts prompt + generated tokens actually processed (attention-mask sum) per second
of step wall time; model loading and worker start-up are excluded. The first step is a warm-up and
is excluded from the timing unless ``--steps 1``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="HF model directory (default: build the tiny model)")
    parser.add_argument("--train-file", help="parquet in verl's schema (default: the arithmetic task)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step")
    parser.add_argument("--n", type=int, default=4, help="responses per prompt")
    parser.add_argument("--max-prompt-length", type=int, default=64)
    parser.add_argument("--max-response-length", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--kl-coef", type=float, default=0.001, help="KL loss coefficient (0: no reference)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rollout", default="engine", help="actor_rollout_ref.rollout.name (engine | hf)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="trainer.device")
    parser.add_argument("--shape", choices=["tiny", "smollm2"], default="tiny", help="the built model")
    parser.add_argument("--extra", nargs="*", default=[], help="more key=value config overrides")
    return parser.parse_args(argv)


def default_assets(work: Path, shape: str = "tiny") -> tuple[str, str]:
    from hybridflow.models.tiny import build_tiny_model
    from hybridflow.tasks.arithmetic import ArithmeticTaskConfig, write_rl_dataset

    train, _ = write_rl_dataset(work / "data", ArithmeticTaskConfig(num_train=2000, num_test=16))
    sizes = smollm2_sizes() if shape == "smollm2" else {}
    return str(build_tiny_model(work / "model", **sizes)), str(train)


def smollm2_sizes() -> dict:
    """SmolLM2-135M's shape (``rollout_backends.SHAPES``) as :func:`build_tiny_model` arguments."""
    from rollout_backends import SHAPES  # benchmarks/ is on the path of its scripts

    shape = SHAPES["smollm2"]
    return dict(
        arch="llama",
        hidden_size=shape["hidden_size"],
        num_layers=shape["num_hidden_layers"],
        num_heads=shape["num_attention_heads"],
        num_kv_heads=shape["num_key_value_heads"],
        intermediate_size=shape["intermediate_size"],
        max_position_embeddings=shape["max_position_embeddings"],
        vocab_size=shape["vocab_size"],
    )


def overrides(args: argparse.Namespace, model: str, train: str) -> list[str]:
    use_kl = args.kl_coef > 0
    micro = max(1, args.prompts * args.n // args.workers // 4)  # 4 micro-batches per mini-batch
    return [
        f"data.train_files={train}",
        f"data.val_files={train}",
        f"actor_rollout_ref.model.path={model}",
        f"data.train_batch_size={args.prompts}",
        f"data.max_prompt_length={args.max_prompt_length}",
        f"data.max_response_length={args.max_response_length}",
        "data.filter_overlong_prompts=true",
        f"actor_rollout_ref.rollout.n={args.n}",
        f"actor_rollout_ref.rollout.name={args.rollout}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
        f"actor_rollout_ref.actor.optim.lr={args.lr}",
        f"actor_rollout_ref.actor.use_kl_loss={use_kl}",
        f"actor_rollout_ref.actor.kl_loss_coef={args.kl_coef}",
        "algorithm.adv_estimator=grpo",
        f"trainer.total_training_steps={args.steps}",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.logger=[jsonl]",
        "trainer.progress_bar=false",
        "trainer.plot_curves=false",
        f"trainer.n_gpus_per_node={args.workers}",
        f"trainer.device={args.device}",
        "trainer.resume_mode=disable",
        *args.extra,
    ]


def summarise(records: list[dict], args: argparse.Namespace) -> dict:
    timed = records[1:] if len(records) > 1 else records
    wall = sum(r["perf/time_per_step"] for r in timed)
    tokens = sum(r["perf/total_num_tokens"] for r in timed)
    phases = sorted({k for r in timed for k in r if k.startswith("timing_s/")})
    worker_rss = max(r.get("perf/cpu_peak_rss_gb", 0.0) for r in records)
    return {
        "benchmark": "grpo_step",
        "rollout": args.rollout,
        "steps_timed": len(timed),
        "prompts": args.prompts,
        "n": args.n,
        "max_response_length": args.max_response_length,
        "workers": args.workers,
        "device": args.device,
        "tokens_per_s": round(tokens / wall, 1),
        "step_s": round(wall / len(timed), 3),
        "phase_s": {
            p.removeprefix("timing_s/"): round(sum(r.get(p, 0.0) for r in timed) / len(timed), 4)
            for p in phases
        },
        "update_weights_peak_extra_mb": round(
            max((r.get("perf/update_weights_peak_extra_mb", 0.0) for r in records), default=0.0), 3
        ),
        "rollout_log_probs_diff_max": max(
            (
                r["training/rollout_log_probs_diff_max"]
                for r in records
                if "training/rollout_log_probs_diff_max" in r
            ),
            default=None,
        ),
        "mean_reward": round(sum(r["critic/score/mean"] for r in timed) / len(timed), 4),
        "response_length_mean": round(sum(r["response_length/mean"] for r in timed) / len(timed), 2),
        "peak_gpu_memory_gb": max((r.get("perf/max_memory_allocated_gb", 0.0) for r in records), default=0.0)
        or None,
        "mfu_actor": max((r.get("perf/mfu/actor", 0.0) for r in records), default=0.0) or None,
        "peak_rss_gb": {
            "worker": round(worker_rss, 3),
            "driver": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
        },
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    from hybridflow.trainer.config import load_config
    from hybridflow.trainer.main_ppo import run_ppo

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model, train = (
            (args.model, args.train_file)
            if args.model and args.train_file
            else default_assets(work, args.shape)
        )
        os.chdir(work)
        start = time.time()
        run_ppo(load_config(overrides(args, model, train)))
        log = work / "outputs" / "hybridflow" / "arithmetic_grpo" / "metrics.jsonl"
        records = [json.loads(line) for line in log.read_text().splitlines()]
        result = summarise(records, args)
        result["total_wall_s"] = round(time.time() - start, 1)
    print(json.dumps(result), file=sys.stdout, flush=True)
    return result


if __name__ == "__main__":
    main()
