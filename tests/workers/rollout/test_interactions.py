"""verl's interactions: the YAML registry, ``Gsm8kInteraction``, and a simulated user in the multi-turn
machine, through the ``tool_agent`` loop (server mode) and the synchronous multi-turn rollout. The model
is the real tiny model on the real engine, its turns forced token by token (``Script``), so every token
and mask position is known."""

import asyncio
import textwrap

import pytest
from omegaconf import OmegaConf

from hybridflow.workers.rollout.agent_loop import DictConfigWrap
from hybridflow.workers.rollout.agent_loop.tool_agent import ToolAgentLoop
from hybridflow.workers.rollout.engine import EngineModel, LLMEngine, SamplingParams
from hybridflow.workers.rollout.interactions.gsm8k_interaction import CORRECT, INCORRECT, Gsm8kInteraction
from hybridflow.workers.rollout.interactions.registry import (
    InteractionConfigError,
    initialize_interactions_from_config,
    shared_interactions,
)
from hybridflow.workers.rollout.multi_turn import assemble_conversations, build_agent_loop
from hybridflow.workers.rollout.replica import STOP_REASONS, TokenOutput
from tests.workers.rollout.test_multi_turn import EOS, Script

GSM8K_YAML = """\
interaction:
  - name: "gsm8k"
    class_name: "verl.interactions.gsm8k_interaction.Gsm8kInteraction"
    config: {}
"""
COUNTDOWN = "tests.workers.rollout.verl_written_interaction.CountdownInteraction"


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from hybridflow.models.loading import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    return tokenizer, EngineModel.from_hf_module(model, 1024)


@pytest.fixture
def alias():
    """The verl alias on for one test (a user's interaction module imports ``verl.interactions``)."""
    from hybridflow import verl_compat

    assert verl_compat.install()
    shared_interactions.cache_clear()
    yield
    shared_interactions.cache_clear()
    verl_compat.uninstall()


