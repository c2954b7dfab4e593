"""Where the actor update's time goes (issue 47): one rank's ``update_policy`` in this process, split
into its parts, and torch.profiler's busiest operators. Prints JSON lines.

    python benchmarks/update_profile.py [--workload A|B] [--reps 8] [--threads 1] [--model DIR]

The batch is the vs_trl workload's (``../shared/peers/vs_trl.py``): 16 prompts x 4 samples = 64 rows of
a ~22-token chat prompt; A's responses ~4 tokens (a warm-started model's answers, 32 at most), B's ~104
(a random model, 128 at most); one mini-batch, one micro-batch, one PPO epoch, as vs_trl runs it (the
on-policy shortcut: the update's forward is the old policy's). Without ``--model`` a random Qwen2 of the
peer's shape (hidden 256, 4 layers, 4/2 heads, MLP 688, vocabulary 512) is built. The model is built as
one worker holds it in ``main_ppo --workers 1`` (a world of 1, gloo): a plain module (``--variant plain``,
the default: ``fsdp_config.shard_one_rank=false``), or FSDP2-sharded over the one rank (``fsdp``).

Parts (seconds per update, the mean of ``--reps`` after one warm-up): ``forward`` (the root module's
forward: FSDP's pre/post hooks, attention, MLP, logits), ``log_probs`` (log-softmax and gather on the
logits), ``loss`` (policy loss and metrics), ``backward``, ``grad_norm`` (clip_grad_norm_ over the (DTensor)
shards), ``optimizer`` (the fused AdamW step and zero_grad), ``other`` (the rest: splitting, packing,
host reads). The ``ops`` line lists the operators with the most self CPU time in one profiled update.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import tempfile
import time
from collections import defaultdict

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

WORKLOADS = {"A": (4, 32), "B": (104, 128)}  # (mean response tokens, most response tokens)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="A")
    parser.add_argument("--reps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", help="HF model directory (default: a random Qwen2 of the peer's shape)")
    parser.add_argument("--no-ops", action="store_true", help="skip the torch.profiler operator table")
    parser.add_argument(
        "--variant",
        choices=["fsdp", "fsdp_keep", "plain"],
        default="plain",
        help="plain: as the worker builds it (no FSDP on one rank); fsdp: FSDP2 on the one rank "
        "(fsdp_config.shard_one_rank=true); fsdp_keep: that with reshard_after_forward=false",
    )
    return parser.parse_args(argv)


def build_model_dir(out: str) -> str:
    import transformers

    config = transformers.Qwen2Config(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    import torch

    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(out)
    return out


def build_batch(workload: str, rows: int = 64, prompt_len: int = 64):
    """Rows ``[prompt, left-padded | response, right-padded]`` with the workload's lengths, GRPO groups
    of 4 sharing a prompt, advantages of mean 0."""
    import torch

    from hybridflow import keys
    from hybridflow.protocol import DataProto

    mean_len, max_len = WORKLOADS[workload]
    gen = torch.Generator().manual_seed(0)
    ids = torch.zeros(rows, prompt_len + max_len, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row in range(rows):
        if row % 4 == 0:
            p = int(torch.randint(18, 27, (), generator=gen))
            prompt = torch.randint(4, 500, (p,), generator=gen)
        n = int(min(max_len, max(1, mean_len + torch.randint(-3, 4, (), generator=gen))))
        ids[row, prompt_len - p : prompt_len] = prompt
        ids[row, prompt_len : prompt_len + n] = torch.randint(4, 500, (n,), generator=gen)
        mask[row, prompt_len - p : prompt_len + n] = 1
    advantages = torch.randn(rows, 1, generator=gen).expand(rows, max_len).contiguous()
    return DataProto.from_dict(
        {
            keys.INPUT_IDS: ids,
            keys.ATTENTION_MASK: mask,
            keys.POSITION_IDS: (mask.cumsum(-1) - 1).clamp(min=0),
            keys.RESPONSES: ids[:, prompt_len:],
            keys.RESPONSE_MASK: mask[:, prompt_len:],
            keys.ADVANTAGES: advantages * mask[:, prompt_len:],
        },
        meta_info={"temperature": 1.0, "global_steps": 1},
    )


class PartTimer:
    """Wall seconds spent inside named callables (outermost calls only, so parts never double count)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._depth = 0

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            if self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
                self._depth -= 1

        return timed


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from hybridflow.trainer.config import load_config
    from hybridflow.workers.actor import dp_actor
    from hybridflow.workers.fsdp_utils import build_device_mesh, build_optimizer
    from hybridflow.workers.model_builder import build_fsdp_module

    torch.set_num_threads(args.threads)
    work = tempfile.mkdtemp(prefix="update_profile_")
    model_dir = args.model or build_model_dir(os.path.join(work, "model"))
    dist.init_process_group("gloo", init_method=f"file://{work}/store", rank=0, world_size=1)
    try:
        mesh = build_device_mesh(1, "cpu")
        config = load_config(
            [
                f"actor_rollout_ref.model.path={model_dir}",
                "actor_rollout_ref.actor.ppo_mini_batch_size=16",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64",
                "actor_rollout_ref.rollout.n=4",
                "actor_rollout_ref.actor.optim.lr=1e-5",
            ]
        )
        actor_cfg = config.actor_rollout_ref.actor
        fsdp_cfg = OmegaConf.merge(
            actor_cfg.fsdp_config,
            {"reshard_after_forward": args.variant != "fsdp_keep", "shard_one_rank": args.variant != "plain"},
        )
        module = build_fsdp_module(config.actor_rollout_ref.model, fsdp_cfg, mesh)
        optimizer = build_optimizer(module.parameters(), actor_cfg.optim)
        cfg = OmegaConf.merge(actor_cfg, {"ppo_mini_batch_size": 64})  # rows per rank, after n
        actor = dp_actor.DataParallelPPOActor(
            cfg, module, optimizer, response_length=WORKLOADS[args.workload][1]
        )
        data = build_batch(args.workload)
        timer = PartTimer()
        originals = _instrument(timer, actor, dp_actor)
        actor.update_policy(data)  # warm-up
        timer.seconds.clear()
        walls = []
        for _ in range(args.reps):
            start = time.perf_counter()
            actor.update_policy(data)
            walls.append(time.perf_counter() - start)
        wall = sum(walls) / len(walls)
        parts = {k: round(v / args.reps, 4) for k, v in sorted(timer.seconds.items())}
        parts["other"] = round(wall - sum(parts.values()), 4)
        tokens = int(data.batch["attention_mask"].sum())
        print(json.dumps(_machine(args, tokens)))
        print(json.dumps({"update_s": round(wall, 4), "min_s": round(min(walls), 4), "parts_s": parts}))
        if not args.no_ops:
            _restore(originals)
            print(json.dumps({"ops": _top_ops(actor, data)}))
    finally:
        dist.destroy_process_group()


