"""verl's ``data.apply_chat_template_kwargs`` (issue 48 item 7): a Qwen3 run turns thinking off with
``{enable_thinking: false}``, and every path that templates a prompt reads it: the sync dataset (training
and validation build it alike), main_generation, the agent loops (their own test:
tests/workers/rollout/test_agent_loops.py) and the sync multi-turn rollout's tool turns. Before, only
the agent loops did."""

from hybridflow.models.tiny import build_tokenizer
from hybridflow.tasks.arithmetic import ArithmeticTaskConfig, task_texts, write_rl_dataset
from hybridflow.trainer.config import load_config
from hybridflow.trainer.main_generation import prompt_token_ids
from hybridflow.utils.dataset.rl_dataset import RLHFDataset

# Qwen3's switch, reduced to what it does to the generation prompt: an empty think block when off
QWEN3_STYLE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)
OFF = {"enable_thinking": False}


def _tokenizer():
    tokenizer = build_tokenizer([*task_texts(n=200), "<think>\n\n</think>\n\n"])
    tokenizer.chat_template = QWEN3_STYLE
    return tokenizer


def test_the_sync_dataset_and_main_generation_pass_them_to_the_template(tmp_path):
    tokenizer = _tokenizer()
    train, _ = write_rl_dataset(tmp_path, ArithmeticTaskConfig(num_train=4, num_test=2))
    texts = {}
    for name, kwargs in (("default", None), ("off", OFF)):
        config = {"max_prompt_length": 256, "return_full_prompt": True, "apply_chat_template_kwargs": kwargs}
        row = RLHFDataset(str(train), tokenizer, config)[0]
        texts[name] = row["full_prompts"]
        assert tokenizer.decode(row["raw_prompt_ids"]) == row["full_prompts"]
    assert texts["off"] == texts["default"] + "<think>\n\n</think>\n\n"
    messages = [[{"role": "user", "content": "What is 2 + 3?"}]]
    default, off = (
        tokenizer.decode(prompt_token_ids(messages, tokenizer, 256, "error", template_kwargs=k)[0])
        for k in (None, OFF)
    )
    assert off == default + "<think>\n\n</think>\n\n"


def test_the_key_is_verls_in_both_configs():
    ppo = load_config(["+data.apply_chat_template_kwargs.enable_thinking=false"])
    assert ppo.data.apply_chat_template_kwargs == OFF
    generation = load_config(
        ["+data.apply_chat_template_kwargs.enable_thinking=false"], config_name="generation"
    )
    assert generation.data.apply_chat_template_kwargs == OFF


def test_the_agent_loops_read_them_from_the_data_section():
    import asyncio

    from omegaconf import OmegaConf

    from hybridflow.workers.rollout.agent_loop import SingleTurnAgentLoop
    from hybridflow.workers.rollout.agent_loop.base import DictConfigWrap

    tokenizer = _tokenizer()
    messages = [{"role": "user", "content": "What is 2 + 3?"}]

    async def ids(kwargs):
        config = OmegaConf.create(
            {
                "actor_rollout_ref": {"rollout": {"name": "engine", "response_length": 16}},
                "data": {"apply_chat_template_kwargs": kwargs},
            }
        )
        loop = SingleTurnAgentLoop(
            trainer_config=DictConfigWrap(config),
            server_manager=None,
            tokenizer=tokenizer,
            dataset_config=DictConfigWrap(config.data),
            eos_token_ids=[2],
        )
        return await loop.apply_chat_template(messages)

    default, off = (tokenizer.decode(asyncio.run(ids(k))) for k in (None, OFF))
    assert off == default + "<think>\n\n</think>\n\n"


def test_the_sync_multi_turn_rollout_renders_tool_turns_with_them():
    """The sync multi-turn rollout renders each tool turn and the next assistant header itself: the
    generate call carries the kwargs (``chat_template_meta``) and its renderer applies them, so the
    header after a tool turn gets the same empty think block as the prompt's."""
    from hybridflow.trainer.ppo.rollouts import chat_template_meta
    from hybridflow.workers.rollout.multi_turn import ToolTurnRenderer

    tokenizer = _tokenizer()
    end_of_turn = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    default = tokenizer.decode(ToolTurnRenderer(tokenizer, end_of_turn).tool_turn_ids(["5"]))
    off = tokenizer.decode(ToolTurnRenderer(tokenizer, end_of_turn, OFF).tool_turn_ids(["5"]))
    assert default.endswith("<|im_start|>assistant\n") and off == default + "<think>\n\n</think>\n\n"
    config = load_config(["+data.apply_chat_template_kwargs.enable_thinking=false"])
    assert chat_template_meta(config) == {"apply_chat_template_kwargs": OFF}
    assert chat_template_meta(load_config([])) == {}
