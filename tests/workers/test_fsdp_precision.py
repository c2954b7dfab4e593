"""Precision and memory settings of the FSDP2 workers, on the tiny model at world size 1 in process:
bf16 mixed precision (``fsdp_config.mixed_precision``), bf16 master weights (``fsdp_config.model_dtype``)
and gradient checkpointing (``model.enable_gradient_checkpointing``)."""

import os

import pytest
import torch
from omegaconf import OmegaConf

from hybridflow import keys
from hybridflow.protocol import DataProto
from hybridflow.workers.actor.dp_actor import DataParallelPPOActor
from hybridflow.workers.fsdp_utils import (
    FAST_BF16_CPU_FLAGS,
    build_device_mesh,
    build_optimizer,
    cpu_has_fast_bf16,
    cpuinfo_flags,
)
from hybridflow.workers.model_builder import build_fsdp_module
from tests.utils.checkpoint.fsdp_toy import gloo_group

BF16_MIXED = {"mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"}}
BF16_MASTER = {"model_dtype": "bf16"}
# |Δ log-prob| of bf16 compute against fp32 on the response tokens of _batch(), measured on the tiny
# model: mean 6.3e-4, max 1.9e-3 (bf16 mixed precision and bf16 master weights alike). Bounds ~5x that.
MAX_MEAN_LOGPROB_DIFF = 3e-3
MAX_LOGPROB_DIFF = 1e-2
PROMPT_LEN, RESPONSE_LEN = 10, 8
LOG_PROB_BATCHING = OmegaConf.create(
    {
        "log_prob_micro_batch_size_per_gpu": 2,
        "log_prob_use_dynamic_bsz": False,
        "log_prob_max_token_len_per_gpu": None,
    }
)


@pytest.fixture
def mesh():
    with gloo_group():
        yield build_device_mesh(1, "cpu")


def _module(model_dir: str, mesh, fsdp: dict | None = None, checkpointing: bool = False):
    model_cfg = OmegaConf.create({"path": model_dir, "enable_gradient_checkpointing": checkpointing})
    return build_fsdp_module(model_cfg, OmegaConf.create({"shard_one_rank": True, **(fsdp or {})}), mesh)


