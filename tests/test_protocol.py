"""DataProto semantics (verl-compatible) and the pitfalls it avoids."""

import pickle

import numpy as np
import pytest
import torch

from hybridflow import keys
from hybridflow.protocol import (
    DataProto,
    DataProtoItem,
    pad_dataproto_to_divisor,
    unpad_dataproto,
)


def make(n: int = 4, meta: dict | None = None, **kwargs) -> DataProto:
    return DataProto.from_single_dict(
        {
            "obs": torch.arange(n * 2, dtype=torch.float32).reshape(n, 2),
            "ids": torch.arange(n),
            "uid": np.array([f"u{i}" for i in range(n)], dtype=object),
            "info": [{"k": i} for i in range(n)],
        },
        meta_info=meta if meta is not None else {"temperature": 1.0},
        **kwargs,
    )


def test_from_single_dict_splits_tensors_and_non_tensors():
    data = make(3)
    assert len(data) == 3
    assert set(data.batch.keys()) == {"obs", "ids"}
    assert set(data.non_tensor_batch) == {"uid", "info"}
    assert data.non_tensor_batch["info"].dtype == object and data.non_tensor_batch["info"][1] == {"k": 1}


def test_from_dict_keeps_ragged_lists_as_objects():
    data = DataProto.from_dict(non_tensors={"turns": [[1, 2], [3], [4, 5]]})
    assert len(data) == 3 and data.non_tensor_batch["turns"][1] == [3]


def test_inconsistent_lengths_are_rejected():
    with pytest.raises(ValueError, match="disagree"):
        DataProto.from_dict({"a": torch.zeros(3), "b": torch.zeros(4)})
    with pytest.raises(ValueError, match="disagree on length"):
        DataProto.from_dict({"a": torch.zeros(3)}, {"s": ["x", "y"]})


def test_getitem_int_slice_list_mask_tensor():
    data = make(4)
    item = data[2]
    assert isinstance(item, DataProtoItem)
    assert item.batch["ids"].item() == 2 and item.non_tensor_batch["uid"] == "u2"
    assert data[1:3].batch["ids"].tolist() == [1, 2]
    assert data[[3, 0]].batch["ids"].tolist() == [3, 0]
    assert list(data[[3, 0]].non_tensor_batch["uid"]) == ["u3", "u0"]
    mask = torch.tensor([True, False, True, False])
    assert data[mask].batch["ids"].tolist() == [0, 2]
    assert data[np.array([False, True, True, True])].batch["ids"].tolist() == [1, 2, 3]
    assert data[torch.tensor([1])].batch["ids"].tolist() == [1]
    with pytest.raises(ValueError, match="boolean mask"):
        data.select_idxs(torch.tensor([True, False]))


def test_select_and_pop():
    data = make(3)
    sub = data.select(batch_keys=["obs"], non_tensor_batch_keys=["uid"], meta_info_keys=[])
    assert list(sub.batch.keys()) == ["obs"] and list(sub.non_tensor_batch) == ["uid"] and sub.meta_info == {}
    popped = data.pop(batch_keys=["ids"], non_tensor_batch_keys=["info"], meta_info_keys=["temperature"])
    assert list(popped.batch.keys()) == ["ids"] and popped.meta_info == {"temperature": 1.0}
    assert "ids" not in data.batch.keys() and "info" not in data.non_tensor_batch
    assert "temperature" not in data.meta_info
    with pytest.raises(KeyError, match=r"no key\(s\) \['nope'\]"):
        data.select(batch_keys=["nope"])


def test_select_deepcopy_does_not_share_storage():
    data = make(2)
    copy = data.select(deepcopy=True)
    copy.batch["obs"][0, 0] = 99.0
    assert data.batch["obs"][0, 0] == 0.0


def test_rename():
    data = make(2).rename("obs", "observations")
    assert "observations" in data.batch.keys() and "obs" not in data.batch.keys()
    with pytest.raises(ValueError, match="old keys"):
        data.rename(["a", "b"], ["c"])


def test_union_merges_and_detects_conflicts():
    left = make(3)
    right = DataProto.from_dict(
        {"ids": torch.arange(3), "extra": torch.ones(3)}, {"uid": left.non_tensor_batch["uid"]}, {"step": 7}
    )
    left.union(right)
    assert set(left.batch.keys()) == {"obs", "ids", "extra"} and left.meta_info["step"] == 7
    with pytest.raises(ValueError, match="batch key 'ids' differs"):
        left.union(DataProto.from_dict({"ids": torch.arange(3) + 1}))
    with pytest.raises(ValueError, match="non_tensor_batch key 'uid' differs"):
        left.union(DataProto.from_dict(non_tensors={"uid": ["a", "b", "c"]}))
    with pytest.raises(ValueError, match="meta_info key 'step' conflicts"):
        left.union(DataProto.from_dict({"extra": torch.ones(3)}, meta_info={"step": 8}))
    with pytest.raises(ValueError, match="batch sizes differ"):
        left.union(make(2))


