"""The planner and cost model know Ulysses sequence parallelism (hand-derived numbers, no Ray).

The model is the one ``benchmarks/sp_memory.py`` measured (a Qwen2 with hidden 256, 4 layers, 8 heads,
4 kv heads, vocabulary 4096; only its config.json: the planner reads shapes on the meta device). At
one 8192-token sequence per micro-batch its update's activations per rank are the measured 1364 MiB at
sp = 1 and 868 MiB at sp = 2 (the calibration), and 124 x 2048 x 256 x 4 + 47 616 x 8192 bytes = 632
MiB at sp = 4.
"""

import copy
import json

import pytest
from omegaconf import OmegaConf
from transformers import Qwen2Config

from hybridflow import plan_placement
from hybridflow.placement.cost_model import PHASES, CostModel, PhaseFit, Workload, step_seconds
from hybridflow.placement.memory import BYTES_PER_PARAM, MEMORY_HEADROOM, activation_bytes
from hybridflow.placement.planner import (
    format_ranking,
    rank_placements,
    resolve_auto_placement,
    sp_options,
    workload_from_config,
)
from hybridflow.placement.spec import Placement
from hybridflow.trainer.config import load_config, validate_config
from hybridflow.utils.ulysses_rules import alltoall_bytes_per_layer

MIB = 2**20
# every phase 1e-12 s per work unit: the ranking's order comes from the workers and the all-to-alls
MODEL = CostModel({phase: PhaseFit(0.0, 1e-12) for phase in PHASES})


def _model_dir(path, heads=8, kv_heads=4):
    config = Qwen2Config(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=704,
        vocab_size=4096,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
    )
    config.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return _model_dir(tmp_path_factory.mktemp("sp_model"))


@pytest.fixture(scope="module")
def base_config(model_dir):
    """GRPO-like actor-only run on 4 devices: 4 prompts x 1 response of 64 + 8128 tokens, one sequence
    per micro-batch."""
    args = plan_placement.build_parser().parse_args(
        ["--profile", "unused", "--actor", model_dir, "--devices", "4", "--batch", "4"]
        + ["--prompt-length", "64", "--response-length", "8128"]
        + ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"]
    )
    return load_config(plan_placement.plan_overrides(args))


def _config(base, **changes):
    """A copy of ``base`` with ``changes`` (dotted key -> value; ``__`` for ``.``) set."""
    config = copy.deepcopy(base)
    for key, value in changes.items():
        OmegaConf.update(config, key.replace("__", "."), value)
    return config


def _memory_gb(usable_mib: float) -> float:
    """The device memory whose usable part (after the headroom) is ``usable_mib``."""
    return usable_mib * MIB / 2**30 / MEMORY_HEADROOM


def _resident(load: Workload, workers: int) -> float:
    return BYTES_PER_PARAM["actor_rollout"] * load.params["actor_rollout"] / workers


def test_alltoall_bytes_are_the_paper_s_formula(base_config):
    # (sp - 1) / sp x S / sp x (2 nh + 2 max(nkv, sp)) x head_dim x 4: the docs' measured 6.0 / 4.5 MiB
    assert alltoall_bytes_per_layer(8192, 2, 8, 4, 32) == 1 / 2 * 4096 * (16 + 8) * 32 * 4 == 6.0 * MIB
    assert alltoall_bytes_per_layer(8192, 4, 8, 4, 32) == 3 / 4 * 2048 * (16 + 8) * 32 * 4 == 4.5 * MIB
    assert alltoall_bytes_per_layer(8192, 8, 8, 4, 32) == 7 / 8 * 1024 * (16 + 16) * 32 * 4  # kv repeated
    assert alltoall_bytes_per_layer(8192, 1, 8, 4, 32) == 0.0
    load = workload_from_config(base_config)
    # update on 4 workers at sp 2: dp = 2 groups of 2 rows x 8192 tokens, 4 layers, forward + backward
    per_layer = 1 / 2 * (2 * 8192) / 2 * (16 + 8) * 32 * 4
    assert load.alltoall_bytes("update_actor", 4, 2) == 2 * 4 * per_layer
    assert load.alltoall_bytes("old_log_prob", 4, 2) == 4 * per_layer  # a forward: one pass
    assert load.alltoall_bytes("gen", 4, 2) == 0.0  # generation is never split
    # the stage carries it: update's lane grows by the bytes over the link
    workers, pool_of = {"p": 4}, {"actor_rollout": "p"}
    _, at_one = step_seconds(MODEL, load, pool_of, workers)
    _, at_two = step_seconds(MODEL, load, pool_of, workers, sp={"actor_rollout": 2})
    link = MODEL.link_gb_per_s * 1e9
    assert at_two["update"] - at_one["update"] == pytest.approx(8 * per_layer / link, rel=1e-12)
    assert at_two["gen"] == at_one["gen"]


