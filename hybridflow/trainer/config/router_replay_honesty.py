"""verl's router-replay keys (``actor_rollout_ref.{actor,ref}.router_replay``,
``actor_rollout_ref.rollout.enable_rollout_routing_replay``), checked before Ray starts.

What runs (:mod:`hybridflow.workers.router_replay`, :mod:`hybridflow.workers.rollout.engine.routing`):
``mode: R3`` on the actor (old log-probs and update replay the rollout's ``routed_experts``) and on the
reference, ``mode: R2`` on the actor, the engine recording in the sync rollout (single-turn and
``multi_turn``), in server mode (``rollout.mode=async``: the replicas' answers carry each request's ids,
the agent loops keep them, :mod:`hybridflow.workers.rollout.agent_loop.worker` lays them out) and in
``fully_async_main`` (its samples carry them into the trainer's batch; a sample resumed after a partial
rollout's abort takes the resumed request's record, which covers the whole sample: the engine prefills
prompt + partial response again while it records), on the MoE families transformers routes with a
``*TopKRouter`` (Qwen2-MoE, Qwen3-MoE, Mixtral). What does not is refused with the reason:

- ``record_file`` / ``replay_file``: the routing travels in the batch (``routed_experts``), never
  through a file (verl declares both keys; its FSDP and Megatron workers do not read them either);
- replay on a dense model (no router to replay), or on an MoE type without that router;
- ``R3`` without ``rollout.enable_rollout_routing_replay`` (nothing records the ids), recording on
  another rollout than the engine (vLLM, HF: they hand back no expert ids here);
- ``R2`` on the reference: R2 records in the actor's old-log-prob pass, which the reference's runs
  beside, not before; ``R2`` with the rollout recording (the update would replay the rollout's ids
  wherever the old-log-prob pass is skipped);
- ``R2`` with Ulysses sequence parallelism (R3 replays under it: each rank its slice's ids).
"""

from __future__ import annotations

import json
import os

from omegaconf import DictConfig

from hybridflow.trainer.config.parallelism import sp_size

MODES = ("disabled", "R2", "R3")


def _model_type(path) -> tuple[str | None, bool] | None:
    """(model_type, has routed experts) from the model directory's config.json; None when unreadable."""
    from hybridflow.models.moe import is_moe_config

    file = os.path.join(os.path.expanduser(str(path)), "config.json")
    try:
        with open(file) as handle:
            raw = json.load(handle)
    except (OSError, ValueError):
        return None
    return raw.get("model_type"), is_moe_config(raw)


def router_replay_problems(config: DictConfig) -> list[str]:
    """One line per router-replay setting that cannot run (none when replay is off)."""
    arr = config.actor_rollout_ref
    problems = []
    modes = {}
    for section in ("actor", "ref"):
        replay = arr[section].get("router_replay") or {}
        key = f"actor_rollout_ref.{section}.router_replay"
        mode = replay.get("mode", "disabled")
        if mode not in MODES:
            problems.append(f"{key}.mode={mode!r}: use one of {MODES}")
            continue
        modes[section] = mode
        for name in ("record_file", "replay_file"):
            if replay.get(name) is not None:
                problems.append(
                    f"{key}.{name}={replay.get(name)!r}: routing travels in the batch (routed_experts), not "
                    "through a file; set null"
                )
    if modes.get("ref") == "R2":
        problems.append(
            "actor_rollout_ref.ref.router_replay.mode=R2: R2 records in the actor's old-log-prob pass, which "
            "the reference's runs beside; use R3 or disabled"
        )
    recording = bool(arr.rollout.get("enable_rollout_routing_replay", False))
    replaying = [s for s, m in modes.items() if m != "disabled"]
    if not replaying and not recording:
        return problems
    facts = _model_type(arr.model.path)
    if facts is not None:
        from hybridflow.workers.rollout.engine.moe import MOE_MODEL_TYPES

        model_type, moe = facts
        if not moe:
            problems.append(
                f"router replay (router_replay.mode / rollout.enable_rollout_routing_replay): the model at "
                f"actor_rollout_ref.model.path is dense ({model_type}, no mixture-of-experts layer); turn "
                "replay off"
            )
            return problems
        if model_type not in MOE_MODEL_TYPES:
            problems.append(f"router replay: built for {MOE_MODEL_TYPES}, not {model_type!r}; turn it off")
    if modes.get("actor") == "R2" and recording:
        problems.append(
            "actor_rollout_ref.actor.router_replay.mode=R2 with rollout.enable_rollout_routing_replay=true: "
            "R2 replays the old-log-prob pass's own routing, and where that pass is skipped the update "
            "would replay the rollout's (R3's) instead; use R3, or set enable_rollout_routing_replay=false"
        )
    r3 = [s for s in replaying if modes[s] == "R3"]
    if r3 and not recording:
        problems.append(
            f"actor_rollout_ref.{r3[0]}.router_replay.mode=R3 replays the rollout's routing: set "
            "actor_rollout_ref.rollout.enable_rollout_routing_replay=true"
        )
    if recording:
        rollout = arr.rollout
        if rollout.name != "engine":
            problems.append(
                f"rollout.enable_rollout_routing_replay=true: rollout.name={rollout.name} does not record "
                "routing here; use rollout.name=engine"
            )
    if modes.get("actor") == "R2" and sp_size(config, "actor_rollout_ref.actor") > 1:
        problems.append(
            "actor_rollout_ref.actor.router_replay.mode=R2: recording under Ulysses sequence parallelism is "
            "not built (each rank routes a slice); use R3, or ulysses_sequence_parallel_size=1"
        )
    return problems
