"""The embedded engine with images (Qwen2.5-VL): the language model in the engine's fused layout, the
vision tower as the HF module, image features in the prefill's embeddings, M-RoPE positions, and decode
at ``cache_len + rope_delta``. References: transformers' own rotary embedding, ``generate`` (greedy)
and forward on the same image prompts, and the actor's recompute (vision_forward) of the engine
rollout's samples, before and after a weight sync that changes the vision tower."""

import copy

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from hybridflow import keys
from hybridflow.models.loading import load_tokenizer
from hybridflow.protocol import DataProto
from hybridflow.utils.dataset import RLHFDataset, collate_fn
from hybridflow.utils.dataset.multimodal import load_processor
from hybridflow.workers.rollout.engine import EngineModel, LLMEngine, SamplingParams
from hybridflow.workers.rollout.engine.vision import mrope_cos_sin

PROMPT_KEYS = [keys.INPUT_IDS, keys.ATTENTION_MASK, keys.POSITION_IDS]


@pytest.fixture(scope="module")
def vlm(vlm_model_dir, visual_data):
    """``(HF model with larger random weights, tokenizer, dataset)``: the tiny model's own init makes
    every greedy token the same; weights of std 0.3 make tokens depend on the image and the positions."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    tokenizer = load_tokenizer(vlm_model_dir)
    dataset = RLHFDataset(
        visual_data[0],
        tokenizer,
        {"max_prompt_length": 32},
        processor=load_processor(vlm_model_dir, tokenizer),
    )
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(vlm_model_dir)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0, 0.3, generator=generator)
    return model, tokenizer, dataset


def _image_prompts(model, tokenizer, dataset):
    """Three one-image prompts, a two-image prompt and a text prompt: ``[(ids, images or {})]``."""
    prompts = []
    for i in range(3):
        row = dataset[i]
        prompts.append((row["input_ids"][row["attention_mask"].bool()].tolist(), row["multi_modal_inputs"]))
    start, end = (tokenizer.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|vision_end|>"))
    second = [start] + [model.config.image_token_id] * 4 + [end]
    two_ids = prompts[0][0] + tokenizer.encode(" and ") + second + tokenizer.encode(" which?")
    two = {k: torch.cat([prompts[0][1][k], prompts[1][1][k]]) for k in ("pixel_values", "image_grid_thw")}
    return [*prompts, (two_ids, two), (tokenizer.encode("what colour is the square?"), {})]


def _hf_inputs(model, ids: list[int], images: dict, prompt_len: int) -> dict:
    """HF's image inputs for ``ids`` (its first ``prompt_len`` tokens the prompt)."""
    if not images:
        return {}
    token_type = torch.zeros(1, len(ids), dtype=torch.int)
    token_type[0, :prompt_len] = torch.tensor(ids[:prompt_len]) == model.config.image_token_id
    return {**{k: images[k] for k in ("pixel_values", "image_grid_thw")}, "mm_token_type_ids": token_type}


def test_mrope_cos_sin_equals_transformers_rotary(vlm):
    model, _, _ = vlm
    engine = EngineModel.from_hf_module(model, 64)
    positions = torch.randint(0, 64, (3, 2, 7), generator=torch.Generator().manual_seed(0))
    cos, sin = mrope_cos_sin(engine.rope_cos, engine.rope_sin, positions, engine.mrope_axes)
    hf_cos, hf_sin = model.model.language_model.rotary_emb(torch.zeros(1), positions)
    assert torch.equal(cos[:, :, 0], hf_cos) and torch.equal(sin[:, :, 0], hf_sin)


