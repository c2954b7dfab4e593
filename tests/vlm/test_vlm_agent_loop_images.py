"""verl's vision-language agent loops unchanged: a server call's ``image_data`` as the sample's PIL images
(:mod:`hybridflow.workers.rollout.agent_loop.images`), prompt ids from ``self.processor`` the way verl's
loops build them. Reference: the same request given the dataset's ``multi_modal_inputs``."""

import asyncio
import copy
import threading
from uuid import uuid4

import pytest
import torch

from hybridflow.models.loading import load_tokenizer
from hybridflow.utils.dataset import RLHFDataset
from hybridflow.utils.dataset.multimodal import load_processor
from hybridflow.workers.rollout.agent_loop import (
    AgentLoopBase,
    AgentLoopOutput,
    AsyncLLMServerManager,
    DictConfigWrap,
    register,
)
from hybridflow.workers.rollout.agent_loop.base import AgentLoopMetrics, agent_loop_class
from hybridflow.workers.rollout.agent_loop.images import image_inputs
from hybridflow.workers.rollout.engine import EngineModel, LLMEngine, SamplingParams

GREEDY = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def vlm(vlm_model_dir, visual_data):
    """``(engine model, processor, dataset)``; weights of std 0.3 make greedy tokens depend on the image."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    tokenizer = load_tokenizer(vlm_model_dir)
    processor = load_processor(vlm_model_dir, tokenizer)
    dataset = RLHFDataset(
        visual_data[0], tokenizer, {"max_prompt_length": 32, "return_raw_chat": True}, processor=processor
    )
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(vlm_model_dir)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0, 0.3, generator=generator)
    return EngineModel.from_hf_module(model, 128), processor, dataset


def _row(dataset, i):
    row = dataset[i]
    return row, row["input_ids"][row["attention_mask"].bool()].tolist()


def test_pil_image_data_gives_the_datasets_inputs_and_the_same_greedy_tokens(vlm):
    engine_model, processor, dataset = vlm
    engine = LLMEngine(engine_model, 8, 128, [])
    params = SamplingParams(max_new_tokens=8, do_sample=False, ignore_eos=True)
    tokens = {}
    for i in range(3):
        row, ids = _row(dataset, i)
        pil = row["multi_modal_data"]["image"]
        processed = image_inputs(processor, pil, ids, f"r{i}")
        for key in ("pixel_values", "image_grid_thw"):
            assert torch.equal(processed[key], row["multi_modal_inputs"][key])
        as_dicts = image_inputs(processor, [{"image": image} for image in pil], ids, f"r{i}")
        assert torch.equal(as_dicts["pixel_values"], processed["pixel_values"])
        given = [engine.add_request(ids, params, images=x) for x in (processed, row["multi_modal_inputs"])]
        while engine.has_unfinished():
            engine.step()
        pil_tokens, reference = (r.completions[0].token_ids for r in given)
        assert pil_tokens == reference and len(reference) == 8
        tokens[i] = reference
    assert len({tuple(t) for t in tokens.values()}) > 1  # the tokens depend on the image
    # the verl loop's way to the prompt ids: processor.apply_chat_template + processor(text, images)
    row, ids = _row(dataset, 0)
    text = processor.apply_chat_template(row["raw_prompt"], add_generation_prompt=True, tokenize=False)
    out = processor(text=[text], images=row["multi_modal_data"]["image"], return_tensors="pt")
    assert out["input_ids"][0].tolist() == ids
    assert torch.equal(out["image_grid_thw"], row["multi_modal_inputs"]["image_grid_thw"])


def test_image_data_whose_count_does_not_match_the_image_tokens_is_refused_by_request(vlm):
    _, processor, dataset = vlm
    row, ids = _row(dataset, 0)
    image = row["multi_modal_data"]["image"][0]
    with pytest.raises(
        ValueError, match=r"request sample-7: the prompt has \d+ image tokens but its 2 image"
    ):
        image_inputs(processor, [image, image], ids, "sample-7")
    with pytest.raises(ValueError, match="request sample-8: the prompt has 0 image tokens"):
        image_inputs(processor, [image], [1, 2, 3], "sample-8")
    with pytest.raises(ValueError, match="request sample-9: image_data was given but the model has no image"):
        image_inputs(None, [image], ids, "sample-9")


@register("verl_vlm_single_turn")
class VerlVisionSingleTurn(AgentLoopBase):
    """The code shape of verl's ``single_turn_agent_loop.py`` for a vision-language model."""

    async def run(self, sampling_params, **kwargs) -> AgentLoopOutput:
        messages = list(kwargs["raw_prompt"])
        image_data = copy.deepcopy(kwargs.get("multi_modal_data", {}).get("image", None))
        raw_prompt = await self.loop.run_in_executor(
            None,
            lambda: self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
        )
        model_inputs = self.processor(text=[raw_prompt], images=image_data, return_tensors="pt")
        prompt_ids = model_inputs.pop("input_ids").squeeze(0).tolist()
        output = await self.server_manager.generate(
            request_id=uuid4().hex,
            prompt_ids=prompt_ids,
            sampling_params=sampling_params,
            image_data=image_data,
        )
        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=output.token_ids,
            response_mask=[1] * len(output.token_ids),
            response_logprobs=output.log_probs,
            multi_modal_data={"image": image_data},
            num_turns=2,
            metrics=AgentLoopMetrics(),
        )


def test_a_verl_style_vision_agent_loop_runs_unchanged_on_a_real_server(vlm, ray_session):
    """The registered loop, its ``self.processor`` as the worker gives it, PIL ``image_data`` through the
    server manager to a real Ray LLMServer and an engine: tokens = the engine's on ``multi_modal_inputs``;
    the loop's own ``apply_chat_template(messages, images=...)`` gives the same prompt ids."""
    import ray

    from hybridflow.workers.rollout.replica import LLMServer, serve_requests

    engine_model, processor, dataset = vlm
    engine = LLMEngine(engine_model, 8, 128, [])
    server = ray.remote(num_cpus=0, max_concurrency=100)(LLMServer).remote("replica 0")
    thread = threading.Thread(
        target=lambda: serve_requests(engine, server, SamplingParams(max_new_tokens=8), wait_s=0.02),
        daemon=True,
    )
    thread.start()
    manager = AsyncLLMServerManager({}, [server], processor=processor)
    cls, extra = agent_loop_class("verl_vlm_single_turn")
    rows = [_row(dataset, i) for i in range(2)]

    async def run():
        outputs, own_ids = [], []
        for row, _ in rows:
            loop = cls(
                DictConfigWrap({"data": {}}), manager, processor.tokenizer, processor=processor, **extra
            )
            outputs.append(await loop.run(GREEDY, **row))
            own_ids.append(
                await loop.apply_chat_template(row["raw_prompt"], images=row["multi_modal_data"]["image"])
            )
        return outputs, own_ids

    try:
        with torch.no_grad():
            outputs, own_ids = asyncio.run(run())
    finally:
        ray.get(server.stop_serving.remote())
        thread.join(timeout=30)
    params = SamplingParams(max_new_tokens=8, do_sample=False, ignore_eos=True)
    reference = LLMEngine(engine_model, 8, 128, [])
    expected = [reference.add_request(ids, params, images=row["multi_modal_inputs"]) for row, ids in rows]
    while reference.has_unfinished():
        reference.step()
    for (_, ids), output, own, want in zip(rows, outputs, own_ids, expected, strict=True):
        assert output.prompt_ids == ids == own
        assert output.response_ids == want.completions[0].token_ids
        assert output.response_logprobs == pytest.approx(want.completions[0].log_probs, abs=1e-5)
