"""On-policy distillation on the CPU: a weak student learns 2-digit + 2-digit addition (with carries) from
a served teacher, against GRPO alone at the same wall clock.

``python examples/distill/run.py [--out DIR] [--stage all|models|distill|grpo|summary|probe]``

1. ``models``: the task (``a + b``, both operands of two digits: most problems carry) and the
   quickstart's tiny model (``hybridflow.quickstart``), fine-tuned twice: the **teacher** on correct
   answers until it adds well, the **student** warm-started as the quickstart's is, on a weak teacher that
   writes the carry-free answer on 70% of carry problems, and for fewer steps;
2. ``distill``: the teacher served by ``python -m hybridflow.serve`` (``/v1/score``), the student trained
   by pure on-policy distillation (``actor_rollout_ref.teacher``, verl's top-k KL) for
   ``--minutes`` of wall clock, validating greedily every few steps;
3. ``grpo``: the same student trained by GRPO against the exact-answer reward, same minutes, same workers;
4. ``summary``: one JSON line per run (greedy accuracy before / after, points gained, seconds, the
   accuracy at 15 s ... 10 min; ``summary.jsonl`` with the whole curves) and ``distill_vs_grpo.png``
   (validation accuracy against the seconds since training began).

``models`` = ``teacher`` then ``student`` (each its own stage too). ``probe`` (not in ``all``) picks the
student's SFT steps: one student trained to the largest of ``--probe-steps``, its greedy accuracy and its
sample accuracy at temperature 1 (``sample_accuracy``: how often GRPO's groups of 8 hold a right answer)
printed at each, the models kept in ``DIR/probe/student_<steps>``. Each stage is one heavy job (run them
one at a time on a shared machine). The student runs are the real stack: Ray worker groups, FSDP2 over
gloo, the engine, an HTTP teacher.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from hybridflow.utils.ports import find_free_port as _free_port

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

VAL_KEY = "val-core/hybridflow/arithmetic/reward/mean@1"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--out", default="outputs/distill_example")
    parser.add_argument(
        "--stage",
        default="all",
        choices=("all", "models", "teacher", "student", "distill", "grpo", "summary", "probe"),
    )
    parser.add_argument("--minutes", type=float, default=10.0, help="wall clock of each student run")
    parser.add_argument("--teacher-sft-steps", type=int, default=1200)
    parser.add_argument(
        "--student-sft-steps", type=int, default=250, help="few: a student whose samples are rarely right"
    )
    parser.add_argument("--probe-steps", default="100,150,200,250,300,350,400", help="--stage probe's marks")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--prompts-per-step", type=int, default=32)
    parser.add_argument("--distill-n", type=int, default=2, help="responses per prompt when distilling")
    parser.add_argument("--distill-lr", type=float, default=5e-4)
    parser.add_argument("--grpo-n", type=int, default=8)
    parser.add_argument("--grpo-lr", type=float, default=2e-4)
    parser.add_argument("--top-k", type=int, default=16, help="the teacher's top-k per position")
    parser.add_argument(
        "--scheduler", default="sequential", choices=("sequential", "one_step_off", "two_step_off")
    )
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def quickstart_args(args, out: Path, steps: int, error_rate: float) -> argparse.Namespace:
    from hybridflow.quickstart import parse_args as quickstart_parse

    return quickstart_parse(
        [
            f"--out={out}",
            "--b-digits=2",
            f"--sft-steps={steps}",
            f"--teacher-carry-error-rate={error_rate}",
            f"--workers={args.workers}",
            f"--seed={args.seed}",
        ]
    )


def build_models(args, out: Path, which: tuple[str, ...] = ("teacher", "student")) -> None:
    """The task data and the tiny base model (the quickstart's ``prepare``), then the teacher (fine-tuned
    on correct answers) and the student (warm-started on the weak teacher's answers) from that base: one
    tokenizer, so the teacher can score the student's ids."""
    from hybridflow.quickstart import prepare
    from hybridflow.tasks.arithmetic import ArithmeticTaskConfig, write_sft_dataset

    student_args = quickstart_args(args, out / "student", args.student_sft_steps, 0.7)
    _, test, weak_sft, base = prepare(student_args, out / "student")
    task = ArithmeticTaskConfig(num_test=200, b_digits=(2, 2), instruction="", seed=args.seed)
    strong_sft = write_sft_dataset(out / "teacher" / "data", task, 12800, 0.0, seed=args.seed + 1)
    for name, data, steps in (
        ("teacher", strong_sft, args.teacher_sft_steps),
        ("student", weak_sft, args.student_sft_steps),
    ):
        if name not in which:
            continue
        seconds = fine_tune(base, data, out / name / "sft_model", steps, args.seed)
        accuracy = greedy_accuracy(out / name / "sft_model", test)
        line = {"model": name, "sft_steps": steps, "sft_s": round(seconds, 1), "greedy_accuracy": accuracy}
        line.update(sample_accuracy(out / name / "sft_model", test))
        print(json.dumps(line), flush=True)


def fine_tune(
    base: Path, sft_file: Path, target: Path, steps: int, seed: int, lr: float = 1e-3, on_save=None
) -> float:
    """Supervised fine-tuning in this process (a plain PyTorch loop, 2 threads: for a 1.9M-parameter
    model the worker-group path's per-step overhead is most of a step): batches of 128 problems,
    cross-entropy on the answer tokens and the end of turn only. Returns the seconds it took.

    ``on_save`` (``--stage probe``): ``{step: callback(model_dir, seconds, loss)}``; at each such step
    the model is also saved to ``{target}_{step}`` and the callback called (its time not counted)."""
    import random

    import pyarrow.parquet as pq
    import torch
    from transformers import AutoModelForCausalLM

    from hybridflow.models.loading import load_tokenizer

    torch.set_num_threads(2)
    torch.manual_seed(seed)
    tokenizer = load_tokenizer(str(base))
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    rows = pq.read_table(sft_file).to_pylist()
    examples = []
    for row in rows:
        prompt = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        answer_ids = tokenizer.encode(row["response"], add_special_tokens=False) + [tokenizer.eos_token_id]
        examples.append((prompt_ids, answer_ids))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20))
    rng, start = random.Random(seed), time.time()
    model.train()
    for step in range(steps):
        batch = rng.sample(examples, 128)
        width = max(len(p) + len(a) for p, a in batch)
        ids = torch.full((128, width), tokenizer.pad_token_id)
        labels = torch.full((128, width), -100)
        mask = torch.zeros((128, width), dtype=torch.long)
        for i, (p, a) in enumerate(batch):
            ids[i, : len(p) + len(a)] = torch.tensor(p + a)
            labels[i, len(p) : len(p) + len(a)] = torch.tensor(a)
            mask[i, : len(p) + len(a)] = 1
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if on_save and step + 1 in on_save:
            paused = time.time()
            model.save_pretrained(f"{target}_{step + 1}")
            tokenizer.save_pretrained(f"{target}_{step + 1}")
            on_save[step + 1](Path(f"{target}_{step + 1}"), paused - start, loss.item())
            model.train()
            start += time.time() - paused
        if step % 100 == 0:
            print(f"[sft {target.parent.name}] step {step} loss {loss.item():.4f}", flush=True)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return time.time() - start


