"""Ulysses sequence parallelism: peak memory per rank, all-to-all volume and step time on long sequences.

For each world size and SP size (dp = world / sp) it spawns ``world`` gloo processes; each builds the actor
(FSDP2 over the world, ``ulysses_sequence_parallel_size`` = sp) and runs one PPO update of one sequence
per dp rank (``use_dynamic_bsz`` false, one sequence per micro-batch) of ``--tokens`` tokens (a
64-token prompt + the response). Printed per layout, one JSON line:

- ``peak_step_mib``: the largest rise of the process's resident memory above its level before the step
  (sampled every 2 ms by a thread), max over ranks: the step's activations, gradients and temporaries;
- ``step_s``: the update's wall time (slowest rank; the ranks share the machine's cores);
- ``a2a_sent_mib_per_layer``: bytes one rank sent to the others through the all-to-alls, per decoder
  layer and pass (forward; the backward sends as much again), measured, beside the DeepSpeed-Ulysses
  paper's ``paper_a2a_mib_per_layer`` = (sp - 1) / sp x (q + k + v + out) of the rank's L = S / sp
  tokens (the paper's 4 N h / P per device, with the kv heads of grouped attention, repeated to sp).

The model is a random Qwen2 (``--hidden`` wide, ``--layers`` deep) whose ``max_position_embeddings``
covers the sequence. Run::

    python benchmarks/sp_memory.py --layouts 2:1 2:2 4:1 4:2 4:4 --tokens 8192
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time


def _rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakSampler:
    """The largest resident-memory rise above the level at start, sampled on a thread."""

    def __init__(self, every_s: float = 0.002) -> None:
        self.every_s, self.base, self.peak, self._stop = every_s, _rss_bytes(), 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_bytes() - self.base)
            time.sleep(self.every_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_bytes() - self.base)


def build_model(path: str, args) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        intermediate_size=args.hidden * 11 // 4,
        vocab_size=args.vocab,
        max_position_embeddings=max(8192, args.tokens),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path)


def _sequence(tokens: int, vocab: int, rows: int):
    import torch

    from hybridflow import keys
    from hybridflow.protocol import DataProto

    prompt = 64
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(4, vocab, (rows, tokens), generator=gen)
    mask = torch.ones_like(ids)
    responses = ids[:, prompt:]
    return DataProto.from_dict(
        {
            keys.INPUT_IDS: ids,
            keys.ATTENTION_MASK: mask,
            keys.POSITION_IDS: mask.cumsum(-1) - 1,
            keys.RESPONSES: responses,
            keys.RESPONSE_MASK: torch.ones_like(responses),
            keys.ADVANTAGES: torch.randn(rows, responses.shape[1], generator=gen),
        }
    )


def _count_all_to_all():
    """Wrap ``torch.distributed.all_to_all`` to count the bytes this rank sends to other ranks."""
    import torch.distributed as dist

    sent = {"bytes": 0}
    original = dist.all_to_all

    def counting(outputs, inputs, group=None, async_op=False):
        me = dist.get_rank(group)
        sent["bytes"] += sum(t.numel() * t.element_size() for i, t in enumerate(inputs) if i != me)
        return original(outputs, inputs, group=group, async_op=async_op)

    dist.all_to_all = counting
    return sent


def _rank(rank: int, world: int, sp: int, port: int, model_dir: str, args, out: str) -> None:
    import torch
    from omegaconf import OmegaConf

    from hybridflow import keys
    from hybridflow.workers.actor.dp_actor import DataParallelPPOActor
    from hybridflow.workers.fsdp_utils import build_device_mesh
    from hybridflow.workers.model_builder import build_training_parts
    from hybridflow.workers.ulysses import enable_sequence_parallel

    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        parts = build_training_parts(
            OmegaConf.create({"path": model_dir}),
            OmegaConf.create({}),
            OmegaConf.create({"lr": 1e-5}),
            build_device_mesh(world, "cpu"),
        )
        enable_sequence_parallel(parts.module, sp, world, "cpu")
        config = OmegaConf.create(
            {
                "ppo_mini_batch_size": 1,
                "ppo_micro_batch_size_per_gpu": 1,
                "use_dynamic_bsz": False,
                "ppo_max_token_len_per_gpu": None,
                "ppo_epochs": 1,
                "shuffle": False,
                "grad_clip": 1.0,
                "clip_ratio": 0.2,
                "clip_ratio_low": 0.2,
                "clip_ratio_high": 0.2,
                "clip_ratio_c": 3.0,
                "loss_agg_mode": "token-mean",
                "loss_scale_factor": None,
                "entropy_coeff": 0.0,
                "use_kl_loss": False,
                "policy_loss": {"loss_mode": "vanilla"},
            }
        )
        actor = DataParallelPPOActor(config, parts.module, parts.optimizer, response_length=args.tokens)
        warm = _sequence(128, args.vocab, 1)
        actor.update_policy(warm)  # optimizer state and lazy buffers exist before the measured step
        data = _sequence(args.tokens, args.vocab, 1)
        data.batch[keys.OLD_LOG_PROBS] = torch.zeros_like(data.batch[keys.ADVANTAGES])
        sent = _count_all_to_all()
        torch.distributed.barrier()
        with PeakSampler() as sampler:
            start = time.perf_counter()
            actor.update_policy(data)
            seconds = time.perf_counter() - start
        result = {"peak": sampler.peak, "seconds": seconds, "sent": sent["bytes"]}
        with open(os.path.join(out, f"rank{rank}.json"), "w") as handle:
            json.dump(result, handle)
    finally:
        torch.distributed.destroy_process_group()


def _free_port() -> int:
    from hybridflow.utils.ports import find_free_port

    return find_free_port()


def run_layout(world: int, sp: int, model_dir: str, args) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_rank, args=(world, sp, _free_port(), model_dir, args, out), nprocs=world, join=True)
        ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(world)]
    local = -(-args.tokens // sp)
    head_dim = args.hidden // args.heads
    elements = local * head_dim * (2 * args.heads + 2 * max(args.kv_heads, sp))  # q, out, k, v
    paper = (sp - 1) / sp * elements * 4
    per_layer_pass = max(r["sent"] for r in ranks) / (2 * args.layers)  # forward + backward
    return {
        "benchmark": "sp_memory",
        "world": world,
        "sp": sp,
        "dp": world // sp,
        "tokens": args.tokens,
        "model": f"qwen2 h{args.hidden} L{args.layers} nh{args.heads} nkv{args.kv_heads} V{args.vocab}",
        "peak_step_mib": round(max(r["peak"] for r in ranks) / 2**20, 1),
        "step_s": round(max(r["seconds"] for r in ranks), 2),
        "a2a_sent_mib_per_layer": round(per_layer_pass / 2**20, 3),
        "paper_a2a_mib_per_layer": round(paper / 2**20, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", nargs="+", default=["2:1", "2:2", "4:1", "4:2"], help="world:sp")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "model")
        build_model(model_dir, args)
        for layout in args.layouts:
            world, sp = map(int, layout.split(":"))
            print(json.dumps(run_layout(world, sp, model_dir, args)), flush=True)


if __name__ == "__main__":
    main()
