"""fp32 vs bf16 for FSDP2 training steps and log-prob forwards on this CPU.

    python benchmarks/precision.py [--hidden 512 --layers 10 --heads 8 --intermediate 1536 --vocab 32000
        --batch 4 --seq-len 128 --steps 3 --threads 1 --settings fp32 bf16_mixed bf16_master]

A Llama-architecture model from a transformers config (random init, tied embeddings; ~50M parameters
by default) is sharded with the workers' ``apply_fsdp2`` at world size 1 (gloo, in process) in three
settings: ``fp32``; ``bf16_mixed`` (FSDP2 MixedPrecisionPolicy, bf16 params / fp32 reduce, fp32 master
weights); ``bf16_master`` (``model_dtype=bf16``: the weights and AdamW state are bf16). Each setting runs
in a fresh process so ``peak_rss_mb`` is its own. Prints one JSON line per setting with seconds per
training step (forward + backward + AdamW) and per log-prob forward (no grad), tokens/s and GFLOP/s
counted as 6 * params * tokens (train) and 2 * params * tokens (forward), attention excluded. The first
step of each is a warm-up and is not timed. bf16 is fast only where the CPU has native bf16 matmuls
(``avx512_bf16`` / ``amx_bf16`` in /proc/cpuinfo); on AVX2 torch emulates them, several times slower.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import resource
import time
from concurrent.futures import ProcessPoolExecutor

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

SETTINGS = {
    "fp32": {},
    "bf16_mixed": {"mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"}},
    "bf16_master": {"model_dtype": "bf16"},
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=4, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    return parser.parse_args(argv)


def cpu_report() -> dict:
    """torch's CPU kernel level and the bf16 flags /proc/cpuinfo lists."""
    import torch

    from hybridflow.workers.fsdp_utils import cpu_has_fast_bf16, cpuinfo_flags

    try:
        with open("/proc/cpuinfo") as f:
            flags = cpuinfo_flags(f.read())
    except OSError:
        flags = set()
    return {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "avx512_bf16": "avx512_bf16" in flags,
        "amx_bf16": "amx_bf16" in flags,
        "cpu_has_fast_bf16": cpu_has_fast_bf16(),
    }


def build_model(args: argparse.Namespace, setting: str):
    """The sharded model of ``setting`` (same random init for every setting)."""
    import torch
    from omegaconf import OmegaConf
    from transformers import LlamaConfig, LlamaForCausalLM

    from hybridflow.workers.fsdp_utils import apply_fsdp2, build_device_mesh, to_dtype

    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=max(args.seq_len, 128),
        tie_word_embeddings=True,
    )
    fsdp_cfg = OmegaConf.create(SETTINGS[setting])
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(to_dtype(fsdp_cfg.get("model_dtype", "fp32")))
    return apply_fsdp2(model, build_device_mesh(1, "cpu"), fsdp_cfg)


@contextlib.contextmanager
def single_rank_group():
    """A world-size-1 gloo process group on a free local port."""
    import torch.distributed as dist

    from hybridflow.utils.ports import find_free_port

    port = find_free_port()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def seconds_per_call(fn, steps: int) -> float:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - start) / steps


def run_setting(args: argparse.Namespace, setting: str) -> dict:
    """Time one setting; runs in its own process (gloo group, peak RSS)."""
    import torch
    from omegaconf import OmegaConf

    from hybridflow.utils.torch_functional import logprobs_from_logits
    from hybridflow.workers.fsdp_utils import build_optimizer

    torch.set_num_threads(args.threads)
    with single_rank_group():
        model = build_model(args, setting)
        params = sum(p.numel() for p in model.parameters())
        optimizer = build_optimizer(model.parameters(), OmegaConf.create({"lr": 1e-5}))
        ids = torch.randint(
            0, args.vocab, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0)
        )

        def train_step() -> None:
            model.train()
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        @torch.no_grad()
        def log_prob_forward() -> None:  # as the actor's compute_log_prob: fp32 logits, gather
            model.eval()
            logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
            logprobs_from_logits(logits, ids[:, 1:])

        train_s = seconds_per_call(train_step, args.steps)
        forward_s = seconds_per_call(log_prob_forward, args.steps)
    tokens = args.batch * args.seq_len
    return {
        "benchmark": "precision",
        "setting": setting,
        "params_m": round(params / 1e6, 2),
        "batch": args.batch,
        "seq_len": args.seq_len,
        "threads": args.threads,
        "train_s_per_step": round(train_s, 4),
        "train_tok_s": round(tokens / train_s, 1),
        "train_gflop_s": round(6 * params * tokens / train_s / 1e9, 2),
        "forward_s": round(forward_s, 4),
        "forward_tok_s": round(tokens / forward_s, 1),
        "forward_gflop_s": round(2 * params * tokens / forward_s / 1e9, 2),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "torch": torch.__version__,
        **cpu_report(),
    }


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    results = []
    for setting in args.settings:
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
            result = pool.submit(run_setting, args, setting).result()
        print(json.dumps(result), flush=True)
        results.append(result)
    return results


if __name__ == "__main__":
    main()
