"""FSDPCheckpointManager on real gloo process groups: exact resume at world 1 and 2, resharding 2 -> 1,
crash-safety of the save, pruning and content checks."""

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from hybridflow.utils.checkpoint import (
    FSDPCheckpointManager,
    atomic_torch_save,
    find_latest_ckpt_path,
    global_step_dir,
    read_latest_checkpointed_iteration,
    write_latest_checkpointed_iteration,
)
from hybridflow.utils.checkpoint.fsdp_checkpoint_manager import read_checkpoint_meta
from tests.utils.checkpoint import fsdp_toy
from tests.utils.checkpoint.fsdp_toy import build, full_optim_state, full_weights, train_steps


@pytest.fixture(scope="module")
def world1():
    """A single-rank gloo process group in this process, for the whole module."""
    with fsdp_toy.gloo_group():
        yield


def _assert_same_state(actual: dict, expected: dict) -> None:
    flat_a, flat_e = _flatten(actual), _flatten(expected)
    assert flat_a.keys() == flat_e.keys()
    for key, value in flat_e.items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(flat_a[key], value, rtol=0, atol=0, msg=key)
        else:
            assert flat_a[key] == value, key


def _flatten(obj, prefix=""):
    if isinstance(obj, dict):
        return {k: v for key, val in obj.items() for k, v in _flatten(val, f"{prefix}{key}.").items()}
    if isinstance(obj, list):
        return {k: v for i, val in enumerate(obj) for k, v in _flatten(val, f"{prefix}{i}.").items()}
    return {prefix: obj}


def _assert_exact_resume(result: dict) -> None:
    torch.testing.assert_close(
        torch.tensor(result["losses_loaded"]), torch.tensor(result["losses_saved"]), rtol=0, atol=1e-6
    )
    (t_saved, py_saved, np_saved), (t_loaded, py_loaded, np_loaded) = (
        result["probe_saved"],
        result["probe_loaded"],
    )
    assert torch.equal(t_saved, t_loaded) and py_saved == py_loaded and np_saved == np_loaded


def test_exact_resume_world1(world1, tmp_path):
    result = fsdp_toy.save_and_resume(str(tmp_path / "actor"))
    _assert_exact_resume(result)
    assert result["meta"] == {
        "global_step": 2,
        "world_size": 1,
        "model_class": "Qwen2ForCausalLM",
        "dtype": "float32",
        "contents": ["model", "optimizer", "extra"],
        "trainable_only": False,
    }


def test_exact_resume_world2_and_layout():
    run_dir = fsdp_toy.world2_run()
    for rank in range(2):
        _assert_exact_resume(torch.load(run_dir / f"rank{rank}.pt", weights_only=False))
    ckpt = run_dir / "ckpt"
    expected = ["checkpoint_meta.json", "extra_state_rank_0.pt", "extra_state_rank_1.pt"]
    expected += [
        f"huggingface/{name}" for name in ("config.json", "generation_config.json", "tokenizer.json")
    ]
    expected += [
        f"{part}/{name}"
        for part in ("model", "optim")
        for name in (".metadata", "__0_0.distcp", "__1_0.distcp")
    ]
    assert all((ckpt / name).is_file() for name in expected), sorted(str(p) for p in ckpt.rglob("*"))
    assert read_checkpoint_meta(ckpt)["world_size"] == 2
    assert not (run_dir / "ckpt.tmp").exists()


def test_reshard_world2_checkpoint_into_world1(world1):
    run_dir = fsdp_toy.world2_run()
    at_save = torch.load(run_dir / "rank0.pt", weights_only=False)
    model, optimizer, scheduler = build(1, seed=7)
    FSDPCheckpointManager(model, optimizer, scheduler).load_checkpoint(str(run_dir / "ckpt"))
    _assert_same_state(full_weights(model), at_save["weights"])
    _assert_same_state(full_optim_state(model, optimizer), at_save["optim_state"])
    assert scheduler.last_epoch == 2
    assert torch.equal(torch.rand(3), at_save["probe_saved"][0])  # rank 0's RNG


def _crash_on_second_dcp_save(monkeypatch):
    """The model shards get written, then the process 'dies' while writing the optimizer shards."""
    real_save, calls = dcp.save, []

    def save(state_dict, **kwargs):
        calls.append(kwargs["checkpoint_id"])
        if len(calls) == 2:
            raise RuntimeError("simulated crash during save")
        return real_save(state_dict, **kwargs)

    monkeypatch.setattr(dcp, "save", save)


