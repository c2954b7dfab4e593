"""``fsdp_config`` keys on a CPU mesh at world size 1, in process.

``param_offload`` / ``optimizer_offload`` / ``offload_policy``: FSDP2's CPUOffloadPolicy; an actor built with
it trains a PPO step through ``DataParallelPPOActor.update_policy`` to the same weights as the actor without
it. ``wrap_policy.transformer_layer_cls_to_wrap``: which module classes become FSDP units (verl's key).
``shard_one_rank``: at world size 1 in fp32 the model stays a plain module unless it is true; both train to
the same bits and read each other's checkpoints."""

import pytest
import torch
from omegaconf import OmegaConf
from torch.distributed.fsdp import FSDPModule

from hybridflow import keys
from hybridflow.protocol import DataProto
from hybridflow.trainer.config import load_schema
from hybridflow.workers.actor.dp_actor import DataParallelPPOActor
from hybridflow.workers.fsdp_utils import build_device_mesh, offload_policy, wants_cpu_offload
from hybridflow.workers.model_builder import build_fsdp_module, build_training_parts
from tests.utils.checkpoint.fsdp_toy import SHARDED, gloo_group

PROMPT_LEN, RESPONSE_LEN, ROWS = 6, 5, 4


@pytest.fixture
def mesh():
    with gloo_group():
        yield build_device_mesh(1, "cpu")


def _actor_config():
    actor = OmegaConf.to_container(load_schema().actor_rollout_ref.actor, resolve=True)
    actor.update(ppo_mini_batch_size=ROWS, ppo_micro_batch_size_per_gpu=2, use_kl_loss=False)
    actor["optim"]["lr"] = 1e-2
    return OmegaConf.create(actor)


def _batch(seed: int = 1) -> DataProto:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 200, (ROWS, PROMPT_LEN + RESPONSE_LEN), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    data = DataProto.from_dict(
        {
            keys.INPUT_IDS: ids,
            keys.ATTENTION_MASK: mask,
            keys.POSITION_IDS: (mask.cumsum(-1) - 1).clamp(min=0),
            keys.RESPONSES: ids[:, PROMPT_LEN:],
            keys.RESPONSE_MASK: torch.ones(ROWS, RESPONSE_LEN, dtype=torch.long),
            keys.ADVANTAGES: torch.tensor([[1.0], [-1.0], [0.5], [-0.5]]).expand(ROWS, RESPONSE_LEN).clone(),
        }
    )
    data.meta_info = {"temperature": 1.0, "global_steps": 1}
    return data


def _offloaded(module) -> set[bool]:
    """Whether each FSDP unit's sharded parameters live under CPUOffloadPolicy."""
    return {
        param.offload_to_cpu
        for unit in module.modules()
        if isinstance(unit, FSDPModule)
        for group in unit._get_fsdp_state()._fsdp_param_groups
        for param in group.fsdp_params
    }


def _train_one_step(model_dir: str, mesh, fsdp: dict) -> tuple[torch.nn.Module, dict[str, list]]:
    config = _actor_config()
    parts = build_training_parts(
        OmegaConf.create({"path": model_dir}), OmegaConf.create(fsdp), config.optim, mesh
    )
    actor = DataParallelPPOActor(config, parts.module, parts.optimizer)
    data = _batch()
    batching = OmegaConf.create(
        {
            "log_prob_micro_batch_size_per_gpu": 2,
            "log_prob_use_dynamic_bsz": False,
            "log_prob_max_token_len_per_gpu": None,
        }
    )
    old_log_probs, _ = actor.compute_log_prob(data, batching)
    data.batch[keys.OLD_LOG_PROBS] = old_log_probs
    return parts.module, actor.update_policy(data)


def _weights(module) -> dict[str, torch.Tensor]:
    """Each parameter's values (a DTensor's local shard: the whole tensor at world size 1)."""
    return {name: _local(p).detach().clone() for name, p in module.named_parameters()}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def test_offload_keys_select_cpu_offload_policy():
    for key in ("param_offload", "optimizer_offload", "offload_policy"):
        assert wants_cpu_offload({key: True})
        policy = offload_policy({key: True}, "cpu")
        assert type(policy).__name__ == "CPUOffloadPolicy" and policy.pin_memory is False  # no accelerator
    assert offload_policy({"param_offload": True}, "cuda").pin_memory is True
    assert not wants_cpu_offload({}) and type(offload_policy({}, "cpu")).__name__ == "OffloadPolicy"


