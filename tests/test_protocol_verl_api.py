"""The parts of verl's protocol API added for verl users: num_batch_dims, verl's storage of nested
non-tensor columns, unfold_column_chunks, the explicit (de)serialisers, and errors that are both
ValueError and AssertionError."""

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from hybridflow.protocol import (
    DataProto,
    DataProtoError,
    deserialize_single_tensor,
    deserialize_tensordict,
    serialize_single_tensor,
    serialize_tensordict,
    union_numpy_dict,
)


def test_refusals_are_value_and_assertion_errors():
    assert issubclass(DataProtoError, ValueError) and issubclass(DataProtoError, AssertionError)
    six = DataProto.from_dict({"x": torch.arange(6)})
    for bad in (lambda: six.chunk(4), lambda: six.split([1, 1]), lambda: six.reorder(torch.arange(5))):
        with pytest.raises(AssertionError):
            bad()
        with pytest.raises(ValueError):
            bad()


def test_num_batch_dims_two_is_read_then_refused_by_the_one_batch_dim_rule():
    a, b = torch.zeros(4, 3), torch.zeros(4, 3, 2)
    assert DataProto.from_dict({"a": a, "b": b}, num_batch_dims=1).batch.batch_size == (4,)
    with pytest.raises(DataProtoError, match="one batch dim"):  # (4, 3) agree, but DataProto holds one
        DataProto.from_dict({"a": a, "b": b}, num_batch_dims=2)
    with pytest.raises(DataProtoError, match="disagree"):  # (4, 3) vs (4, 2)
        DataProto.from_dict({"a": a, "b": torch.zeros(4, 2)}, num_batch_dims=2)
    with pytest.raises(DataProtoError, match="num_batch_dims=1"):
        DataProto.from_dict({"a": a}, {"s": ["p", "q", "r", "t"]}, num_batch_dims=2)


def test_non_tensor_columns_are_stored_as_verl_stores_them():
    data = DataProto.from_dict(
        non_tensors={
            "pairs": [["a1", "a2"], ["b1", "b2"]],  # equal lengths: a (2, 2) object array
            "ragged": [[], [0.5]],  # ragged: one list per row
            "ints": np.array([1, 2], dtype=np.int32),  # a numpy array is kept as it is
        }
    )
    assert data.non_tensor_batch["pairs"].shape == (2, 2) and data.non_tensor_batch["pairs"][1, 0] == "b1"
    assert data.non_tensor_batch["ragged"].shape == (2,) and data.non_tensor_batch["ragged"][1] == [0.5]
    assert data.non_tensor_batch["ints"].dtype == np.int32


def test_unfold_column_chunks_by_hand():
    # row 0: obs [1 2 3 4] -> rows [1 2], [3 4]; row 1: [5 6 7 8] -> [5 6], [7 8]
    # keep (not split) repeats each row twice; pairs (split) gives one column per new row.
    data = DataProto.from_dict(
        {"obs": torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]), "keep": torch.tensor([10, 20])},
        {"pairs": [["a1", "a2"], ["b1", "b2"]], "tag": ["a", "b"]},
        meta_info={"m": {"k": 1}},
    )
    out = data.unfold_column_chunks(2, split_keys=["obs", "pairs"])
    assert out.batch["obs"].tolist() == [[1, 2], [3, 4], [5, 6], [7, 8]]
    assert out.batch["keep"].tolist() == [10, 10, 20, 20]
    assert out.non_tensor_batch["pairs"].tolist() == [["a1"], ["a2"], ["b1"], ["b2"]]
    assert out.non_tensor_batch["tag"].tolist() == ["a", "a", "b", "b"]
    out.meta_info["m"]["k"] = 2
    assert data.meta_info == {"m": {"k": 1}}  # the result owns its meta_info
    with pytest.raises(DataProtoError, match="divisible by 3"):
        data.unfold_column_chunks(3, split_keys=["obs"])


def test_concat_conflict_uses_verls_words():
    one = DataProto.from_dict({"x": torch.zeros(1)}, meta_info={"config": "A"})
    two = DataProto.from_dict({"x": torch.ones(1)}, meta_info={"config": "B"})
    with pytest.raises(AssertionError, match="Conflicting values for meta_info key 'config'"):
        DataProto.concat([one, two])


def test_serialize_single_tensor_is_dtype_shape_and_bytes():
    dtype, shape, data = serialize_single_tensor(torch.tensor([[1.0, -2.0]], dtype=torch.bfloat16))
    assert (dtype, tuple(shape), data.dtype, data.size) == ("bfloat16", (1, 2), np.uint8, 4)  # 2 x 2 bytes
    back = deserialize_single_tensor((dtype, shape, data))
    assert back.dtype == torch.bfloat16 and back.tolist() == [[1.0, -2.0]]
    empty = deserialize_single_tensor(serialize_single_tensor(torch.zeros(0, 3)))
    assert empty.shape == (0, 3)


def test_serialize_tensordict_keeps_dtypes_nesting_and_device():
    jagged = torch.nested.as_nested_tensor([torch.arange(2.0), torch.arange(3.0)], layout=torch.jagged)
    td = TensorDict(
        {"flag": torch.tensor([True, False]), "id": torch.tensor([3, 4]), "rows": jagged},
        batch_size=[2],
        device="cpu",
    )
    batch_size, device, items = serialize_tensordict(td)
    assert batch_size == (2,) and device == "cpu" and items["rows"][0] == "jagged"
    back = deserialize_tensordict((batch_size, device, items))
    assert str(back.device) == "cpu" and back["flag"].dtype == torch.bool and back["id"].tolist() == [3, 4]
    assert [r.tolist() for r in back["rows"].unbind()] == [[0.0, 1.0], [0.0, 1.0, 2.0]]


def test_union_numpy_dict_compares_self_referencing_arrays():
    def loop():
        arr = np.array([None], dtype=object)
        arr[0] = arr
        return arr

    union_numpy_dict({"d": loop()}, {"d": loop()})  # same structure: equal, and no RecursionError
    with pytest.raises(AssertionError, match="`d` in tensor_dict1 and tensor_dict2 are not the same object"):
        union_numpy_dict({"d": loop()}, {"d": np.array([None], dtype=object)})


def test_from_tensordict_reads_the_batch_size_from_the_first_tensor():
    td = TensorDict({"x": torch.zeros(2, 3)}, batch_size=[2])
    assert len(DataProto.from_tensordict(td)) == 2
    with pytest.raises(DataProtoError, match="one batch dim"):
        DataProto.from_tensordict(td, num_batch_dims=2)
