"""The built-in agent loops (``single_turn_agent``, ``tool_agent``) against scripted servers, in this
process: missing log-probs are an error naming the sample and the backend (never zeros), and a tool
conversation aborted by a partial rollout resumes where it stopped — every token kept, no tool call run
twice."""

import asyncio

import pytest
from omegaconf import OmegaConf

from hybridflow.workers.rollout.agent_loop import DictConfigWrap, SingleTurnAgentLoop, tool_agent
from hybridflow.workers.rollout.agent_loop.tool_agent import ToolAgentLoop
from hybridflow.workers.rollout.replica import TokenOutput
from hybridflow.workers.rollout.tools.base_tool import BaseTool, ToolSchema

EOS = 2  # the tiny model's <|im_end|>
PARAMS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True}


def _config(name: str = "engine"):
    return OmegaConf.create(
        {
            "actor_rollout_ref": {
                "rollout": {
                    "name": name,
                    "response_length": 200,
                    "multi_turn": {"format": "hermes", "max_parallel_calls": 1, "tool_timeout_s": 10},
                }
            },
            "data": {},
        }
    )


class ScriptedServers:
    """The server manager's ``generate`` for one sample: the k-th assistant turn is ``turns[k]``; a call
    continues the current turn where the last one stopped. ``cut``: ``{call number: tokens}`` — that
    call stops after so many tokens as aborted (a partial rollout's pause). Every token has log-prob
    -0.25 (``log_probs=False``: the server sends none)."""

    def __init__(self, turns: list[list[int]], cut: dict[int, int] | None = None, log_probs: bool = True):
        self.turns, self.cut, self.log_probs = turns, dict(cut or {}), log_probs
        self.turn, self.position, self.calls = 0, 0, 0

    async def generate(self, request_id, *, prompt_ids, sampling_params, image_data=None, video_data=None):
        script = self.turns[min(self.turn, len(self.turns) - 1)]
        rest = script[self.position :]
        self.calls += 1
        aborted = self.calls in self.cut
        tokens = rest[: self.cut[self.calls]] if aborted else rest
        self.position += len(tokens)
        if not aborted:
            self.turn, self.position = self.turn + 1, 0
        return TokenOutput(
            token_ids=list(tokens),
            log_probs=[-0.25] * len(tokens) if self.log_probs else None,
            stop_reason="aborted" if aborted else "completed",
            weight_version=0,
        )


class CountingAddTool(BaseTool):
    """``add``, counting its instances and executions."""

    def __init__(self):
        super().__init__({}, ToolSchema("add", "a + b", {"type": "object", "required": ["a", "b"]}))
        self.created, self.executed, self.released = 0, 0, 0

    async def create(self, instance_id=None, **kwargs):
        self.created += 1
        return await super().create(instance_id)

    async def execute(self, instance_id, parameters, **kwargs):
        self.executed += 1
        return str(int(parameters["a"]) + int(parameters["b"])), 0.5, {}

    async def release(self, instance_id, **kwargs):
        self.released += 1


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from hybridflow.models.loading import load_tokenizer

    return load_tokenizer(tiny_model_dir)


def _run(loop_cls, config, servers, tokenizer=None, **fields):
    async def go():
        loop = loop_cls(
            trainer_config=DictConfigWrap(config),
            server_manager=servers,
            tokenizer=tokenizer,
            dataset_config=DictConfigWrap(config.data),
            eos_token_ids=[EOS],
        )
        return await loop.run(dict(fields.pop("params", PARAMS)), **fields)

    return asyncio.run(go())


# ---------------------------------------------------------------------- missing log-probs


@pytest.mark.parametrize("backend", ["engine", "vllm"])
def test_single_turn_missing_log_probs_are_an_error_naming_the_sample_and_backend(backend):
    servers = ScriptedServers([[5, 6, 7, EOS]], log_probs=False)
    with pytest.raises(
        ValueError, match=rf"sample uid-3.*rollout\.name={backend}.*4 tokens with no log-probs"
    ):
        _run(SingleTurnAgentLoop, _config(backend), servers, raw_prompt_ids=[1, 2], sample_id="uid-3")


