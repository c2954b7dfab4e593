"""RLHFDataset (verl parquet schema, padding, truncation, errors) and the resumable StatefulDataLoader."""

import itertools
import logging

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from hybridflow.models.tiny import build_tokenizer
from hybridflow.protocol import DataProto
from hybridflow.tasks.arithmetic import ArithmeticTaskConfig, task_texts, write_rl_dataset
from hybridflow.utils.dataset import RLHFDataset, StatefulDataLoader, collate_fn


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(task_texts(n=300))


@pytest.fixture(scope="module")
def arithmetic_files(tmp_path_factory):
    cfg = ArithmeticTaskConfig(num_train=12, num_test=4)
    return write_rl_dataset(tmp_path_factory.mktemp("arith"), cfg)


def row(content: str, index=None, data_source="test/source") -> dict:
    extra = {"split": "train"} if index is None else {"split": "train", "index": index}
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": content}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "1"},
        "extra_info": extra,
    }


def write(tmp_path, rows, name="data.parquet"):
    path = tmp_path / name
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def templated_ids(tokenizer, content):
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_item_schema_left_padding_and_position_ids(tokenizer, arithmetic_files):
    dataset = RLHFDataset(arithmetic_files[0], tokenizer, {"max_prompt_length": 48})
    assert len(dataset) == 12
    item = dataset[3]
    for key in ("input_ids", "attention_mask", "position_ids"):
        assert item[key].shape == (48,) and item[key].dtype == torch.int64
    ids = item["raw_prompt_ids"]
    n = len(ids)
    assert item["input_ids"][: 48 - n].tolist() == [tokenizer.pad_token_id] * (48 - n)
    assert item["input_ids"][48 - n :].tolist() == ids
    assert item["attention_mask"].tolist() == [0] * (48 - n) + [1] * n
    assert item["position_ids"].tolist() == [0] * (48 - n) + list(range(n))
    assert tokenizer.decode(ids).startswith("<|im_start|>user\nWhat is ")
    assert tokenizer.decode(ids).endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert item["data_source"] == "hybridflow/arithmetic" and item["ability"] == "math"
    assert item["reward_model"]["style"] == "rule" and item["index"] == 3 == item["extra_info"]["index"]
    assert item["tools_kwargs"] == {} and item["interaction_kwargs"] == {}
    assert "prompt" not in item and "raw_prompt" not in item and "full_prompts" not in item


def test_raw_chat_and_full_prompt(tokenizer, arithmetic_files):
    cfg = {"max_prompt_length": 48, "return_raw_chat": True, "return_full_prompt": True, "cache_dir": "/x"}
    item = RLHFDataset([arithmetic_files[1]], tokenizer, cfg)[0]
    assert item["raw_prompt"][0]["role"] == "user" and item["raw_prompt"][0]["content"].startswith("What is")
    assert item["full_prompts"] == tokenizer.apply_chat_template(
        item["raw_prompt"], add_generation_prompt=True, tokenize=False
    )


def test_mutating_an_item_does_not_touch_the_dataset(tokenizer, arithmetic_files):
    dataset = RLHFDataset(arithmetic_files[0], tokenizer, {"max_prompt_length": 48})
    dataset[0]["reward_model"]["ground_truth"] = "changed"
    assert dataset[0]["reward_model"]["ground_truth"] != "changed"


