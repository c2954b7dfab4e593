"""The reward loop's two modes on one workload: the reward time left exposed after the rollout ends, and
the step time. One JSON line per mode, then one comparing them.

    python benchmarks/reward_loop_modes.py [--workload staggered|uniform] [--steps 5 --warmup 1]

``main_ppo`` serves the GenRM judge itself (``reward_model.enable=true`` with
``use_reward_loop=true``, ``reward_model.model.path`` = the policy's starting model, our engine), and an
async reward function asks it, greedily, for a ``--judge-tokens`` verdict about every sample (the
sample's score stays the task's rule score, so both modes train on the same rewards), through the
``limited`` manager (``--max-concurrent`` at once). ``rollout.mode=async`` with 2 agent-loop workers
on 2 single-thread workers; ``--judge-replicas`` replicas of one thread each in both modes:

- colocated (``enable_resource_pool=false``): the trainer's reward phase wakes the judge after the
  rollout, scores the batch and puts it back to sleep (its KV cache released); ``reward/exposed_s``
  is that phase's time;
- standalone (``enable_resource_pool=true``): each sample is judged in its agent loop as it finishes,
  while the others still generate; ``reward/exposed_s`` is the time from the last sample's generation
  end to the last score.

Workloads:

- ``staggered`` (default): ``benchmarks/long_tail.py``'s (its taught tiny model and data): a tool call
  whose latency is drawn per prompt (0.05 / 0.3 / 1.5 s), then a list whose length has a geometric
  tail (means 6 / 24 / 96 words), so samples finish seconds apart; a 2-token verdict;
- ``uniform``: the arithmetic task on the untaught tiny model, 16-token responses that all finish
  within ~0.5 s, a 16-token verdict (the first measurement's workload).

The first ``--warmup`` steps are left out; the figures are means over the others.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import textwrap
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = Path(__file__).resolve().parent

JUDGE = """
import sys

sys.path.insert(0, {here!r})

from hybridflow.utils.served_client import chat_complete


async def compute_score(data_source, solution_str, ground_truth, extra_info, reward_router_address, **kwargs):
    messages = [{{"role": "user", "content": f"{{solution_str[-200:]}} = {{ground_truth}}?"}}]
    request = {{"model": kwargs["judge_model"], "messages": messages, "max_tokens": kwargs["judge_tokens"],
               "temperature": 0, "ignore_eos": True}}
    await chat_complete(reward_router_address, request, timeout_s=120, max_retries=8)
    if data_source == "long_tail":
        from long_tail import compute_score as rule
    else:
        from hybridflow.utils.reward_score import default_compute_score as rule
    score = rule(data_source, solution_str, ground_truth, extra_info)
    return score["score"] if isinstance(score, dict) else float(score)