def test_union_does_not_alias_meta_info():
    nested = {"metrics": {"a": 1}}
    left, right = make(2, meta={}), make(2, meta=nested)
    left.union(right)
    left.meta_info["metrics"]["a"] = 2
    assert right.meta_info["metrics"]["a"] == 1


def test_chunk_exact_and_errors_without_padding():
    parts = make(4).chunk(2)
    assert [p.batch["ids"].tolist() for p in parts] == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="does not split into 3 equal parts"):
        make(4).chunk(3)


def test_chunk_uneven_with_auto_padding():
    parts = make(5, auto_padding=True).chunk(2)
    assert [len(p) for p in parts] == [3, 2]
    assert parts[1].non_tensor_batch["uid"].tolist() == ["u3", "u4"]


def test_chunk_and_split_never_alias_meta_info():
    data = make(4, meta={"metrics": {"x": [1]}, "temperature": 1.0})
    parts = data.chunk(2)
    parts[0].meta_info["temperature"] = 0.0
    parts[0].meta_info["metrics"]["x"].append(2)
    assert parts[1].meta_info == {"metrics": {"x": [1]}, "temperature": 1.0}
    assert data.meta_info == {"metrics": {"x": [1]}, "temperature": 1.0}
    halves = data.split(2)
    assert halves[0].meta_info is not halves[1].meta_info


def test_split_by_size_and_by_list():
    assert [len(p) for p in make(5).split(2)] == [2, 2, 1]
    assert [len(p) for p in make(5).split([1, 4])] == [1, 4]
    with pytest.raises(ValueError, match="do not add up"):
        make(5).split([1, 1])


def test_concat_collects_metrics_and_rejects_conflicting_meta():
    parts = make(4).chunk(2)
    parts[0].meta_info["metrics"] = {"loss": 1.0}
    parts[1].meta_info["metrics"] = {"loss": 2.0}
    joined = DataProto.concat(parts)
    assert joined.batch["ids"].tolist() == [0, 1, 2, 3]
    assert joined.non_tensor_batch["uid"].tolist() == ["u0", "u1", "u2", "u3"]
    assert joined.meta_info == {"temperature": 1.0, "metrics": {"loss": [1.0, 2.0]}}
    parts[1].meta_info["temperature"] = 0.5
    with pytest.raises(ValueError, match="Conflicting values for meta_info key 'temperature'"):
        DataProto.concat(parts)


def test_reorder_and_repeat():
    data = make(3)
    data.reorder(torch.tensor([2, 0, 1]))
    assert data.batch["ids"].tolist() == [2, 0, 1] and data.non_tensor_batch["uid"].tolist() == [
        "u2",
        "u0",
        "u1",
    ]
    base = make(2)
    assert base.repeat(2, interleave=True).batch["ids"].tolist() == [0, 0, 1, 1]
    assert base.repeat(3, interleave=False).non_tensor_batch["uid"].tolist() == ["u0", "u1"] * 3


def test_padding_and_pad_to_divisor_roundtrip():
    data = make(3)
    data.padding(2)
    assert data.batch["ids"].tolist() == [0, 1, 2, 0, 0]
    last = make(3)
    last.padding(1, padding_candidate="last")
    assert last.batch["ids"].tolist() == [0, 1, 2, 2]
    small = make(2)
    padded, pad = pad_dataproto_to_divisor(small, 5)
    assert pad == 3 and padded.batch["ids"].tolist() == [0, 1, 0, 1, 0]
    assert padded.meta_info == small.meta_info and padded.meta_info is not small.meta_info
    assert unpad_dataproto(padded, pad).batch["ids"].tolist() == [0, 1]
    same, zero = pad_dataproto_to_divisor(make(4), 2)
    assert zero == 0 and len(same) == 4


