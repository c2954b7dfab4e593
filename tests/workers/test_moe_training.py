"""Mixture-of-experts families train in the FSDP2 actor (issue 48 item 1), on one gloo rank: Qwen2-MoE (shared
expert and its gate, a dense ``mlp_only_layers`` layer, gradient checkpointing), Qwen3-MoE and Mixtral take a
PPO step with dynamic batching over packed rows whose loss is finite and which moves every parameter, each
expert's slice and each router included (weight decay 0: only a gradient moves a weight). LoRA on an MoE
model adapts the attention and dense parts only, its adapter checkpoint merges into a model that gives the
trained actor's log-probs; a full MoE checkpoint loads back exactly and merges the same way. Tensor
parallelism on an MoE model is refused before Ray starts."""

import pytest
import torch
import transformers
from omegaconf import OmegaConf

from hybridflow import keys
from hybridflow.model_merger import merge_fsdp_checkpoint
from hybridflow.models import attention
from hybridflow.utils.checkpoint import FSDPCheckpointManager
from hybridflow.workers.actor.dp_actor import DataParallelPPOActor, response_log_probs
from hybridflow.workers.fsdp_utils import build_device_mesh, full_state_dict
from hybridflow.workers.lora import merged_hf_weights
from hybridflow.workers.model_builder import build_training_parts
from tests.tiny_configs import MOE_FAMILIES, tiny_decoder_config
from tests.utils.checkpoint.fsdp_toy import SHARDED, gloo_group
from tests.workers.grouped_batches import grouped_batch
from tests.workers.test_loss_normalisation import _actor_config

PROMPT_LEN, RESPONSE_LEN, VOCAB = 7, 6, 97
# two GRPO groups of two: the packed rows hold each prompt once
PROMPTS, RESPONSE_LENGTHS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14]], [[5, 2], [6, 3]]
LOG_PROB_BATCHING = {
    "log_prob_micro_batch_size_per_gpu": None,
    "log_prob_use_dynamic_bsz": True,
    "log_prob_max_token_len_per_gpu": 30,
}


def _model_dir(tmp_path, family: str) -> str:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_decoder_config(family))
    model.save_pretrained(tmp_path / family)
    return str(tmp_path / family)


def _batch():
    data = grouped_batch(PROMPTS, RESPONSE_LENGTHS, PROMPT_LEN, RESPONSE_LEN, (23, VOCAB))
    advantages = torch.tensor([[1.0], [-1.0], [0.5], [-0.5]])
    data.batch[keys.ADVANTAGES] = advantages * data.batch[keys.RESPONSE_MASK]
    return data


def _train_step(model_cfg: dict, lr: float = 1e-2):
    """(parts, batch with old log-probs, metrics, weights before) of one PPO step on one gloo rank, the
    micro-batches cut by a 30-token budget (dynamic batch size)."""
    parts = build_training_parts(
        OmegaConf.create(model_cfg),
        OmegaConf.create(SHARDED),
        OmegaConf.create({"lr": lr, "weight_decay": 0.0}),
        build_device_mesh(1, "cpu"),
    )
    config = _actor_config("token-mean", 4, 4)
    config.use_dynamic_bsz, config.ppo_max_token_len_per_gpu = True, 30
    actor = DataParallelPPOActor(config, parts.module, parts.optimizer, response_length=RESPONSE_LEN)
    data = _batch()
    log_probs, _ = actor.compute_log_prob(data, OmegaConf.create(LOG_PROB_BATCHING))
    data.batch[keys.OLD_LOG_PROBS] = log_probs
    before = _local(parts.module)
    metrics = actor.update_policy(data)
    return parts, data, metrics, before