def test_engine_equals_hf_generate_and_forward_on_a_batch_mixing_image_and_text_rows(vlm):
    model, tokenizer, dataset = vlm
    config = model.config
    prompts = _image_prompts(model, tokenizer, dataset)
    engine_model = EngineModel.from_hf_module(model, 128)
    greedy = SamplingParams(max_new_tokens=10, do_sample=False, ignore_eos=True)
    outputs = {}
    # the static decode step, a burst of 4, and the eager step (a top-log-prob request forces it)
    for name, steps, params in [
        ("static", 1, greedy),
        ("burst", 4, greedy),
        ("eager", 1, SamplingParams(max_new_tokens=10, do_sample=False, ignore_eos=True, logprobs=1)),
    ]:
        engine = LLMEngine(engine_model, 8, 128, [tokenizer.eos_token_id], decode_steps_per_sync=steps)
        requests = [engine.add_request(ids, params, images=images) for ids, images in prompts]
        while engine.has_unfinished():
            engine.step()
        outputs[name] = [r.completions[0] for r in requests]
        assert engine.stats["eager_steps" if name == "eager" else "static_steps"] > 0
    for name in ("burst", "eager"):
        assert [c.token_ids for c in outputs[name]] == [c.token_ids for c in outputs["static"]]
    suppressed = [config.image_token_id, config.video_token_id]
    for (ids, images), completion in zip(prompts, outputs["static"], strict=True):
        prompt = torch.tensor([ids])
        hf = model.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=10,
            do_sample=False,
            suppress_tokens=suppressed,
            eos_token_id=None,
            pad_token_id=0,
            **_hf_inputs(model, ids, images, len(ids)),
        )
        assert completion.token_ids == hf[0, len(ids) :].tolist()
        sequence = ids + completion.token_ids
        with torch.no_grad():
            logits = model(
                input_ids=torch.tensor([sequence]), **_hf_inputs(model, sequence, images, len(ids))
            ).logits.float()
        logits[..., suppressed] = -1e30
        response = torch.tensor(completion.token_ids)
        reference = torch.log_softmax(logits[0, len(ids) - 1 : -1], -1).gather(-1, response[:, None])[:, 0]
        assert (reference - torch.tensor(completion.log_probs)).abs().max() < 1e-5
    # the image prompts decode at an offset (M-RoPE compresses an image's positions); the text one not
    deltas = LLMEngine(engine_model, 8, 128, [])
    for ids, images in prompts:
        deltas.add_request(ids, SamplingParams(max_new_tokens=8), images=images)
    deltas.step()
    assert [s.rope_delta for s in deltas._running] == [-2, -2, -2, -4, 0]


def test_image_tokens_without_their_features_fail_the_request_by_name(vlm):
    model, tokenizer, dataset = vlm
    ids, images = _image_prompts(model, tokenizer, dataset)[0]
    engine = LLMEngine(EngineModel.from_hf_module(model, 64), 2, 64, [])
    with pytest.raises(ValueError, match="request r7: the prompt has 4 image tokens but its images have 0"):
        engine.add_request(ids, SamplingParams(), request_id="r7")
    with pytest.raises(ValueError, match="has 0 image tokens but its images have 4"):
        engine.add_request(tokenizer.encode("no image here"), SamplingParams(), images=images)
    with pytest.raises(ValueError, match="sequence 0 holds image tokens: scoring takes no images"):
        __import__("asyncio").run(engine.score([ids], [len(ids) - 1], k=1))


def test_engine_rollout_log_probs_equal_the_actors_before_and_after_a_vision_tower_sync(vlm):
    from hybridflow.trainer.config import load_config
    from hybridflow.workers.actor.dp_actor import response_log_probs
    from hybridflow.workers.fsdp_utils import apply_fsdp2, build_device_mesh
    from hybridflow.workers.rollout.engine_rollout import EngineRollout, prompt_runs
    from tests.utils.checkpoint.fsdp_toy import gloo_group

    model, tokenizer, dataset = vlm
    batch = DataProto.from_single_dict(collate_fn([dataset[i] for i in range(4)])).repeat(2, interleave=True)
    prompts = batch.select(batch_keys=PROMPT_KEYS, non_tensor_batch_keys=[keys.MULTI_MODAL_INPUTS, "index"])
    prompts.meta_info = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    copied = copy.deepcopy(
        prompts
    )  # each row's own images object (equal values): still one prefill per prompt
    copied.non_tensor_batch[keys.MULTI_MODAL_INPUTS] = np.array(
        [dict(r) for r in copied.non_tensor_batch[keys.MULTI_MODAL_INPUTS]], dtype=object
    )
    for data in (prompts, copied):
        assert [run[1] for run in prompt_runs(data)] == [2, 2, 2, 2]
    values = {"data.max_prompt_length": 32, "data.max_response_length": 6}
    overrides = [
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        "actor_rollout_ref.rollout.decode_threads=2",
    ]
    config = load_config([f"{k}={v}" for k, v in values.items()] + overrides)
    OmegaConf.resolve(config)
    with gloo_group():
        actor = apply_fsdp2(copy.deepcopy(model), build_device_mesh(1, "cpu"), OmegaConf.create({}))
        rollout = EngineRollout(actor, config.actor_rollout_ref.rollout, rank=0)

        def rolled_out():
            output = rollout.generate_sequences(prompts)
            output.non_tensor_batch[keys.MULTI_MODAL_INPUTS] = prompts.non_tensor_batch[
                keys.MULTI_MODAL_INPUTS
            ]
            with torch.no_grad():
                recomputed, _ = response_log_probs(actor, output, temperature=1.0)
            mask = output.batch[keys.RESPONSE_MASK].bool()
            assert (recomputed - output.batch[keys.ROLLOUT_LOG_PROBS])[mask].abs().max() < 1e-5
            return output.batch[keys.ROLLOUT_LOG_PROBS]

        before = rolled_out()
        with torch.no_grad():  # a trained vision tower: its weights must reach the engine too
            for name, param in actor.named_parameters():
                if name.startswith("model.visual.") and param.dim() == 2:
                    param.mul_(1.5)
        rollout.release_weights()  # between rollouts: the vision tower's copy is freed and re-made too
        assert rollout.model.vision.module.patch_embed.proj.weight.is_meta
        rollout.update_weights()
        after = rolled_out()
        assert not torch.allclose(before, after)
        # multi-turn (multi_turn.enable, no tools: one turn each): the conversations carry the images
        config.actor_rollout_ref.rollout.multi_turn.enable = True
        rollout = EngineRollout(actor, config.actor_rollout_ref.rollout, rank=0, tokenizer=tokenizer)
        rolled_out()


