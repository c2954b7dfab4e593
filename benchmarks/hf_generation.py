"""Baseline for the rollout engine choice: HF ``generate`` vs transformers' continuous batching.

    python benchmarks/hf_generation.py [--model DIR] [--prompts 64 --n 4 --new-tokens 64 --threads 1]

Same model, prompts (lengths 16-64, random ids) and sampling settings for both; prints one JSON line
with new tokens per second of each. Without ``--model`` it builds the tiny model.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="HF model directory (default: build the tiny model)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    return parser.parse_args(argv)


def make_prompts(vocab_size: int, count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab_size) for _ in range(rng.randint(16, 64))] for _ in range(count)]


def hf_generate(model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> float:
    """New tokens/s of one left-padded ``generate`` call over all rows."""
    import torch

    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = (input_ids != pad_id).long()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=True,
            pad_token_id=pad_id,
            eos_token_id=None,
        )
    return (out.shape[1] - width) * len(prompts) / (time.perf_counter() - start)


def continuous_batching(model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> float:
    """New tokens/s of transformers' ``generate_batch`` (continuous batching, paged cache)."""
    import torch
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=new_tokens, do_sample=True, eos_token_id=None, pad_token_id=pad_id
    )
    start = time.perf_counter()
    with torch.no_grad():
        results = model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
    return sum(len(r.generated_tokens) for r in results.values()) / (time.perf_counter() - start)


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model
        if path is None:
            from hybridflow.models.tiny import build_tiny_model

            path = str(build_tiny_model(os.path.join(tmp, "model"), hidden_size=192, intermediate_size=576))
        model = AutoModelForCausalLM.from_pretrained(path).eval()
    prompts = [p for p in make_prompts(model.config.vocab_size, args.prompts) for _ in range(args.n)]
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    result = {
        "benchmark": "hf_generation",
        "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 2),
        "rows": len(prompts),
        "new_tokens": args.new_tokens,
        "threads": args.threads,
        "hf_generate_tok_s": round(hf_generate(model, prompts, args.new_tokens, pad_id), 1),
    }
    try:
        result["generate_batch_tok_s"] = round(
            continuous_batching(model, prompts, args.new_tokens, pad_id), 1
        )
    except Exception as err:  # the API is young; report instead of failing the baseline
        result["generate_batch_error"] = f"{type(err).__name__}: {err}"[:300]
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