def test_param_offload_actor_trains_a_step_like_the_plain_actor(tiny_model_dir, mesh):
    initial = {n: p.detach().clone() for n, p in _initial_named_parameters(tiny_model_dir)}
    plain, _ = _train_one_step(tiny_model_dir, mesh, SHARDED)
    offloaded, metrics = _train_one_step(tiny_model_dir, mesh, {"param_offload": True})
    assert _offloaded(offloaded) == {True} and _offloaded(plain) == {False}
    assert all(p.device.type == "cpu" for p in offloaded.parameters())
    assert torch.isfinite(torch.tensor(metrics["actor/pg_loss"])).all()
    assert metrics["actor/grad_norm"][0] > 0
    after, reference = _weights(offloaded), _weights(plain)
    changed = [n for n, w in after.items() if not torch.equal(w, initial[n])]
    assert len(changed) == len(after)  # AdamW moves every weight
    for name, weight in after.items():
        torch.testing.assert_close(weight, reference[name], rtol=1e-5, atol=1e-6, msg=name)


def _initial_named_parameters(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir).named_parameters()


def _units(module) -> list[str]:
    return sorted(
        {type(m).__name__.removeprefix("FSDP") for m in module.modules() if isinstance(m, FSDPModule)}
    )


def test_wrap_policy_picks_the_sharded_module_classes(tiny_model_dir, mesh):
    model_cfg = OmegaConf.create({"path": tiny_model_dir})
    default = build_fsdp_module(model_cfg, OmegaConf.create(SHARDED), mesh)
    assert _units(default) == ["Qwen2DecoderLayer", "Qwen2ForCausalLM"]  # HF's _no_split_modules, then root
    wrap = {**SHARDED, "wrap_policy": {"min_num_params": 0, "transformer_layer_cls_to_wrap": ["Qwen2MLP"]}}
    assert _units(build_fsdp_module(model_cfg, OmegaConf.create(wrap), mesh)) == [
        "Qwen2ForCausalLM",
        "Qwen2MLP",
    ]
    for shard in (True, False):  # a plain one-rank model checks the key too
        bad = {"shard_one_rank": shard, "wrap_policy": {"transformer_layer_cls_to_wrap": "Nope"}}
        with pytest.raises(ValueError, match="matches no module"):
            build_fsdp_module(model_cfg, OmegaConf.create(bad), mesh)


def test_one_rank_fp32_model_stays_plain_unless_fsdp2_has_work(tiny_model_dir, mesh):
    model_cfg = OmegaConf.create({"path": tiny_model_dir})
    plain = build_fsdp_module(model_cfg, OmegaConf.create({}), mesh)
    assert not isinstance(plain, FSDPModule) and _units(plain) == []
    assert not any(hasattr(p, "to_local") for p in plain.parameters())  # plain tensors, no DTensor
    bf16 = {"mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"}}
    for fsdp in (SHARDED, bf16, {"param_offload": True}):
        assert isinstance(build_fsdp_module(model_cfg, OmegaConf.create(fsdp), mesh), FSDPModule), fsdp


def test_a_one_rank_cuda_mesh_keeps_fsdp2_under_its_default_mixed_precision():
    """On CUDA the default mixed precision is bf16 compute on fp32 master weights, which FSDP2 does:
    a one-GPU run keeps FSDP2, and so does any run that asks for bf16 compute."""
    from types import SimpleNamespace

    from hybridflow.workers.fsdp_utils import stays_plain_on_one_rank

    def mesh(kind):  # the three facts the decision reads of a DeviceMesh (no GPU here to build one)
        return SimpleNamespace(size=lambda: 1, device_type=kind, mesh_dim_names=("fsdp",))

    assert not stays_plain_on_one_rank(mesh("cuda"), OmegaConf.create({}))
    bf16 = {"mixed_precision": {"param_dtype": "bf16"}}
    assert not stays_plain_on_one_rank(mesh("cuda"), OmegaConf.create(bf16))
    assert stays_plain_on_one_rank(mesh("cpu"), OmegaConf.create({}))
    assert not stays_plain_on_one_rank(mesh("cpu"), OmegaConf.create(bf16))


