"""Router replay in the actor's forwards (issue 48 item 3, verl's ``router_replay``; the engine's recorded
ids: ``tests/workers/rollout/test_engine_routed_experts.py``). On tiny random Qwen2-MoE (shared expert, a
dense layer), Qwen3-MoE and Mixtral models in fp32, routers scaled so that routing is decisive:

- replaying the model's own recorded routing gives its log-probs and its gradients (the router's included:
  the replayed layer gathers its own router's probabilities at the ids), in the padded layout, the packed
  rows and the shared-prompt block mask, recorded in one layout and replayed in another;
- replaying other ids (each shifted to the next expert) moves the log-probs far beyond rounding, and the
  router still gets a gradient;
- micro-batches of 1 row, of the whole batch and dynamic batches give the same replayed log-probs (the ids
  travel with their rows);
- R2: the actor's old-log-prob pass records the routing HF picks, and the update's micro-batches route
  with the batch's ids;
- on an FSDP2-sharded actor the replay gives the unreplayed log-probs, and the state dict (what checkpoints
  save) keeps its keys;
- a dense model is refused."""

import pytest
import torch
import transformers
from omegaconf import OmegaConf

from hybridflow import keys
from hybridflow.models.attention import register_cpu_attention
from hybridflow.workers import packed_rows, router_replay, shared_prefix
from hybridflow.workers.actor.dp_actor import DataParallelPPOActor, response_log_probs
from tests.tiny_configs import MOE_FAMILIES, tiny_decoder_config
from tests.workers.grouped_batches import grouped_batch
from tests.workers.test_loss_normalisation import _actor_config

PROMPT_LEN, RESPONSE_LEN, VOCAB = 7, 6, 97
PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [15, 16, 17, 18, 19, 20, 21]]
RESPONSE_LENGTHS = [[5, 2], [6, 3], [6]]
LAYOUTS = ("padded", "packed", "block_mask")


def _model(family: str, attn: str | None = None):
    torch.manual_seed(0)
    config = tiny_decoder_config(family, attn_implementation=attn or register_cpu_attention())
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.mul_(40.0)
    return model.eval()


def _data():
    return grouped_batch(PROMPTS, RESPONSE_LENGTHS, PROMPT_LEN, RESPONSE_LEN, (23, VOCAB))


def _layout(monkeypatch, name: str) -> None:
    monkeypatch.setattr(packed_rows, "MAX_TOKEN_FRACTION", 1e9 if name == "packed" else -1.0)
    monkeypatch.setattr(shared_prefix, "MIN_SAVING", -1e9 if name == "block_mask" else 1e9)


def _record(model, data):
    """The model's own routing of ``data`` as ``routed_experts`` (B, T, L, k), through the record action."""
    with router_replay.acting(model, router_replay.RECORD) as replay:
        with torch.no_grad():
            response_log_probs(model, data, temperature=1.0)
        return router_replay.recorded_ids(replay, data)


def _log_probs_and_router_grads(model, data, replaying: bool):
    model.zero_grad()
    with router_replay.acting(model, router_replay.REPLAY if replaying else None):
        log_probs, _ = response_log_probs(model, data, temperature=1.0)
        mask = data.batch[keys.RESPONSE_MASK].float()
        (log_probs * mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")}
    return log_probs.detach() * mask, grads


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_replaying_the_own_routing_gives_the_same_log_probs_and_gradients_in_every_layout(
    monkeypatch, family
):
    model = _model(family)
    router_replay.install(model)
    data = _data()
    _layout(monkeypatch, "padded")
    recorded = _record(model, data)
    assert recorded.dtype == torch.uint8 and recorded.shape[:2] == data.batch[keys.INPUT_IDS].shape
    reference, reference_grads = _log_probs_and_router_grads(model, data, replaying=False)
    assert reference_grads and all(g.abs().sum() > 0 for g in reference_grads.values())
    for layout in LAYOUTS:
        _layout(monkeypatch, layout)
        assert torch.equal(_record(model, data), recorded), layout  # every layout routes alike
        data.batch[keys.ROUTED_EXPERTS] = recorded
        replayed, grads = _log_probs_and_router_grads(model, data, replaying=True)
        torch.testing.assert_close(replayed, reference, rtol=0, atol=1e-6, msg=layout)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, reference_grads[name], rtol=1e-4, atol=1e-6, msg=name)
        del data.batch[keys.ROUTED_EXPERTS]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_other_ids_move_the_log_probs_and_the_router_still_learns(monkeypatch, layout):
    model = _model("qwen3_moe")
    router_replay.install(model)
    data = _data()
    _layout(monkeypatch, layout)
    recorded = _record(model, data)
    reference, _ = _log_probs_and_router_grads(model, data, replaying=False)
    data.batch[keys.ROUTED_EXPERTS] = (recorded + 1) % 4  # each token's experts shifted: still k distinct
    shifted, grads = _log_probs_and_router_grads(model, data, replaying=True)
    assert (shifted - reference).abs().max() > 1e-2
    assert all(g.abs().sum() > 0 for g in grads.values())


