"""From this machine's long-tail measurements to verl's published scale: the fully-async speed-up predicted
for Qwen2.5-Math-7B on 128 GPUs, next to the 2.35-2.67x verl measured. One JSON line.

    python benchmarks/async_prediction.py LONG_TAIL_JSONL

The model (a pipeline of two pools, each step bound by the slower one):

- synchronous, colocated on G devices: ``step = gen + old_log_prob + update + other`` (verl's published
  phase times at G = 128, and the update at G = 64, from verl's docs/advance/fully_async.md);
- fully asynchronous on R:T = 64:64 devices: the trainer runs ``update`` (no old-log-prob pass:
  ``use_rollout_log_probs``) on T devices; the rollouter streams, so its devices never wait for a
  batch's slowest sample. Its time per step is the synchronous generation's device-time divided by
  the **tail factor** ``tau`` (device-seconds a synchronous step's generation takes / device-seconds
  the same samples take when streamed), spread over R devices: ``gen x G / tau / R``.
- ``tau`` is what this machine measures (``benchmarks/long_tail.py``): the sync run's generation
  phase on its 2 processes against the fully-async run's step time on its 1 rollout process, when
  that run was rollout-bound (the trainer waited for samples). When the fully-async run was
  trainer-bound, its step time bounds the rollout from above and ``tau`` from below.
- The trainer's time on T devices is bracketed: verl's measured update at 64 colocated GPUs (what
  strong scaling gave them), and the 128-GPU update x 128 / T (perfect scaling, the pessimistic end).

It ignores the parameter sync (measured here: ~1% of a step) and verl's staleness-induced extra
steps; it is an estimate of where the step time goes, not a simulation.
"""

from __future__ import annotations

import json
import sys

# verl docs/advance/fully_async.md, "Asynchronous Training on 7B Model" (H20, Qwen2.5-Math-7B, DAPO,
# 28K max response, rollout.n 16, train_batch_size 512): colocate sync phase times in seconds.
VERL_SYNC_128 = {"step": 356.30, "gen": 177.85, "old_log_prob": 53.92, "update_actor": 113.81}
VERL_UPDATE_64 = 133.41  # colocate sync on 64 GPUs
VERL_MEASURED = (2.35, 2.67)  # fully_async_policy 64:64 vs colocate sync 128, total time at 400 / 100 steps
GPUS, ROLLOUT_GPUS, TRAINER_GPUS = 128, 64, 64


def tail_factor(sync: dict, fully_async: dict) -> tuple[float, bool]:
    """(tau, exact): exact when the fully-async run was rollout-bound."""
    sync_gen_device_s = sync["phase_s"]["gen"] * 2  # 2 processes generate in the sync run
    idle = fully_async["extra"].get("fully_async/trainer/idle_ratio", 0.0)
    stream_device_s = fully_async["step_s"] * 1  # 1 rollout process
    return sync_gen_device_s / stream_device_s, idle > 0.05


def predict(tau: float) -> dict:
    rollout_s = VERL_SYNC_128["gen"] * GPUS / tau / ROLLOUT_GPUS
    trainer_s = {
        "strong_scaling_measured_by_verl": VERL_UPDATE_64,
        "perfect_scaling": VERL_SYNC_128["update_actor"] * GPUS / TRAINER_GPUS,
    }
    return {
        "rollout_s_per_step": round(rollout_s, 1),
        "trainer_s_per_step": {k: round(v, 1) for k, v in trainer_s.items()},
        "speedup": {k: round(VERL_SYNC_128["step"] / max(rollout_s, v), 2) for k, v in trainer_s.items()},
    }


def main(path: str) -> dict:
    runs = {}
    for line in open(path):
        record = json.loads(line)
        if record.get("mode"):
            runs[record["mode"]] = record
    tau, exact = tail_factor(runs["sync"], runs["fully_async"])
    result = {
        "benchmark": "async_prediction",
        "tau": round(tau, 2),
        "tau_is": "measured (rollout-bound run)" if exact else "a lower bound (trainer-bound run)",
        **predict(tau),
        "verl_measured": VERL_MEASURED,
        "inputs": {"verl_sync_128": VERL_SYNC_128, "verl_update_64": VERL_UPDATE_64},
    }
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main(sys.argv[1])