def _yaml(tmp_path, text: str, name: str = "interactions.yaml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def _chat(answer: str) -> list[dict]:
    return [{"role": "user", "content": "What is 6 * 7?"}, {"role": "assistant", "content": answer}]


# ---------------------------------------------------------------------- the registry and Gsm8kInteraction


def test_verls_interaction_yaml_loads_and_names_default_from_the_class(tmp_path):
    path = _yaml(
        tmp_path,
        GSM8K_YAML + '  - class_name: "hybridflow.workers.rollout.interactions.base.BaseInteraction"\n',
    )
    interactions = initialize_interactions_from_config(path)
    assert sorted(interactions) == ["base", "gsm8k"]  # "BaseInteraction" -> "base", as verl names it
    assert isinstance(interactions["gsm8k"], Gsm8kInteraction)
    assert interactions["gsm8k"].name == "gsm8k" and interactions["gsm8k"].config == {"name": "gsm8k"}

    twice = _yaml(tmp_path, GSM8K_YAML + GSM8K_YAML.split("\n", 1)[1], "twice.yaml")
    with pytest.raises(InteractionConfigError, match=r"twice.yaml: interaction\[1\]: duplicate .*'gsm8k'"):
        initialize_interactions_from_config(twice)
    missing = _yaml(tmp_path, "interaction:\n  - class_name: no_such_pkg.mod.Cls\n", "missing.yaml")
    with pytest.raises(InteractionConfigError, match=r"missing.yaml: interaction\[0\]: cannot import"):
        initialize_interactions_from_config(missing)
    weather = _yaml(
        tmp_path,
        "interaction:\n  - class_name: verl.interactions.weather_interaction.WeatherInteraction\n",
        "weather.yaml",
    )
    with pytest.raises(InteractionConfigError, match="a verl interaction with no counterpart here"):
        initialize_interactions_from_config(weather)


def test_gsm8k_interaction_scores_right_and_wrong_answers():
    async def go():
        user = Gsm8kInteraction({"name": "gsm8k"})
        sample = await user.start_interaction("s1", ground_truth="42", query="What is 6 * 7?")
        assert sample == "s1"
        wrong = await user.generate_response(sample, _chat("6 * 7 = 36\n#### 36"))
        no_answer = await user.generate_response(sample, _chat("I think it is 42"))  # strict: no ####
        right = await user.generate_response(sample, _chat("6 * 7 = 42\n#### 42"))
        score = await user.calculate_score(sample)
        await user.finalize_interaction(sample)
        return wrong, no_answer, right, score, user._instance_dict

    wrong, no_answer, right, score, left = asyncio.run(go())
    assert wrong == (False, INCORRECT, 0.0, {}) and no_answer == (False, INCORRECT, 0.0, {})
    assert right == (True, CORRECT, 1.0, {}) and score == 1.0
    assert left == {}  # finalize drops the sample's state


# ---------------------------------------------------------------------- in the agent loops


class EngineServers:
    """The server manager's ``generate`` served by a real engine in this process: each request's
    ``max_tokens`` honoured, the model's tokens forced by ``script``."""

    def __init__(self, engine_model, script: Script) -> None:
        self.engine = LLMEngine(engine_model, 4, 1024, eos_token_ids=[EOS])
        self.script = script

    async def generate(self, request_id, *, prompt_ids, sampling_params, image_data=None, video_data=None):
        params = SamplingParams(
            max_new_tokens=int(sampling_params["max_tokens"]), logits_processor=self.script
        )
        turn = (await self.engine.generate(list(prompt_ids), params)).completions[0]
        return TokenOutput(
            token_ids=list(turn.token_ids),
            log_probs=list(turn.log_probs),
            stop_reason=STOP_REASONS.get(turn.finish_reason, "completed"),
            weight_version=0,
        )


def _loop_config(path: str, max_user_turns=None):
    multi_turn = {"format": "hermes", "interaction_config_path": path, "max_user_turns": max_user_turns}
    return OmegaConf.create(
        {
            "actor_rollout_ref": {
                "rollout": {"name": "engine", "response_length": 300, "multi_turn": multi_turn}
            }
        }
    )


def _run_tool_agent(setup, config, turns: list[str], interaction_kwargs: dict):
    tokenizer, engine_model = setup
    servers = EngineServers(engine_model, Script(tokenizer, turns))
    prompt = [{"role": "user", "content": "What is 6 * 7?"}]

    async def go():
        loop = ToolAgentLoop(
            trainer_config=DictConfigWrap(config),
            server_manager=servers,
            tokenizer=tokenizer,
            dataset_config=DictConfigWrap(OmegaConf.create({})),
            eos_token_ids=[EOS],
        )
        return await loop.run(
            {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True},
            raw_prompt=prompt,
            extra_info={"interaction_kwargs": interaction_kwargs},
            sample_id="s-0",
        )

    return asyncio.run(go())


def _expected(tokenizer, renderer_of, answers: list[str], replies: list[str]):
    """The response ids and mask of ``answers`` (mask 1) interleaved with user ``replies`` (mask 0)."""
    ids, mask = [], []
    for k, answer in enumerate(answers):
        generated = tokenizer.encode(answer, add_special_tokens=False) + [EOS]
        ids, mask = ids + generated, mask + [1] * len(generated)
        if k < len(replies):
            user = renderer_of(replies[k])
            ids, mask = ids + user, mask + [0] * len(user)
    return ids, mask


def _user_turn_ids(setup):
    from hybridflow.workers.rollout.multi_turn import ToolTurnRenderer

    return ToolTurnRenderer(setup[0], [EOS]).user_turn_ids


def test_tool_agent_loop_runs_the_configured_interaction_until_it_stops(setup, tmp_path):
    """verl's Gsm8kInteraction from verl's YAML: a wrong answer hears "incorrect", the model tries again,
    the right one hears "correct" and the conversation ends; the user turns are masked out."""
    shared_interactions.cache_clear()
    config = _loop_config(_yaml(tmp_path, GSM8K_YAML))
    answers = ["#### 36", "#### 42", "never generated"]
    output = _run_tool_agent(setup, config, answers, {"name": "gsm8k", "ground_truth": "42"})

    ids, mask = _expected(setup[0], _user_turn_ids(setup), answers[:2], [INCORRECT, CORRECT])
    assert output.response_ids == ids and output.response_mask == mask
    assert all(lp == 0.0 for lp, m in zip(output.response_logprobs, mask, strict=True) if m == 0)
    assert INCORRECT in setup[0].decode(output.response_ids)
    assert output.extra_fields["turn_scores"] == [0.0, 1.0]
    assert output.num_turns == 2 + 2 + 1  # assistant + user turns + the prompt, as verl counts
    state = output.extra_fields["conversation"]
    assert state["finish_reason"] == "interaction" and state["user_turns"] == 2
    assert [m["role"] for m in state["messages"]] == ["user", "assistant", "user", "assistant", "user"]
    assert not shared_interactions(config.actor_rollout_ref.rollout.multi_turn.interaction_config_path)[
        "gsm8k"
    ]._instance_dict  # finalized


@pytest.mark.parametrize("turns, max_user_turns", [(2, None), (5, 2)])
def test_a_verl_written_interaction_runs_through_the_alias_and_max_user_turns_holds(
    setup, tmp_path, alias, turns, max_user_turns
):
    """A user's class written against verl (``verl.interactions.base``), loaded from verl's YAML through
    ``verl.interactions.utils.interaction_registry``: it stops after ``turns`` replies, or
    ``max_user_turns`` stops it first (one more answer, then no reply)."""
    from verl.interactions.utils.interaction_registry import initialize_interactions_from_config as verls

    path = _yaml(tmp_path, f"interaction:\n  - class_name: {COUNTDOWN}\n    config: {{turns: 9}}\n")
    assert list(verls(path)) == ["countdown"]  # verl's default name
    config = _loop_config(path, max_user_turns)
    answers = ["a", "b", "c", "d", "e", "f"]
    output = _run_tool_agent(setup, config, answers, {"name": "countdown", "turns": turns})

    users = min(turns, max_user_turns or turns)
    replies = [f"Reply {k}." for k in range(1, users + 1)]
    generated = answers[: users + (max_user_turns is not None)]  # the limit lets one more answer come
    ids, mask = _expected(setup[0], _user_turn_ids(setup), generated, replies)
    assert output.response_ids == ids and output.response_mask == mask
    assert output.extra_fields["turn_scores"] == [float(k) for k in range(1, users + 1)]
    state = output.extra_fields["conversation"]
    assert state["user_turns"] == users and state["assistant_turns"] == len(generated)
    assert state["finish_reason"] == ("max_user_turns" if max_user_turns else "interaction")
    assert shared_interactions(path)["countdown"].finalized == 1  # verl's finalize_interaction(self)


def test_the_sync_multi_turn_rollout_runs_interactions(setup, tmp_path, alias):
    """The synchronous rollout's machine (``build_agent_loop``, as the engine and vLLM rollouts build
    it): two samples with their own interaction kwargs, concurrently; the batch's ``response_mask`` is
    0 on the user turns and ``turn_scores`` rides along."""
    tokenizer, engine_model = setup
    path = _yaml(
        tmp_path, f"interaction:\n  - name: count\n    class_name: {COUNTDOWN}\n    config: {{turns: 1}}\n"
    )
    rollout = OmegaConf.create({"response_length": 120, "multi_turn": {"interaction_config_path": path}})
    loop = build_agent_loop(LLMEngine(engine_model, 4, 1024, eos_token_ids=[EOS]), tokenizer, rollout, [EOS])
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    params = [SamplingParams(logits_processor=Script(tokenizer, ["x", "y", "z"])) for _ in range(2)]
    kwargs = [{"name": "count", "turns": 1}, {"name": "count", "turns": 2}]
    convs = asyncio.run(loop.run_batch([prompt_ids] * 2, params, [None, None], None, kwargs))

    for conv, answers, replies in (
        (convs[0], ["x"], ["Reply 1."]),
        (convs[1], ["x", "y"], ["Reply 1.", "Reply 2."]),
    ):
        ids, mask = _expected(tokenizer, loop.renderer.user_turn_ids, answers, replies)
        assert conv.response_ids == ids and conv.response_mask == mask and conv.finish_reason == "interaction"
    import torch

    from hybridflow.protocol import DataProto

    prompts = DataProto.from_dict({"input_ids": torch.tensor([prompt_ids] * 2)})
    prompts.batch["attention_mask"] = torch.ones_like(prompts.batch["input_ids"])
    prompts.batch["position_ids"] = torch.arange(len(prompt_ids)).expand(2, -1)
    batch = assemble_conversations(prompts, convs, int(tokenizer.pad_token_id), 120)
    assert batch.batch["response_mask"][1, : len(convs[1].response_mask)].tolist() == convs[1].response_mask
    assert list(batch.non_tensor_batch["turn_scores"]) == [[1.0], [1.0, 2.0]]


def test_turn_scores_reach_the_batch_and_the_reward_functions_extra_info(setup):
    """An agent-loop worker's chunk carries ``turn_scores`` as a column, and the one-sample batch it
    scores hands them to the reward function's ``extra_info``: through the reward manager and through
    the reward loop (verl's ``tool_extra_fields``)."""
    import numpy as np

    from hybridflow.protocol import DataProto
    from hybridflow.workers.reward_loop.base import decode_one
    from hybridflow.workers.reward_manager.naive import decode_samples
    from hybridflow.workers.rollout.agent_loop import AgentLoopMetrics, AgentLoopOutput
    from hybridflow.workers.rollout.agent_loop.worker import AgentLoopWorker

    worker = object.__new__(AgentLoopWorker)  # what _assemble and _sample read of __init__'s work
    worker.config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"response_length": 8}}})
    worker.tokenizer, worker.reward_fn = setup[0], None
    column = lambda value: np.array([value], dtype=object)  # noqa: E731
    batch = DataProto.from_dict(
        non_tensors={
            "data_source": column("openai/gsm8k"),
            "reward_model": column({"ground_truth": "42"}),
            "extra_info": column({"index": 0}),
        }
    )
    fields = {"turn_scores": [0.0, 1.0], "tool_rewards": 0.5, "tool_calls": 0}
    output = AgentLoopOutput(
        prompt_ids=[5, 6],
        response_ids=[7, 8, 9],
        response_mask=[1, 0, 1],
        metrics=AgentLoopMetrics(),
        extra_fields=fields,
    )
    chunk = worker._assemble(batch, [output], [None])
    assert list(chunk.non_tensor_batch["turn_scores"]) == [[0.0, 1.0]]
    sample = worker._sample(batch, 0, output)
    assert decode_samples(sample, setup[0])[0].extra_info == {
        "index": 0,
        "tool_rewards": 0.5,
        "turn_scores": [0.0, 1.0],
    }
    assert decode_one(sample, setup[0]).extra_info["turn_scores"] == [0.0, 1.0]


