"""The reward loop's two modes on one workload: the reward time left exposed after the rollout ends, and
the step time. One JSON line per mode, then one comparing them.

    python benchmarks/reward_loop_modes.py [--steps 3 --prompts 8 --n 4 --judge-tokens 16]

A GenRM judge (the tiny model served by ``python -m hybridflow.serve``, one replica) is asked, greedily,
for ``--judge-tokens`` tokens about every sample by an async reward function (the sample's score is the
task's rule score, so both modes train on the same rewards). ``main_ppo`` runs ``rollout.mode=async`` with
``reward_model.use_reward_loop=true``, ``reward_manager=limited``:

- colocated: ``rollout.agent.reward_in_loop=false``: the trainer's reward phase scores the batch after the
  rollout; ``reward/exposed_s`` is that phase's time;
- standalone: ``reward_in_loop=true``: each sample is judged in its agent loop as it finishes, while the
  others still generate; ``reward/exposed_s`` is the time from the last sample's generation end to the
  last score.

The first step is a warm-up (excluded); the figures are means over the others.
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

JUDGE = """
from hybridflow.utils.reward_score import default_compute_score
from hybridflow.utils.served_client import chat_complete


async def compute_score(data_source, solution_str, ground_truth, extra_info, reward_router_address, **kwargs):
    messages = [{"role": "user", "content": f"{solution_str} = {ground_truth}?"}]
    request = {"model": "judge", "messages": messages, "max_tokens": kwargs["judge_tokens"],
               "temperature": 0, "ignore_eos": True}
    await chat_complete(reward_router_address, request, timeout_s=120)
    rule = default_compute_score(data_source, solution_str, ground_truth, extra_info)
    return rule["score"] if isinstance(rule, dict) else float(rule)
"""


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-response-length", type=int, default=16)
    parser.add_argument("--judge-tokens", type=int, default=16)
    parser.add_argument("--max-concurrent", type=int, default=16)
    return parser.parse_args(argv)


def run_mode(
    name: str, in_loop: bool, args, model: str, train: str, judge_file: Path, address: str, work: Path
):
    from omegaconf import OmegaConf

    from hybridflow.trainer.config import load_config
    from hybridflow.trainer.main_ppo import run_ppo

    values = {
        "data.train_files": train,
        "data.val_files": train,
        "data.train_batch_size": args.prompts,
        "data.max_prompt_length": 40,
        "data.max_response_length": args.max_response_length,
        "actor_rollout_ref.model.path": model,
        "actor_rollout_ref.rollout.n": args.n,
        "actor_rollout_ref.rollout.mode": "async",
        "actor_rollout_ref.rollout.agent.reward_in_loop": in_loop,
        "actor_rollout_ref.actor.ppo_mini_batch_size": args.prompts,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": args.prompts * args.n // 2,
        "reward_model.use_reward_loop": True,
        "reward_model.reward_manager": "limited",
        "reward_model.max_concurrent": args.max_concurrent,
        "+reward_model.reward_kwargs.reward_router_address": address,
        "+reward_model.reward_kwargs.judge_tokens": args.judge_tokens,
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
    config = load_config([f"{k}={v}" for k, v in values.items()])
    OmegaConf.resolve(config)
    os.chdir(work)
    run_ppo(config)
    lines = (work / "outputs" / "hybridflow" / name / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line) for line in lines][1:] or [json.loads(lines[0])]

    def mean(key):
        return round(sum(s[key] for s in steps) / len(steps), 3)

    return {
        "mode": name,
        "reward_exposed_s": mean("reward/exposed_s"),
        "step_s": mean("timing_s/step"),
        "gen_s": mean("timing_s/gen"),
        "judge_latency_p50_s": mean("reward/judge_latency_p50_s"),
        "score_mean": mean("reward/genrm/mean"),
        "steps_timed": len(steps),
    }


def main(argv=None) -> None:
    args = parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from grpo_step import default_assets

    from hybridflow.workers.reward_loop.servers import RewardModelServers

    work = Path(tempfile.mkdtemp(prefix="reward-loop-modes-"))
    model, train = default_assets(work)
    judge_file = work / "judge.py"
    judge_file.write_text(textwrap.dedent(JUDGE))
    results = {}
    with RewardModelServers(model, replicas=1, served_name="judge", log_dir=str(work)) as servers:
        for name, in_loop in (("colocated", False), ("standalone", True)):
            results[name] = run_mode(name, in_loop, args, model, train, judge_file, servers.address, work)
            print(json.dumps({**results[name], **vars(args)}), flush=True)
    colocated, standalone = results["colocated"], results["standalone"]
    print(
        json.dumps(
            {
                "exposed_reward_ratio": round(
                    colocated["reward_exposed_s"] / max(standalone["reward_exposed_s"], 1e-3), 2
                ),
                "step_time_ratio": round(standalone["step_s"] / colocated["step_s"], 3),
            }
        )
    )


if __name__ == "__main__":
    main()
