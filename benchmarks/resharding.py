"""Training -> generation weight resharding (HybridFlow §5, Table 2) on ``--world`` gloo processes.

For each model size and each layout pair (actor tensor_model_parallel_size t, rollout t_g) it runs three
ways of handing the actor's weights (TP over t, FSDP2 over dp = world / t) to generation engines of t_g
ranks, and prints one JSON line per (model, t, t_g, scheme):

- ``hybridflow``: hybridflow's resharding (:mod:`hybridflow.workers.rollout.engine.reshard`): one
  all_to_all per FSDP unit moves to each rank exactly the pieces of its generation shard it lacks;
- ``gather_all`` (DS-Chat-style): every rank gathers every whole parameter (ZeRO-3 ``GatheredParameters``
  over the model) and keeps its shard: the whole model is held at once;
- ``broadcast`` (OpenRLHF-style): rank 0 gathers each whole parameter and broadcasts it to every
  generation rank (in OpenRLHF those are separate vLLM GPUs; here the same processes stand in for them).

Per line: bytes each rank sent / received per sync (max over ranks), the sync's wall time (median of
``--repeats``, slowest rank), the peak extra memory per rank during the sync (buffers and gathered tensors
held at once, from the tensors' sizes; plus the engine's generation shard, which is freed again between
rollouts), and the paper's analytic numbers for the same M and layout (``paper_*``: communication volume,
peak memory and redundant memory of DS-Chat, HybridFlow-V and HybridFlow, p = p_g = 1).

    python benchmarks/resharding.py --world 4 --models 20m 100m --out resharding.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

MODELS = {  # Llama-architecture sizes whose heads, key-value heads, MLP and vocabulary divide by 4
    "20m": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                intermediate_size=704, vocab_size=32000),
    "100m": dict(hidden_size=768, num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=4,
                 intermediate_size=2048, vocab_size=32000),
    "400m": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=8,
                 intermediate_size=2816, vocab_size=32000),
}  # fmt: skip


def _actor(name: str, world: int, tp: int):
    """A randomly initialised Llama sharded as the actor trains it: TP over tp, FSDP2 over world / tp."""
    from omegaconf import OmegaConf
    from transformers import LlamaConfig, LlamaForCausalLM

    from hybridflow.workers.fsdp_utils import apply_fsdp2, build_device_mesh
    from hybridflow.workers.tensor_parallel import apply_tensor_parallel

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODELS[name], tie_word_embeddings=False)).requires_grad_(False)
    mesh = build_device_mesh(world, "cpu", tp)
    if tp > 1:
        apply_tensor_parallel(model, mesh)
    return apply_fsdp2(model, mesh, OmegaConf.create({}))


def _full(param) -> torch.Tensor:
    return param.full_tensor() if hasattr(param, "full_tensor") else param


def _gather_all(engine, module) -> tuple[int, int, int]:
    """DS-Chat-style: every rank gathers the whole model, then keeps its shard."""
    from hybridflow.workers.rollout.engine.parallel import take_shard

    held, received = [], 0
    for _, param in module.named_parameters():
        full = _full(param)
        held.append(full)
        received += (full.numel() - param.to_local().numel()) * full.element_size()
    for (name, _), full in zip(module.named_parameters(), held, strict=True):
        if name not in engine.ignored_weight_names:
            engine.load_weight(name, take_shard(name, full, engine.shard))
    peak = sum(t.numel() * t.element_size() for t in held)
    return 0, received, peak


def _broadcast(engine, module) -> tuple[int, int, int]:
    """OpenRLHF-style: rank 0 gathers each whole parameter and broadcasts it to every generation rank."""
    from hybridflow.workers.rollout.engine.parallel import take_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    sent = received = peak = 0
    for name, param in module.named_parameters():
        full = _full(param)  # training side: gather the whole parameter (a collective)
        nbytes = full.numel() * full.element_size()
        dist.broadcast(full, src=0)
        sent += nbytes * (world - 1) if rank == 0 else 0
        received += 0 if rank == 0 else nbytes
        peak = max(peak, nbytes)
        if name not in engine.ignored_weight_names:
            engine.load_weight(name, take_shard(name, full, engine.shard))
    return sent, received, peak


def _hybridflow(engine, module, layout, rank) -> tuple[int, int, int]:
    from hybridflow.workers.rollout.engine.reshard import reshard_weights
    from hybridflow.workers.rollout.engine.weight_sync import sync_weights

    stats = sync_weights(engine, module) if layout.trivial else reshard_weights(engine, module, layout, rank)
    return stats.sent_bytes, stats.received_bytes, stats.peak_extra_bytes


def paper_table(model_bytes: int, t: int, dp: int, tg: int) -> dict[str, float]:
    """HybridFlow Table 2 (transition overhead per GPU, p = p_g = 1), in bytes: communication volume,
    peak memory of the generation weights, and memory redundant with the training shard."""
    m = model_bytes
    return {
        "paper_dschat_comm": (t * dp - 1) / (t * dp) * m,
        "paper_dschat_peak": m,
        "paper_dschat_redundant": m / (t * dp),
        "paper_hybridflow_v_comm": (t - 1) / t * m,
        "paper_hybridflow_v_peak": m,
        "paper_hybridflow_v_redundant": m / t,
        "paper_hybridflow_comm": (t - tg) / (tg * t) * m if tg <= t else 0.0,
        "paper_hybridflow_peak": m / tg,
        "paper_hybridflow_redundant": 0.0,
        "paper_openrlhf_comm": m,  # each generation GPU receives the whole model, on GPUs of its own
        "paper_openrlhf_redundant": m,  # a second full copy lives on the generation GPUs
    }


def _max_over_ranks(values: list[float]) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def _measure(name: str, world: int, t: int, tg: int, repeats: int, rank: int, out) -> None:
    from hybridflow.workers.fsdp_workers import generation_shard
    from hybridflow.workers.rollout.engine import EngineModel
    from hybridflow.workers.rollout.engine.reshard import ReshardLayout

    module = _actor(name, world, t)
    layout = ReshardLayout(world, t, tg)
    shard = generation_shard(layout, rank)
    model_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    schemes = {
        "hybridflow": lambda e: _hybridflow(e, module, layout, rank),
        "gather_all": lambda e: _gather_all(e, module),
        "broadcast": lambda e: _broadcast(e, module),
    }
    for scheme, sync in schemes.items():
        engine = EngineModel.empty_like_hf_module(module, 64, shard=shard)
        sync(engine)  # warm-up: gloo connections, allocator
        times = []
        for _ in range(repeats):
            engine.release()  # as between rollouts: the engine's weights are re-created by the sync
            dist.barrier()
            start = time.perf_counter()
            sent, received, peak = sync(engine)
            times.append(time.perf_counter() - start)
        seconds, sent, received, peak = _max_over_ranks([statistics.median(times), sent, received, peak])
        engine_bytes = _max_over_ranks([engine.parameter_bytes()])[0]
        if rank == 0:
            row = {
                "benchmark": "resharding",
                "model": name,
                "params": sum(p.numel() for p in module.parameters()),
                "model_bytes": model_bytes,
                "world": world,
                "train_tp": t,
                "train_dp": world // t,
                "gen_tp": tg,
                "scheme": scheme,
                "sent_bytes": int(sent),
                "received_bytes": int(received),
                "sync_s": round(seconds, 4),
                "peak_extra_bytes": int(peak),
                "engine_bytes": int(engine_bytes),
                **{k: int(v) for k, v in paper_table(model_bytes, t, world // t, tg).items()},
            }
            print(json.dumps(row), flush=True)
            if out is not None:
                out.write(json.dumps(row) + "\n")
                out.flush()
        del engine


def _rank_main(rank: int, world: int, port: int, args) -> None:
    import datetime

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )  # fmt: skip
    sizes = [s for s in (1, 2, 4, 8) if s <= world and world % s == 0]
    out = open(args.out, "a") if rank == 0 and args.out else None
    try:
        for name in args.models:
            for t in sizes:
                for tg in sizes:
                    if t % tg == 0 or tg % t == 0:
                        _measure(name, world, t, tg, args.repeats, rank, out)
    finally:
        if out is not None:
            out.close()
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:

    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--models", nargs="+", default=["20m"], choices=sorted(MODELS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="also append the JSON lines to this file")
    args = parser.parse_args(argv)
    from hybridflow.utils.ports import find_free_port

    port = find_free_port()
    mp.spawn(_rank_main, args=(args.world, port, args), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
