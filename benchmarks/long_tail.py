"""A long-tail multi-turn GRPO workload, run three ways; one JSON line per run, then a summary line.

    python benchmarks/long_tail.py [--modes sync,async,fully_async] [--steps 12] [--prompts 8] [--n 4]

The workload (built here, in a temporary directory): every prompt asks for a "short", "medium" or
"long" list of fruit (50/30/20%) after looking up "today's fruit" with the ``lookup`` tool
(:mod:`hybridflow.workers.rollout.tools.lookup_tool`), whose latency is drawn per prompt (0.05, 0.3
or 1.5 s). The tiny model is first taught the format by teacher forcing (a few seconds): turn 1 is
the Hermes tool call, turn 2 a list of fruit ending with a probability per word set by the prompt's
size word (means 6, 24 and 96 words), so a GRPO group's samples are long or short together and the
lengths have a geometric tail. The reward is the share of the listed fruit equal to the looked-up one
(about 0.3 after teaching; GRPO can raise it), scored after ``--reward-latency`` seconds (a verifier's
cost).

Modes, all on the same 2 cores with 2 processes of 1 thread each and ``prompts x n`` samples a step:

- ``sync``: ``main_ppo`` with ``rollout.mode=sync``: the batch is split statically over the 2 ranks,
  each runs its conversations on its own engine, rewards are scored after the rollout;
- ``async``: ``main_ppo`` with ``rollout.mode=async``, 2 agent-loop workers: requests balanced over
  the 2 replicas (least in flight), rewards scored in the loop as each sample finishes;
- ``fully_async``: ``fully_async_main``, 1 trainer process and 1 rollout process, staleness 1,
  partial rollout, token-level IS correction.
- ``async_traced`` / ``fully_async_traced``: that mode with ``rollout.trace.backend=jsonl`` and
  ``token2text`` on every sample (the rollout trace's cost; docs/agent_loops.md#trace).

``samples_per_s`` = samples trained / the summed wall time of the timed steps (the first
``--warmup`` steps excluded); ``reward_last`` = mean and standard error of the per-step mean reward
over the last 10 steps (or all timed steps when fewer).

A mode may be named more than once (``--modes async,async_traced,async,async_traced``: alternating
repetitions, each in its own directory). With a mode and its ``_traced`` twin, the last line is the
trace's overhead: the mean step time of the traced runs over the untraced ones, and the median over the
timed steps of the step-by-step ratio (both runs draw the same samples, so step i of each is the same
work). With ``sync``, the summary gives each mode's speed-up over it, then the overlap bound
(:func:`overlap_bound`: what hiding the rewards behind generation can gain at most).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

FRUIT = ["apple", "pear", "plum", "fig", "lime", "kiwi", "date", "grape"]
SIZES = {"short": 6, "medium": 24, "long": 96}  # mean words of the list
SIZE_WEIGHTS = {"short": 0.5, "medium": 0.3, "long": 0.2}
LATENCIES_S = ([0.05, 0.3, 1.5], [0.5, 0.3, 0.2])
CALL = '<tool_call>\n{"name": "lookup", "arguments": {}}\n</tool_call>'
VALUE_SHARE = 0.3  # share of the listed fruit equal to the looked-up one in the taught answers
TOOL_CONFIG = """tools:
  - class_name: hybridflow.workers.rollout.tools.lookup_tool.LookupTool
    config: {type: native}
    tool_schema:
      type: function
      function:
        name: lookup
        description: "today's fruit"
        parameters: {type: object, properties: {}, required: []}