def test_single_turn_without_calculate_log_probs_returns_none():
    """``rollout.calculate_log_probs=false`` (the request's ``logprobs`` false): no log-probs, not
    zeros, so the batch carries no ``rollout_log_probs`` column."""
    servers = ScriptedServers([[5, 6, 7, EOS]], log_probs=False)
    output = _run(
        SingleTurnAgentLoop, _config(), servers, raw_prompt_ids=[1, 2], params={**PARAMS, "logprobs": False}
    )
    assert output.response_ids == [5, 6, 7, EOS] and output.response_logprobs is None


@pytest.mark.parametrize("loop_cls", [SingleTurnAgentLoop, ToolAgentLoop])
def test_a_sample_cut_at_its_last_token_resumes_without_asking_for_zero_tokens(
    loop_cls, tokenizer, monkeypatch
):
    """An abort that lands as the response reaches ``response_length``: the partial output already holds
    the whole budget; its resume ends the sample with those tokens and sends no request (before, the
    single-turn loop asked the server for ``max_tokens=0``, which the server refuses)."""
    monkeypatch.setattr(tool_agent, "_tools", lambda path: {})
    config = _config()
    config.actor_rollout_ref.rollout.response_length = 4
    servers = ScriptedServers([[5, 6, 7, 8, 9, EOS]], cut={1: 4})
    fields = {"raw_prompt_ids": [1, 2], "sample_id": "s-9"}
    partial = _run(loop_cls, config, servers, tokenizer, **fields)
    assert partial.extra_fields["is_partial"] and partial.response_ids == [5, 6, 7, 8]
    output = _run(loop_cls, config, servers, tokenizer, **fields, partial_output=partial)
    assert servers.calls == 1, "the resume sent a request with no budget left"
    assert not output.extra_fields["is_partial"] and output.response_ids == [5, 6, 7, 8]
    assert output.response_logprobs == [-0.25] * 4


def test_tool_agent_missing_log_probs_are_an_error(tokenizer, monkeypatch):
    monkeypatch.setattr(tool_agent, "_tools", lambda path: {})
    servers = ScriptedServers([tokenizer.encode("hello", add_special_tokens=False) + [EOS]], log_probs=False)
    with pytest.raises(ValueError, match=r"sample s-1.*rollout\.name=engine"):
        _run(ToolAgentLoop, _config(), servers, tokenizer, raw_prompt_ids=[1, 2], sample_id="s-1")


def test_vllm_tokens_without_log_probs_are_an_error_naming_the_request():
    from hybridflow.workers.rollout.vllm_rollout.engine import _sampled_log_probs

    class Logprob:
        logprob = -0.5

    assert _sampled_log_probs([5, 6], [{5: Logprob()}, {6: Logprob()}], "r") == [-0.5, -0.5]
    assert _sampled_log_probs([], None, "r") == []
    for entries in (None, [], [{5: Logprob()}], [{5: Logprob()}, {7: Logprob()}]):
        with pytest.raises(ValueError, match=r"vLLM.*request req-9"):
            _sampled_log_probs([5, 6], entries, "req-9")


# ---------------------------------------------------------------------- partial rollout of tool conversations


def _call(a: int, b: int) -> str:
    return f'<tool_call>{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>'


def _turns(tokenizer) -> list[list[int]]:
    texts = [_call(2, 3), _call(5, 10), "The answer is 15"]
    return [tokenizer.encode(text, add_special_tokens=False) + [EOS] for text in texts]