def test_make_iterator_covers_each_epoch_and_is_reproducible():
    data = make(8)
    batches = list(data.make_iterator(mini_batch_size=4, epochs=2, seed=1, shuffle=True))
    assert len(batches) == 4 and all(len(b) == 4 for b in batches)
    for epoch in (batches[:2], batches[2:]):
        assert sorted(torch.cat([b.batch["ids"] for b in epoch]).tolist()) == list(range(8))
    again = list(data.make_iterator(4, 2, seed=1, dataloader_kwargs={"shuffle": True}))
    assert [b.batch["ids"].tolist() for b in again] == [b.batch["ids"].tolist() for b in batches]
    first, second = (torch.cat([b.batch["ids"] for b in e]).tolist() for e in (batches[:2], batches[2:]))
    assert first != second  # a fresh permutation per epoch
    plain = list(data.make_iterator(4, 1))
    assert [b.batch["ids"].tolist() for b in plain] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="not divisible"):
        next(data.make_iterator(3, 1))


def test_pickle_roundtrip_preserves_dtypes_including_bf16():
    data = make(3)
    data.batch["half"] = torch.randn(3, 4).to(torch.bfloat16)
    data.batch["flags"] = torch.tensor([True, False, True])
    restored = pickle.loads(pickle.dumps(data, protocol=5))
    for key in data.batch.keys():
        assert restored.batch[key].dtype == data.batch[key].dtype
        assert torch.equal(restored.batch[key], data.batch[key])
    assert restored.non_tensor_batch["info"][2] == {"k": 2}
    assert restored.meta_info == data.meta_info


def test_pickle_moves_tensors_as_out_of_band_buffers():
    data = DataProto.from_dict({"big": torch.zeros(1000, 1000)})
    buffers = []
    payload = pickle.dumps(data, protocol=5, buffer_callback=buffers.append)
    assert len(payload) < 10_000  # the 4 MB tensor travels out of band, not inside the pickle stream
    assert sum(memoryview(b).nbytes for b in buffers) == 4_000_000


def test_read_only_buffers_are_copied_on_load():
    data = DataProto.from_dict({"x": torch.zeros(4)})
    buffers = []
    payload = pickle.dumps(data, protocol=5, buffer_callback=buffers.append)
    frozen = [memoryview(bytes(b.raw())) for b in buffers]  # read-only, like Ray's object store
    restored = pickle.loads(payload, buffers=frozen)
    restored.batch["x"] += 1  # must not raise or write into the shared buffer
    assert restored.batch["x"].tolist() == [1.0] * 4


def test_save_and_load_from_disk(tmp_path):
    data = make(3)
    path = tmp_path / "batch.pkl"
    data.save_to_disk(path)
    loaded = DataProto.load_from_disk(path)
    assert torch.equal(loaded.batch["obs"], data.batch["obs"])
    assert not list(tmp_path.glob("*.tmp-*"))


def test_to_device_and_repr():
    data = make(2).to("cpu")
    assert data.batch["obs"].device.type == "cpu"
    assert "len=2" in repr(data)


def test_standard_keys_are_declared_with_shapes():
    assert keys.SCHEMA[keys.RESPONSES].shape == "(B, T_r)"
    assert keys.OLD_LOG_PROBS == "old_log_probs" and keys.REF_LOG_PROB == "ref_log_prob"
    for name in (
        "input_ids",
        "attention_mask",
        "position_ids",
        "prompts",
        "responses",
        "response_mask",
        "old_log_probs",
        "ref_log_prob",
        "values",
        "token_level_scores",
        "token_level_rewards",
        "advantages",
        "returns",
        "rollout_log_probs",
    ):
        assert name in keys.SCHEMA, name
    assert "responses: (B, T_r) int64" in keys.describe("responses")


# ------------------------------------------------------------------ verl helper APIs
def test_empty_constructions_have_length_zero():
    for data in (DataProto(), DataProto(non_tensor_batch=None), DataProto(meta_info=None)):
        assert len(data) == 0 and data.non_tensor_batch == {} and data.meta_info == {}


def test_sample_level_repeat_per_row_counts():
    data = make(3, meta={"m": [1]})  # ids 0, 1, 2
    for counts in ([2, 0, 3], (2, 0, 3), np.array([2, 0, 3]), torch.tensor([2, 0, 3])):
        out = data.sample_level_repeat(counts)
        assert out.batch["ids"].tolist() == [0, 0, 2, 2, 2]
        assert out.non_tensor_batch["uid"].tolist() == ["u0", "u0", "u2", "u2", "u2"]
        assert out.batch["obs"][2].tolist() == [4.0, 5.0]
    out.meta_info["m"].append(2)
    assert data.meta_info == {"m": [1]}  # never aliased
    with pytest.raises(ValueError, match="one count per row"):
        data.sample_level_repeat([1, 1])
    with pytest.raises(ValueError, match="non-negative"):
        data.sample_level_repeat([1, -1, 1])