"""


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """Share of the fruit words in the final answer equal to ``ground_truth`` (0 without any), after
    ``extra_info["reward_latency_s"]`` seconds."""
    time.sleep(float((extra_info or {}).get("reward_latency_s", 0.0)))
    answer = solution_str.rsplit("value:", 1)[-1].rsplit("</tool_call>", 1)[-1]
    words = [word.strip(".,") for word in answer.split()]
    fruit = [word for word in words if word in FRUIT]
    return sum(word == ground_truth for word in fruit) / len(fruit) if fruit else 0.0


# ------------------------------------------------------------------ the workload
def _prompt(index: int, size: str) -> str:
    return f"Order {index}: look up today's fruit, then write a {size} list of fruit."


def _answer(rng: random.Random, size: str, value: str) -> str:
    words = []
    while True:
        words.append(value if rng.random() < VALUE_SHARE else rng.choice([f for f in FRUIT if f != value]))
        if rng.random() < 1.0 / SIZES[size]:
            return " ".join(words) + "."


def _rows(count: int, seed: int, split: str, reward_latency_s: float) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        size = rng.choices(list(SIZES), weights=list(SIZE_WEIGHTS.values()))[0]
        value = rng.choice(FRUIT)
        latency = rng.choices(*LATENCIES_S)[0]
        rows.append(
            {
                "data_source": "long_tail",
                "prompt": [{"role": "user", "content": _prompt(index, size)}],
                "ability": "tools",
                "reward_model": {"style": "rule", "ground_truth": value},
                "extra_info": {
                    "split": split,
                    "index": index,
                    "size": size,
                    "reward_latency_s": reward_latency_s,
                    "tools_kwargs": {"lookup": {"create_kwargs": {"value": value, "latency_s": latency}}},
                },
            }
        )
    return rows


def write_data(work: Path, reward_latency_s: float) -> tuple[Path, Path, Path]:
    import pandas as pd

    (work / "data").mkdir(parents=True, exist_ok=True)
    paths = []
    for split, count, seed in (("train", 2048, 0), ("test", 32, 1)):
        path = work / "data" / f"{split}.parquet"
        pd.DataFrame(_rows(count, seed, split, reward_latency_s)).to_parquet(path)
        paths.append(path)
    tools = work / "data" / "tool_config.yaml"
    tools.write_text(TOOL_CONFIG)
    return paths[0], paths[1], tools


def _conversation_ids(tokenizer, renderer, rng: random.Random, eos: int) -> tuple[list[int], list[int]]:
    """One taught conversation as the rollout lays it out: ``(ids, labels)`` (labels -100 off the
    assistant's turns)."""
    size = rng.choices(list(SIZES), weights=list(SIZE_WEIGHTS.values()))[0]
    value = rng.choice(FRUIT)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": _prompt(rng.randrange(4096), size)}],
        tokenize=False,
        add_generation_prompt=True,
    )
    parts = [
        (tokenizer.encode(prompt, add_special_tokens=False), False),
        (tokenizer.encode(CALL, add_special_tokens=False) + [eos], True),
        (renderer.tool_turn_ids([f"value: {value}"]), False),
        (tokenizer.encode(_answer(rng, size, value), add_special_tokens=False) + [eos], True),
    ]
    ids = [t for part, _ in parts for t in part]
    labels = [t if taught else -100 for part, taught in parts for t in part]
    return ids, labels


def teach(model_dir: Path, steps: int, seed: int = 0) -> dict:
    """Teacher-force the format into the model in ``model_dir`` (in place); returns the final loss."""
    import torch
    from transformers import AutoModelForCausalLM

    from hybridflow.models.loading import load_tokenizer
    from hybridflow.workers.rollout.multi_turn import ToolTurnRenderer

    tokenizer = load_tokenizer(str(model_dir))
    eos = tokenizer.eos_token_id
    renderer = ToolTurnRenderer(tokenizer, [eos])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    limit = model.config.max_position_embeddings
    start = time.perf_counter()
    for _ in range(steps):
        batch = [_conversation_ids(tokenizer, renderer, rng, eos) for _row in range(32)]
        width = min(max(len(ids) for ids, _ in batch), limit)
        ids = torch.full((len(batch), width), tokenizer.pad_token_id)
        labels = torch.full((len(batch), width), -100)
        for row, (seq, lab) in enumerate(batch):
            ids[row, : len(seq[:width])] = torch.tensor(seq[:width])
            labels[row, : len(lab[:width])] = torch.tensor(lab[:width])
        loss = model(
            input_ids=ids, attention_mask=(labels != -100) | (ids != tokenizer.pad_token_id), labels=labels
        ).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(model_dir)
    return {
        "teach_steps": steps,
        "teach_loss": round(loss.item(), 4),
        "teach_s": round(time.perf_counter() - start, 1),
    }


def build_model(work: Path, teach_steps: int) -> tuple[Path, dict]:
    """The taught tiny model in ``work/model``; one already taught there for ``teach_steps`` (its
    ``taught.json``: a kept ``--work``) is reused."""
    from hybridflow.models.tiny import build_tiny_model

    marker = work / "model" / "taught.json"
    if marker.exists() and json.loads(marker.read_text()).get("teach_steps") == teach_steps:
        return work / "model", {**json.loads(marker.read_text()), "reused": True}
    rng = random.Random(7)
    texts = [
        _prompt(i, s) + " " + CALL + " value: " + v + " " + _answer(rng, s, v)
        for i in range(400)
        for s, v in [(rng.choice(list(SIZES)), rng.choice(FRUIT))]
    ]
    model_dir = build_tiny_model(work / "model", texts=texts, max_position_embeddings=1024)
    taught = teach(model_dir, teach_steps)
    marker.write_text(json.dumps(taught))
    return model_dir, taught


# ------------------------------------------------------------------ the runs
TRACED = "_traced"  # a mode name ending in it: the same run with every agent-loop call traced


