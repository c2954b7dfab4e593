"""Rollout throughput: the embedded engine vs Hugging Face ``generate`` on the same model and prompts.

Both generate ``--prompts`` prompts x ``--n`` samples, up to ``--new-tokens`` tokens each (prompt
lengths drawn uniformly from ``--min-prompt``..``--max-prompt``), with the same sampling settings
(temperature 1, no top-k/top-p), in one process with the same torch threads. HF ``generate`` gets
every row in one left-padded batch (its fastest setting here); the engine gets each prompt once with
``n`` samples, as the rollout does. Two workloads, each timed for both:

- ``fixed_length``: stop tokens ignored, every row generates exactly ``--new-tokens`` (pure decode
  speed; HF's padding and finished-row waste play no part);
- ``variable_length``: ``--stop-fraction`` of the vocabulary are stop tokens, so responses end after a
  roughly geometric number of tokens, as RL responses vary in length. HF decodes every row until the
  longest finishes; the engine retires finished rows. Tokens/s counts generated tokens up to and
  including each row's stop token.

    python benchmarks/rollout.py --model tiny       # the quickstart-sized model (1.7M)
    python benchmarks/rollout.py --model llama100m  # a ~100M-parameter Llama config (random init)
    python benchmarks/rollout.py --model smollm2 --device cuda --dtype bf16 --prompts 128 --n 4 \
        --new-tokens 256                            # issue 26's GPU target: 512 rows x 256 tokens

Prints one JSON line: tokens/s of each, their ratio per workload, and the engine's counters
(decode steps, static / eager steps, CUDA graphs captured and the seconds it took). ``--profile-step``
adds ``step_profile``: one decode step of the fixed-length workload at full batch, its aten ops and
host reads (engine/op_count.py) and its milliseconds; on CUDA also the profiler's view of it (kernels
launched, GPU busy time against the step's wall time, the top kernels). ``--enforce-eager`` decodes
without CUDA graphs (the engine's ``enforce_eager``); ``HYBRIDFLOW_DECODE_ATTENTION=span|flex``
picks the decode attention (engine/attention.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from rollout_backends import SHAPES  # noqa: E402  (benchmarks/ is on the path of its scripts)

MODELS = {
    # name -> LlamaConfig kwargs (None: the built-in tiny model)
    "tiny": None,
    "llama100m": dict(
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        intermediate_size=2048,
        vocab_size=32000,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    ),
    "smollm2": SHAPES["smollm2"],  # SmolLM2-135M's shape, as rollout_backends.py builds it
}


def build_model(name: str, dtype: torch.dtype, device: str = "cpu"):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if MODELS[name] is None:
        from hybridflow.models.tiny import build_tiny_model

        path = build_tiny_model(
            os.path.join(tempfile.mkdtemp(), "tiny"), hidden_size=192, intermediate_size=512
        )
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    else:
        model = LlamaForCausalLM(LlamaConfig(**MODELS[name])).to(dtype)
    return model.to(device).eval()


def _synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so a timer reads finished work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_prompts(args, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(args.min_prompt, args.max_prompt + 1, (args.prompts,), generator=gen)
    return [torch.randint(4, vocab, (int(n),), generator=gen).tolist() for n in lengths]


def hf_generate(model, prompts: list[list[int]], args, stop_ids: list[int]) -> tuple[int, float]:
    rows = [p for p in prompts for _ in range(args.n)]
    width = max(len(p) for p in rows)
    pad_id = 0
    input_ids = torch.full((len(rows), width), pad_id)
    attention_mask = torch.zeros_like(input_ids)
    for i, p in enumerate(rows):
        input_ids[i, width - len(p) :] = torch.tensor(p)
        attention_mask[i, width - len(p) :] = 1
    input_ids, attention_mask = input_ids.to(model.device), attention_mask.to(model.device)
    _synchronize(model.device)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=args.new_tokens,
            min_new_tokens=0 if stop_ids else args.new_tokens,
            do_sample=True,
            temperature=args.temperature,
            top_k=0,
            top_p=1.0,
            eos_token_id=stop_ids or None,
            pad_token_id=pad_id,
        )
    _synchronize(model.device)
    elapsed = time.perf_counter() - start
    generated = out[:, width:]
    if not stop_ids:
        return generated.numel(), elapsed
    from hybridflow.utils.torch_functional import get_response_mask

    return int(get_response_mask(generated, stop_ids).sum()), elapsed


def build_engine(model, args):
    from hybridflow.workers.rollout.engine import EngineModel, LLMEngine

    max_len = args.max_prompt + args.new_tokens
    engine_model = EngineModel.from_hf_module(model, max_len, dtype=model.dtype, device=model.device)
    per_sync = args.decode_steps_per_sync or (8 if model.device.type == "cuda" else 1)
    return LLMEngine(
        engine_model,
        max_num_seqs=args.max_num_seqs,
        max_model_len=max_len,
        eos_token_ids=[],
        decode_steps_per_sync=per_sync,
        enforce_eager=args.enforce_eager,
    )


def engine_generate(model, prompts: list[list[int]], args, stop_ids: list[int]) -> tuple[int, float, dict]:
    from hybridflow.workers.rollout.engine import SamplingParams

    engine = build_engine(model, args)
    params = SamplingParams(
        max_new_tokens=args.new_tokens, temperature=args.temperature, stop_token_ids=tuple(stop_ids)
    )
    _synchronize(model.device)
    start = time.perf_counter()
    results = engine.generate_batch(prompts, params, n=args.n)
    _synchronize(model.device)
    elapsed = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for r in results for c in r.completions)
    return tokens, elapsed, {**engine.stats, "eager_reasons": dict(engine.eager_reasons)}


def profile_decode_step(model, prompts: list[list[int]], args) -> dict:
    """One engine step that only decodes (every row running, graphs already captured): its ops and
    host reads, its wall time per decode step and, on CUDA, the profiler's kernel summary."""
    from hybridflow.workers.rollout.engine import SamplingParams
    from hybridflow.workers.rollout.engine.op_count import profile_step

    engine = build_engine(model, args)
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=args.temperature, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params, n=args.n)
    for _ in range(3):  # prefill, then decode steps that capture the full batch's graphs
        engine.step()
    out = profile_step(engine)
    _synchronize(model.device)
    steps_before, start = engine.stats["decode_steps"], time.perf_counter()
    for _ in range(3):
        engine.step()
    _synchronize(model.device)
    steps = engine.stats["decode_steps"] - steps_before
    out["ms_per_decode_step"] = round((time.perf_counter() - start) * 1e3 / max(1, steps), 2)
    out["batch"] = engine.num_running
    if model.device.type == "cuda":
        out["cuda"] = cuda_profile(engine)
    return out