def test_to_and_from_tensordict_round_trip():
    from tensordict import NonTensorData, NonTensorStack

    data = make(3, meta={"temperature": 0.7, "steps": [1, 2]})
    td = data.to_tensordict()
    assert td.batch_size == torch.Size([3])
    assert torch.equal(td["obs"], data.batch["obs"])
    assert isinstance(td.get("uid"), NonTensorStack) and td.get("uid").tolist() == ["u0", "u1", "u2"]
    assert isinstance(td.get("temperature"), NonTensorData) and td["temperature"] == 0.7

    back = DataProto.from_tensordict(td, meta_info={"extra": 1})
    assert torch.equal(back.batch["ids"], torch.arange(3))
    assert back.non_tensor_batch["uid"].dtype == object
    assert back.non_tensor_batch["info"].tolist() == [{"k": 0}, {"k": 1}, {"k": 2}]
    assert back.meta_info == {"extra": 1, "temperature": 0.7, "steps": [1, 2]}

    with pytest.raises(ValueError, match=r"\['uid'\]"):
        DataProto.from_dict({"x": torch.zeros(3)}, {"uid": [1, 2, 3]}, {"uid": 0}).to_tensordict()


def test_union_helpers_follow_verl_checks():
    from tensordict import TensorDict

    from hybridflow.protocol import UnionConflictError, union_numpy_dict, union_tensor_dict

    a = TensorDict({"x": torch.ones(2)}, batch_size=[2])
    out = union_tensor_dict(a, TensorDict({"x": torch.ones(2), "y": torch.zeros(2)}, batch_size=[2]))
    assert out is a and set(a.keys()) == {"x", "y"}
    with pytest.raises(UnionConflictError, match="batch key 'x' differs"):
        union_tensor_dict(a, TensorDict({"x": torch.zeros(2), "z": torch.zeros(2)}, batch_size=[2]))
    assert "z" not in a.keys()  # nothing written on a conflict
    with pytest.raises(AssertionError, match="batch sizes differ"):  # verl code catches AssertionError
        union_tensor_dict(a, TensorDict({"x": torch.ones(3)}, batch_size=[3]))

    nan = np.array([1.0, np.nan])
    left = {"v": nan, "o": np.array([{"a": [1, np.nan]}], dtype=object)}
    merged = union_numpy_dict(left, {"v": nan.copy(), "o": np.array([{"a": [1, np.nan]}], dtype=object)})
    assert merged is left  # NaN == NaN, object arrays compared element by element
    with pytest.raises(ValueError, match="key 'v' differs"):  # same values, different dtype: verl refuses
        union_numpy_dict(left, {"v": nan.astype(np.float32)})
    with pytest.raises(ValueError, match="key 'o' differs"):
        union_numpy_dict(left, {"o": np.array([{"a": [2, np.nan]}], dtype=object)})


def test_union_failure_leaves_dataproto_unchanged():
    left = make(2)
    bad = DataProto.from_dict({"new": torch.ones(2)}, {"uid": ["x", "y"]})
    with pytest.raises(ValueError, match="non_tensor_batch key 'uid'"):
        left.union(bad)
    assert "new" not in left.batch.keys()


def test_fold_and_unfold_batch_dim():
    from hybridflow.protocol import fold_batch_dim, unfold_batch_dim

    data = DataProto.from_dict(
        {"x": torch.arange(12).reshape(6, 2)}, {"uid": list("abcdef")}, meta_info={"m": {"k": 1}}
    )
    folded = fold_batch_dim(data, 2)
    assert len(folded) == 2 and folded.batch["x"].shape == (2, 3, 2)
    assert folded.batch["x"][1, 0].tolist() == [6, 7]  # row 3 of the original
    assert folded.non_tensor_batch["uid"].tolist() == [["a", "b", "c"], ["d", "e", "f"]]
    assert data.non_tensor_batch["uid"].shape == (6,)  # the input is left alone
    folded.meta_info["m"]["k"] = 2
    assert data.meta_info["m"]["k"] == 1

    unfolded = unfold_batch_dim(folded, batch_dims=2)
    assert torch.equal(unfolded.batch["x"], data.batch["x"])
    assert unfolded.non_tensor_batch["uid"].tolist() == list("abcdef")
    assert folded.batch.batch_size == torch.Size([2])
    with pytest.raises(ValueError, match="does not fold"):
        fold_batch_dim(data, 4)