def _local(module) -> dict[str, torch.Tensor]:
    """Plain copies of the (world-size-1, so complete) DTensor shards."""
    return {name: p.detach().to_local().clone() for name, p in module.named_parameters()}


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_one_fsdp2_step_moves_every_expert_and_router(tmp_path, monkeypatch, family):
    calls = []
    real = attention.packed_attention
    monkeypatch.setattr(attention, "packed_attention", lambda *a: calls.append(1) or real(*a))
    model_cfg = {"path": _model_dir(tmp_path, family)}
    if family == "qwen2_moe":
        model_cfg["enable_gradient_checkpointing"] = True
    with gloo_group():
        parts, _, metrics, before = _train_step(model_cfg)
        after = _local(parts.module)
    assert calls, "the packed rows were not used"
    assert len(metrics["actor/pg_loss"]) == 1 and torch.isfinite(torch.tensor(metrics["actor/pg_loss"])).all()
    assert metrics["actor/grad_norm"][0] > 0
    units = [type(m).__name__ for m in parts.module.modules() if hasattr(m, "unshard")]
    assert sum(name.endswith("DecoderLayer") for name in units) == parts.module.config.num_hidden_layers
    for name, weight in before.items():
        if ".experts." in name:  # every expert (dim 0) was routed to and trained
            moved = (after[name] - weight).flatten(1).abs().amax(dim=1)
            assert (moved > 0).all(), (name, moved)
        assert not torch.equal(after[name], weight), f"{name} did not change"
    assert any("shared_expert_gate" in n for n in before) == (family == "qwen2_moe")


@pytest.fixture(scope="module")
def lora_mixtral(tmp_path_factory):
    """A Mixtral actor with LoRA (peft would adapt its router and experts under transformers 5 if asked for
    ``all-linear`` naively) after one step at a large lr, its adapter checkpoint, and its log-probs."""
    tmp_path = tmp_path_factory.mktemp("lora_moe")
    model_dir = _model_dir(tmp_path, "mixtral")
    with gloo_group():
        parts, data, metrics, before = _train_step(
            {"path": model_dir, "lora_rank": 4, "lora_alpha": 8}, lr=0.05
        )
        after = _local(parts.module)
        trainable = {name for name, p in parts.module.named_parameters() if p.requires_grad}
        merged = dict(merged_hf_weights(parts.module, list(full_state_dict(parts.module).items())))
        FSDPCheckpointManager(
            parts.module, parts.optimizer, parts.lr_scheduler, trainable_only=True
        ).save_checkpoint(str(tmp_path / "ckpt"), global_step=1)
        with torch.no_grad():
            log_probs, _ = response_log_probs(parts.module.eval(), data, temperature=1.0)
    return dict(
        model_dir=model_dir, ckpt=tmp_path / "ckpt", data=data, log_probs=log_probs, metrics=metrics,
        before=before, after=after, trainable=trainable, merged=merged,
    )  # fmt: skip


def test_lora_on_moe_adapts_attention_only_and_trains(lora_mixtral):
    trainable = lora_mixtral["trainable"]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert all(".self_attn." in n for n in trainable), "a router or an expert got an adapter"
    changed = {n for n, w in lora_mixtral["before"].items() if not torch.equal(w, lora_mixtral["after"][n])}
    assert changed and changed <= trainable and lora_mixtral["metrics"]["actor/grad_norm"][0] > 0
    # the weights a rollout engine receives: HF names, the adapter merged into the attention projections
    base = transformers.AutoModelForCausalLM.from_pretrained(lora_mixtral["model_dir"]).state_dict()
    merged = lora_mixtral["merged"]
    assert set(merged) == set(base)
    assert not torch.equal(
        merged["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"]
    )
    assert torch.equal(
        merged["model.layers.0.mlp.experts.gate_up_proj"], base["model.layers.0.mlp.experts.gate_up_proj"]
    )