def overrides(args, mode: str, model: Path, train: Path, test: Path, tools: Path) -> list[str]:
    if mode.endswith(TRACED):  # the rollout trace's cost: every sample, token ids also as text
        base = overrides(args, mode.removesuffix(TRACED), model, train, test, tools)
        name = "trainer.experiment_name="
        base = [f"{name}{mode}" if v.startswith(name) else v for v in base]
        return [
            *base,
            "actor_rollout_ref.rollout.trace.backend=jsonl",
            "actor_rollout_ref.rollout.trace.token2text=true",
        ]
    samples_per_gpu = args.prompts * args.n // 2
    common = [
        f"data.train_files={train}",
        f"data.val_files={test}",
        f"actor_rollout_ref.model.path={model}",
        "data.max_prompt_length=48",
        f"data.max_response_length={args.max_response_length}",
        f"data.seed={args.seed}",
        "data.shuffle=true",
        f"actor_rollout_ref.rollout.n={args.n}",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={max(1, samples_per_gpu // 2)}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={max(1, samples_per_gpu // 2)}",
        f"actor_rollout_ref.actor.optim.lr={args.lr}",
        "actor_rollout_ref.actor.use_kl_loss=false",
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=false",
        f"custom_reward_function.path={Path(__file__).resolve()}",
        "custom_reward_function.name=compute_score",
        f"trainer.total_training_steps={args.steps}",
        f"trainer.experiment_name={mode}",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.logger=[jsonl]",
        "trainer.progress_bar=false",
        "trainer.plot_curves=false",
        "trainer.resume_mode=disable",
        "trainer.num_threads_per_worker=1",
    ]
    if mode == "sync":
        return [*common, "trainer.n_gpus_per_node=2", f"data.train_batch_size={args.prompts}"]
    if mode == "async":
        return [
            *common,
            "trainer.n_gpus_per_node=2",
            f"data.train_batch_size={args.prompts}",
            "actor_rollout_ref.rollout.mode=async",
            "actor_rollout_ref.rollout.agent.num_workers=2",
        ]
    return [
        *common,
        "trainer.n_gpus_per_node=1",
        "rollout.n_gpus_per_node=1",
        "async_training.staleness_threshold=1",
        "async_training.trigger_parameter_sync_step=1",
        "async_training.partial_rollout=true",
        "async_training.use_rollout_log_probs=true",  # no rollout_is: with these log-probs its weights are 1
    ]


def run_mode(args, mode: str, work: Path) -> dict:
    """One run in this process (``--run MODE``): train and summarise its metrics."""
    from hybridflow.trainer.config import load_config

    model = work / "model"
    train, test, tools = (
        work / "data" / name for name in ("train.parquet", "test.parquet", "tool_config.yaml")
    )
    run_dir = work / (mode if not args.rep else f"{mode}.{args.rep}")
    run_dir.mkdir(exist_ok=True)
    os.chdir(run_dir)
    values = overrides(args, mode, model, train, test, tools)
    start = time.time()
    if mode.removesuffix(TRACED) == "fully_async":
        from hybridflow.trainer.fully_async.main import run_fully_async

        run_fully_async(load_config(values, config_name="fully_async_ppo_trainer"))
    else:
        from hybridflow.trainer.main_ppo import run_ppo

        run_ppo(load_config(values))
    log = next(run_dir.glob(f"outputs/*/{mode}/metrics.jsonl"))
    records = [json.loads(line) for line in log.read_text().splitlines()]
    return summarise(records, args, mode, time.time() - start)


def summarise(records: list[dict], args, mode: str, wall_s: float) -> dict:
    timed = records[args.warmup :]
    step_s = [r["perf/time_per_step"] for r in timed]
    samples = args.prompts * args.n * len(timed)
    rewards = [r["critic/score/mean"] for r in records]
    last = rewards[-10:]
    mean = sum(last) / len(last)
    stderr = math.sqrt(sum((x - mean) ** 2 for x in last) / max(len(last) - 1, 1) / len(last))
    phases = sorted({k for r in timed for k in r if k.startswith("timing_s/")})
    return {
        "benchmark": "long_tail",
        "mode": mode,
        "steps": len(records),
        "steps_timed": len(timed),
        "samples_per_step": args.prompts * args.n,
        "samples_per_s": round(samples / sum(step_s), 3),
        "step_s": round(sum(step_s) / len(step_s), 2),
        "step_s_each": [round(x, 3) for x in step_s],
        "phase_s": {
            p.removeprefix("timing_s/"): round(sum(r.get(p, 0.0) for r in timed) / len(timed), 3)
            for p in phases
        },
        "response_length_mean": round(sum(r["response_length/mean"] for r in timed) / len(timed), 1),
        "response_length_max": max(r["response_length/max"] for r in timed),
        "reward_first": round(rewards[0], 4),
        "reward_last": {"mean": round(mean, 4), "stderr": round(stderr, 4), "steps": len(last)},
        "reward_curve": [round(x, 4) for x in rewards],
        "extra": {
            k: round(sum(r.get(k, 0.0) for r in timed) / len(timed), 4)
            for k in (
                "fully_async/staleness/mean",
                "fully_async/partial/partial_ratio",
                "fully_async/trainer/idle_ratio",
                "fully_async/rollouter/idle_ratio",
                "agent_loop/replica_requests/max",
                "agent_loop/replica_requests/min",
            )
            if any(k in r for r in timed)
        },
        "wall_s": round(wall_s, 1),
    }


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--modes", default="sync,async,fully_async")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the timing")
    parser.add_argument("--prompts", type=int, default=8, help="prompt groups per step")
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-response-length", type=int, default=384)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--teach-steps", type=int, default=300)
    parser.add_argument("--reward-latency", type=float, default=0.02, help="seconds per scored sample")
    parser.add_argument("--work", help="keep the assets and runs here (default: a temporary directory)")
    parser.add_argument("--run", help=argparse.SUPPRESS)
    parser.add_argument("--rep", type=int, default=0, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.run:
        print(json.dumps(run_mode(args, args.run, Path(args.work))), flush=True)
        return
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        write_data(work, args.reward_latency)
        _, taught = build_model(work, args.teach_steps)
        print(json.dumps({"benchmark": "long_tail", "setup": taught}), flush=True)
        results: dict[str, list[dict]] = {}
        for mode in args.modes.split(","):
            child = [
                sys.executable,
                __file__,
                *(argv if argv is not None else sys.argv[1:]),
                "--run",
                mode,
                "--rep",
                str(len(results.get(mode, []))),
                "--work",
                str(work),
            ]
            out = subprocess.run(child, capture_output=True, text=True)
            lines = [line for line in out.stdout.splitlines() if line.startswith('{"benchmark"')]
            if out.returncode or not lines:
                sys.stderr.write(out.stderr[-5000:])
                raise SystemExit(f"the {mode} run failed (exit {out.returncode})")
            results.setdefault(mode, []).append(json.loads(lines[-1]))
            print(lines[-1], flush=True)
        machine = {"benchmark": "long_tail", "date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count()}
        if "sync" in results:
            base = _mean([r["samples_per_s"] for r in results["sync"]])
            speedup = {
                m: round(_mean([r["samples_per_s"] for r in rs]) / base, 3) for m, rs in results.items()
            }
            print(json.dumps({**machine, "speedup_over_sync": speedup}), flush=True)
            print(json.dumps({**machine, "overlap_bound_over_sync": overlap_bound(results["sync"], args)}))
        overhead = trace_overhead(results)
        if overhead:
            print(json.dumps({**machine, "trace_overhead": overhead}), flush=True)


def overlap_bound(sync_runs: list[dict], args) -> float:
    """The most a mode that scores rewards while others still generate can gain over ``sync`` here:
    sync's step over the same step with its reward phase hidden but for the last sample's score
    (``--reward-latency``: it starts once that sample is generated). Reached only if that mode's
    generation and update take no longer than sync's."""
    step = _mean([r["step_s"] for r in sync_runs])
    reward = _mean([r["phase_s"].get("reward", 0.0) for r in sync_runs])
    return round(step / (step - reward + args.reward_latency), 3)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def trace_overhead(results: dict[str, list[dict]]) -> dict:
    """Per mode with a ``_traced`` twin: the traced runs' mean step time over the untraced ones' minus 1
    (``step``, and the same for the generation phase), and the median over runs and timed steps of
    (traced step i / untraced step i) minus 1, pairing the k-th traced run with the k-th untraced one."""
    overhead = {}
    for mode, traced in results.items():
        plain = results.get(mode.removesuffix(TRACED)) if mode.endswith(TRACED) else None
        if not plain:
            continue
        ratios = sorted(
            t / p
            for a, b in zip(traced, plain, strict=False)
            for t, p in zip(a["step_s_each"], b["step_s_each"], strict=True)
        )
        middle = len(ratios) // 2
        median = ratios[middle] if len(ratios) % 2 else (ratios[middle - 1] + ratios[middle]) / 2
        step = [_mean([r["step_s"] for r in runs]) for runs in (traced, plain)]
        gen = [_mean([r["phase_s"].get("gen", 0.0) for r in runs]) for runs in (traced, plain)]
        overhead[mode] = {
            "runs": [len(traced), len(plain)],
            "step_s": [round(x, 3) for x in step],
            "step": round(step[0] / step[1] - 1, 4),
            "step_paired_median": round(median - 1, 4),
            "gen": round(gen[0] / gen[1] - 1, 4) if gen[1] else None,
        }
    return overhead


if __name__ == "__main__":
    main()