def test_a_conversation_with_an_interaction_resumes_after_an_abort(setup, tmp_path):
    """A partial rollout cuts the second answer: resumed, the conversation ends exactly as an
    uninterrupted one, the interaction's session (parked with the tool instances) kept, no reply twice."""
    from tests.workers.rollout.test_agent_loops import ScriptedServers

    tokenizer = setup[0]
    shared_interactions.cache_clear()
    config = _loop_config(_yaml(tmp_path, GSM8K_YAML))
    turns = [tokenizer.encode(t, add_special_tokens=False) + [EOS] for t in ("#### 36", "#### 42")]
    fields = {
        "raw_prompt_ids": [1],
        "extra_info": {"interaction_kwargs": {"name": "gsm8k", "ground_truth": "42"}},
    }

    def run(servers, **more):
        async def go():
            loop = ToolAgentLoop(
                trainer_config=DictConfigWrap(config),
                server_manager=servers,
                tokenizer=tokenizer,
                dataset_config=DictConfigWrap(OmegaConf.create({})),
                eos_token_ids=[EOS],
            )
            return await loop.run({"logprobs": True}, **fields, **more)

        return asyncio.run(go())

    reference = run(ScriptedServers(turns), sample_id="r-1")
    servers = ScriptedServers(turns, cut={2: 2})
    partial = run(servers, sample_id="r-2")
    assert partial.extra_fields["is_partial"] and partial.extra_fields["turn_scores"] == [0.0]
    output = run(servers, sample_id="r-2", partial_output=partial)
    assert output.response_ids == reference.response_ids and output.response_mask == reference.response_mask
    assert (
        output.extra_fields["turn_scores"] == [0.0, 1.0]
        and "tool_session_restarted" not in output.extra_fields
    )
    assert (
        output.extra_fields["conversation"]["messages"] == reference.extra_fields["conversation"]["messages"]
    )
    assert not shared_interactions(config.actor_rollout_ref.rollout.multi_turn.interaction_config_path)[
        "gsm8k"
    ]._instance_dict  # both samples finalized
