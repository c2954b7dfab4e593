"""The rollout trace's own cost per call, in one process: one JSON line.

    python benchmarks/rollout_trace_cost.py [--calls 2000] [--tokenizer MODEL_DIR]

Calls shaped like ``benchmarks/long_tail.py``'s (a sample: its loop's ``run`` with a 64-token prompt
and a 384-position response, two generations of 32 tokens with log-probs, a tool call, the reward) go
through :func:`~hybridflow.utils.rollout_trace.rollout_trace_op` into the jsonl backend. Measured:

- ``on_loop_us``: what a traced call adds on the event loop (the JSON-ready copy and the queue put),
  against the same call undecorated, while the writer thread runs beside it (the GIL is shared);
- ``cpu_us``: the CPU time a record costs the process in all (the copy on the loop, and on the writer's
  thread ``token2text`` decoding with ``--tokenizer``, JSON encoding, the locked append), from the first
  call until the last record is on disk, against the undecorated run;
- ``per_sample_cpu_ms``: ``cpu_us`` for one sample's 5 records (long_tail traces ~160 records a step).

The cost of a step is at most ``per_sample_cpu_ms`` x samples (all of it CPU taken from the engines on
a machine whose cores are busy): compare it with the step's time (docs/agent_loops.md#trace).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

RECORDS_PER_SAMPLE = 5  # run, 2 x generate, tool, reward


class Sample:
    """One long_tail-shaped sample's calls; ``traced`` picks the decorated methods."""

    def __init__(self, op) -> None:
        self.generate = op(self._generate)
        self.execute = op(self._execute)
        self.run = op(self._run)

    async def _generate(self, request_id, *, prompt_ids, sampling_params):
        return {
            "token_ids": list(range(1000, 1032)),
            "log_probs": [-0.5] * 32,
            "stop_reason": "completed",
            "weight_version": 3,
        }

    async def _execute(self, instance_id, parameters, **kwargs):
        return "value: lime", 0.0, {}

    async def _run(self, sampling_params, **kwargs):
        return {
            "prompt_ids": list(range(64)),
            "response_ids": list(range(384)),
            "response_mask": [1] * 384,
            "response_logprobs": [-0.5] * 384,
            "num_turns": 4,
            "extra_fields": {"tool_calls": 1, "is_partial": False},
        }


async def one_sample(sample: Sample, record_reward) -> None:
    prompt = list(range(64))
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True}
    fields = {"raw_prompt": [{"role": "user", "content": "Order 7: look up today's fruit."}], "index": 7}
    await sample.run(params, **fields)
    first = await sample.generate("r", prompt_ids=prompt, sampling_params=params)
    await sample.execute("i", {})
    await sample.generate("r", prompt_ids=prompt + first["token_ids"] + [5] * 8, sampling_params=params)
    record_reward()


async def timed(samples: int, traced: bool) -> float:
    from hybridflow.utils.rollout_trace import record_event, rollout_trace_attr, rollout_trace_op

    sample = Sample(rollout_trace_op if traced else (lambda f: f))
    reward = (
        (lambda: record_event("reward", "worker.reward", output={"score": 0.25}))
        if traced
        else (lambda: None)
    )
    start = time.perf_counter()
    for index in range(samples):
        with rollout_trace_attr(sample_index=index, step=1, rollout_n=0, trace=traced):
            await one_sample(sample, reward)
    return time.perf_counter() - start


def _clocks(run, then=None):
    """``run()`` (then ``then()``): ((wall seconds of run, CPU seconds of run), (wall, CPU) to the end
    of ``then``); CPU is the whole process's (the writer thread included)."""
    wall, cpu = time.perf_counter(), time.process_time()
    run()
    first = (time.perf_counter() - wall, time.process_time() - cpu)
    if then is None:
        return first
    then()
    return first, (time.perf_counter() - wall, time.process_time() - cpu)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--tokenizer", help="a model directory: token2text with its tokenizer")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    from hybridflow.utils.rollout_trace import RolloutTraceConfig

    tokenizer = None
    if args.tokenizer:
        from hybridflow.models.loading import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
    with tempfile.TemporaryDirectory() as tmp:
        RolloutTraceConfig.init("bench", "cost", "jsonl", bool(tokenizer), directory=tmp, tokenizer=tokenizer)
        asyncio.run(timed(20, True))  # warm up (imports, the file)
        RolloutTraceConfig.flush(None)
        plain, plain_cpu = min(_clocks(lambda: asyncio.run(timed(args.samples, False))) for _ in range(3))
        (loop_s, _), (_, traced_cpu) = _clocks(
            lambda: asyncio.run(timed(args.samples, True)), then=lambda: RolloutTraceConfig.flush(None)
        )
        size = sum(os.path.getsize(os.path.join(tmp, f)) for f in os.listdir(tmp))
        RolloutTraceConfig.reset()
    records = args.samples * RECORDS_PER_SAMPLE
    on_loop_us = (loop_s - plain) / records * 1e6
    cpu_us = (traced_cpu - plain_cpu) / records * 1e6
    print(
        json.dumps(
            {
                "benchmark": "rollout_trace_cost",
                "date": time.strftime("%Y-%m-%d"),
                "records": records,
                "token2text": bool(tokenizer),
                "on_loop_us": round(on_loop_us, 1),
                "cpu_us": round(cpu_us, 1),
                "per_sample_cpu_ms": round(cpu_us * RECORDS_PER_SAMPLE / 1e3, 3),
                "bytes_per_sample": round(size / (args.samples + 20)),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