def test_the_server_takes_a_samples_multi_modal_inputs_and_names_what_else_it_refuses():
    import asyncio

    from PIL import Image

    from hybridflow.workers.rollout.replica import LLMServer, ReplicaError

    async def calls():
        server = LLMServer("replica 0")
        grid = {"pixel_values": torch.zeros(16, 1176), "image_grid_thw": torch.tensor([[1, 4, 4]])}
        waiting = asyncio.ensure_future(server.generate("a", prompt_ids=[1, 2], image_data=grid))
        await asyncio.sleep(0)
        assert server._queue[0][3] is grid  # queued for the engine with its images
        with pytest.raises(
            ReplicaError, match="request b: image_data must be the sample's multi_modal_inputs"
        ):
            await server.generate("b", prompt_ids=[1], image_data=[Image.new("RGB", (56, 56))])
        waiting.cancel()

    asyncio.run(calls())


def test_engine_rollout_accepted_for_qwen2_5_vl_and_refused_for_another_vision_type(vlm_model_dir, tmp_path):
    import json
    import shutil

    from hybridflow.trainer.config import load_config
    from hybridflow.trainer.config.vision_honesty import vision_problems

    engine = [f"actor_rollout_ref.model.path={vlm_model_dir}", "actor_rollout_ref.rollout.name=engine"]
    assert vision_problems(load_config(engine)) == []
    other = tmp_path / "qwen2_vl"
    shutil.copytree(vlm_model_dir, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "qwen2_vl"}))
    problems = vision_problems(load_config([f"actor_rollout_ref.model.path={other}", engine[1]]))
    assert any(
        "engine runs the vision tower and M-RoPE of qwen2_5_vl only: set rollout.name=hf" in p
        for p in problems
    )


class _Scripted:
    """Forces the model's first turn to ``text`` then EOS; later turns generate freely (greedy)."""

    def __init__(self, token_ids: list[int]):
        self.script, self.turn = token_ids, 0

    def __call__(self, generated: list[int], logits: torch.Tensor) -> torch.Tensor:
        if self.turn > 0:
            return logits
        token = self.script[len(generated)]
        self.turn += len(generated) == len(self.script) - 1
        forced = torch.full_like(logits, float("-inf"))
        forced[token] = 0.0
        return forced


def test_a_two_turn_tool_conversation_carries_the_first_turns_images(vlm):
    """Turn 1 (scripted) calls a tool; turn 2's prefill (prompt with the image, turn 1, the tool's
    answer) takes the first turn's images: its greedy tokens and log-probs equal HF's forward on the
    whole image+text conversation."""
    import asyncio

    from hybridflow.workers.rollout.multi_turn import MultiTurnLimits, ToolAgentLoop
    from hybridflow.workers.rollout.tools.base_tool import BaseTool, ToolSchema
    from hybridflow.workers.rollout.tools.parser import get_tool_call_parser

    class Colour(BaseTool):
        def __init__(self):
            super().__init__({}, ToolSchema("colour", "the colour", {"type": "object"}))

        async def execute(self, instance_id, parameters, **kwargs):
            return "red", 0.0, {}

    model, tokenizer, dataset = vlm
    ids, images = _image_prompts(model, tokenizer, dataset)[0]
    eos = tokenizer.eos_token_id
    engine = LLMEngine(EngineModel.from_hf_module(model, 256), 4, 256, [eos])
    limits = MultiTurnLimits(response_length=120, max_assistant_turns=2)
    loop = ToolAgentLoop(
        engine, tokenizer, {"colour": Colour()}, get_tool_call_parser("hermes"), limits, [eos]
    )
    call = tokenizer.encode('<tool_call>{"name": "colour", "arguments": {}}</tool_call>') + [eos]
    params = SamplingParams(do_sample=False, logits_processor=_Scripted(call))
    conv = asyncio.run(loop.run(ids, params, images=images))
    assert (conv.assistant_turns, conv.tool_calls, conv.tool_failures) == (2, 1, 0), conv.finish_reason
    tool_turn = loop.renderer.tool_turn_ids(["red"])
    assert conv.response_ids[: len(call) + len(tool_turn)] == call + tool_turn
    second = len(call) + len(tool_turn)  # where turn 2 starts in the response
    assert len(conv.response_ids) > second and conv.response_mask[second:] == [1] * (
        len(conv.response_ids) - second
    )
    sequence = ids + conv.response_ids
    with torch.no_grad():
        logits = model(
            input_ids=torch.tensor([sequence]), **_hf_inputs(model, sequence, images, len(ids))
        ).logits
    logits = logits.float()
    logits[..., [model.config.image_token_id, model.config.video_token_id]] = -1e30
    start = len(ids) + second
    turn2 = torch.log_softmax(logits[0, start - 1 : -1], -1)
    assert turn2.argmax(-1).tolist() == conv.response_ids[second:]  # HF's greedy choice at every token
    chosen = turn2.gather(-1, torch.tensor(conv.response_ids[second:])[:, None])[:, 0]
    assert (chosen - torch.tensor(conv.log_probs[second:])).abs().max() < 1e-5


