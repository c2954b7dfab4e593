"""Tensor-parallel training (DTensor TP over ``tp`` composed with FSDP2 over ``dp``) gives the log-probs,
entropies, loss, gradients and gradient norm of the unsharded model: the float64 objective of the whole
mini-batch, computed here by hand. Checked on 2 gloo processes (t = 2) and on 4 (t = 4; t = 2 with
dp = 2). With dp = 1 the loss is seq-mean-token-sum-norm, which scales with the dp degree FSDP averages
over: counting the world instead (each row once per TP rank) doubles the gradient. With dp = 2 it is
token-mean over rows of 6, 1, 3 and 4 response tokens: token counts summed over the wrong ranks change
the normalisation."""

import os

import pytest
import torch
from omegaconf import OmegaConf

from hybridflow import keys
from hybridflow.workers.actor.dp_actor import DataParallelPPOActor
from hybridflow.workers.fsdp_utils import build_device_mesh, grad_norm_and_clip
from hybridflow.workers.model_builder import build_fsdp_module
from tests.utils.checkpoint.fsdp_toy import free_port, gloo_group
from tests.workers.test_loss_normalisation import PROMPT_LEN, RESPONSE_LEN, _actor_config, _batch

BATCHING = {
    "log_prob_micro_batch_size_per_gpu": 1,
    "log_prob_use_dynamic_bsz": False,
    "log_prob_max_token_len_per_gpu": None,
}


def build_qwen3_dir(path) -> str:
    """A random tiny Qwen3 (per-head q/k RMSNorm, 4 heads, 2 key-value heads, untied) saved as an HF dir."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=256,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(path)
    return str(path)


def _mode(world: int, tp: int) -> str:
    return "token-mean" if world // tp > 1 else "seq-mean-token-sum-norm"


def _run(model_dir: str, world: int, tp: int, out_dir: str) -> None:
    """This rank's share of one mini-batch under layout (world / tp, tp); the results of each TP group's
    first rank go to ``out_dir``."""
    rank, dp = torch.distributed.get_rank(), world // tp
    mesh = build_device_mesh(world, "cpu", tp)
    module = build_fsdp_module(OmegaConf.create({"path": model_dir}), OmegaConf.create({}), mesh)
    rows = list(range(rank // tp, 4, dp))  # dp rank d holds rows d, d + dp, ...
    actor = DataParallelPPOActor(
        _actor_config(_mode(world, tp), len(rows), 1),
        module,
        torch.optim.SGD(module.parameters(), lr=0.0),
        response_length=RESPONSE_LEN,
    )
    data = _batch().select_idxs(torch.tensor(rows))
    log_probs, entropy = actor.compute_log_prob(data, OmegaConf.create(BATCHING), calculate_entropy=True)
    data.batch[keys.OLD_LOG_PROBS] = log_probs
    module.train()
    actor.accumulate_gradients(data, temperature=1.0, metrics={})
    grads = {name: p.grad.full_tensor() for name, p in module.named_parameters()}
    norm = grad_norm_and_clip(module, max_norm=1e9)
    if rank % tp == 0:
        result = {"rows": rows, "log_probs": log_probs, "entropy": entropy, "grads": grads, "norm": norm}
        torch.save(result, os.path.join(out_dir, f"t{tp}_rank{rank}.pt"))


def _full_state(parts) -> tuple[dict, dict]:
    """Whole weights and AdamW state of a (TP/FSDP-sharded) training model, on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    weights = {name: p.full_tensor().clone() for name, p in parts.module.named_parameters()}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
    optim = get_optimizer_state_dict(parts.module, parts.optimizer, options=options)["state"]
    return weights, {name: {k: v.clone() for k, v in s.items()} for name, s in optim.items()}


def _checkpoint_round_trip(model_dir: str, world: int, out_dir: str) -> None:
    """One AdamW step with t = 2, save; load into fresh t = 2 and FSDP-only (t = 1) models; both hold
    the saved weights and optimizer state, and the next step from the t = 2 copy equals the original's."""
    from hybridflow.utils.checkpoint import FSDPCheckpointManager
    from hybridflow.workers.model_builder import build_training_parts

    def parts(tp):
        optim = OmegaConf.create({"lr": 1e-2})
        return build_training_parts(
            OmegaConf.create({"path": model_dir}),
            OmegaConf.create({}),
            optim,
            build_device_mesh(world, "cpu", tp),
        )

    def step(p):
        actor = DataParallelPPOActor(_actor_config("token-mean", 4, 2), p.module, p.optimizer)
        data = _batch()
        data.batch[keys.OLD_LOG_PROBS] = actor.compute_log_prob(data, OmegaConf.create(BATCHING))[0]
        p.module.train()
        actor.update_policy(data)

    ckpt = os.path.join(out_dir, "ckpt")
    original = parts(2)
    step(original)
    FSDPCheckpointManager(original.module, original.optimizer, original.lr_scheduler).save_checkpoint(ckpt, 1)
    saved = _full_state(original)
    for tp in (2, 1):
        loaded = parts(tp)
        FSDPCheckpointManager(loaded.module, loaded.optimizer, loaded.lr_scheduler).load_checkpoint(ckpt)
        got = _full_state(loaded)
        if tp == 2:
            step(original), step(loaded)
            got = (got, _full_state(original)[0], _full_state(loaded)[0])
        if torch.distributed.get_rank() == 0:
            torch.save(got, os.path.join(out_dir, f"loaded_t{tp}.pt"))
    if torch.distributed.get_rank() == 0:
        torch.save(saved, os.path.join(out_dir, "saved.pt"))


