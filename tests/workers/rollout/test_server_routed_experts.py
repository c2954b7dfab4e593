"""Router replay R3 in server mode and fully async (issue 48 item 3; the sync rollout's side:
``test_engine_routed_experts.py``). A tiny random Qwen3-MoE in fp32 behind a real replica (its engine
recording routing, served from a thread of this process as a rank serves it, its front door a real Ray
actor), ``single_turn_agent`` through the agent loops' server manager, and the agent-loop worker's
assembly:

- each answer carries the request's ``routed_experts``; the batch's (B, T, L, k) uint8 sits in
  ``input_ids``' columns (left-padded prompts | right-padded responses), equal to HF's routers' picks for
  every attended token but the last, 0 on padding and on the last token;
- the actor's log-probs replaying them equal its unreplayed ones (fp32, 1e-5) and the engine's;
- a sample aborted mid-flight (partial rollout) and resumed carries the resumed request's record, which
  covers the whole sample (the engine prefills prompt + partial response again);
- fully async: groups of different prompt widths joined to their rows (the rollouter) and concatenated
  (the trainer) keep the ids aligned with ``input_ids``; the trainer's R3 log-probs equal its own;
- ``tool_agent`` keeps the last turn's record of a conversation, and a resumed turn's."""

import asyncio
import threading
import time

import numpy as np
import pytest
import ray
import torch
import transformers
from omegaconf import OmegaConf

from hybridflow import keys
from hybridflow.models.attention import register_cpu_attention
from hybridflow.protocol import DataProto
from hybridflow.workers.actor.dp_actor import DataParallelPPOActor
from hybridflow.workers.rollout.agent_loop import AsyncLLMServerManager, DictConfigWrap, SingleTurnAgentLoop
from hybridflow.workers.rollout.agent_loop.worker import AgentLoopWorker
from hybridflow.workers.rollout.engine import EngineModel, LLMEngine, SamplingParams
from hybridflow.workers.rollout.replica import LLMServer, serve_requests
from tests.workers.rollout.test_engine_routed_experts import _hf_routing
from tests.workers.test_loss_normalisation import _actor_config

MAX_LEN = 96
RESPONSE = 8
PARAMS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True, "ignore_eos": True}
BATCHING = OmegaConf.create(
    {"log_prob_micro_batch_size_per_gpu": 2, "log_prob_use_dynamic_bsz": False,
     "log_prob_max_token_len_per_gpu": 4096}
)  # fmt: skip


