"""Rollout backends side by side: hybridflow's engine, vLLM-CPU and Hugging Face ``generate``.

Each backend runs in its own process (vLLM changes process-wide torch settings; memory stays apart)
on the same model directory, the same prompts (random token ids, lengths uniform in 32..64) and the
same sampling (temperature 1, stop tokens ignored, so every sequence generates exactly
``--new-tokens``: pure generation speed). Each backend generates the workload twice: ``rep0`` (the
first batch after start-up) and ``rep1`` (warm). ``startup_s`` is from nothing to ready to generate
(weights loaded from the directory).

    python benchmarks/rollout_backends.py --shape smollm2 --prompts 64 --new-tokens 128
    python benchmarks/rollout_backends.py --model-dir ~/models/smollm2 --prompts 256 --new-tokens 256

Prints one JSON line per backend, then one with the ratios engine / vLLM and engine / HF (warm).
"""

from __future__ import annotations

import argparse
import json
import os
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
    reps = []
    for _ in range(2):
        begin = time.perf_counter()
        tokens = generate(rows)
        reps.append(tokens / (time.perf_counter() - begin))
    return {
        "backend": args.run,
        "threads": args.threads,
        "prompts": args.prompts,
        "new_tokens": args.new_tokens,
        "startup_s": round(startup, 2),
        "tokens_per_s_rep0": round(reps[0], 1),
        "tokens_per_s_rep1": round(reps[1], 1),
    }


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

    def generate(rows):
        results = engine.generate_batch(rows, params)
        return sum(len(c.token_ids) for r in results for c in r.completions)

    return generate


def _hf(args):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()

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

    return load_config(
        [
            f"model.path={args.model_dir}",
            f"rollout.name={name}",
            "rollout.prompt_length=64",
            f"rollout.response_length={args.new_tokens}",
            f"rollout.max_num_seqs={args.prompts}",
            f"trainer.num_threads={args.threads}",
            "rollout.dtype=fp32",
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
    parser.add_argument("--run", choices=["engine", "vllm", "hf"], help=argparse.SUPPRESS)
    args = parser.parse_args()
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
        ]
        out = subprocess.run(command, capture_output=True, text=True, check=False)
        lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
        if out.returncode != 0 or not lines:
            print(json.dumps({"backend": backend, "error": out.stderr.strip().splitlines()[-3:]}), flush=True)
            continue
        results[backend] = json.loads(lines[-1])
        results[backend]["model"] = args.model_dir or f"{args.shape}-shaped (random)"
        print(json.dumps(results[backend]), flush=True)
    ratios = {}
    for other in ("vllm", "hf"):
        if "engine" in results and other in results:
            ratios[f"engine_over_{other}_warm"] = round(
                results["engine"]["tokens_per_s_rep1"] / results[other]["tokens_per_s_rep1"], 3
            )
            ratios[f"engine_over_{other}_rep0"] = round(
                results["engine"]["tokens_per_s_rep0"] / results[other]["tokens_per_s_rep0"], 3
            )
    print(
        json.dumps({"ratios": ratios, "date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count()}), flush=True
    )


if __name__ == "__main__":
    main()