def test_lora_moe_checkpoint_merges_into_the_trained_policy(lora_mixtral, tmp_path):
    target = merge_fsdp_checkpoint(
        lora_mixtral["ckpt"], tmp_path / "merged", base_model_path=lora_mixtral["model_dir"]
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(target).eval()
    with torch.no_grad():
        log_probs, _ = response_log_probs(model, lora_mixtral["data"], temperature=1.0)
    mask = lora_mixtral["data"].batch[keys.RESPONSE_MASK].bool()
    torch.testing.assert_close(log_probs[mask], lora_mixtral["log_probs"][mask], rtol=0, atol=1e-5)


def test_full_moe_checkpoint_loads_back_and_merges(tmp_path):
    """Qwen2-MoE (sparse and dense layers, a shared expert): save after a step, load it into a fresh actor,
    merge it into an HF directory that gives the trained actor's log-probs."""
    model_dir = _model_dir(tmp_path, "qwen2_moe")
    with gloo_group():
        parts, data, _, _ = _train_step({"path": model_dir})
        FSDPCheckpointManager(parts.module, parts.optimizer, parts.lr_scheduler).save_checkpoint(
            str(tmp_path / "ckpt"), global_step=1
        )
        trained = _local(parts.module)
        with torch.no_grad():
            log_probs, _ = response_log_probs(parts.module.eval(), data, temperature=1.0)
        fresh = build_training_parts(
            OmegaConf.create({"path": model_dir}), OmegaConf.create(SHARDED), OmegaConf.create({"lr": 1e-2}),
            build_device_mesh(1, "cpu"),
        )  # fmt: skip
        FSDPCheckpointManager(fresh.module, fresh.optimizer, fresh.lr_scheduler).load_checkpoint(
            str(tmp_path / "ckpt")
        )
        for name, weight in _local(fresh.module).items():
            assert torch.equal(weight, trained[name]), name
    model = transformers.AutoModelForCausalLM.from_pretrained(
        merge_fsdp_checkpoint(tmp_path / "ckpt", tmp_path / "merged", hf_model_path=model_dir)
    ).eval()
    with torch.no_grad():
        merged_log_probs, _ = response_log_probs(model, data, temperature=1.0)
    mask = data.batch[keys.RESPONSE_MASK].bool()
    torch.testing.assert_close(merged_log_probs[mask], log_probs[mask], rtol=0, atol=1e-5)


def _sequence_parallel_rank(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    """SP = 2 over 2 gloo ranks: log-probs and entropies of the whole batch, one row per micro-batch."""
    from hybridflow.workers.ulysses import apply_sequence_parallel, sequence_parallel_groups

    torch.set_num_threads(1)
    with gloo_group(rank, 2, port):
        parts = build_training_parts(
            OmegaConf.create({"path": model_dir}), OmegaConf.create(SHARDED), OmegaConf.create({"lr": 1e-2}),
            build_device_mesh(2, "cpu"),
        )  # fmt: skip
        apply_sequence_parallel(parts.module, sequence_parallel_groups(2, 2, "cpu"))
        batching = {
            **LOG_PROB_BATCHING,
            "log_prob_micro_batch_size_per_gpu": 1,
            "log_prob_use_dynamic_bsz": False,
        }
        result = DataParallelPPOActor(None, parts.module).compute_log_prob(
            _batch(), OmegaConf.create(batching), calculate_entropy=True
        )
        torch.save(result, f"{out_dir}/sp_rank{rank}.pt")


@pytest.mark.slow  # two spawned torch processes: ~25 s on 2 cores, over the fast tier's budget for this file
def test_ulysses_sp2_gives_one_process_log_probs(tmp_path):
    """Ulysses splits the attention heads; the routers and experts run on each rank's slice of tokens, so
    SP = 2 (Qwen2-MoE: sparse and dense layers, shared expert) gives one unsplit process's log-probs."""
    import torch.multiprocessing as mp

    from hybridflow.workers.model_builder import load_hf_model
    from tests.utils.checkpoint.fsdp_toy import free_port

    model_dir = _model_dir(tmp_path, "qwen2_moe")
    mp.spawn(_sequence_parallel_rank, args=(free_port(), model_dir, str(tmp_path)), nprocs=2, join=True)
    model = load_hf_model(OmegaConf.create({"path": model_dir}), "causal_lm", torch.float32).eval()
    data = _batch()
    with torch.no_grad():
        want = response_log_probs(model, data, temperature=1.0, with_entropy=True)
    mask = data.batch[keys.RESPONSE_MASK].bool()
    for rank in range(2):
        got = torch.load(tmp_path / f"sp_rank{rank}.pt")
        for have, expected in zip(got, want, strict=True):
            torch.testing.assert_close(have[mask], expected[mask], rtol=0, atol=1e-5)