def test_activation_memory_reproduces_the_calibration(base_config):
    load = workload_from_config(base_config)
    assert load.shapes["actor_rollout"] == {
        "hidden": 256, "heads": 8, "kv_heads": 4, "head_dim": 32, "vocab": 4096, "vision": 0,
    }  # fmt: skip
    assert (load.micro_rows["actor_rollout"], load.sequence_tokens) == (1, 8192)
    assert activation_bytes(load, "actor_rollout", 1, 2) == 1364 * MIB  # SP = 1 x DP = 2, measured
    assert activation_bytes(load, "actor_rollout", 2, 2) == 868 * MIB  # SP = 2 x DP = 1, measured
    assert activation_bytes(load, "actor_rollout", 4, 4) == 124 * 2048 * 256 * 4 + 47616 * 8192


def test_long_response_gets_the_smallest_sp_that_fits(base_config):
    config = base_config
    load = workload_from_config(config)
    usable = 1100  # MiB: sp = 1 needs 1364 + the shards, sp = 2 868 + the shards
    ranked = rank_placements(config, MODEL, _memory_gb(usable))
    # 1 worker cannot split a sequence; 2 and 4 workers run at sp = 2 (sp = 4 also fits 4: not needed)
    assert sorted(c.placement.total_workers for c in ranked) == [2, 4]
    assert all(c.sp == {"actor_rollout": 2} for c in ranked)
    for cand in ranked:
        workers = cand.placement.total_workers
        peak = _resident(load, workers) + 868 * MIB
        assert cand.peak_bytes[cand.placement.pool_of("actor_rollout")] == pytest.approx(peak)
        assert _resident(load, workers) + 1364 * MIB > usable * MIB  # sp = 1 would not fit
    assert ranked[0].placement.total_workers == 4  # the halved per-worker work outweighs more bytes
    assert format_ranking(ranked).splitlines()[1].endswith("sp: actor_rollout=2")
    # tighter: only 4 workers at sp = 4 (632 MiB + the shards) fit
    ranked = rank_placements(config, MODEL, _memory_gb(700))
    assert [(c.placement.total_workers, c.sp) for c in ranked] == [(4, {"actor_rollout": 4})]


def test_short_response_and_no_memory_limit_keep_sp_1(base_config):
    short = rank_placements(_config(base_config, data__max_response_length=64), MODEL, _memory_gb(1100))
    assert sorted(c.placement.total_workers for c in short) == [1, 2, 4]
    assert all(c.sp == {"actor_rollout": 1} for c in short)
    unlimited = rank_placements(base_config, MODEL, None)
    assert all(c.sp == {"actor_rollout": 1} for c in unlimited) and len(unlimited) == 3


def test_sp_options_follow_verl_s_kv_rule_and_divide_the_pool(base_config, tmp_path):
    def options(heads, kv_heads, workers):
        path = _model_dir(tmp_path / f"m{heads}_{kv_heads}", heads, kv_heads)
        config = _config(base_config, actor_rollout_ref__model__path=path)
        placement = Placement({"p": (workers,)}, {"actor_rollout": "p"})
        return sp_options(config, workload_from_config(config), placement, "actor_rollout")

    assert options(8, 4, 6) == [1, 2]  # 3 and 6 do not divide 8 heads
    assert options(8, 2, 8) == [1, 2, 4, 8]  # kv heads split (2) or repeated (4, 8)
    assert options(12, 3, 4) == [1]  # 3 kv heads: neither 3 % 2 nor 2 % 3, nor 4 and 3
    assert options(12, 4, 8) == [1, 2, 4]  # 8 does not divide 12 heads
    # a role whose heads tensor parallelism splits cannot take SP
    config = _config(base_config, actor_rollout_ref__actor__tensor_model_parallel_size=2)
    placement = Placement({"p": (4,)}, {"actor_rollout": "p"})
    assert sp_options(config, workload_from_config(config), placement, "actor_rollout") == [1]