def _instrument(timer: PartTimer, actor, dp_actor_module) -> list:
    """Wrap the update's parts (each restored by :func:`_restore`)."""
    import torch

    originals = []

    def patch(owner, name: str, label: str) -> None:
        fn = getattr(owner, name)
        originals.append((owner, name, fn))
        setattr(owner, name, timer.wrap(label, fn))

    patch(actor.module, "forward", "forward")
    patch(dp_actor_module, "logprobs_from_logits", "log_probs")
    patch(dp_actor_module, "compute_policy_loss", "loss")
    patch(torch.Tensor, "backward", "backward")
    patch(dp_actor_module, "grad_norm_and_clip", "grad_norm")
    patch(actor.optimizer, "step", "optimizer")
    patch(actor.optimizer, "zero_grad", "optimizer")
    return originals


def _restore(originals: list) -> None:
    for owner, name, fn in reversed(originals):
        setattr(owner, name, fn)


def _top_ops(actor, data, top: int = 15) -> list[dict]:
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        actor.update_policy(data)
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return [{"op": e.key, "calls": e.count, "self_ms": round(e.self_cpu_time_total / 1e3, 2)} for e in rows]


def _machine(args, tokens: int) -> dict:
    model = "unknown"
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    return {
        "benchmark": "update_profile",
        "workload": args.workload,
        "cpu": model,
        "avx512": "avx512f" in flags,
        "cores": os.cpu_count(),
        "threads": args.threads,
        "variant": args.variant,
        "tokens": tokens,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


if __name__ == "__main__":
    main()