def _critic(model_dir: str, world: int, out_dir: str) -> None:
    """A t = 2 critic (token-classification LM, replicated value head): values and the gradient of
    their masked sum."""
    from hybridflow.workers.critic.dp_critic import forward_values

    mesh = build_device_mesh(world, "cpu", 2)
    module = build_fsdp_module(
        OmegaConf.create({"path": model_dir}), OmegaConf.create({}), mesh, "token_value"
    )
    values = forward_values(module, _batch())
    values.sum().backward()
    grads = {name: p.grad.full_tensor() for name, p in module.named_parameters()}
    if torch.distributed.get_rank() == 0:
        torch.save({"values": values.detach(), "grads": grads}, os.path.join(out_dir, "critic.pt"))


def _critic_reference(model_dir: str) -> dict:
    from hybridflow.workers.critic.dp_critic import forward_values
    from hybridflow.workers.model_builder import load_hf_model

    model = load_hf_model(OmegaConf.create({"path": model_dir}), "token_value", torch.float32).double()
    values = forward_values(model, _batch())
    values.sum().backward()
    return {"values": values.detach(), "grads": {n: p.grad for n, p in model.named_parameters()}}


def _shared_prompt_batch():
    """4 responses (3 tokens) to each of 2 prompts of 24 tokens: the actor's forward packs them."""
    from hybridflow.protocol import DataProto

    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(4, 200, (2, 24), generator=gen).repeat_interleave(4, dim=0)
    responses = torch.randint(4, 200, (8, 3), generator=gen)
    ids = torch.cat([prompts, responses], dim=1)
    mask = torch.ones_like(ids)
    return DataProto.from_dict(
        {
            keys.INPUT_IDS: ids,
            keys.ATTENTION_MASK: mask,
            keys.POSITION_IDS: mask.cumsum(-1) - 1,
            keys.RESPONSES: responses,
            keys.RESPONSE_MASK: torch.ones_like(responses),
        }
    )


def _packed(model_dir: str, world: int, out_dir: str) -> None:
    """Log-probs of a t = 2 model over rows that share prompts, computed packed."""
    from hybridflow.models.attention import CPU_ATTENTION
    from hybridflow.workers.actor.dp_actor import response_log_probs
    from hybridflow.workers.packed_rows import plan_packed_rows

    module = build_fsdp_module(
        OmegaConf.create({"path": model_dir}), OmegaConf.create({}), build_device_mesh(world, "cpu", 2)
    )
    data = _shared_prompt_batch()
    assert module.config._attn_implementation == CPU_ATTENTION
    assert plan_packed_rows(data, 27) is not None  # the forward below does pack
    with torch.no_grad():
        log_probs, _ = response_log_probs(module, data, 1.0)
    if torch.distributed.get_rank() == 0:
        torch.save(log_probs, os.path.join(out_dir, "packed.pt"))