def _actor(model, mode: str, optimizer=None):
    config = _actor_config("token-mean", 5, 5)
    config.router_replay = {"mode": mode, "record_file": None, "replay_file": None}
    return DataParallelPPOActor(config, model, optimizer, response_length=RESPONSE_LEN)


def _batching(micro, dynamic: bool, budget: int = 4096):
    return OmegaConf.create(
        {
            "log_prob_micro_batch_size_per_gpu": micro,
            "log_prob_use_dynamic_bsz": dynamic,
            "log_prob_max_token_len_per_gpu": budget,
        }
    )


def test_micro_batches_and_dynamic_batches_carry_each_rows_ids(monkeypatch):
    model = _model("mixtral")
    actor = _actor(model, "R3")
    data = _data()
    _layout(monkeypatch, "packed")
    data.batch[keys.ROUTED_EXPERTS] = (_record(model, data) + 1) % 4
    whole, _ = actor.compute_log_prob(data, _batching(None, False))
    own, _ = _actor(_model("mixtral"), "disabled").compute_log_prob(data, _batching(None, False))
    mask = data.batch[keys.RESPONSE_MASK].bool()
    assert (whole - own)[mask].abs().max() > 1e-2  # the replayed ids are in use
    for batching in (_batching(1, False), _batching(2, False), _batching(None, True, budget=16)):
        _layout(monkeypatch, "padded")
        split, _ = actor.compute_log_prob(data, batching)
        torch.testing.assert_close(split[mask], whole[mask], rtol=0, atol=1e-6)


def _hf_picks(model, data) -> torch.Tensor:
    """(B, T, L, k): the experts HF's routers pick for every column of the padded rows (no replay)."""
    picks = []
    hooks = [
        module.register_forward_hook(lambda m, i, out: picks.append(out[2]))
        for module in model.modules()
        if type(module).__name__.endswith("TopKRouter")
    ]
    with torch.no_grad():
        model(input_ids=data.batch[keys.INPUT_IDS], attention_mask=data.batch[keys.ATTENTION_MASK],
              position_ids=data.batch[keys.POSITION_IDS])  # fmt: skip
    for hook in hooks:
        hook.remove()
    return torch.stack(picks, 1).view(*data.batch[keys.INPUT_IDS].shape, len(picks), -1)


def test_r2_records_in_the_old_log_prob_pass_and_the_update_replays(monkeypatch):
    from hybridflow.workers.forward import attended_span

    model = _model("qwen2_moe")
    data = _data()
    _layout(monkeypatch, "padded")
    actor = _actor(model, "R2", torch.optim.SGD(model.parameters(), lr=0.0))
    log_probs, _ = actor.compute_log_prob(data, _batching(2, False))
    recorded = actor.recorded_routing
    assert recorded.shape == (*data.batch[keys.INPUT_IDS].shape, 2, 2)  # 2 sparse layers of 3, top-2
    mask = data.batch[keys.ATTENTION_MASK].bool()
    hf = _hf_picks(_model("qwen2_moe"), data)
    assert set(hf[mask].flatten().tolist()) == {0, 1, 2, 3}
    assert torch.equal(hf[mask].to(torch.uint8), recorded[mask])
    assert not recorded[~mask].any()  # padding: 0
    picked = []
    spies = [  # registered after replay's hook: they see the ids the experts get
        router.register_forward_hook(lambda m, i, out: picked.append(out[2].clone()))
        for router in router_replay.install(model).routers
    ]
    data.batch[keys.OLD_LOG_PROBS] = log_probs
    data.batch[keys.ADVANTAGES] = torch.ones_like(log_probs) * data.batch[keys.RESPONSE_MASK]
    actor.config.ppo_micro_batch_size_per_gpu = 2
    data.batch[keys.ROUTED_EXPERTS] = recorded  # (lr 0) the recorded routing: the old log-probs again
    assert max(abs(v) for v in actor.update_policy(data)["actor/ppo_kl"]) < 1e-7
    data.batch[keys.ROUTED_EXPERTS] = (recorded + 1) % 4
    picked.clear()
    metrics = actor.update_policy(data)
    assert len(picked) == 3 * 2  # three micro-batches x two sparse layers, each with the batch's ids
    first, end = attended_span(data.batch[keys.ATTENTION_MASK][:2], PROMPT_LEN)
    expected = data.batch[keys.ROUTED_EXPERTS][:2, first:end, 0].reshape(-1, 2)
    assert torch.equal(picked[0].to(torch.uint8), expected)
    assert max(abs(v) for v in metrics["actor/ppo_kl"]) > 1e-6  # other ids: other log-probs
    for spy in spies:
        spy.remove()


