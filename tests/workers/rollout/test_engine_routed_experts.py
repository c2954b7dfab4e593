"""The engine records routing for router replay R3 (issue 48 item 3; the actor's side:
``tests/workers/test_router_replay.py``). On tiny random Qwen2-MoE, Qwen3-MoE and Mixtral models in fp32:

- every prompt and generated token's recorded top-k ids equal the experts HF's routers pick for the same
  tokens (the last token, which no forward fed, has 0s), with ``n`` samples sharing a prefill and through
  preemption; prefix caching is off while recording; a dense model is refused;
- through the sync rollout (an FSDP2 actor feeding the engine): ``routed_experts`` (B, T, L, k) uint8 sits in
  ``input_ids``' columns, and the actor's log-probs replaying it equal its own (routing agrees in fp32) and
  the engine's; shifted ids move them;
- through a multi-turn tool conversation (``multi_turn``): the last turn's record covers the conversation
  and reaches the batch's columns."""

import pytest
import torch
import transformers
from omegaconf import OmegaConf

from hybridflow import keys
from hybridflow.models.attention import register_cpu_attention
from hybridflow.workers.actor.dp_actor import DataParallelPPOActor
from hybridflow.workers.rollout.engine import EngineModel, LLMEngine, SamplingParams
from tests.tiny_configs import MOE_FAMILIES, tiny_decoder_config
from tests.workers.engine_prompts import tiny_prompts
from tests.workers.rollout.test_engine import EOS, _prompts
from tests.workers.test_loss_normalisation import _actor_config


def _random_moe(family: str):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        tiny_decoder_config(family, attn_implementation=register_cpu_attention())
    ).eval()
    with torch.no_grad():  # peaked distributions, and routers spread over every expert
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0, 1.0 if name.endswith("mlp.gate.weight") else 0.2)
    return model


def _hf_routing(model, ids: list[int]) -> torch.Tensor:
    """(T, L, k): the experts HF's routers pick for each token of ``ids``, each token's k sorted."""
    picks = []
    hooks = [
        module.register_forward_hook(lambda m, i, out: picks.append(out[2]))
        for module in model.modules()
        if type(module).__name__.endswith("TopKRouter")
    ]
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]))
    for hook in hooks:
        hook.remove()
    return torch.stack(picks, 1).sort(-1).values


def _engine(model, **kwargs) -> LLMEngine:
    return LLMEngine(
        EngineModel.from_hf_module(model, 96), 16, 96, eos_token_ids=[EOS], record_routing=True, **kwargs
    )


def _check_against_hf(model, results) -> int:
    checked = 0
    for result in results:
        for completion in result.completions:
            tokens = result.prompt_token_ids + completion.token_ids
            ids = completion.routed_experts
            assert ids.dtype == torch.uint8 and ids.shape[0] == len(tokens)
            hf = _hf_routing(model, tokens)
            assert ids.shape[1:] == hf.shape[1:]
            assert torch.equal(ids[:-1].long().sort(-1).values, hf[:-1])
            assert not ids[-1].any()
            checked += len(tokens) - 1
    return checked


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_recorded_ids_are_hf_routers_picks_for_prompt_and_generated_tokens(family):
    model = _random_moe(family)
    engine = _engine(model)
    assert not engine.enable_prefix_caching and not engine.pool.caching
    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=3)
    results = engine.generate_batch(_prompts(4, seed=4), params, n=2)
    assert _check_against_hf(model, results) > 60
    assert engine.eager_reasons.get("record_routing", 0) > 0


def test_preemption_recomputes_the_routing_it_drops():
    model = _random_moe("qwen3_moe")
    params = SamplingParams(max_new_tokens=16, temperature=0.8, seed=3, ignore_eos=True)
    small = _engine(model, num_blocks=6)
    results = small.generate_batch(_prompts(6, seed=7), params, n=2)
    assert small.stats["preemptions"] > 0
    _check_against_hf(model, results)


def test_recording_on_a_dense_model_is_refused():
    torch.manual_seed(0)
    dense = transformers.AutoModelForCausalLM.from_config(tiny_decoder_config("qwen2"))
    with pytest.raises(ValueError, match="dense model"):
        _engine(dense)


