"""The reward-model worker reads and places the score at the last attended token (verl), in process at
world size 1 on the tiny model: multi-turn masks with gaps and pad == eos do not move it."""

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from hybridflow import keys
from hybridflow.protocol import DataProto
from hybridflow.utils.ports import find_free_port
from hybridflow.workers.reward_model_worker import (
    RewardModelWorker,
    last_valid_positions,
    place_on_last_token,
)

EOS = 2  # the tiny model's eos; rows below also use it as padding (pad == eos)
PROMPT_LEN, RESPONSE_LEN = 4, 6


def _batch() -> DataProto:
    """Row 0, multi-turn: model tokens, a tool answer (attended, response_mask 0), model tokens, eos.
    Row 1, pad == eos: three generated tokens ending in eos, then eos used as right padding.
    Row 2, a full response (no padding) after a left-padded prompt."""
    prompts = torch.tensor([[EOS, 10, 11, 12], [EOS, EOS, 13, 14], [EOS, 15, 16, 17]])
    responses = torch.tensor(
        [[20, 21, 30, 31, 22, EOS], [23, 24, EOS, EOS, EOS, EOS], [25, 26, 27, 28, 29, 40]]
    )
    prompt_mask = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1], [0, 1, 1, 1]])
    attention = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]])
    response_mask = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]])
    mask = torch.cat([prompt_mask, attention], dim=1)
    return DataProto.from_dict(
        {
            keys.PROMPTS: prompts,
            keys.RESPONSES: responses,
            keys.INPUT_IDS: torch.cat([prompts, responses], dim=1),
            keys.ATTENTION_MASK: mask,
            keys.POSITION_IDS: (mask.cumsum(-1) - 1).clamp(min=0),
            keys.RESPONSE_MASK: response_mask,
        }
    )


# Last attended response column per row, by construction: 5 (the eos after the tool answer; the old
# response_mask.sum() - 1 = 3 pointed into the tool answer), 2 (the first eos), 5.
LAST_RESPONSE_COLUMN = [5, 2, 5]


def test_last_valid_positions_ignore_gaps_and_padding_ids():
    mask = _batch().batch[keys.ATTENTION_MASK]
    assert last_valid_positions(mask).tolist() == [PROMPT_LEN + c for c in LAST_RESPONSE_COLUMN]
    assert last_valid_positions(torch.tensor([[0, 0, 0], [1, 0, 1]])).tolist() == [0, 2]


def test_place_on_last_token_cuts_to_the_response():
    mask = _batch().batch[keys.ATTENTION_MASK]
    placed = place_on_last_token(torch.tensor([1.5, -2.0, 3.0]), mask, RESPONSE_LEN)
    expected = torch.zeros(3, RESPONSE_LEN)
    expected[0, 5], expected[1, 2], expected[2, 5] = 1.5, -2.0, 3.0
    assert torch.equal(placed, expected)
    # a row with no attended response token keeps no score (verl drops it with the prompt part)
    prompt_only = torch.tensor([[1, 1, 0, 0]])
    assert torch.equal(place_on_last_token(torch.tensor([7.0]), prompt_only, 2), torch.zeros(1, 2))


@pytest.fixture
def reward_worker(tiny_model_dir, monkeypatch):
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": str(find_free_port())}.items():
        monkeypatch.setenv(name, value)

    def build(**overrides):
        config = {
            "model": {
                "path": tiny_model_dir,
                "input_tokenizer": tiny_model_dir,
                "fsdp_config": {"model_dtype": "fp32"},
            },
            "micro_batch_size": None,
            "micro_batch_size_per_gpu": 2,
            "use_dynamic_bsz": False,
            "forward_max_token_len_per_gpu": 16,
            **overrides,
        }
        worker = RewardModelWorker(OmegaConf.create(config))
        worker.init_model()
        return worker

    yield build
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "batching",
    [{"micro_batch_size_per_gpu": 2}, {"use_dynamic_bsz": True, "forward_max_token_len_per_gpu": 12}],
    ids=["fixed", "dynamic"],
)
def test_rm_score_is_the_value_head_at_the_last_attended_token(reward_worker, tiny_model_dir, batching):
    from transformers import AutoModelForTokenClassification

    data = _batch()
    rm_scores = reward_worker(**batching).compute_rm_score(data).batch["rm_scores"]

    torch.manual_seed(0)  # the worker seeds the fresh value head the same way
    reference = AutoModelForTokenClassification.from_pretrained(tiny_model_dir, num_labels=1)
    values = reference(
        input_ids=data.batch[keys.INPUT_IDS],
        attention_mask=data.batch[keys.ATTENTION_MASK],
        position_ids=data.batch[keys.POSITION_IDS],
    ).logits[..., 0]
    assert rm_scores.shape == (3, RESPONSE_LEN)
    for row, column in enumerate(LAST_RESPONSE_COLUMN):
        assert rm_scores[row].nonzero().flatten().tolist() == [column]
        want = values[row, PROMPT_LEN + column].item()
        assert rm_scores[row, column].item() == pytest.approx(want, abs=1e-5)


def test_global_micro_batch_size_is_split_over_ranks(reward_worker):
    worker = reward_worker(micro_batch_size=3, micro_batch_size_per_gpu=16)
    assert worker.config.micro_batch_size_per_gpu == 3  # world size 1: the global size is this rank's


def test_other_tokenizer_inputs_are_re_encoded_and_cut_to_max_length(reward_worker, tiny_model_dir, tmp_path):
    import shutil

    from hybridflow.models.loading import load_tokenizer

    policy_dir = shutil.copytree(tiny_model_dir, tmp_path / "policy")  # another path: re-tokenised
    model = {
        "path": tiny_model_dir,
        "input_tokenizer": str(policy_dir),
        "fsdp_config": {"model_dtype": "fp32"},
    }
    worker = reward_worker(max_length=5, model=model)
    data = _batch()
    rm_input = worker._rm_inputs(data).batch
    tokenizer = load_tokenizer(tiny_model_dir)
    for row in range(len(data)):
        valid = data.batch[keys.INPUT_IDS][row][data.batch[keys.ATTENTION_MASK][row].bool()]
        text = tokenizer.decode(valid, skip_special_tokens=True)
        want = tokenizer(text, return_tensors="pt")["input_ids"][0][:5]  # verl: right truncation
        n = int(rm_input[keys.ATTENTION_MASK][row].sum())
        assert rm_input[keys.INPUT_IDS][row][:n].tolist() == want.tolist()
    assert rm_input[keys.INPUT_IDS].shape[1] <= 5
    scores = worker.compute_rm_score(data).batch["rm_scores"]
    assert [row.nonzero().flatten().tolist() for row in scores] == [[c] for c in LAST_RESPONSE_COLUMN]