def test_a_lora_actor_reaches_the_engine_merged_on_the_language_model_only(vlm):
    """A LoRA actor (adapter on the language model's linears, as the trainer builds it for a
    vision-language model) syncs into the engine with the adapter merged: the engine's greedy tokens on
    an image prompt equal HF's with the adapter merged, and differ from the base model's."""
    from omegaconf import OmegaConf

    from hybridflow.workers.lora import apply_lora
    from hybridflow.workers.model_builder import _lm_only_lora

    model, tokenizer, dataset = vlm
    ids, images = _image_prompts(model, tokenizer, dataset)[0]
    lora = apply_lora(
        copy.deepcopy(model),
        _lm_only_lora(OmegaConf.create({"lora_rank": 4, "lora_alpha": 8, "target_modules": "all-linear"})),
    )
    with torch.no_grad():  # a trained adapter (peft starts B at 0)
        for name, param in lora.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    assert not any("visual" in name and "lora_" in name for name, _ in lora.named_parameters())

    def greedy(engine_model):
        engine = LLMEngine(engine_model, 2, 64, [])
        request = engine.add_request(ids, SamplingParams(max_new_tokens=8, do_sample=False), images=images)
        while engine.has_unfinished():
            engine.step()
        return request.completions[0].token_ids

    merged = copy.deepcopy(lora).merge_and_unload()
    prompt = torch.tensor([ids])
    hf = merged.generate(
        input_ids=prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=8,
        do_sample=False,
        suppress_tokens=[model.config.image_token_id, model.config.video_token_id],
        eos_token_id=None,
        pad_token_id=0,
        **_hf_inputs(model, ids, images, len(ids)),
    )[0, len(ids) :].tolist()
    assert greedy(EngineModel.from_hf_module(lora, 64)) == hf != greedy(EngineModel.from_hf_module(model, 64))


def test_the_prefix_cache_keys_image_prompts_by_their_images_not_their_placeholders(vlm):
    """The same prompt ids with other images find nothing cached (every block's key covers the images'
    contents); with the same images they find their blocks, and every answer is what an engine with
    no prefix cache gives (M-RoPE positions past a cached prefix included)."""
    model, tokenizer, dataset = vlm
    prompts = _image_prompts(model, tokenizer, dataset)
    ids, first = prompts[0]
    second = prompts[1][1]
    assert first["pixel_values"].shape == second["pixel_values"].shape  # same placeholders, other pixels
    params = SamplingParams(max_new_tokens=8, do_sample=False)
    cached = LLMEngine(EngineModel.from_hf_module(model, 128), 4, 128, [], block_size=4)
    plain = LLMEngine(
        EngineModel.from_hf_module(model, 128), 4, 128, [], block_size=4, enable_prefix_caching=False
    )
    def answer(engine, images) -> list[int]:
        request = engine.add_request(ids, params, images=images)
        while not request.done:
            engine.step()
        return request.completions[0].token_ids

    answers, hits = [], []
    for images in (first, second, first):
        before = cached.pool.stats["prefix_hits"]
        answers.append(answer(cached, images))
        hits.append(cached.pool.stats["prefix_hits"] - before)
        assert answers[-1] == answer(plain, images)
    assert hits[0] == 0 and hits[1] == 0 and hits[2] == 4 * ((len(ids) - 1) // 4)
    assert answers[0] == answers[2] != answers[1]
