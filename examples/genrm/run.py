"""A GenRM recipe that learns: the quickstart policy trained by GRPO against a tiny LLM judge alone (CPU).

``python examples/genrm/run.py [--out DIR] [--stage all|models|policy|judge|genrm|rule|summary]``

1. ``models``: the quickstart's task (``a + b``, a two-digit ``a`` and a one-digit ``b``) and tiny
   Qwen2-shaped model (one tokenizer trained on the task's and the judge's texts), fine-tuned twice from
   that base:
   - the **policy**, warm-started as the quickstart's is (a weak teacher writing the carry-free answer on
     70% of carry problems);
   - the **judge**, by SFT on labelled pairs (``hybridflow/tasks/arithmetic_judge.py``: a problem, a
     candidate answer, half of them right, the rest carry-free, off by one or ten, random or malformed),
     taught to reply with the sum and ``correct`` / ``incorrect``. Its accuracy on one held-out pair per
     test problem is printed as a JSON line (``judge_accuracy``);
2. ``genrm``: GRPO of the policy through ``main_ppo`` with the judge as the only reward:
   ``reward_model.enable=true reward_model.use_reward_loop=true reward_model.model.path=<judge>`` (main_ppo
   serves the judge itself, colocated: the two cores are the trainer's, and a standalone judge would only
   compete with the rollout for them; colocated it sleeps through the rollout and the update) and
   ``custom_reward_function.path=examples/genrm/reward.py`` (the judge's verdict, never the ground
   truth, on training samples), for ``--minutes`` of wall clock; greedy validation every ``--test-freq``
   steps on the held-out problems, which reward.py scores by the task's exact-answer **rule**, so the
   curve is true correctness;
3. ``rule``: the same run with the exact-answer rule reward, ``--rule-minutes`` of wall clock;
4. ``summary``: one JSON line per run (greedy accuracy before / after, points gained, seconds) and
   ``genrm_vs_rule.png`` (greedy accuracy against the seconds since training began).

``models`` = ``policy`` then ``judge`` (each its own stage too). Each stage is one heavy job (run them
one at a time on a shared machine).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

HERE = Path(__file__).resolve().parent
# greedy validation accuracy: the rule run's reward; the GenRM run's reward function returns a float, which
# the reward loop also logs as the ``acc`` extra (the core metric then)
VAL_KEYS = ("val-core/hybridflow/arithmetic/acc/mean@1", "val-core/hybridflow/arithmetic/reward/mean@1")
PROJECT = "genrm_example"


def _distill():
    """examples/distill/run.py: its in-process SFT loop, greedy accuracy and ``wall_clock`` tracker
    (loaded once: the tracker registers once per process)."""
    if "distill_example" in sys.modules:
        return sys.modules["distill_example"]
    spec = importlib.util.spec_from_file_location("distill_example", HERE.parent / "distill" / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["distill_example"] = module
    return module


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="outputs/genrm_example")
    parser.add_argument(
        "--stage", default="all", choices=("all", "models", "policy", "judge", "genrm", "rule", "summary")
    )
    parser.add_argument("--minutes", type=float, default=10.0, help="wall clock of the GenRM run")
    parser.add_argument("--rule-minutes", type=float, default=10.0, help="wall clock of the rule run")
    parser.add_argument("--policy-sft-steps", type=int, default=450, help="the quickstart's warm start")
    parser.add_argument("--judge-sft-steps", type=int, default=400)
    parser.add_argument("--sft-lr", type=float, default=1e-3)
    parser.add_argument("--judge-pairs", type=int, default=12800)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--prompts-per-step", type=int, default=32)
    parser.add_argument("--n", type=int, default=8, help="responses per prompt (GRPO group size)")
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--test-freq", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def task_config(seed: int):
    from hybridflow.tasks.arithmetic import ArithmeticTaskConfig

    return ArithmeticTaskConfig(num_test=200, b_digits=(1, 1), instruction="", seed=seed)


def judge_accuracy(model_dir: Path, pairs_file: Path) -> dict:
    """Greedy verdicts of the judge on held-out pairs (HF ``generate`` in this process): the fraction
    whose parsed verdict equals the label, overall, on the right and wrong candidates, and per mistake."""
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoModelForCausalLM

    from hybridflow.models.loading import load_tokenizer
    from hybridflow.tasks.arithmetic_judge import parse_verdict

    tokenizer = load_tokenizer(str(model_dir))
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = pq.read_table(pairs_file).to_pylist()
    hits: dict[str, list[bool]] = {}
    for first in range(0, len(rows), 50):
        chunk = rows[first : first + 50]
        texts = [
            tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
            for r in chunk
        ]
        inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            output = model.generate(
                **inputs, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id
            )
        replies = tokenizer.batch_decode(output[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        for reply, row in zip(replies, chunk, strict=True):
            hits.setdefault(row["mistake"], []).append(parse_verdict(reply) == row["label"])
    every = [h for group in hits.values() for h in group]
    wrong = [h for kind, group in hits.items() if kind != "none" for h in group]
    return {
        "judge_accuracy": round(sum(every) / len(every), 3),
        "on_right_answers": round(sum(hits.get("none", [])) / max(1, len(hits.get("none", []))), 3),
        "on_wrong_answers": round(sum(wrong) / max(1, len(wrong)), 3),
        "per_mistake": {kind: round(sum(g) / len(g), 3) for kind, g in sorted(hits.items())},
        "held_out_pairs": len(every),
    }


def build_models(args, out: Path, which: tuple[str, ...] = ("policy", "judge")) -> None:
    """Task data, one base model (built once), the policy's warm start and the judge's SFT (module
    docstring); one JSON line per model, also appended to ``models.jsonl``."""
    from hybridflow.models.tiny import build_tiny_model
    from hybridflow.tasks.arithmetic import task_texts, write_rl_dataset, write_sft_dataset
    from hybridflow.tasks.arithmetic_judge import judge_texts, write_judge_datasets

    distill = _distill()
    task = task_config(args.seed)
    data = out / "data"
    _, test = write_rl_dataset(data, task)
    weak_sft = write_sft_dataset(data, task, 12800, 0.7, seed=args.seed + 1)
    judge_train, judge_test = write_judge_datasets(data, task, args.judge_pairs, seed=args.seed + 7)
    base = out / "base_model"
    if not (base / "config.json").exists():
        texts = task_texts(task) + judge_texts(task)
        build_tiny_model(
            base, texts=texts, hidden_size=192, num_layers=4, intermediate_size=576, seed=args.seed
        )
    for name in which:
        target = out / name / "sft_model"
        sft_file, steps = (
            (weak_sft, args.policy_sft_steps) if name == "policy" else (judge_train, args.judge_sft_steps)
        )
        seconds = distill.fine_tune(base, sft_file, target, steps, args.seed, lr=args.sft_lr)
        line = {"model": name, "sft_steps": steps, "sft_s": round(seconds, 1)}
        if name == "policy":
            line["greedy_accuracy"] = distill.greedy_accuracy(target, test)
        else:
            line.update(judge_accuracy(target, judge_test))
        print(json.dumps(line), flush=True)
        with (out / "models.jsonl").open("a") as f:
            f.write(json.dumps(line) + "\n")


def policy_run(args, out: Path, name: str, minutes: float, extra: list[str]) -> None:
    from hybridflow.trainer.config import load_config
    from hybridflow.trainer.main_ppo import run_ppo
    from hybridflow.utils.tracking import register_tracker

    distill = _distill()
    if not getattr(distill, "registered", False):
        register_tracker("wall_clock")(distill.WallClockTracker)
        distill.registered = True
    rows_per_worker = args.prompts_per_step * args.n // args.workers
    data = out / "data"
    config = load_config(
        [
            f"data.train_files={data / 'train.parquet'}",
            f"data.val_files={data / 'test.parquet'}",
            f"actor_rollout_ref.model.path={out / 'policy' / 'sft_model'}",
            f"data.train_batch_size={args.prompts_per_step}",
            "data.max_prompt_length=40",
            "data.max_response_length=6",
            f"actor_rollout_ref.rollout.n={args.n}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts_per_step}",
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={rows_per_worker}",
            f"actor_rollout_ref.actor.optim.lr={args.lr}",
            "algorithm.adv_estimator=grpo",
            "trainer.total_training_steps=100000",
            f"trainer.time_budget_minutes={minutes}",
            f"trainer.test_freq={args.test_freq}",
            f"trainer.n_gpus_per_node={args.workers}",
            "trainer.logger=[console,jsonl,wall_clock]",
            f"trainer.default_local_dir={out / 'checkpoints' / name}",
            f"trainer.project_name={PROJECT}",
            f"trainer.experiment_name={name}",
            "trainer.resume_mode=disable",
            *extra,
        ]
    )
    os.chdir(out)  # logs: outputs/genrm_example/<name>/metrics.jsonl under --out
    run_ppo(config)


def genrm(args, out: Path) -> None:
    """GRPO against the judge alone, the judge served by main_ppo itself (colocated)."""
    judge = out / "judge" / "sft_model"
    policy_run(
        args,
        out,
        "genrm",
        args.minutes,
        [
            "actor_rollout_ref.rollout.mode=async",
            "reward_model.enable=true",
            "reward_model.use_reward_loop=true",
            f"reward_model.model.path={judge}",
            "reward_model.enable_resource_pool=false",
            "reward_model.rollout.kv_cache_memory_gb=0.05",
            "reward_model.rollout.max_num_seqs=128",
            "reward_model.rollout.prompt_length=64",
            "reward_model.rollout.response_length=8",
            "reward_model.reward_manager=naive",
            f"+custom_reward_function.reward_kwargs.judge_model={judge}",
            f"custom_reward_function.path={HERE / 'reward.py'}",
            "custom_reward_function.name=compute_score",
        ],
    )


def rule(args, out: Path) -> None:
    policy_run(args, out, "rule", args.rule_minutes, ["actor_rollout_ref.rollout.mode=async"])


def summary(out: Path) -> list[dict]:
    """One line per run (the distill example's curve and summary, this project's run names) and the plot."""
    lines = []
    for name in ("genrm", "rule"):
        run_dir = out / "outputs" / PROJECT / name
        if not (run_dir / "metrics.jsonl").exists():
            continue
        points = _curve(run_dir)
        if not points:
            continue
        lines.append(
            {
                "run": name,
                "reward": "the judge alone (GenRM)" if name == "genrm" else "exact-answer rule",
                "accuracy_before": points[0][1],
                "accuracy_after": points[-1][1],
                "gain_points": round(100 * (points[-1][1] - points[0][1]), 1),
                "best": max(a for _, a in points),
                "seconds": points[-1][0],
                "first_plus_20_points_s": next(
                    (s for s, a in points if a - points[0][1] >= 0.20 - 1e-9), None
                ),
                "accuracy_at_s": [
                    [mark, [a for s, a in points if s <= mark][-1]]
                    for mark in (60, 120, 300, 600)
                    if mark <= points[-1][0] + 1
                ],
                "validations": len(points),
                "curve": points,
            }
        )
        print(json.dumps({k: v for k, v in lines[-1].items() if k != "curve"}), flush=True)
    (out / "summary.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    plot(out, lines)
    return lines


def _curve(run_dir: Path) -> list[tuple[float, float]]:
    """(seconds since the validation before training, greedy accuracy) at each validation."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    clock = {
        r["step"]: r["wall_s"]
        for r in map(json.loads, (run_dir / "wall_clock.jsonl").read_text().splitlines())
    }
    return [
        (round(clock.get(r["step"], 0.0), 1), float(next(r[k] for k in VAL_KEYS if k in r)))
        for r in sorted(records, key=lambda r: r["step"])
        if any(k in r for k in VAL_KEYS)
    ]


def plot(out: Path, lines: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 3.5))
    for line in lines:
        seconds, accuracy = zip(*line["curve"], strict=True)
        axis.plot(seconds, [100 * a for a in accuracy], marker=".", linewidth=1, label=line["reward"])
    if lines:
        axis.axhline(100 * lines[0]["accuracy_before"] + 20, color="grey", linestyle=":", linewidth=1,
                     label="start + 20 points")  # fmt: skip
    axis.set_xlabel("seconds since training began")
    axis.set_ylabel("greedy test accuracy (%, rule)")
    axis.legend()
    figure.tight_layout()
    figure.savefig(out / "genrm_vs_rule.png", dpi=120)


def main(argv=None) -> None:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.stage in ("all", "models", "policy", "judge"):
        build_models(args, out, ("policy", "judge") if args.stage in ("all", "models") else (args.stage,))
    if args.stage in ("all", "genrm"):
        genrm(args, out)
    if args.stage in ("all", "rule"):
        rule(args, out)
    if args.stage in ("all", "summary"):
        summary(out)


if __name__ == "__main__":
    main()
