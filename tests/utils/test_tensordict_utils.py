"""hybridflow.utils.tensordict_utils: verl's helpers for a TensorDict holding a whole batch."""

import pytest
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from hybridflow.errors import InvalidInputError
from hybridflow.protocol import DataProto
from hybridflow.utils import tensordict_utils as tu


def jagged(*rows):
    return torch.nested.as_nested_tensor(
        [torch.tensor(r, dtype=torch.float32) for r in rows], layout=torch.jagged
    )


def test_get_tensordict_columns_and_batch_values():
    td = tu.get_tensordict({"obs": torch.arange(3), "turns": [[], [1], [2, 3]]}, {"step": 7})
    assert td.batch_size == (3,)
    assert isinstance(td.get("turns"), NonTensorStack) and isinstance(td.get("step"), NonTensorData)
    assert tu.get(td, "turns") == [[], [1], [2, 3]] and tu.get(td, "step") == 7
    assert tu.get(td, "missing", "dflt") == "dflt"
    assert tu.get_tensordict({}, {"only": 1}).batch_size == ()
    with pytest.raises(InvalidInputError, match="has 2 rows"):
        tu.get_tensordict({"a": torch.zeros(3), "b": [1, 2]})
    with pytest.raises(AssertionError, match="both a column"):
        tu.get_tensordict({"a": [1]}, {"a": 2})


def test_round_trip_with_dataproto():
    td = tu.get_tensordict({"obs": torch.tensor([1, 2]), "label": ["a", "b"]}, {"name": "run"})
    data = DataProto.from_tensordict(td)
    assert data.non_tensor_batch["label"].tolist() == ["a", "b"] and data.meta_info == {"name": "run"}
    assert tu.get(data.to_tensordict(), "label") == ["a", "b"]


def test_assign_pop_and_key_subsets():
    td = TensorDict({"x": torch.arange(2)}, batch_size=[2])
    tu.assign_non_tensor(td, tag="t", rows=[{"a": 1}, {"a": 2}])
    assert tu.get_non_tensor_data(td, "tag", None) == "t" and tu.get(td, "rows")[1] == {"a": 2}
    part = tu.get_keys(td, ["x", "tag"])
    assert set(part.keys()) == {"x", "tag"} and "tag" in td.keys()
    popped = tu.pop_keys(td, ["rows"])
    assert tu.get(popped, "rows") == [{"a": 1}, {"a": 2}] and "rows" not in td.keys()
    assert tu.pop(td, "tag") == "t" and tu.pop(td, "tag", 0) == 0


def test_rows_of_jagged_tensors_select_concat_chunk_and_pad():
    td = TensorDict(
        {"ids": jagged([1], [2, 2], [3, 3, 3]), "w": torch.tensor([1.0, 2.0, 3.0])}, batch_size=[3]
    )
    picked = tu.index_select_tensor_dict(td, [2, 0])
    assert [r.tolist() for r in picked["ids"].unbind()] == [[3, 3, 3], [1]] and picked["w"].tolist() == [3, 1]
    joined = tu.concat_tensordict([td, picked])
    assert len(joined) == 5 and joined["ids"].unbind()[4].tolist() == [1]
    padded, pad = tu.pad_to_divisor(td, 4)  # rows [a, b, c] -> [a, b, c, a]
    assert pad == 1 and padded["w"].tolist() == [1, 2, 3, 1]
    assert tu.unpad(padded, pad)["w"].tolist() == [1, 2, 3]
    with pytest.raises(AssertionError):
        tu.chunk_tensordict(td, 2)
    parts = tu.chunk_tensordict(tu.concat_tensordict([td, td]), 2)
    tu.assert_tensordict_eq(parts[0], td)


def test_make_iterator_is_reproducible_and_covers_every_row():
    td = TensorDict({"x": torch.arange(6)}, batch_size=[6])
    first = [
        b["x"].tolist()
        for b in tu.make_iterator(td, 3, epochs=2, seed=1, dataloader_kwargs={"shuffle": True})
    ]
    again = [
        b["x"].tolist()
        for b in tu.make_iterator(td, 3, epochs=2, seed=1, dataloader_kwargs={"shuffle": True})
    ]
    assert first == again and sorted(first[0] + first[1]) == list(range(6))
    with pytest.raises(ValueError):
        list(tu.make_iterator(td, 4, epochs=1))


def test_contiguous_and_unwrap():
    td = tu.get_tensordict({"x": torch.arange(6).reshape(2, 3).t().t()[:, ::2]}, {"tag": "t"})
    assert not td["x"].is_contiguous()
    out = tu.contiguous(td)
    assert out["x"].is_contiguous() and out["x"].tolist() == [[0, 2], [3, 5]] and tu.get(out, "tag") == "t"
    assert tu.unwrap_non_tensor_data(NonTensorData(3)) == 3 and tu.unwrap_non_tensor_data(4) == 4