def _batch() -> DataProto:
    """4 rows of 10 prompt + 8 response tokens; the first prompt is left-padded by 3."""
    ids = torch.randint(4, 200, (4, PROMPT_LEN + RESPONSE_LEN), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    return DataProto.from_dict(
        {
            keys.INPUT_IDS: ids,
            keys.ATTENTION_MASK: mask,
            keys.POSITION_IDS: (mask.cumsum(-1) - 1).clamp(min=0),
            keys.RESPONSES: ids[:, PROMPT_LEN:],
        }
    )


def _log_probs(module) -> torch.Tensor:
    """(4, RESPONSE_LEN) through the actor's log-prob path."""
    log_probs, _ = DataParallelPPOActor(None, module).compute_log_prob(_batch(), LOG_PROB_BATCHING)
    return log_probs


def _loss_and_grads(module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Next-token loss of _batch() in train mode, backward; the loss and each parameter's local grad."""
    batch = _batch().batch
    module.train()
    labels = batch[keys.INPUT_IDS].masked_fill(batch[keys.ATTENTION_MASK] == 0, -100)
    loss = module(
        input_ids=batch[keys.INPUT_IDS],
        attention_mask=batch[keys.ATTENTION_MASK],
        position_ids=batch[keys.POSITION_IDS],
        labels=labels,
        use_cache=False,
    ).loss
    loss.backward()
    return loss.detach(), {name: p.grad.to_local() for name, p in module.named_parameters()}


def _local_weights(module) -> dict[str, torch.Tensor]:
    return {name: p.to_local().detach().clone() for name, p in module.named_parameters()}


def _unchanged_by_one_adamw_step(module) -> set[str]:
    """Names of the parameters one AdamW step (lr 1e-3) leaves bitwise equal; dtypes must not change."""
    before = _local_weights(module)
    build_optimizer(module.parameters(), OmegaConf.create({"lr": 1e-3})).step()
    after = _local_weights(module)
    assert all(after[n].dtype == before[n].dtype for n in before)
    return {n for n in before if torch.equal(after[n], before[n])}


def _count_mlp_calls(module) -> list[int]:
    """Runs of the first decoder layer's MLP: 2 per training step when checkpointing recomputes it.
    Counted on entry to ``forward``: the recompute stops as soon as the last saved tensor is rebuilt
    (torch's checkpoint early stop), before the MLP returns, so a forward hook would see one run."""
    calls, mlp = [0], module.model.layers[0].mlp
    forward = mlp.forward

    def counted(*args, **kwargs):
        calls[0] += 1
        return forward(*args, **kwargs)

    mlp.forward = counted
    return calls


def test_cpuinfo_flags_read_only_the_flags_line():
    cpuinfo = (
        "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16\n"
        "vmx flags\t: ept vpid amx_bf16\nbugs\t\t: spectre_v1\n\n"
        "processor\t: 1\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16\n"
    )
    assert cpuinfo_flags(cpuinfo) == {"fpu", "sse2", "avx2", "avx512f", "avx512_bf16"}
    assert cpuinfo_flags(cpuinfo) & FAST_BF16_CPU_FLAGS == {"avx512_bf16"}
    assert not cpuinfo_flags("flags\t\t: fpu avx2 avx512f avx512bw\n") & FAST_BF16_CPU_FLAGS
    assert cpuinfo_flags("") == set()


def test_cpu_has_fast_bf16_agrees_with_proc_cpuinfo():  # HYBRIDFLOW_DEVICE=cpu: the CPU's answer
    try:
        with open("/proc/cpuinfo") as f:
            flags = cpuinfo_flags(f.read())
    except OSError:
        flags = set()
    assert cpu_has_fast_bf16() == bool(flags & FAST_BF16_CPU_FLAGS)
    if torch.backends.cpu.get_cpu_capability() == "AVX2" and "ATEN_CPU_CAPABILITY" not in os.environ:
        assert not cpu_has_fast_bf16()  # no AVX-512 at all; every AMX CPU has AVX-512 too


def test_bf16_mixed_precision_computes_in_bf16_on_fp32_master_weights(tiny_model_dir, mesh):
    fp32 = _module(tiny_model_dir, mesh)
    mixed = _module(tiny_model_dir, mesh, BF16_MIXED)
    assert {p.dtype for p in mixed.parameters()} == {torch.float32}  # the sharded master weights

    reference, log_probs = _log_probs(fp32), _log_probs(mixed)
    assert log_probs.dtype == torch.float32
    diff = (log_probs - reference).abs()
    assert diff.max().item() > 1e-5  # bf16 compute did happen: fp32 twice is bitwise equal
    assert diff.mean().item() <= MAX_MEAN_LOGPROB_DIFF
    assert diff.max().item() <= MAX_LOGPROB_DIFF

    loss, grads = _loss_and_grads(mixed)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads.values())
    assert _unchanged_by_one_adamw_step(mixed) == set()


@pytest.mark.parametrize("fsdp", [{}, BF16_MIXED], ids=["fp32", "bf16_mixed"])
def test_gradient_checkpointing_gives_the_same_loss_and_gradients(tiny_model_dir, mesh, fsdp):
    plain = _module(tiny_model_dir, mesh, fsdp)
    checkpointed = _module(tiny_model_dir, mesh, fsdp, checkpointing=True)
    assert checkpointed.is_gradient_checkpointing and not plain.is_gradient_checkpointing
    plain_calls, checkpointed_calls = _count_mlp_calls(plain), _count_mlp_calls(checkpointed)

    loss, grads = _loss_and_grads(plain)
    checkpointed_loss, checkpointed_grads = _loss_and_grads(checkpointed)
    assert plain_calls == [1] and checkpointed_calls == [2]  # the backward recomputed the layer
    torch.testing.assert_close(checkpointed_loss, loss, rtol=1e-6, atol=1e-7)
    assert checkpointed_grads.keys() == grads.keys()
    for name, grad in checkpointed_grads.items():
        assert grad.dtype == torch.float32 and torch.isfinite(grad).all(), name
        torch.testing.assert_close(grad, grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_bf16_master_weights_load_and_train(tiny_model_dir, mesh):
    reference = _log_probs(_module(tiny_model_dir, mesh))
    module = _module(tiny_model_dir, mesh, BF16_MASTER)
    assert {p.dtype for p in module.parameters()} == {torch.bfloat16}

    diff = (_log_probs(module) - reference).abs()
    assert diff.mean().item() <= MAX_MEAN_LOGPROB_DIFF
    assert diff.max().item() <= MAX_LOGPROB_DIFF

    loss, grads = _loss_and_grads(module)
    assert torch.isfinite(loss)
    assert all(g.dtype == torch.bfloat16 and torch.isfinite(g).all() for g in grads.values())
    # AdamW's first step moves each weight by ~lr = 1e-3. The RMSNorm weights start at 1.0, where bf16's
    # spacing is 2^-8 below and 2^-7 above: the update rounds away. The fp32 master weights keep it.
    norms = {n for n, _ in module.named_parameters() if n.endswith("norm.weight")}
    assert norms and _unchanged_by_one_adamw_step(module) == norms


def test_auto_precision_follows_the_device(monkeypatch):
    from hybridflow.workers import fsdp_utils
    from hybridflow.workers.rollout import engine_rollout

    for fast in (True, False):
        monkeypatch.setattr(fsdp_utils, "has_fast_bf16", lambda kind=None, fast=fast: fast)
        monkeypatch.setattr(engine_rollout, "has_fast_bf16", lambda kind=None, fast=fast: fast)
        policy = fsdp_utils.mixed_precision_policy("auto", "cpu")
        assert (policy is not None and policy.param_dtype == torch.bfloat16) == fast
        assert engine_rollout.engine_dtype("auto", "cpu") == (torch.bfloat16 if fast else torch.float32)
    with pytest.raises(ValueError, match="rollout.dtype"):
        engine_rollout.engine_dtype("fp8", "cpu")
    assert cpuinfo_flags("") == set()


def test_unset_precision_is_the_devices_default():
    # verl's default on GPU: bf16 compute, fp32 master weights and gradient reduction; CPU stays fp32.
    from hybridflow.workers import fsdp_utils
    from hybridflow.workers.rollout import engine_rollout

    cuda = fsdp_utils.mixed_precision_policy(None, "cuda")
    assert cuda.param_dtype == torch.bfloat16 and cuda.reduce_dtype == torch.float32
    assert fsdp_utils.mixed_precision_policy(None, "cpu") is None
    fp32_on_cuda = fsdp_utils.mixed_precision_policy({"param_dtype": "fp32", "reduce_dtype": "fp32"}, "cuda")
    assert fp32_on_cuda.param_dtype == torch.float32
    assert engine_rollout.engine_dtype(None, "cuda") == torch.bfloat16
    assert engine_rollout.engine_dtype(None, "cpu") == torch.float32