@pytest.mark.parametrize(
    "cut",
    [{3: 6}, {1: 4, 2: 3, 4: 0}],
    ids=["mid-second-call", "three-aborts-one-empty"],
)
def test_an_aborted_tool_conversation_resumes_without_running_a_tool_twice(tokenizer, monkeypatch, cut):
    """The reference conversation calls ``add`` twice, then answers. Cut by aborts — inside a tool
    call's text (the call must be parsed from the whole turn), or several times, once with no token —
    and resumed from each partial output, it ends with the very tokens, mask and log-probs of the
    uninterrupted one, and the tool ran exactly twice on one instance (before, the resume restarted
    the conversation: tools ran again and the tokens were thrown away)."""
    tools = {"add": CountingAddTool()}
    monkeypatch.setattr(tool_agent, "_tools", lambda path: tools)
    reference = _run(
        ToolAgentLoop, _config(), ScriptedServers(_turns(tokenizer)), tokenizer, raw_prompt_ids=[1]
    )
    assert tools["add"].executed == 2 and not reference.extra_fields["is_partial"]

    tools["add"] = counting = CountingAddTool()
    servers = ScriptedServers(_turns(tokenizer), cut=cut)
    output = _run(ToolAgentLoop, _config(), servers, tokenizer, raw_prompt_ids=[1], sample_id="s-7")
    partials = 0
    while output.extra_fields["is_partial"]:
        partials += 1
        kept = list(output.response_ids)
        output = _run(
            ToolAgentLoop,
            _config(),
            servers,
            tokenizer,
            raw_prompt_ids=[1],
            sample_id="s-7",
            partial_output=output,
        )
        assert output.response_ids[: len(kept)] == kept  # the tokens so far are kept
    assert partials == len(cut)
    assert counting.executed == 2, "a tool call ran again after a resume"
    assert (counting.created, counting.released) == (1, 1)
    assert output.response_ids == reference.response_ids
    assert output.response_mask == reference.response_mask
    assert output.response_logprobs == reference.response_logprobs
    assert output.num_turns == reference.num_turns
    assert output.extra_fields["tool_calls"] == 2 and output.extra_fields["tool_rewards"] == pytest.approx(
        1.0
    )
    assert output.metrics.num_preempted == len(cut)
    assert "tool_session_restarted" not in output.extra_fields
    assert not tool_agent._PARKED  # the parked tool session was taken back


def test_a_resume_in_another_process_says_the_tool_instances_are_new(tokenizer, monkeypatch):
    tools = {"add": CountingAddTool()}
    monkeypatch.setattr(tool_agent, "_tools", lambda path: tools)
    servers = ScriptedServers(_turns(tokenizer), cut={3: 6})
    partial = _run(ToolAgentLoop, _config(), servers, tokenizer, raw_prompt_ids=[1], sample_id="s-8")
    tool_agent._PARKED.clear()  # another process: the parked instances are not here
    output = _run(
        ToolAgentLoop,
        _config(),
        servers,
        tokenizer,
        raw_prompt_ids=[1],
        sample_id="s-8",
        partial_output=partial,
    )
    assert output.extra_fields["tool_session_restarted"] is True
    assert tools["add"].executed == 2  # still no call ran twice


def test_a_group_split_over_two_workers_keeps_distinct_sample_streams():
    """3 prompts x n=2 over 2 agent-loop workers: rows [A0 A1 B0] and [B1 C0 C1]. Each row's number in
    its group comes from the manager's count over the whole batch (``rollout_n``), so B's second sample
    draws from stream 1 in the second chunk, not stream 0 again (the same response twice)."""
    from types import SimpleNamespace

    import numpy as np
    import torch

    from hybridflow import keys
    from hybridflow.protocol import DataProto
    from hybridflow.utils.rollout_trace import rollout_numbers
    from hybridflow.workers.rollout.agent_loop.worker import AgentLoopWorker

    uids = np.array(["a", "a", "b", "b", "c", "c"], dtype=object)
    batch = DataProto.from_dict(
        tensors={"input_ids": torch.zeros(6, 2, dtype=torch.long)},
        non_tensors={keys.UID: uids, "index": np.array([7, 7, 8, 8, 9, 9])},
    )
    batch.non_tensor_batch["rollout_n"] = np.array(rollout_numbers(uids, 6), dtype=np.int64)
    worker = SimpleNamespace(config=OmegaConf.create({"actor_rollout_ref": {"rollout": {"seed": 3}}}))
    params = {"temperature": 1.0}
    streams = []
    for chunk in batch.split([3, 3]):
        streams += AgentLoopWorker._seeds(worker, chunk, params)
    b0, b1 = streams[2], streams[3]
    assert b0["seed"] == b1["seed"] and (b0["seed_sample"], b1["seed_sample"]) == (0, 1)
    assert len({(s["seed"], s["seed_sample"]) for s in streams}) == 6  # six samples, six streams
    # a chunk without the manager's column counts its own rows (a whole group, as fully async sends)
    del batch.non_tensor_batch["rollout_n"]
    alone = AgentLoopWorker._seeds(worker, batch.split([3, 3])[1], params)
    assert [s["seed_sample"] for s in alone] == [0, 0, 1]