"""


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=("staggered", "uniform"), default="staggered")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-response-length", type=int, default=None, help="staggered 256, uniform 16")
    parser.add_argument("--judge-tokens", type=int, default=None, help="staggered 2, uniform 16")
    parser.add_argument("--judge-replicas", type=int, default=2)
    parser.add_argument("--max-concurrent", type=int, default=16)
    parser.add_argument("--teach-steps", type=int, default=300, help="staggered: long_tail's teaching")
    parser.add_argument("--work", help="keep the assets here (a taught model is reused)")
    args = parser.parse_args(argv)
    staggered = args.workload == "staggered"
    args.max_response_length = args.max_response_length or (256 if staggered else 16)
    args.judge_tokens = args.judge_tokens or (2 if staggered else 16)
    return args


def workload(args, work: Path) -> tuple[str, list[str]]:
    """(the model, the workload's overrides)."""
    sys.path.insert(0, str(HERE))
    if args.workload == "uniform":
        from grpo_step import default_assets

        model, train = default_assets(work)
        return model, [f"data.train_files={train}", f"data.val_files={train}", "data.max_prompt_length=40"]
    import long_tail

    train, test, tools = long_tail.write_data(work, 0.0)
    model, taught = long_tail.build_model(work, args.teach_steps)
    print(json.dumps({"benchmark": "reward_loop_modes", "setup": taught}), flush=True)
    return str(model), [
        f"data.train_files={train}",
        f"data.val_files={test}",
        "data.max_prompt_length=48",
        "data.shuffle=true",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2",
        "actor_rollout_ref.actor.optim.lr=1e-4",
    ]


def run_mode(name: str, args, model: str, data: list[str], judge_file: Path, work: Path) -> dict:
    from omegaconf import OmegaConf

    from hybridflow.trainer.config import load_config
    from hybridflow.trainer.main_ppo import run_ppo

    samples_per_gpu = args.prompts * args.n // 2
    values = {
        "data.train_batch_size": args.prompts,
        "data.max_response_length": args.max_response_length,
        "actor_rollout_ref.model.path": model,
        "actor_rollout_ref.rollout.n": args.n,
        "actor_rollout_ref.rollout.mode": "async",
        "actor_rollout_ref.rollout.agent.num_workers": 2,
        "actor_rollout_ref.actor.ppo_mini_batch_size": args.prompts,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": max(1, samples_per_gpu // 2),
        "trainer.n_gpus_per_node": 2,
        "trainer.num_threads_per_worker": 1,
        "reward_model.use_reward_loop": True,
        "reward_model.enable": True,
        "reward_model.model.path": model,
        "reward_model.rollout.kv_cache_memory_gb": 0.05,
        "reward_model.rollout.max_num_seqs": args.max_concurrent,
        "reward_model.rollout.prompt_length": 512,
        "reward_model.rollout.response_length": args.judge_tokens,
        "reward_model.reward_manager": "limited",
        "reward_model.max_concurrent": args.max_concurrent,
        "+custom_reward_function.reward_kwargs.judge_model": model,
        "+custom_reward_function.reward_kwargs.judge_tokens": args.judge_tokens,
        "custom_reward_function.path": str(judge_file),
        "trainer.total_training_steps": args.steps,
        "trainer.resume_mode": "disable",
        "trainer.logger": "[jsonl]",
        "trainer.progress_bar": False,
        "trainer.plot_curves": False,
        "trainer.val_before_train": False,
        "trainer.test_freq": -1,
        "trainer.save_freq": -1,
        "trainer.experiment_name": name,
        "trainer.default_local_dir": str(work / "ckpt" / name),
    }
    if name == "standalone":  # the judge's own pool: as many replicas as colocated gets from the trainer's
        values.update(
            {
                "reward_model.enable_resource_pool": True,
                "reward_model.nnodes": 1,
                "reward_model.n_gpus_per_node": args.judge_replicas,
            }
        )
    else:
        values["trainer.n_gpus_per_node"] = 2  # colocated: one replica per trainer worker
    config = load_config([*data, *(f"{k}={v}" for k, v in values.items())])
    OmegaConf.resolve(config)
    os.chdir(work)
    run_ppo(config)
    lines = (work / "outputs" / "hybridflow" / name / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    steps = records[args.warmup :] or records[-1:]

    def mean(key):
        return round(sum(s.get(key, 0.0) for s in steps) / len(steps), 3)

    return {
        "benchmark": "reward_loop_modes",
        "workload": args.workload,
        "mode": name,
        "reward_exposed_s": mean("reward/exposed_s"),
        "step_s": mean("timing_s/step"),
        "gen_s": mean("timing_s/gen"),
        "judge_latency_p50_s": mean("reward/judge_latency_p50_s"),
        "judge_freed_kv_gb": mean("reward/judge_freed_kv_gb"),
        "response_length_max": max(s["response_length/max"] for s in steps),
        "response_length_mean": mean("response_length/mean"),
        "score_mean": mean("reward/genrm/mean"),
        "failures": sum(
            s.get("reward/failures/error", 0) + s.get("reward/failures/timeout", 0) for s in steps
        ),
        "steps_timed": len(steps),
    }


def main(argv=None) -> None:
    args = parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="reward-loop-modes-"))
    work.mkdir(parents=True, exist_ok=True)
    model, data = workload(args, work)
    judge_file = work / "judge.py"
    judge_file.write_text(textwrap.dedent(JUDGE.format(here=str(HERE))))
    results = {}
    for name in ("colocated", "standalone"):
        results[name] = run_mode(name, args, model, data, judge_file, work)
        print(json.dumps({**results[name], **vars(args)}), flush=True)
    colocated, standalone = results["colocated"], results["standalone"]
    ratio = {
        "benchmark": "reward_loop_modes",
        "workload": args.workload,
        "exposed_reward_ratio": round(
            colocated["reward_exposed_s"] / max(standalone["reward_exposed_s"], 1e-3), 2
        ),
        "step_time_ratio": round(standalone["step_s"] / colocated["step_s"], 3),
    }
    print(json.dumps(ratio), flush=True)


if __name__ == "__main__":
    main()