def test_an_sp_the_config_sets_is_kept(base_config):
    config = _config(base_config, actor_rollout_ref__actor__ulysses_sequence_parallel_size=4)
    ranked = rank_placements(config, MODEL, _memory_gb(4000))  # sp = 1 would fit: 4 is kept anyway
    assert [(c.placement.total_workers, c.sp) for c in ranked] == [(4, {"actor_rollout": 4})]
    # the newer engine's key is read too; a pool of 2 workers cannot hold sp = 4, so none is left
    engine = {"actor_rollout_ref__actor__fsdp_config__ulysses_sequence_parallel_size": 4}
    two_devices = _config(base_config, trainer__n_gpus_per_node=2, **engine)
    assert rank_placements(two_devices, MODEL, None) == []


def _profile(tmp_path, load: Workload, device_memory_gb: float) -> str:
    """A profile at 1 and 2 workers whose phases take 1e-12 s per work unit (as MODEL)."""
    samples = [
        {
            "workers": {"actor_rollout": w},
            "workload": {**load.__dict__},
            "seconds": {
                p: load.work(p) * 1e-12 / (1 if p in ("reward", "adv") else w) for p in load.phases()
            },
            "step_s": 1.0,
        }
        for w in (1, 2)
    ]
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"version": 1, "device_memory_gb": device_memory_gb, "samples": samples}))
    return str(path)


def test_placement_auto_writes_verl_s_key_and_says_why(base_config, arithmetic_data, tmp_path):
    train, test = arithmetic_data
    profile = _profile(tmp_path, workload_from_config(base_config), _memory_gb(1100))
    config = _config(
        base_config,
        data__train_files=train,
        data__val_files=test,
        trainer__placement="auto",
        trainer__placement_profile=profile,
    )
    validate_config(config)
    [note] = resolve_auto_placement(config)
    assert config.actor_rollout_ref.actor.ulysses_sequence_parallel_size == 2
    resident = _resident(workload_from_config(config), 4)
    assert note.endswith(
        f"; Ulysses SP: actor_rollout sp=2 (predicted {(resident + 868 * MIB) / 2**30:.2f} GiB per worker "
        f"of {1100 / 1024:.2f} usable; sp=1 would need {(resident + 1364 * MIB) / 2**30:.2f} GiB)"
    ), note
    assert config.trainer.resource_pool_spec == {"actor_rollout": [4]}
    validate_config(config)  # the written sp passes the config's own SP checks on the chosen pool


def test_lora_reference_takes_the_actor_s_sp(base_config):
    # the reference's forward alone fits at sp = 1, but with LoRA it is the actor's own module
    config = _config(
        base_config, actor_rollout_ref__model__lora_rank=8, actor_rollout_ref__actor__use_kl_loss=True
    )
    ranked = rank_placements(config, MODEL, _memory_gb(1100))
    assert ranked and all(c.sp == {"actor_rollout": 2, "ref": 2} for c in ranked)
    without_lora = _config(base_config, actor_rollout_ref__actor__use_kl_loss=True)
    assert {c.sp["ref"] for c in rank_placements(without_lora, MODEL, _memory_gb(1100))} == {1}


def test_the_critic_gets_its_own_sp(base_config, model_dir):
    # GAE with a critic of the same shape (16 bytes/param resident, the same activations as the actor)
    config = _config(
        base_config, critic__enable=True, critic__model__path=model_dir, algorithm__adv_estimator="gae"
    )
    candidates = [Placement({"a": (2,), "c": (2,)}, {"actor_rollout": "a", "critic": "c"})]
    [cand] = rank_placements(config, MODEL, _memory_gb(1100), candidates)
    assert cand.sp == {"actor_rollout": 2, "critic": 2}
    load = workload_from_config(config)
    pools = {"actor_rollout": "a", "critic": "c"}
    _, at_one = step_seconds(MODEL, load, pools, {"a": 2, "c": 2})
    link = MODEL.link_gb_per_s * 1e9
    # prepare is the critic's values lane (no old-log-prob pass: one mini-batch, one epoch); on 2 workers
    # at sp 2 one group (dp 1) takes all 4 rows: 1/2 x (4 x 8192) / 2 x 24 heads x 32 x 4 bytes a layer
    values_a2a = 4 * (1 / 2 * (4 * 8192) / 2 * 24 * 32 * 4) / link
    assert load.alltoall_bytes("values", 2, 2) / link == pytest.approx(values_a2a, rel=1e-12)
    assert cand.stages["prepare"] == pytest.approx(at_one["prepare"] + values_a2a, rel=1e-9)