class MoeReplica:
    """A recording engine on the tiny MoE, served from a thread until :meth:`close`."""

    def __init__(self, path: str) -> None:
        module = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.engine = LLMEngine(
            EngineModel.from_hf_module(module, MAX_LEN), 8, MAX_LEN, eos_token_ids=[], record_routing=True
        )
        self.server = ray.remote(num_cpus=0, max_concurrency=1000)(LLMServer).remote("moe replica")
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        with torch.no_grad():
            serve_requests(self.engine, self.server, SamplingParams(max_new_tokens=RESPONSE), wait_s=0.05)

    def close(self) -> None:
        ray.get(self.server.stop_serving.remote())
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def moe(ray_session, tmp_path_factory):
    """(model dir, HF model, replica, tokenizer)."""
    from hybridflow.models.loading import load_tokenizer
    from hybridflow.models.tiny import build_tiny_model

    path = str(
        build_tiny_model(
            tmp_path_factory.mktemp("moe") / "model",
            arch="qwen3_moe",
            hidden_size=64,
            num_layers=2,
            intermediate_size=64,
        )
    )
    replica = MoeReplica(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    yield path, model, replica, load_tokenizer(path)
    replica.close()


def _worker(tokenizer) -> AgentLoopWorker:
    """What the worker's assembly reads of its ``__init__``'s work."""
    worker = object.__new__(AgentLoopWorker)
    worker.config = OmegaConf.create(
        {
            "actor_rollout_ref": {
                "rollout": {"response_length": RESPONSE, "enable_rollout_routing_replay": True}
            }
        }
    )
    worker.tokenizer, worker.reward_fn = tokenizer, None
    return worker


def _loop(server_manager, tokenizer, response_length: int = RESPONSE) -> SingleTurnAgentLoop:
    config = OmegaConf.create(
        {"actor_rollout_ref": {"rollout": {"response_length": response_length}}, "data": {}}
    )
    return SingleTurnAgentLoop(DictConfigWrap(config), server_manager, tokenizer)


def _generate(replica, tokenizer, prompts: list[list[int]], lengths: list[int], seed: int) -> list:
    """One single-turn sample per prompt (``lengths``: each sample's response limit)."""
    manager = AsyncLLMServerManager({}, [replica.server])

    async def run():
        return await asyncio.gather(
            *(
                _loop(manager, tokenizer, length).run(
                    {**PARAMS, "seed": seed, "seed_sample": i},
                    raw_prompt_ids=prompt,
                    sample_id=f"s{seed}-{i}",
                )
                for i, (prompt, length) in enumerate(zip(prompts, lengths, strict=True))
            )
        )

    return asyncio.run(run())


def _chunk(worker, outputs) -> DataProto:
    """The worker's chunk of ``outputs`` (as ``generate_sequences`` assembles it)."""
    width = max(len(o.prompt_ids) for o in outputs)
    batch = DataProto.from_dict({keys.INPUT_IDS: torch.zeros(len(outputs), width, dtype=torch.long)})
    return worker._assemble(batch, list(outputs), [None] * len(outputs))


def _check_columns(model, batch: DataProto) -> None:
    """``routed_experts`` in ``input_ids``' columns: HF's picks on attended tokens but the last, else 0."""
    routed = batch.batch[keys.ROUTED_EXPERTS]
    input_ids, mask = batch.batch[keys.INPUT_IDS], batch.batch[keys.ATTENTION_MASK].bool()
    assert routed.dtype == torch.uint8 and routed.shape[:2] == input_ids.shape and routed.shape[2] == 2
    assert not routed[~mask].any()
    for row in range(len(input_ids)):
        tokens = input_ids[row][mask[row]].tolist()
        ids = routed[row][mask[row]]
        assert torch.equal(ids[:-1].long().sort(-1).values, _hf_routing(model, tokens)[:-1])
        assert not ids[-1].any()


def _replayed_log_probs(path: str, batch: DataProto) -> dict[str, torch.Tensor]:
    """The actor's log-probs without and with R3 on ``batch``."""
    found = {}
    for mode in ("disabled", "R3"):
        cfg = _actor_config("token-mean", 6, 6)
        cfg.router_replay = {"mode": mode}
        module = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation=register_cpu_attention()
        )
        actor = DataParallelPPOActor(cfg, module, response_length=RESPONSE)
        found[mode], _ = actor.compute_log_prob(batch, BATCHING)
    return found


def test_server_mode_carries_routed_experts_that_the_actor_replays(moe):
    path, model, replica, tokenizer = moe
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14]]
    outputs = _generate(replica, tokenizer, prompts, [RESPONSE, 5, RESPONSE], seed=11)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.routed_experts.shape == (len(prompt) + len(output.response_ids), 2, 2)
    chunk = _chunk(_worker(tokenizer), outputs)
    assert chunk.batch[keys.ATTENTION_MASK][1, -3:].sum() == 0  # a right-padded response
    _check_columns(model, chunk)
    log_probs = _replayed_log_probs(path, chunk)
    response = chunk.batch[keys.RESPONSE_MASK].bool()
    torch.testing.assert_close(log_probs["R3"][response], log_probs["disabled"][response], rtol=0, atol=1e-5)
    rollout = chunk.batch[keys.ROLLOUT_LOG_PROBS]
    assert (rollout - log_probs["R3"])[response].abs().max() <= 1e-4
    chunk.batch[keys.ROUTED_EXPERTS] = (chunk.batch[keys.ROUTED_EXPERTS] + 1) % 4  # replayed: they move
    shifted = _replayed_log_probs(path, chunk)["R3"]
    assert (shifted - log_probs["R3"])[response].abs().max() > 1e-2


