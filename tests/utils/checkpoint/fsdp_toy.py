"""A tiny FSDP2 training setup shared by the checkpoint and merger tests, in-process (world 1) or spawned.

The toy model uses attention dropout and draws its batches from the global torch RNG, so an exact resume
needs the RNG states restored as well as the weights, optimizer and scheduler.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import datetime
import os
import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from hybridflow.utils.ports import find_free_port as free_port

VOCAB = 128
SHARDED = {"shard_one_rank": True}  # an fsdp_config that keeps FSDP2 even on a mesh of one rank


@contextlib.contextmanager
def gloo_group(rank: int = 0, world_size: int = 1, port: int | None = None):
    port = port or free_port()
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=120),  # a rank that dies fails the others instead of hanging them
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def tiny_config(**overrides):
    from transformers import Qwen2Config

    kwargs = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        attention_dropout=0.1,  # training draws from the torch RNG: resume must restore it
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return Qwen2Config(**{**kwargs, **overrides})


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"w{i}": i for i in range(4, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def build(world_size: int, seed: int = 0, model_cls_name: str = "Qwen2ForCausalLM", **config_overrides):
    """Seeded model, sharded per decoder layer then root; AdamW and a LambdaLR. Reseeds per rank after."""
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = getattr(transformers, model_cls_name)(tiny_config(**config_overrides)).train()
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + step))
    seed_all(seed * 1000 + dist.get_rank() + 1)  # ranks draw different batches
    return model, optimizer, scheduler


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def train_steps(model, optimizer, scheduler, n: int) -> list[float]:
    """``n`` steps on random token batches; returns this rank's losses."""
    losses = []
    for _ in range(n):
        input_ids = torch.randint(4, VOCAB, (2, 12))
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (collective), or the tensor itself: a one-rank fp32 model stays plain
    (``fsdp_config.shard_one_rank``)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def local_value(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor, or a plain tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def full_weights(model) -> dict[str, torch.Tensor]:
    """Unsharded CPU weights, copied (collective; non-empty on rank 0 only)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return copy.deepcopy(get_model_state_dict(model, options=options))


def full_optim_state(model, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    # deepcopy: the scalar "step" tensors are the optimizer's live ones, not copies.
    return copy.deepcopy(get_optimizer_state_dict(model, optimizer, options=options))


def rng_probe() -> tuple:
    """One draw from each RNG the manager restores."""
    return torch.rand(3), random.random(), float(np.random.rand())


def save_and_resume(ckpt: str, out: str | None = None) -> dict:
    """2 steps, save, 2 more steps; a fresh model loads the checkpoint and repeats them.

    Returns (and writes to ``out/rank{r}.pt`` if given) the losses, RNG probes and full state at the save.
    """
    from hybridflow.utils.checkpoint import FSDPCheckpointManager

    world_size, rank = dist.get_world_size(), dist.get_rank()
    model, optimizer, scheduler = build(world_size)
    train_steps(model, optimizer, scheduler, 2)
    manager = FSDPCheckpointManager(model, optimizer, scheduler, processing_class=tiny_tokenizer())
    manager.save_checkpoint(ckpt, global_step=2)
    weights, optim_state = full_weights(model), full_optim_state(model, optimizer)
    probe_saved = rng_probe()
    losses_saved = train_steps(model, optimizer, scheduler, 2)

    model2, optimizer2, scheduler2 = build(world_size, seed=7)  # different init and RNG until the load
    meta = FSDPCheckpointManager(model2, optimizer2, scheduler2).load_checkpoint(ckpt)
    probe_loaded = rng_probe()
    losses_loaded = train_steps(model2, optimizer2, scheduler2, 2)
    result = dict(
        meta=meta,
        probe_saved=probe_saved,
        probe_loaded=probe_loaded,
        losses_saved=losses_saved,
        losses_loaded=losses_loaded,
        weights=weights,
        optim_state=optim_state,
    )
    if out is not None:
        torch.save(result, Path(out) / f"rank{rank}.pt")
    return result


def _spawned_save_and_resume(rank: int, world_size: int, port: int, ckpt: str, out: str) -> None:
    torch.set_num_threads(1)
    with gloo_group(rank, world_size, port):
        save_and_resume(ckpt, out)


_WORLD2_RUN: Path | None = None


def world2_run() -> Path:
    """Run ``save_and_resume`` on 2 spawned ranks once per test session; returns its directory.

    ``dir/ckpt`` is the checkpoint, ``dir/rank{r}.pt`` each rank's results. Shared by the checkpoint and
    merger tests because spawning 2 torch processes costs several seconds.
    """
    global _WORLD2_RUN
    if _WORLD2_RUN is None:
        import torch.multiprocessing as mp

        run_dir = Path(tempfile.mkdtemp(prefix="hybridflow_ckpt_world2_"))
        atexit.register(shutil.rmtree, run_dir, ignore_errors=True)
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        args = (2, free_port(), str(run_dir / "ckpt"), str(run_dir))
        mp.spawn(_spawned_save_and_resume, args=args, nprocs=2, join=True)
        _WORLD2_RUN = run_dir
    return _WORLD2_RUN