def cuda_profile(engine, top: int = 8) -> dict:
    """torch.profiler over one engine step: kernels launched, GPU busy time, the step's wall time."""
    from torch.profiler import ProfilerActivity, profile

    steps_before = engine.stats["decode_steps"]
    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.step()
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) * 1e3
    events = [e for e in prof.key_averages() if getattr(e, "device_type", None) is not None]
    kernels = [e for e in events if str(e.device_type).endswith("CUDA") and e.device_time_total > 0]
    busy_ms = sum(e.device_time_total for e in kernels) / 1e3
    kernels.sort(key=lambda e: e.device_time_total, reverse=True)
    return {
        "decode_steps": engine.stats["decode_steps"] - steps_before,
        "wall_ms": round(wall_ms, 2),
        "gpu_busy_ms": round(busy_ms, 2),
        "gpu_busy_fraction": round(busy_ms / wall_ms, 3) if wall_ms else None,
        "kernel_launches": sum(e.count for e in kernels),
        "top_kernels_ms": {e.key[:60]: round(e.device_time_total / 1e3, 3) for e in kernels[:top]},
    }


def compare(model, prompts, args, stop_ids: list[int]) -> dict:
    engine_tokens, engine_s, stats = engine_generate(model, prompts, args, stop_ids)
    rows = args.prompts * args.n
    result = {
        "engine_tok_s": round(engine_tokens / engine_s, 1),
        "engine_s": round(engine_s, 2),
        "mean_response_tokens": round(engine_tokens / rows, 1),
        "engine_decode_steps": stats["decode_steps"],
        "engine_stats": {
            key: round(value, 3) if isinstance(value, float) else value
            for key, value in stats.items()
            if key
            in (
                "static_steps",
                "eager_steps",
                "host_reads",
                "graph_captures",
                "graph_capture_s",
                "graph_replays",
                "uncaptured_steps",
                "padded_rows",
                "eager_reasons",
            )
        },
    }
    if not args.skip_hf:
        hf_tokens, hf_s = hf_generate(model, prompts, args, stop_ids)
        result.update(hf_tok_s=round(hf_tokens / hf_s, 1), hf_s=round(hf_s, 2))
        result["ratio"] = round(result["engine_tok_s"] / result["hf_tok_s"], 2)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--min-prompt", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stop-fraction", type=float, default=0.02, help="0: only the fixed-length workload")
    parser.add_argument("--skip-hf", action="store_true", help="time only the engine")
    parser.add_argument("--enforce-eager", action="store_true", help="the engine never captures CUDA graphs")
    parser.add_argument("--decode-steps-per-sync", type=int, help="default: 8 on CUDA, 1 on the CPU")
    parser.add_argument("--profile-step", action="store_true", help="add step_profile (see the docstring)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU is visible")
    model = build_model(args.model, dtype, args.device)
    prompts = make_prompts(args, model.config.vocab_size)
    vocab = model.config.vocab_size
    stop_ids = list(range(4, 4 + max(1, round(args.stop_fraction * vocab))))
    result = {
        "model": args.model,
        "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
        "dtype": args.dtype,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "threads": args.threads,
        "rows": args.prompts * args.n,
        "max_new_tokens": args.new_tokens,
        "fixed_length": compare(model, prompts, args, stop_ids=[]),
    }
    if args.profile_step:
        result["step_profile"] = profile_decode_step(model, prompts, args)
        print(json.dumps({"step_profile": result["step_profile"]}), flush=True)  # kept if a later part dies
    if args.stop_fraction > 0:
        result["variable_length"] = compare(model, prompts, args, stop_ids)
    if args.device == "cuda":
        result["peak_gpu_memory_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
    json.dump(result, sys.stdout)
    print()


if __name__ == "__main__":
    main()