def test_sync_rollout_carries_routed_experts_that_the_actor_replays():
    from hybridflow.trainer.config import load_config
    from hybridflow.workers.fsdp_utils import apply_fsdp2, build_device_mesh
    from hybridflow.workers.rollout.engine_rollout import EngineRollout
    from tests.utils.checkpoint.fsdp_toy import gloo_group

    values = {
        "data.max_prompt_length": 16,
        "data.max_response_length": 8,
        "actor_rollout_ref.rollout.enable_rollout_routing_replay": True,
        "actor_rollout_ref.rollout.calculate_log_probs": True,
        "actor_rollout_ref.rollout.dtype": "fp32",
    }
    config = load_config([f"{k}={v}" for k, v in values.items()])
    OmegaConf.resolve(config)
    actor_model = _random_moe("mixtral")
    with gloo_group():
        sharded = apply_fsdp2(_random_moe("mixtral"), build_device_mesh(1, "cpu"), OmegaConf.create({}))
        rollout = EngineRollout(sharded, config.actor_rollout_ref.rollout, rank=0)
        prompts = tiny_prompts(n=2, do_sample=True)
        prompts.meta_info["temperature"] = 1.0
        output = rollout.generate_sequences(prompts)
    routed = output.batch[keys.ROUTED_EXPERTS]
    input_ids, mask = output.batch[keys.INPUT_IDS], output.batch[keys.ATTENTION_MASK].bool()
    assert routed.dtype == torch.uint8 and routed.shape == (*input_ids.shape, 2, 2)
    assert not routed[~mask].any()
    for row in range(len(input_ids)):  # every attended column but the last: HF's picks for its token
        tokens = input_ids[row][mask[row]].tolist()
        assert torch.equal(
            routed[row][mask[row]][:-1].long().sort(-1).values, _hf_routing(actor_model, tokens)[:-1]
        )
    batching = OmegaConf.create(
        {"log_prob_micro_batch_size_per_gpu": 2, "log_prob_use_dynamic_bsz": False,
         "log_prob_max_token_len_per_gpu": 4096}
    )  # fmt: skip
    log_probs = {}
    for mode in ("disabled", "R3"):
        cfg = _actor_config("token-mean", 6, 6)
        cfg.router_replay = {"mode": mode}
        actor = DataParallelPPOActor(cfg, _random_moe("mixtral"), response_length=8)
        log_probs[mode], _ = actor.compute_log_prob(output, batching)
    response = output.batch[keys.RESPONSE_MASK].bool()
    torch.testing.assert_close(log_probs["R3"][response], log_probs["disabled"][response], rtol=0, atol=1e-5)
    rollout_lp = output.batch[keys.ROLLOUT_LOG_PROBS]
    assert (rollout_lp - log_probs["R3"])[response].abs().max() <= 1e-4
    output.batch[keys.ROUTED_EXPERTS] = (routed + 1) % 4
    shifted, _ = actor.compute_log_prob(output, batching)
    assert (shifted - log_probs["R3"])[response].abs().max() > 1e-2


def test_a_multi_turn_conversation_carries_its_routing_into_the_batch(tmp_path):
    """A tool call, its answer, then the model's answer: the last turn's record covers the whole
    conversation (prompt, both generated turns, the tool's tokens between them) and sits in the batch's
    columns; only the last token (never fed) has 0s."""
    import asyncio

    from hybridflow.models.loading import load_tokenizer
    from hybridflow.models.tiny import build_tiny_model
    from hybridflow.protocol import DataProto
    from hybridflow.workers.rollout.multi_turn import MultiTurnLimits, ToolAgentLoop, assemble_conversations
    from hybridflow.workers.rollout.tools.parser import get_tool_call_parser
    from tests.workers.rollout.test_multi_turn import EOS as TURN_END
    from tests.workers.rollout.test_multi_turn import AddTool, Script, _call, _prompt

    path = build_tiny_model(
        tmp_path / "moe", arch="qwen3_moe", hidden_size=64, num_layers=2, intermediate_size=64
    )
    tokenizer = load_tokenizer(str(path))
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    engine = LLMEngine(
        EngineModel.from_hf_module(model, 512), 4, 512, eos_token_ids=[TURN_END], record_routing=True
    )
    limits = MultiTurnLimits(response_length=200, max_parallel_calls=2)
    loop = ToolAgentLoop(
        engine, tokenizer, {"add": AddTool()}, get_tool_call_parser("hermes"), limits, [TURN_END]
    )
    prompt = _prompt(tokenizer)
    params = SamplingParams(logits_processor=Script(tokenizer, [_call(2, 3), "The answer is 5"]))
    conv = asyncio.run(loop.run(prompt, params))
    assert conv.assistant_turns == 2 and 0 in conv.response_mask  # the tool's tokens sit between the turns
    tokens = prompt + conv.response_ids
    hf = _hf_routing(model, tokens)
    assert conv.routed_experts.shape[0] == len(tokens)
    assert torch.equal(conv.routed_experts[:-1].long().sort(-1).values, hf[:-1])
    width = len(prompt) + 3  # left padding
    ids = torch.tensor([[0] * 3 + prompt])
    mask = (torch.arange(width) >= 3).long()[None]
    prompts = DataProto.from_dict(
        {
            keys.INPUT_IDS: ids,
            keys.ATTENTION_MASK: mask,
            keys.POSITION_IDS: (mask.cumsum(-1) - 1).clamp(min=0),
        }
    )
    batch = assemble_conversations(prompts, [conv], pad_id=0, response_length=200)
    routed, attended = batch.batch[keys.ROUTED_EXPERTS][0], batch.batch[keys.ATTENTION_MASK][0].bool()
    assert routed.shape[0] == width + 200 and not routed[~attended].any()
    assert torch.equal(routed[attended][:-1].long().sort(-1).values, hf[:-1])