def test_replay_on_a_dense_model_is_refused():
    model = transformers.AutoModelForCausalLM.from_config(tiny_decoder_config("qwen2"))
    with pytest.raises(ValueError, match="no mixture-of-experts router"):
        _actor(model, "R3")
    _actor(model, "disabled")  # nothing is installed, nothing refused


def test_an_fsdp2_actor_replays_and_its_checkpoint_keys_do_not_change(monkeypatch):
    """The hooks sit on the routers of an FSDP2-sharded actor (one gloo rank) and add nothing to its state
    dict: checkpoints save and load the same keys with replay on."""
    from hybridflow.workers.fsdp_utils import apply_fsdp2, build_device_mesh
    from tests.utils.checkpoint.fsdp_toy import gloo_group

    data = _data()
    _layout(monkeypatch, "packed")
    with gloo_group():
        module = apply_fsdp2(_model("qwen3_moe"), build_device_mesh(1, "cpu"), OmegaConf.create({}))
        before = sorted(module.state_dict())
        actor = _actor(module, "R3")
        assert sorted(module.state_dict()) == before
        own, _ = _actor(_model("qwen3_moe"), "disabled").compute_log_prob(data, _batching(2, False))
        data.batch[keys.ROUTED_EXPERTS] = _record(_model_with_replay("qwen3_moe"), data)
        replayed, _ = actor.compute_log_prob(data, _batching(2, False))
    mask = data.batch[keys.RESPONSE_MASK].bool()
    torch.testing.assert_close(replayed[mask], own[mask], rtol=0, atol=1e-5)


def _model_with_replay(family: str):
    model = _model(family)
    router_replay.install(model)
    return model


def _shifted_ids(data, layers: int, experts: int = 4) -> torch.Tensor:
    """(B, T, layers, 2) valid ids, two distinct experts per token, drawn with seed 1."""
    first = torch.randint(
        0, experts, (*data.batch[keys.INPUT_IDS].shape, layers, 1), generator=torch.Generator().manual_seed(1)
    )
    return torch.cat([first, (first + 1) % experts], -1).to(torch.uint8)


def _sp_rank(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    from hybridflow.workers.fsdp_utils import build_device_mesh
    from hybridflow.workers.model_builder import build_fsdp_module
    from hybridflow.workers.ulysses import apply_sequence_parallel, sequence_parallel_groups
    from tests.utils.checkpoint.fsdp_toy import gloo_group

    torch.set_num_threads(1)
    with gloo_group(rank, 2, port):
        module = build_fsdp_module(
            OmegaConf.create({"path": model_dir}), OmegaConf.create({}), build_device_mesh(2, "cpu")
        )
        apply_sequence_parallel(module, sequence_parallel_groups(2, 2, "cpu"))
        data = _data()
        data.batch[keys.ROUTED_EXPERTS] = _shifted_ids(data, 2)
        log_probs, _ = _actor(module, "R3").compute_log_prob(data, _batching(2, False))
        torch.save(log_probs, f"{out_dir}/sp_rank{rank}.pt")


@pytest.mark.slow  # two spawned torch processes (~25 s on 2 cores)
def test_ulysses_sp2_replays_like_one_process(tmp_path):
    """Each SP rank replays the ids of its slice of the packed row: SP = 2 gives one process's replayed
    log-probs (and the replayed ids are in use: they differ from the model's own routing's)."""
    import torch.multiprocessing as mp

    from tests.utils.checkpoint.fsdp_toy import free_port

    _model("qwen3_moe").save_pretrained(tmp_path / "model")
    mp.spawn(_sp_rank, args=(free_port(), str(tmp_path / "model"), str(tmp_path)), nprocs=2, join=True)
    data = _data()
    own, _ = _actor(_model("qwen3_moe"), "disabled").compute_log_prob(data, _batching(2, False))
    data.batch[keys.ROUTED_EXPERTS] = _shifted_ids(data, 2)
    want, _ = _actor(_model("qwen3_moe"), "R3").compute_log_prob(data, _batching(2, False))
    mask = data.batch[keys.RESPONSE_MASK].bool()
    assert (want - own)[mask].abs().max() > 1e-2
    for rank in range(2):
        got = torch.load(tmp_path / f"sp_rank{rank}.pt")
        torch.testing.assert_close(got[mask], want[mask], rtol=0, atol=1e-5)
