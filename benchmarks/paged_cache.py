"""The paged KV cache and its prefix cache, measured: multi-turn prefill, capacity, block sizes.

    python benchmarks/paged_cache.py [--workloads multi_turn,capacity] [--model smollm2|llama100m|tiny]

One JSON line per measurement (the CPU named in each, figures differ by machine):

- ``multi_turn``: ``--conversations`` conversations of ``--turns`` turns on one engine, as an agent loop
  or a chat client drives it: turn k+1's prompt is turn k's whole context, the model's answer
  (``--answer`` tokens) and a new user/tool message (``--message`` tokens). Run with the prefix cache on
  and off (``enable_prefix_caching``, alternating ``--reps`` times): prompt tokens prefilled per
  conversation against the new tokens (the first prompt, then each turn's message and the answer's last
  token, whose keys were never computed; the cache holds whole blocks, so up to ``block_size - 1`` more
  per turn are recomputed), and the seconds per turn.
- ``capacity``: one ``--budget-mib`` KV budget, a variable-length batch of the long-tail shape
  (``benchmarks/long_tail.py``: 50/30/20% short/medium/long answers of 6/24/96 mean words, here
  geometric token counts of means 24/96/384 after a 64-token prompt, ``max_model_len`` 1024). Today's
  slot cache held ``budget / (max_model_len x bytes per position)`` sequences; the paged pool holds as
  many as their actual lengths fit: the most sequences resident at once, counted while the engine
  runs them (prefix caching off, so only paging counts).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from rollout import MODELS, build_model  # noqa: E402  (benchmarks/ is on the path of its scripts)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            model = next((line.split(":", 1)[1].strip() for line in cpuinfo if "model name" in line), "")
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        return platform.processor()
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return f"{model}, {os.cpu_count()} cores, {isa}"


def _engine(model, max_len: int, caching: bool, budget_mib: float | None = None, rows: int = 256):
    from hybridflow.workers.rollout.engine import EngineModel, LLMEngine
    from hybridflow.workers.rollout.engine.kv_cache import DEFAULT_BLOCK_SIZE, blocks_for_budget

    engine_model = EngineModel.from_hf_module(model, max_len, dtype=model.dtype)
    blocks = None
    if budget_mib is not None:
        budget = int(budget_mib * 2**20)
        blocks = blocks_for_budget(engine_model.spec, DEFAULT_BLOCK_SIZE, model.dtype, budget, max_len)
    return LLMEngine(
        engine_model, rows, max_len, eos_token_ids=[], num_blocks=blocks, enable_prefix_caching=caching
    )


def multi_turn(model, args) -> list[dict]:
    """See the module docstring; returns one record per (rep, cache on/off)."""
    from hybridflow.workers.rollout.engine import SamplingParams

    vocab = model.config.vocab_size
    max_len = args.system + args.turns * (args.message + args.answer) + 8
    params = SamplingParams(max_new_tokens=args.answer, temperature=1.0, seed=7, ignore_eos=True)
    records = []
    for rep in range(args.reps):
        for caching in (True, False):
            rng = random.Random(rep)
            system = [rng.randrange(3, vocab) for _ in range(args.system)]  # one system prompt for all
            contexts = [system + [rng.randrange(3, vocab) for _ in range(args.message)]]
            contexts = [list(contexts[0]) for _ in range(args.conversations)]
            for i, context in enumerate(contexts):
                context[-1] = 3 + i  # each conversation's own first message
            engine = _engine(model, max_len, caching)
            turn_s = []
            for _ in range(args.turns):
                start = time.perf_counter()
                results = engine.generate_batch(contexts, params)
                turn_s.append(time.perf_counter() - start)
                contexts = [
                    r.prompt_token_ids
                    + r.completions[0].token_ids
                    + [rng.randrange(3, vocab) for _ in range(args.message)]
                    for r in results
                ]
            # what no cache holds: the first prompt, then each turn's message and the answer's last token
            # (its keys and values are never computed: it is the token the next prefill feeds first)
            fresh = args.conversations * (args.system + args.turns * args.message + args.turns - 1)
            records.append(
                {
                    "workload": "multi_turn",
                    "prefix_caching": caching,
                    "rep": rep,
                    "turns": args.turns,
                    "conversations": args.conversations,
                    "prefill_tokens_per_conversation": engine.stats["prefill_tokens"] / args.conversations,
                    "new_tokens_per_conversation": fresh / args.conversations,
                    "prefill_over_new": round(engine.stats["prefill_tokens"] / fresh, 3),
                    "prefix_hit_rate": round(
                        engine.pool.stats["prefix_hits"] / max(1, engine.pool.stats["prefix_queries"]), 3
                    ),
                    "s_per_turn": round(sum(turn_s) / len(turn_s), 4),
                    "s_total": round(sum(turn_s), 3),
                }
            )
            print(json.dumps({**records[-1], "cpu": cpu_name()}), flush=True)
    return records


def capacity(model, args) -> dict:
    """See the module docstring."""
    from hybridflow.workers.rollout.engine import SamplingParams
    from hybridflow.workers.rollout.engine.kv_cache import bytes_per_block

    max_len, prompt_len = 1024, 64
    rng = random.Random(0)
    engine = _engine(model, max_len, caching=False, budget_mib=args.budget_mib)
    per_position = bytes_per_block(engine.model.spec, 1, model.dtype)
    slots_today = int(args.budget_mib * 2**20 // (max_len * per_position))
    vocab = model.config.vocab_size
    requests = []
    for _ in range(args.sequences):
        mean = rng.choices([24, 96, 384], weights=[0.5, 0.3, 0.2])[0]
        length = min(max_len - prompt_len - 1, max(1, int(rng.expovariate(1 / mean))))
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        params = SamplingParams(max_new_tokens=length, ignore_eos=True)
        requests.append(engine.add_request(prompt, params))
    most, start = 0, time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        most = max(most, engine.num_running)
    record = {
        "workload": "capacity",
        "budget_mib": args.budget_mib,
        "max_model_len": max_len,
        "sequences": args.sequences,
        "slots_today": slots_today,
        "most_resident_paged": most,
        "ratio": round(most / max(1, slots_today), 2),
        "preemptions": engine.stats["preemptions"],
        "blocks": engine.pool.num_blocks,
        "s": round(time.perf_counter() - start, 2),
        "cpu": cpu_name(),
    }
    print(json.dumps(record), flush=True)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", default="multi_turn,capacity")
    parser.add_argument("--model", default="tiny", choices=sorted(MODELS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--system", type=int, default=96, help="system prompt tokens shared by all")
    parser.add_argument("--message", type=int, default=64, help="user/tool tokens per turn")
    parser.add_argument("--answer", type=int, default=32, help="answer tokens per turn")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--budget-mib", type=float, default=16.0)
    parser.add_argument("--sequences", type=int, default=96)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = build_model(args.model, torch.float32)
    for workload in args.workloads.split(","):
        {"multi_turn": multi_turn, "capacity": capacity}[workload](model, args)


if __name__ == "__main__":
    main()