def _rank_main(rank: int, world: int, tps: list[int], port: int, model_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    with gloo_group(rank, world, port):
        for tp in tps:
            _run(model_dir, world, tp, out_dir)
        if world == 2:
            _checkpoint_round_trip(model_dir, world, out_dir)
            _critic(model_dir, world, out_dir)
            _packed(model_dir, world, out_dir)
            _run(os.path.join(out_dir, "qwen3"), world, 2, os.path.join(out_dir, "qwen3"))


def _reference(model_dir: str, mode: str) -> dict:
    """float64, unsharded, all 4 rows at once: log-probs, entropies, the gradient of the PPO objective at
    ratio 1 (``-A log pi`` over the valid tokens, aggregated by ``mode``) and its norm."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    data = _batch().batch
    logits = model(
        input_ids=data[keys.INPUT_IDS],
        attention_mask=data[keys.ATTENTION_MASK],
        position_ids=data[keys.POSITION_IDS],
        use_cache=False,
    ).logits[:, PROMPT_LEN - 1 : -1]
    log_softmax = torch.log_softmax(logits, -1)
    log_probs = log_softmax.gather(-1, data[keys.RESPONSES].unsqueeze(-1)).squeeze(-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    mask = data[keys.RESPONSE_MASK].double()
    divisor = mask.sum() if mode == "token-mean" else RESPONSE_LEN
    (-(data[keys.ADVANTAGES].double() * log_probs * mask).sum() / divisor).backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    norm = torch.sqrt(sum((g**2).sum() for g in grads.values()))
    return {"log_probs": log_probs.detach() * mask, "entropy": entropy.detach(), "grads": grads, "norm": norm}


def _check(out_dir, model_dir: str, world: int, tp: int) -> None:
    want = _reference(model_dir, _mode(world, tp))
    mask = _batch().batch[keys.RESPONSE_MASK].bool()
    for dp_rank in range(world // tp):
        got = torch.load(os.path.join(out_dir, f"t{tp}_rank{dp_rank * tp}.pt"))
        rows = got["rows"]
        torch.testing.assert_close(got["log_probs"].double(), want["log_probs"][rows], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(
            got["entropy"].double()[mask[rows]], want["entropy"][rows][mask[rows]], rtol=1e-5, atol=1e-5
        )
        assert set(got["grads"]) == set(want["grads"])
        for name, grad in want["grads"].items():
            torch.testing.assert_close(got["grads"][name].double(), grad, rtol=2e-4, atol=2e-6, msg=name)
        torch.testing.assert_close(got["norm"].double(), want["norm"], rtol=1e-5, atol=1e-7)


def _spawn(world: int, tps: list[int], model_dir: str, out_dir: str) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_rank_main, args=(world, tps, free_port(), model_dir, out_dir), nprocs=world, join=True)


def _assert_same_state(got: tuple[dict, dict], want: tuple[dict, dict]) -> None:
    for name, tensor in want[0].items():
        torch.testing.assert_close(got[0][name], tensor, rtol=0, atol=0, msg=name)
    assert set(got[1]) == set(want[1])
    for name, state in want[1].items():
        for key, value in state.items():
            torch.testing.assert_close(got[1][name][key], value, rtol=0, atol=0, msg=f"{name}.{key}")


def test_two_processes_tp2_match_the_unsharded_model_and_checkpoint(tp_model_dir, tmp_path):
    """Llama (untied) and Qwen3 (q/k norms); the critic's values and gradients. Also: a t = 2
    checkpoint loads exactly into t = 2 and t = 1 (DCP reshards DTensors), training continues
    identically, and the model merger writes the trained weights as an HF directory."""
    from transformers import AutoModelForCausalLM

    from hybridflow.model_merger import merge_fsdp_checkpoint

    qwen3 = build_qwen3_dir(tmp_path / "qwen3")
    _spawn(2, [2], tp_model_dir, str(tmp_path))
    _check(tmp_path, tp_model_dir, world=2, tp=2)
    _check(tmp_path / "qwen3", qwen3, world=2, tp=2)  # per-head q/k norms over sharded heads

    saved = torch.load(tmp_path / "saved.pt")
    (state_t2, after_original, after_loaded) = torch.load(tmp_path / "loaded_t2.pt")
    _assert_same_state(state_t2, saved)
    _assert_same_state(torch.load(tmp_path / "loaded_t1.pt"), saved)
    for name, tensor in after_original.items():
        assert not torch.equal(tensor, saved[0][name]) or "norm" in name  # the second step moved it
        torch.testing.assert_close(after_loaded[name], tensor, rtol=0, atol=0, msg=name)

    critic, want = torch.load(tmp_path / "critic.pt"), _critic_reference(tp_model_dir)
    torch.testing.assert_close(critic["values"].double(), want["values"].double(), rtol=1e-5, atol=1e-6)
    assert set(critic["grads"]) == set(want["grads"])
    for name, grad in want["grads"].items():
        torch.testing.assert_close(critic["grads"][name].double(), grad, rtol=2e-4, atol=2e-6, msg=name)

    reference = AutoModelForCausalLM.from_pretrained(tp_model_dir, dtype=torch.float64)  # packing
    batch = _shared_prompt_batch().batch
    logits = reference(input_ids=batch[keys.INPUT_IDS], position_ids=batch[keys.POSITION_IDS]).logits
    want = torch.log_softmax(logits[:, 23:-1], -1).gather(-1, batch[keys.RESPONSES].unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(torch.load(tmp_path / "packed.pt").double(), want, rtol=1e-5, atol=1e-5)

    merged = merge_fsdp_checkpoint(tmp_path / "ckpt", tmp_path / "merged")
    exported = dict(AutoModelForCausalLM.from_pretrained(merged).named_parameters())
    assert set(exported) == set(saved[0])
    for name, tensor in saved[0].items():
        assert torch.equal(exported[name].detach(), tensor), name


@pytest.mark.slow  # four processes; two-process TP stays in the fast tier (make test <= 15 min)
def test_four_processes_tp4_and_tp2_with_fsdp_match_the_unsharded_model(tp_model_dir, tmp_path):
    _spawn(4, [4, 2], tp_model_dir, str(tmp_path))
    _check(tmp_path, tp_model_dir, world=4, tp=4)
    _check(tmp_path, tp_model_dir, world=4, tp=2)


def test_sizes_that_do_not_divide_are_rejected_before_sharding(tiny_model_dir):
    from transformers import AutoConfig

    from hybridflow.workers.tensor_parallel import divisibility_problems

    config = AutoConfig.from_pretrained(tiny_model_dir)  # 4 heads, 2 key-value heads
    assert divisibility_problems(config, 2) == []
    assert divisibility_problems(config, 4) == [
        "num_key_value_heads=2 is not divisible by tensor_model_parallel_size=4"
    ]
    assert "vocab_size=" in " ".join(divisibility_problems(config, 3))
