"""verl's agent-loop interface: one asyncio ``AgentLoopBase.run()`` per sample, registered by name.

A loop receives the sample's dataset fields (``raw_prompt`` messages, ``raw_prompt_ids``,
``tools_kwargs``, ``extra_info``, ...) and the sampling parameters, talks to the generation servers by
token ids through ``self.server_manager.generate(request_id, prompt_ids=..., sampling_params=...)``
(:mod:`.server_manager`), and returns an :class:`AgentLoopOutput`. A verl loop runs unchanged::

    from verl.experimental.agent_loop import AgentLoopBase, AgentLoopOutput, register  # the verl alias
    # or: from hybridflow.workers.rollout.agent_loop import AgentLoopBase, AgentLoopOutput, register

    @register("my_agent")
    class MyAgentLoop(AgentLoopBase):
        async def run(self, sampling_params, **kwargs) -> AgentLoopOutput:
            prompt_ids = await self.apply_chat_template(kwargs["raw_prompt"])
            out = await self.server_manager.generate(
                uuid4().hex, prompt_ids=prompt_ids, sampling_params=sampling_params
            )
            return AgentLoopOutput(prompt_ids=prompt_ids, response_ids=out.token_ids,
                                   response_mask=[1] * len(out.token_ids), response_logprobs=out.log_probs,
                                   num_turns=2, metrics={})

Loops are chosen per sample by the dataset's ``agent_name`` column (default
``rollout.agent.default_agent_loop``); ``rollout.agent.agent_loop_config_path`` names a YAML list of
``{name, _target_}`` entries (verl's format) for loops defined outside the package.
"""

from __future__ import annotations

import asyncio
import importlib
from abc import ABC, abstractmethod
from typing import Any

from pydantic import BaseModel, ConfigDict


class AgentLoopMetrics(BaseModel):
    """Per-sample timings (seconds) and counters, aggregated as ``agent_loop/*`` metrics."""

    model_config = ConfigDict(extra="allow")

    generate_sequences: float = 0.0
    tool_calls: float = 0.0
    num_preempted: int = -1  # -1: not tracked by the loop


class AgentLoopOutput(BaseModel):
    """What one sample's loop produced (verl's fields). Lists are unpadded token-level values:
    ``response_ids``/``response_mask``/``response_logprobs`` are aligned (mask 1 on generated tokens,
    0 on tool/user tokens)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float] | None = None
    routed_experts: Any | None = None
    multi_modal_data: dict[str, Any] | None = None
    reward_score: float | None = None  # set by a loop that scores itself (else the reward manager does)
    num_turns: int = 0  # user, assistant and tool turns
    metrics: AgentLoopMetrics
    extra_fields: dict[str, Any] = {}


class DictConfigWrap:
    """Wraps a config so it reaches a loop's ``__init__`` unresolved (verl's wrapper)."""

    def __init__(self, config) -> None:
        self.config = config


class AgentLoopBase(ABC):
    """One sample's agent loop (a new instance per sample). ``trainer_config``: the whole run config
    (wrapped); ``server_manager``: the generation servers; ``tokenizer`` / ``processor``: the model's."""

    def __init__(
        self,
        trainer_config: DictConfigWrap,
        server_manager,
        tokenizer,
        processor=None,
        dataset_cls=None,
        dataset_config: DictConfigWrap | None = None,
        **kwargs,
    ) -> None:
        self.config = trainer_config.config
        self.server_manager = server_manager
        self.tokenizer = tokenizer
        self.processor = processor
        self.dataset_cls = dataset_cls
        self.dataset_config = dataset_config.config if dataset_config is not None else self.config.get("data")
        data = self.dataset_config  # `or {}` would ask a DictConfig its length: ~0.1 ms a sample
        template_kwargs = data.get("apply_chat_template_kwargs") if data is not None else None
        self.apply_chat_template_kwargs = dict(template_kwargs or {})
        self.loop = asyncio.get_running_loop()

    async def apply_chat_template(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        images=None,
        videos=None,
        remove_system_prompt: bool = False,
    ) -> list[int]:
        """The prompt token ids of ``messages`` with the generation prompt (tokenised off the loop);
        with ``images`` (PIL), the processor's ids: each image's tokens expanded (verl's)."""
        if videos:
            raise ValueError("video prompts are not supported")
        if images:
            if self.processor is None:
                raise ValueError("images given but the model has no image processor (a text-only model)")

            def encode_images() -> list[int]:
                text = self.processor.apply_chat_template(
                    list(messages),
                    tools=tools,
                    add_generation_prompt=True,
                    tokenize=False,
                    **self.apply_chat_template_kwargs,
                )
                return self.processor(text=[text], images=images, return_tensors="pt")["input_ids"][
                    0
                ].tolist()

            return await self.loop.run_in_executor(None, encode_images)

        def encode() -> list[int]:
            ids = self.tokenizer.apply_chat_template(
                list(messages),
                tools=tools or None,
                add_generation_prompt=True,
                tokenize=True,
                **self.apply_chat_template_kwargs,
            )
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

        return await self.loop.run_in_executor(None, encode)

    async def process_vision_info(self, messages: list[dict]) -> dict:
        """verl's hook for images and videos: text-only here."""
        return {}

    @abstractmethod
    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        """Run the sample: ``kwargs`` are its dataset fields; returns its output."""


# name -> {"_target_": "module.Class", ...}: verl's registry format (hydra-instantiable entries)
_agent_loop_registry: dict[str, dict] = {}


def register(agent_name: str):
    """Class decorator: make a loop selectable as ``agent_name`` (verl's ``@register``)."""

    def decorator(subclass: type[AgentLoopBase]) -> type[AgentLoopBase]:
        _agent_loop_registry[agent_name] = {"_target_": f"{subclass.__module__}.{subclass.__qualname__}"}
        return subclass

    return decorator


def registered_agent_loops() -> list[str]:
    return sorted(_agent_loop_registry)


def load_agent_loop_configs(path: str | None) -> None:
    """Register the loops of verl's YAML list (``- name: my_agent`` / ``_target_: pkg.mod.Class``)."""
    if not path:
        return
    import os

    from omegaconf import OmegaConf

    for entry in OmegaConf.load(os.path.expanduser(str(path))):
        if "name" not in entry or "_target_" not in entry:
            raise ValueError(
                f"rollout.agent.agent_loop_config_path {path}: each entry needs name and _target_"
            )
        _agent_loop_registry[str(entry.name)] = OmegaConf.to_container(entry, resolve=True)


def agent_loop_class(agent_name: str) -> tuple[type[AgentLoopBase], dict]:
    """The class registered as ``agent_name`` and the extra constructor arguments of its entry."""
    if agent_name not in _agent_loop_registry:
        raise KeyError(f"agent loop {agent_name!r} is not registered; registered: {registered_agent_loops()}")
    entry = dict(_agent_loop_registry[agent_name])
    target = entry.pop("_target_")
    entry.pop("name", None)
    module, _, name = target.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    if not (isinstance(cls, type) and issubclass(cls, AgentLoopBase)):
        raise TypeError(f"agent loop {agent_name!r}: {target} is not an AgentLoopBase subclass")
    return cls, entry