def greedy_accuracy(model_dir: Path, test_file: Path) -> float:
    """Exact-answer greedy accuracy on the held-out problems (HF ``generate``, in this process)."""
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoModelForCausalLM

    from hybridflow.models.loading import load_tokenizer

    tokenizer = load_tokenizer(str(model_dir))
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = pq.read_table(test_file).to_pylist()
    right = 0
    for first in range(0, len(rows), 50):
        chunk = rows[first : first + 50]
        texts = [
            tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
            for r in chunk
        ]
        inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            output = model.generate(
                **inputs, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id
            )
        answers = tokenizer.batch_decode(output[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        right += sum(
            a.strip() == r["reward_model"]["ground_truth"] for a, r in zip(answers, chunk, strict=True)
        )
    return right / len(rows)


def sample_accuracy(model_dir: Path, test_file: Path, n: int = 8, limit: int = 100) -> dict:
    """How much signal GRPO would get from this model: ``n`` samples at temperature 1 (the rollout's) for
    each of the first ``limit`` held-out problems; the fraction of samples that are right and the
    fraction of groups of ``n`` with at least one right answer (a group with none has zero advantage)."""
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoModelForCausalLM

    from hybridflow.models.loading import load_tokenizer

    torch.manual_seed(0)
    tokenizer = load_tokenizer(str(model_dir))
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = pq.read_table(test_file).to_pylist()[:limit]
    right, groups_hit = 0, 0
    for first in range(0, len(rows), 25):
        chunk = rows[first : first + 25]
        texts = [
            tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
            for r in chunk
        ]
        inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            output = model.generate(
                **inputs, max_new_tokens=6, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                num_return_sequences=n, pad_token_id=tokenizer.pad_token_id,
            )  # fmt: skip
        answers = tokenizer.batch_decode(output[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        for i, r in enumerate(chunk):
            hits = sum(a.strip() == r["reward_model"]["ground_truth"] for a in answers[i * n : (i + 1) * n])
            right += hits
            groups_hit += hits > 0
    return {
        "sample_accuracy": round(right / (n * len(rows)), 3),
        "groups_with_a_right_answer": groups_hit / len(rows),
    }


def probe(args, out: Path) -> None:
    """One JSON line per mark of ``--probe-steps``: the student's SFT loss, seconds, greedy and sample
    accuracy after that many steps (the same student as ``--student-sft-steps`` of that many)."""
    from hybridflow.quickstart import prepare

    marks = sorted(int(m) for m in args.probe_steps.split(","))
    _, test, weak_sft, base = prepare(quickstart_args(args, out / "student", marks[-1], 0.7), out / "student")

    def report(steps: int):
        def callback(model_dir: Path, seconds: float, loss: float) -> None:
            line = {"sft_steps": steps, "loss": round(loss, 4), "sft_s": round(seconds, 1)}
            line["greedy_accuracy"] = greedy_accuracy(model_dir, test)
            print(json.dumps({**line, **sample_accuracy(model_dir, test)}), flush=True)

        return callback

    fine_tune(
        base, weak_sft, out / "probe" / "student", marks[-1], args.seed, on_save={m: report(m) for m in marks}
    )


def serve_teacher(out: Path, port: int) -> subprocess.Popen:
    import httpx

    log = open(out / "teacher_server.log", "w")  # noqa: SIM115 - lives as long as the server
    command = [
        sys.executable, "-m", "hybridflow.serve", "--model", str(out / "teacher" / "sft_model"),
        "--port", str(port), "--threads", "1", "--max-num-seqs", "16",
    ]  # fmt: skip
    server = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            time.sleep(0.2)
        if server.poll() is not None:
            break
    server.kill()
    raise RuntimeError(f"the teacher server did not start: see {out / 'teacher_server.log'}")


class WallClockTracker:
    """The ``wall_clock`` tracker: ``{"step": N, "wall_s": s}`` lines in ``{log_dir}/wall_clock.jsonl``,
    ``s`` the seconds since step 0 (the validation before training) was logged, so each validation's
    point sits at the run's real wall clock: steps, validations and logging included."""

    def __init__(self, project_name: str, experiment_name: str, config, log_dir: str) -> None:
        del project_name, experiment_name, config
        self.path = Path(log_dir) / "wall_clock.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("")
        self.start: float | None = None

    def log(self, data: dict, step: int) -> None:
        del data
        now = time.monotonic()
        self.start = now if self.start is None else self.start
        with self.path.open("a") as f:
            f.write(json.dumps({"step": int(step), "wall_s": round(now - self.start, 2)}) + "\n")

    def finish(self) -> None:
        pass


def student_run(args, out: Path, name: str, extra: list[str]) -> None:
    from hybridflow.trainer.config import load_config
    from hybridflow.trainer.main_ppo import run_ppo
    from hybridflow.utils.tracking import register_tracker

    register_tracker("wall_clock")(WallClockTracker)

    n = args.distill_n if name == "distill" else args.grpo_n
    rows_per_worker = args.prompts_per_step * n // args.workers
    data = out / "student" / "data"
    config = load_config(
        [
            f"data.train_files={data / 'train.parquet'}",
            f"data.val_files={data / 'test.parquet'}",
            f"actor_rollout_ref.model.path={out / 'student' / 'sft_model'}",
            f"data.train_batch_size={args.prompts_per_step}",
            "data.max_prompt_length=40",
            "data.max_response_length=6",
            f"actor_rollout_ref.rollout.n={n}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts_per_step}",
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={rows_per_worker}",
            "algorithm.adv_estimator=grpo",
            "trainer.total_training_steps=100000",
            f"trainer.time_budget_minutes={args.minutes}",
            "trainer.test_freq=5",
            f"trainer.n_gpus_per_node={args.workers}",
            "trainer.logger=[console,jsonl,wall_clock]",
            f"trainer.default_local_dir={out / 'checkpoints' / name}",
            "trainer.project_name=distill_example",
            f"trainer.experiment_name={name}",
            "trainer.resume_mode=disable",
            *extra,
        ]
    )
    os.chdir(out)  # logs: outputs/distill_example/<name>/metrics.jsonl under --out
    run_ppo(config)


def distill(args, out: Path) -> None:
    port = _free_port()
    server = serve_teacher(out, port)
    try:
        student_run(
            args,
            out,
            "distill",
            [
                f"actor_rollout_ref.actor.optim.lr={args.distill_lr}",
                "actor_rollout_ref.teacher.server_ip=127.0.0.1",
                f"actor_rollout_ref.teacher.server_port={port}",
                f"actor_rollout_ref.teacher.n_logprobs={args.top_k}",
                "actor_rollout_ref.teacher.micro_batch_size=16",
                f"trainer.scheduler={args.scheduler}",
            ],
        )
    finally:
        server.terminate()
        server.wait(timeout=30)


def grpo(args, out: Path) -> None:
    student_run(args, out, "grpo", [f"actor_rollout_ref.actor.optim.lr={args.grpo_lr}"])


def curve(out: Path, name: str) -> list[tuple[float, float]]:
    """(seconds since training began, greedy accuracy) at each validation, the step-0 validation at 0 s.
    The seconds are the run's wall clock (``wall_clock.jsonl``); a run logged without it gets the sum
    of its steps' ``timing_s/step`` (validations and logging left out)."""
    run_dir = out / "outputs" / "distill_example" / name
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    clock_file = run_dir / "wall_clock.jsonl"
    clock = {}
    if clock_file.exists():
        clock = {r["step"]: r["wall_s"] for r in map(json.loads, clock_file.read_text().splitlines())}
    points, elapsed = [], 0.0
    for record in sorted(records, key=lambda r: r["step"]):
        elapsed += float(record.get("timing_s/step", 0.0))
        if VAL_KEY in record:
            points.append((round(clock.get(record["step"], elapsed), 1), float(record[VAL_KEY])))
    return points


def clock_kind(out: Path, name: str) -> str:
    wall = (out / "outputs" / "distill_example" / name / "wall_clock.jsonl").exists()
    return "wall_clock" if wall else "sum_of_step_timers"


def summary(out: Path) -> list[dict]:
    """One line per run, printed without its curve (``accuracy_at_s``: the last validation at or before
    each mark); ``summary.jsonl`` keeps the whole curves; the plot."""
    lines = []
    for name in ("distill", "grpo"):
        if not (out / "outputs" / "distill_example" / name / "metrics.jsonl").exists():
            continue
        points = curve(out, name)
        if not points:
            continue
        late = [a for s, a in points if s > points[-1][0] / 2]
        lines.append(
            {
                "run": name,
                "accuracy_before": points[0][1],
                "accuracy_after": points[-1][1],
                "gain_points": round(100 * (points[-1][1] - points[0][1]), 1),
                "seconds": points[-1][0],
                "seconds_are": clock_kind(out, name),
                "first_plus_30_points_s": next(
                    (s for s, a in points if a - points[0][1] >= 0.30 - 1e-9), None
                ),
                "first_90_percent_s": next((s for s, a in points if a >= 0.9), None),
                "accuracy_at_s": [
                    [mark, [a for s, a in points if s <= mark][-1]]
                    for mark in (15, 30, 60, 120, 300, 600)
                    if mark <= points[-1][0] + 1
                ],
                "mean_second_half": round(sum(late) / len(late), 3),
                "best": max(a for _, a in points),
                "validations": len(points),
                "curve": points,
            }
        )
        print(json.dumps({k: v for k, v in lines[-1].items() if k != "curve"}), flush=True)
    (out / "summary.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    plot(out, lines)
    return lines


def plot(out: Path, lines: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 3.5))
    for line in lines:
        seconds, accuracy = zip(*line["curve"], strict=True)
        axis.plot(seconds, [100 * a for a in accuracy], marker=".", linewidth=1, label=line["run"])
    if lines:
        target = 100 * lines[0]["accuracy_before"] + 30
        axis.axhline(target, color="grey", linestyle=":", linewidth=1, label="start + 30 points")
    axis.set_xlabel("seconds since training began")
    axis.set_ylabel("greedy test accuracy (%)")
    axis.legend()
    figure.tight_layout()
    figure.savefig(out / "distill_vs_grpo.png", dpi=120)


def main(argv=None) -> None:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.stage in ("all", "models", "teacher", "student"):
        build_models(args, out, ("teacher", "student") if args.stage in ("all", "models") else (args.stage,))
    if args.stage in ("all", "distill"):
        distill(args, out)
    if args.stage in ("all", "grpo"):
        grpo(args, out)
    if args.stage == "probe":
        probe(args, out)
    if args.stage in ("all", "summary"):
        summary(out)


if __name__ == "__main__":
    main()