@pytest.mark.parametrize("mode", ["left", "right", "middle"])
def test_truncation_modes(tokenizer, tmp_path, mode):
    content = "What is 1234567 + 7654321? " * 3
    full = templated_ids(tokenizer, content)
    limit = len(full) - 7
    expected = {
        "left": full[-limit:],
        "right": full[:limit],
        "middle": full[: limit // 2] + full[-(limit - limit // 2) :],
    }
    item = RLHFDataset(
        write(tmp_path, [row(content)]), tokenizer, {"max_prompt_length": limit, "truncation": mode}
    )[0]
    assert item["raw_prompt_ids"] == expected[mode]
    assert item["input_ids"].tolist() == expected[mode] and item["attention_mask"].all()


def test_truncation_error_names_file_row_and_lengths(tokenizer, tmp_path):
    path = write(tmp_path, [row("short"), row("What is 12345678 + 87654321? " * 4)])
    full = len(templated_ids(tokenizer, "What is 12345678 + 87654321? " * 4))
    dataset = RLHFDataset(path, tokenizer, {"max_prompt_length": 30})
    assert dataset[0]["attention_mask"].sum() > 0
    with pytest.raises(
        ValueError, match=rf"data\.parquet row 1: prompt is {full} tokens.*max_prompt_length=30"
    ):
        dataset[1]


def test_bad_truncation_mode(tokenizer, arithmetic_files):
    with pytest.raises(ValueError, match="left.*right.*middle.*error"):
        RLHFDataset(arithmetic_files[0], tokenizer, {"truncation": "both"})


def test_filter_overlong_prompts(tokenizer, tmp_path, caplog):
    rows = [row("a", index=None), row("What is 1 + 2? " * 20), row("b"), row("What is 3 + 4? " * 20)]
    with caplog.at_level(logging.INFO, logger="hybridflow.utils.dataset.rl_dataset"):
        dataset = RLHFDataset(
            write(tmp_path, rows), tokenizer, {"max_prompt_length": 40, "filter_overlong_prompts": True}
        )
    assert len(dataset) == 2
    assert [dataset[i]["index"] for i in range(2)] == [0, 2]  # row numbers from before filtering
    assert "filtered 2 of 4" in caplog.text


def test_multiple_files_concatenate_and_index_falls_back_to_row_number(tokenizer, tmp_path):
    first = write(tmp_path, [row("a"), row("b")], "first.parquet")
    second = write(tmp_path, [row("c", index=70), row("d")], "second.parquet")
    dataset = RLHFDataset([first, second], tokenizer, {"max_prompt_length": 32})
    assert len(dataset) == 4
    assert [dataset[i]["index"] for i in range(4)] == [0, 1, 70, 3]
    assert tokenizer.decode(dataset[2]["raw_prompt_ids"]).startswith("<|im_start|>user\nc")


def test_missing_required_columns_name_file_and_column(tokenizer, tmp_path):
    no_prompt = write(tmp_path, [{"data_source": "x", "question": "hi"}], "no_prompt.parquet")
    with pytest.raises(ValueError, match=r"no_prompt\.parquet has no required column 'prompt'"):
        RLHFDataset(no_prompt, tokenizer, {})
    no_source = write(tmp_path, [{"prompt": [{"role": "user", "content": "hi"}]}], "no_source.parquet")
    with pytest.raises(ValueError, match=r"no_source\.parquet has no required column 'data_source'"):
        RLHFDataset(no_source, tokenizer, {})
    custom_key = RLHFDataset(no_source, tokenizer, {"reward_fn_key": "prompt"})  # any present column works
    assert len(custom_key) == 1
    with pytest.raises(FileNotFoundError, match="missing.parquet"):
        RLHFDataset(str(tmp_path / "missing.parquet"), tokenizer, {})


@pytest.mark.parametrize(
    "prompts, bad_row, message",
    [
        (["What is 1 + 1?"], 0, "must be a non-empty list of chat messages"),  # parquet can't mix with lists
        (
            [[{"role": "user", "content": "ok"}], [{"role": "user"}]],
            1,
            "each message needs string 'role' and 'content'",
        ),
    ],
)
def test_malformed_prompts_name_file_row_and_column(tokenizer, tmp_path, prompts, bad_row, message):
    path = write(tmp_path, [{**row("x"), "prompt": p} for p in prompts], "bad.parquet")
    with pytest.raises(ValueError, match=rf"bad\.parquet row {bad_row} column 'prompt'.*{message}"):
        RLHFDataset(path, tokenizer, {})


def test_collate_fn_feeds_dataproto(tokenizer, arithmetic_files):
    dataset = RLHFDataset(arithmetic_files[0], tokenizer, {"max_prompt_length": 48})
    rows = [dataset[i] for i in range(4)]
    batch = collate_fn(rows)
    longest = max(len(r["raw_prompt_ids"]) for r in rows)
    # shared left padding is trimmed: the batch is as wide as its longest prompt
    assert batch["input_ids"].shape == (4, longest) and rows[0]["input_ids"].shape == (48,)
    assert batch["attention_mask"].sum().item() == sum(len(r["raw_prompt_ids"]) for r in rows)
    assert batch["attention_mask"][:, 0].any()
    assert isinstance(batch["raw_prompt_ids"], np.ndarray) and batch["raw_prompt_ids"].shape == (4,)
    assert batch["raw_prompt_ids"].dtype == object and isinstance(batch["raw_prompt_ids"][0], list)
    data = DataProto.from_single_dict(batch)
    assert len(data) == 4 and data.batch["attention_mask"].shape == (4, longest)
    assert list(data.non_tensor_batch["data_source"]) == ["hybridflow/arithmetic"] * 4


def test_interaction_kwargs_travel_from_extra_info_to_the_rollouts_columns(tokenizer, tmp_path):
    """verl's ``extra_info.interaction_kwargs`` in a parquet row reaches the field each rollout reads:
    the rollout workers' ``interaction_kwargs`` column (:func:`interaction_columns`) and the agent loops'
    ``extra_info`` (:func:`interaction_kwargs_of`); the interaction starts with them."""
    import asyncio

    from hybridflow.trainer.ppo.rollouts import rollout_input
    from hybridflow.workers.rollout.agent_loop.tool_agent import interaction_kwargs_of
    from hybridflow.workers.rollout.interactions.gsm8k_interaction import CORRECT, Gsm8kInteraction
    from hybridflow.workers.rollout.multi_turn import interaction_columns

    kwargs = {"name": "gsm8k", "query": "What is 2 + 2?", "ground_truth": "4"}
    with_kwargs, without = row("What is 2 + 2?", index=0), row("What is 3 + 3?", index=1)
    with_kwargs["extra_info"]["interaction_kwargs"] = kwargs
    path = write(tmp_path, [with_kwargs, without])
    dataset = RLHFDataset(path, tokenizer, {"max_prompt_length": 48, "return_raw_chat": True})
    first, second = dataset[0], dataset[1]
    assert first["interaction_kwargs"] == kwargs and first["extra_info"]["interaction_kwargs"] == kwargs
    assert second["interaction_kwargs"] == {}  # parquet fills the missing struct with null

    prompts = DataProto.from_single_dict(collate_fn([first, second]))
    # the rollout workers' input (the sync multi-turn rollout, vLLM's): the column and the chat
    _, gen_input = rollout_input(prompts, 2, {}, all_fields=False)
    rows_kwargs, chats = interaction_columns(gen_input)
    assert rows_kwargs == [kwargs, kwargs, None, None]  # n=2, interleaved; {} is "no interaction"
    assert chats[0] == [{"role": "user", "content": "What is 2 + 2?"}]
    # the agent loops' input: every field, extra_info included
    _, all_fields = rollout_input(DataProto.from_single_dict(collate_fn([first])), 1, {}, all_fields=True)
    fields = {key: values[0] for key, values in all_fields.non_tensor_batch.items()}
    assert interaction_kwargs_of(fields) == kwargs

    async def reply():
        user = Gsm8kInteraction({"name": "gsm8k"})
        sample = await user.start_interaction("s0", **rows_kwargs[0])
        return await user.generate_response(sample, [*chats[0], {"role": "assistant", "content": "#### 4"}])

    assert asyncio.run(reply()) == (True, CORRECT, 1.0, {})


def test_collate_keeps_equal_length_lists_one_per_row():
    out = collate_fn([{"ids": [1, 2], "t": torch.zeros(2)}, {"ids": [3, 4], "t": torch.ones(2)}])
    assert out["ids"].shape == (2,) and out["ids"][1] == [3, 4] and out["t"].shape == (2, 2)


# ------------------------------------------------------------------------------------ StatefulDataLoader
def stream(loader):
    """Batches across epochs, as a training loop sees them."""
    while True:
        yield from loader


def ints(loader_kwargs):
    return StatefulDataLoader(list(range(10)), collate_fn=list, **loader_kwargs)


def test_epoch_order_comes_from_seed_plus_epoch():
    loader = ints(dict(batch_size=5, seed=3))
    assert len(loader) == 2
    epoch0 = [x for batch in loader for x in batch]
    epoch1 = [x for batch in loader for x in batch]
    assert epoch0 == torch.randperm(10, generator=torch.Generator().manual_seed(3)).tolist()
    assert epoch1 == torch.randperm(10, generator=torch.Generator().manual_seed(4)).tolist()
    assert loader.state_dict() == {"epoch": 2, "batches_yielded": 0, "seed": 3}


def test_drop_last_and_no_shuffle():
    assert list(ints(dict(batch_size=4, shuffle=False, drop_last=False))) == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9],
    ]
    assert list(ints(dict(batch_size=4, shuffle=False))) == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize("batch_size", [2, 3])  # 3 batches = mid-epoch (size 2) or a full epoch (size 3)