def test_crash_mid_save_keeps_previous_checkpoint_and_tracker(world1, tmp_path, monkeypatch):
    root = str(tmp_path)
    model, optimizer, scheduler = build(1)
    manager = FSDPCheckpointManager(model, optimizer, scheduler)
    train_steps(model, optimizer, scheduler, 2)
    # The trainer's order: every part of step 2, then the tracker.
    manager.save_checkpoint(os.path.join(global_step_dir(root, 2), "actor"), global_step=2)
    atomic_torch_save({"dataloader_step": 2}, os.path.join(global_step_dir(root, 2), "data.pt"))
    write_latest_checkpointed_iteration(root, 2)
    weights_step2 = full_weights(model)

    train_steps(model, optimizer, scheduler, 2)
    step4_actor = os.path.join(global_step_dir(root, 4), "actor")
    with monkeypatch.context() as patch:
        _crash_on_second_dcp_save(patch)
        with pytest.raises(RuntimeError, match="simulated crash"):
            manager.save_checkpoint(step4_actor, global_step=4)
    assert read_latest_checkpointed_iteration(root) == 2
    # a save that raises removes its partial shards; a killed one leaves the .tmp, never a checkpoint
    assert not os.path.exists(step4_actor) and not os.path.exists(step4_actor + ".tmp")
    os.makedirs(os.path.join(step4_actor + ".tmp", "model"))  # what a save killed mid-way leaves
    with pytest.raises(FileNotFoundError, match="incomplete"):
        FSDPCheckpointManager(model).load_checkpoint(step4_actor + ".tmp")

    latest = find_latest_ckpt_path(root)
    fresh_model, fresh_optimizer, fresh_scheduler = build(1, seed=7)
    meta = FSDPCheckpointManager(fresh_model, fresh_optimizer, fresh_scheduler).load_checkpoint(
        os.path.join(latest, "actor")
    )
    assert meta["global_step"] == 2 and fresh_scheduler.last_epoch == 2
    _assert_same_state(full_weights(fresh_model), weights_step2)

    manager.save_checkpoint(step4_actor, global_step=4)  # the next save clears the stale .tmp
    assert read_checkpoint_meta(step4_actor)["global_step"] == 4
    assert not os.path.exists(step4_actor + ".tmp")


def test_crash_while_overwriting_same_path_keeps_old_checkpoint(world1, tmp_path, monkeypatch):
    path = str(tmp_path / "actor")
    model, optimizer, scheduler = build(1)
    manager = FSDPCheckpointManager(model, optimizer, scheduler)
    train_steps(model, optimizer, scheduler, 1)
    manager.save_checkpoint(path, global_step=1)
    weights_step1 = full_weights(model)
    train_steps(model, optimizer, scheduler, 1)
    _crash_on_second_dcp_save(monkeypatch)
    with pytest.raises(RuntimeError, match="simulated crash"):
        manager.save_checkpoint(path, global_step=2)

    fresh_model, fresh_optimizer, fresh_scheduler = build(1, seed=7)
    assert (
        FSDPCheckpointManager(fresh_model, fresh_optimizer, fresh_scheduler).load_checkpoint(path)[
            "global_step"
        ]
        == 1
    )
    _assert_same_state(full_weights(fresh_model), weights_step1)


def test_missing_checkpoint_error_names_path(world1, tmp_path):
    model, _, _ = build(1)
    manager = FSDPCheckpointManager(model)
    missing = tmp_path / "global_step_9" / "actor"
    with pytest.raises(FileNotFoundError, match="global_step_9"):
        manager.load_checkpoint(str(missing))
    missing.mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="incomplete"):
        manager.load_checkpoint(str(missing))


def test_max_ckpt_to_keep_prunes_oldest_written(world1, tmp_path):
    root = str(tmp_path)
    model, optimizer, scheduler = build(1)
    manager = FSDPCheckpointManager(model, optimizer, scheduler)
    os.makedirs(global_step_dir(root, 1))
    atomic_torch_save({}, os.path.join(global_step_dir(root, 1), "data.pt"))  # another part of step 1
    for step in (1, 2, 3, 4):
        manager.save_checkpoint(os.path.join(global_step_dir(root, step), "actor"), step, max_ckpt_to_keep=2)

    assert sorted(os.listdir(root)) == ["global_step_1", "global_step_3", "global_step_4"]
    assert os.listdir(global_step_dir(root, 1)) == ["data.pt"]  # only the manager's own directory went
    assert [step for step, _ in manager.saved_checkpoints] == [3, 4]


def test_checkpoint_contents_are_recorded_and_checked(world1, tmp_path):
    with pytest.raises(ValueError, match="Unknown checkpoint contents"):
        FSDPCheckpointManager(None, checkpoint_contents=("model", "weights"))
    model, optimizer, scheduler = build(1)
    path = str(tmp_path / "actor")
    FSDPCheckpointManager(model, optimizer, checkpoint_contents=("model",)).save_checkpoint(path, 3)
    assert read_checkpoint_meta(path)["contents"] == ["model"]
    assert sorted(os.listdir(path)) == ["checkpoint_meta.json", "huggingface", "model"]
    with pytest.raises(ValueError, match=r"lacks \['extra', 'optimizer'\]"):
        FSDPCheckpointManager(model, optimizer, scheduler).load_checkpoint(path)
    meta = FSDPCheckpointManager(model, checkpoint_contents=("model",)).load_checkpoint(path)
    assert meta["global_step"] == 3