def test_a_resumed_sample_carries_the_resumed_requests_record_of_the_whole_sample(moe, monkeypatch):
    """Partial rollout: abort mid-flight, resume from prompt + partial response: the output's ids
    cover prompt + the whole response (the resumed prefill's routing), and lay out like any sample's."""
    _, model, replica, tokenizer = moe
    manager = AsyncLLMServerManager({}, [replica.server])
    fields = {"raw_prompt_ids": [5, 6, 7, 8], "sample_id": "cut"}
    params = {**PARAMS, "seed": 5, "seed_sample": 0}
    engine = replica.engine
    step = engine.step

    def slow_step():  # 40 tokens take >= 0.4 s: the abort (a few Ray hops) lands mid-request
        time.sleep(0.01)
        return step()

    monkeypatch.setattr(engine, "step", slow_step)

    def started() -> bool:
        return any(len(s.token_ids) >= 3 for s in list(engine._running))

    async def run():
        task = asyncio.create_task(_loop(manager, tokenizer, 40).run(params, **fields))
        start = time.monotonic()
        while not started():
            assert time.monotonic() - start < 20, "the sample never started"
            await asyncio.sleep(0.002)
        await manager.abort("cut")
        partial = await task
        resumed = await _loop(manager, tokenizer, 40).run(params, **{**fields, "partial_output": partial})
        return partial, resumed

    partial, resumed = asyncio.run(run())
    assert partial.extra_fields["is_partial"] and 3 <= len(partial.response_ids) < 40
    assert partial.routed_experts.shape[0] == 4 + len(partial.response_ids)
    assert not resumed.extra_fields["is_partial"] and len(resumed.response_ids) == 40
    tokens = resumed.prompt_ids + resumed.response_ids
    assert resumed.routed_experts.shape[0] == len(tokens)
    ids = resumed.routed_experts
    assert torch.equal(ids[:-1].long().sort(-1).values, _hf_routing(model, tokens)[:-1])


def test_fully_async_groups_carry_routed_experts_into_the_trainers_batch(moe):
    """The rollouter joins each group's chunk to its prompt rows; the trainer concatenates groups of
    different prompt widths (each left-padded to the widest): the ids move with their tokens."""
    from hybridflow.trainer.ppo.rollouts import join_rollout
    from hybridflow.workers.rollout.agent_loop.manager import concat_rows

    path, model, replica, tokenizer = moe
    worker = _worker(tokenizer)
    groups = []
    for seed, prompt in ((21, [5, 6, 7]), (22, [8, 9, 10, 11, 12, 13, 14])):
        outputs = _generate(replica, tokenizer, [prompt, prompt], [RESPONSE, 4], seed=seed)
        chunk = _chunk(worker, outputs)
        width = chunk.batch[keys.PROMPTS].shape[1]  # the group's prompt rows, as the dataset gave them
        prompt_keys = (keys.INPUT_IDS, keys.ATTENTION_MASK, keys.POSITION_IDS)
        rows = DataProto.from_dict(
            {key: chunk.batch[key][:, :width].clone() for key in prompt_keys},
            non_tensors={keys.UID: np.array([f"g{seed}"] * 2, dtype=object)},
        )
        chunk.meta_info = {}
        groups.append(join_rollout(rows, chunk))
    assert groups[0].batch[keys.PROMPTS].shape[1] < groups[1].batch[keys.PROMPTS].shape[1]
    batch = concat_rows(groups)
    assert batch.batch[keys.ROUTED_EXPERTS].shape[:2] == batch.batch[keys.INPUT_IDS].shape
    _check_columns(model, batch)
    log_probs = _replayed_log_probs(path, batch)
    response = batch.batch[keys.RESPONSE_MASK].bool()
    torch.testing.assert_close(log_probs["R3"][response], log_probs["disabled"][response], rtol=0, atol=1e-5)