def test_resume_yields_the_batches_that_would_have_come_next(batch_size):
    reference = list(itertools.islice(stream(ints(dict(batch_size=batch_size))), 5))
    first = ints(dict(batch_size=batch_size))
    taken = list(itertools.islice(stream(first), 3))
    state = first.state_dict()
    resumed = ints(dict(batch_size=batch_size, seed=99))
    resumed.load_state_dict(state)
    assert taken == reference[:3]
    assert list(itertools.islice(stream(resumed), 2)) == reference[3:5]


def test_resume_on_dataset_items_and_iter_forever(tokenizer, arithmetic_files):
    dataset = RLHFDataset(arithmetic_files[0], tokenizer, {"max_prompt_length": 48})
    loader = StatefulDataLoader(dataset, batch_size=5)  # 2 batches per epoch of 12 rows
    reference = [b["index"].tolist() for b in itertools.islice(loader.iter_forever(), 4)]
    first = StatefulDataLoader(dataset, batch_size=5)
    next(first.iter_forever())
    state = first.state_dict()
    resumed = StatefulDataLoader(dataset, batch_size=5)
    resumed.load_state_dict(state)
    assert [b["index"].tolist() for b in itertools.islice(resumed.iter_forever(), 3)] == reference[1:]


def test_load_state_dict_rejects_incomplete_state():
    with pytest.raises(KeyError, match="batches_yielded"):
        ints(dict(batch_size=2)).load_state_dict({"epoch": 1, "seed": 1})