def test_plain_and_sharded_one_rank_actors_train_to_the_same_bits(tiny_model_dir, mesh):
    """Two PPO steps (micro-batches of 2, grad clipping, AdamW): every metric and weight bit-for-bit."""
    runs = {}
    for name, fsdp in (("plain", {}), ("sharded", SHARDED)):
        config = _actor_config()
        parts = build_training_parts(
            OmegaConf.create({"path": tiny_model_dir}), OmegaConf.create(fsdp), config.optim, mesh
        )
        actor = DataParallelPPOActor(config, parts.module, parts.optimizer)
        metrics = [_ppo_step(actor, seed) for seed in (1, 2)]
        runs[name] = (isinstance(parts.module, FSDPModule), metrics, _weights(parts.module))
    (plain_fsdp, plain_metrics, plain_weights), (sharded_fsdp, sharded_metrics, sharded_weights) = (
        runs["plain"],
        runs["sharded"],
    )
    assert (plain_fsdp, sharded_fsdp) == (False, True)
    assert plain_metrics == sharded_metrics and plain_metrics[1]["actor/grad_norm"][0] > 0
    assert plain_weights.keys() == sharded_weights.keys()
    for name, weight in plain_weights.items():
        assert torch.equal(weight, sharded_weights[name]), name


def _ppo_step(actor: DataParallelPPOActor, seed: int) -> dict:
    data = _batch(seed)
    batching = OmegaConf.create(
        {
            "log_prob_micro_batch_size_per_gpu": 2,
            "log_prob_use_dynamic_bsz": False,
            "log_prob_max_token_len_per_gpu": None,
        }
    )
    data.batch[keys.OLD_LOG_PROBS] = actor.compute_log_prob(data, batching)[0]
    return actor.update_policy(data)


def test_plain_and_sharded_one_rank_checkpoints_load_into_each_other(tiny_model_dir, mesh, tmp_path):
    from hybridflow.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    def parts(fsdp):
        config = _actor_config()
        built = build_training_parts(
            OmegaConf.create({"path": tiny_model_dir}), OmegaConf.create(fsdp), config.optim, mesh
        )
        return built, DataParallelPPOActor(config, built.module, built.optimizer)

    for saver, loader in (({}, SHARDED), (SHARDED, {})):
        trained, actor = parts(saver)
        _ppo_step(actor, 1)
        path = str(tmp_path / f"from_{bool(saver)}")
        saving = FSDPCheckpointManager(trained.module, trained.optimizer, trained.lr_scheduler)
        saving.save_checkpoint(path, 1)
        resumed, resumed_actor = parts(loader)
        FSDPCheckpointManager(resumed.module, resumed.optimizer, resumed.lr_scheduler).load_checkpoint(path)
        assert isinstance(resumed.module, FSDPModule) != isinstance(trained.module, FSDPModule)
        # the next step from the loaded state equals the next step of the run that saved it
        assert _ppo_step(resumed_actor, 2) == _ppo_step(actor, 2)
        want = _weights(trained.module)
        for name, weight in _weights(resumed.module).items():
            assert torch.equal(weight, want[name]), name


def test_critic_global_micro_batch_forms_are_split_over_the_ranks():
    from hybridflow.workers.fsdp_workers import critic_batch_sizes_per_rank

    cfg = OmegaConf.create(
        {
            "ppo_mini_batch_size": 4,
            "ppo_micro_batch_size": 8,
            "ppo_micro_batch_size_per_gpu": 1,
            "forward_micro_batch_size": 6,
            "forward_micro_batch_size_per_gpu": 1,
        }
    )
    out = critic_batch_sizes_per_rank(cfg, world=2, rollout_n=3)
    assert out.ppo_mini_batch_size == 6  # 4 prompts x 3 responses / 2 ranks
    assert out.ppo_micro_batch_size_per_gpu == 4 and out.forward_micro_batch_size_per_gpu == 3
    with pytest.raises(ValueError, match="forward_micro_batch_size=6 is not divisible by the 4"):
        critic_batch_sizes_per_rank(
            OmegaConf.create(
                {**OmegaConf.to_container(cfg), "ppo_mini_batch_size": 4, "ppo_micro_batch_size": None}
            ),
            world=4,
            rollout_n=1,
        )