def test_a_finished_sample_without_routing_is_an_error_when_recording(moe):
    from hybridflow.workers.rollout.agent_loop import AgentLoopMetrics, AgentLoopOutput
    from hybridflow.workers.rollout.agent_loop.worker import AgentLoopError

    output = AgentLoopOutput(
        prompt_ids=[5, 6], response_ids=[7, 8], response_mask=[1, 1], metrics=AgentLoopMetrics()
    )
    with pytest.raises(AgentLoopError, match="returned no routed_experts"):
        _chunk(_worker(moe[3]), [output])


def test_tool_agent_keeps_the_last_turns_record_through_aborts(tiny_model_dir, monkeypatch):
    """A conversation that calls ``add`` twice and answers, cut three times (once with no token): the
    output carries the last request's record (the whole conversation), and a resumed call that fed
    nothing keeps the record before it."""
    from hybridflow.models.loading import load_tokenizer
    from hybridflow.workers.rollout.agent_loop import tool_agent
    from hybridflow.workers.rollout.agent_loop.tool_agent import ToolAgentLoop
    from tests.workers.rollout.test_agent_loops import CountingAddTool, ScriptedServers, _config, _run, _turns

    class RecordingServers(ScriptedServers):
        """Each answer's record: (prompt + tokens, 2, 2) filled with the call's number; none when the
        call generated nothing (an abort before its first token)."""

        async def generate(
            self, request_id, *, prompt_ids, sampling_params, image_data=None, video_data=None
        ):
            out = await super().generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params)
            if out.token_ids:
                length = len(prompt_ids) + len(out.token_ids)
                out.routed_experts = torch.full((length, 2, 2), self.calls, dtype=torch.uint8)
            return out

    tokenizer = load_tokenizer(tiny_model_dir)
    monkeypatch.setattr(tool_agent, "_tools", lambda path: {"add": CountingAddTool()})
    servers = RecordingServers(_turns(tokenizer), cut={1: 4, 2: 3, 4: 0})
    output = _run(ToolAgentLoop, _config(), servers, tokenizer, raw_prompt_ids=[1], sample_id="r-1")
    last_with_tokens = {}
    while output.extra_fields["is_partial"]:
        last_with_tokens[servers.calls] = output.routed_experts
        output = _run(
            ToolAgentLoop,
            _config(),
            servers,
            tokenizer,
            raw_prompt_ids=[1],
            sample_id="r-1",
            partial_output=output,
        )
    assert int(last_with_tokens[4].unique()) == 3  # the empty 4th call kept the 3rd's record
    assert output.routed_experts.shape == (1 + len(output.response_ids), 2, 2)
    assert int(output.routed_experts.unique()) == servers.calls  # the answer's turn: the last request


def test_the_fully_async_sync_probe_replays_the_probes_routing(moe):
    """After a sync, ``fully_async_main`` probes each replica and the trainer's actor recomputes the
    probe's tokens: with R3 that actor replays, so the probe's batch carries the answers' ids (without
    them the replaying actor has nothing to replay)."""
    from hybridflow.trainer.fully_async.sync_probe import SyncProbe

    path, _, replica, tokenizer = moe
    cfg = _actor_config("token-mean", 6, 6)
    cfg.router_replay = {"mode": "R3"}
    module = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation=register_cpu_attention()
    )
    actor = DataParallelPPOActor(cfg, module, response_length=RESPONSE)
    seen = []

    class ActorGroup:
        def compute_log_prob(self, batch):
            seen.append(batch)
            log_probs, _ = actor.compute_log_prob(batch, BATCHING)
            return DataProto.from_dict({keys.OLD_LOG_PROBS: log_probs})

    rollout_cfg = OmegaConf.create(
        {"temperature": 1.0, "seed": 3, "name": "engine", "response_length": RESPONSE, "prompt_length": 16}
    )
    probe = SyncProbe(tokenizer, rollout_cfg, 1e-4, [replica.server], ["moe replica"], ActorGroup())
    metrics = probe.check(0)
    assert metrics["fully_async/param_sync/probe_gap_max"] <= 1e-4
    assert keys.ROUTED_EXPERTS in seen[0].batch.keys()
