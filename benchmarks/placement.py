"""The planner's ranking against the clock: profile a PPO run (actor, reference, critic) at 1 and 2
workers, rank every placement on 2 devices, then train each placement in turns and time it.

    python benchmarks/placement.py --model-dir DIR --train-file F --val-file F [--rounds 3] [--steps 5]

Prints the ranking table, then one JSON line: per placement the predicted and measured s/step (median
of the steps after each run's first, over the rounds) and the median ``timing_s/overlap_saved``.
Without ``--model-dir`` it builds the README's 1M-parameter model (hidden 128, 4 layers) in a temp dir.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def run_overrides(model_dir: str, train: str, val: str, ckpt: str) -> list[str]:
    return [
        f"data.train_files={train}",
        f"data.val_files={val}",
        f"actor_rollout_ref.model.path={model_dir}",
        "data.train_batch_size=8",
        "data.max_prompt_length=40",
        "data.max_response_length=6",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "critic.enable=true",
        "trainer.n_gpus_per_node=2",
        f"trainer.default_local_dir={ckpt}",
    ]


def placement_overrides(placement) -> list[str]:
    """The config overrides that run ``placement`` (2 devices)."""
    if placement.is_colocated:
        return [f"trainer.n_gpus_per_node={placement.total_workers}"]
    spec, mapping = placement.config_values()
    pools = ",".join(f"{pool}:[{','.join(map(str, counts))}]" for pool, counts in spec.items())
    roles = ",".join(f"{role}:{pool}" for role, pool in mapping.items())
    return [
        "trainer.placement=pools",
        f"trainer.resource_pool_spec={{{pools}}}",
        f"trainer.role_pool_mapping={{{roles}}}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", default=None)
    parser.add_argument(
        "--train-file", default=None, help="default: the arithmetic task, written to a temp dir"
    )
    parser.add_argument("--val-file", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    import ray

    from hybridflow.placement.planner import (
        enumerate_placements,
        format_ranking,
        load_profile,
        rank_placements,
    )
    from hybridflow.profile_placement import measure_run, profile
    from hybridflow.trainer.config import load_config
    from hybridflow.trainer.ppo.workers_setup import build_worker_groups

    work = tempfile.mkdtemp(prefix="placement_bench_")
    os.chdir(work)
    if args.model_dir is None:
        from hybridflow.models.tiny import build_tiny_model

        args.model_dir = str(build_tiny_model(os.path.join(work, "model"), hidden_size=128, num_layers=4))
    if args.train_file is None:
        from hybridflow.tasks.arithmetic import ArithmeticTaskConfig, write_rl_dataset

        train, val = write_rl_dataset(
            os.path.join(work, "data"), ArithmeticTaskConfig(num_train=64, num_test=6)
        )
        args.train_file, args.val_file = str(train), str(val)
    base = run_overrides(args.model_dir, args.train_file, args.val_file, os.path.join(work, "ckpt"))
    ray.init(address="local", num_cpus=16, include_dashboard=False, log_to_driver=False)
    placements = {p.describe(): p for p in enumerate_placements(["actor_rollout", "ref", "critic"], 2)}
    configs = {name: load_config(base + placement_overrides(p)) for name, p in placements.items()}
    groups = {
        name: build_worker_groups(c, use_critic=True, use_reference=True) for name, c in configs.items()
    }
    try:
        by_workers = {p.total_workers: groups[name] for name, p in placements.items() if p.is_colocated}
        with open("profile.json", "w") as f:
            json.dump(profile(base, [1, 2], steps=4, worker_groups=by_workers), f)
        model, _ = load_profile("profile.json")
        ranked = rank_placements(load_config(base), model)
        print(format_ranking(ranked))
        steps = {name: [] for name in placements}
        overlap = {name: [] for name in placements}
        for round_ in range(args.rounds):
            for i, (name, placement) in enumerate(placements.items()):
                experiment = f"round{round_}_placement{i}"
                run = measure_run(base + placement_overrides(placement), args.steps, experiment, groups[name])
                steps[name] += run["steps_s"]
                with open(os.path.join("outputs", "hybridflow", experiment, "metrics.jsonl")) as f:
                    records = [json.loads(line) for line in f][1:]
                overlap[name] += [r.get("timing_s/overlap_saved", 0.0) for r in records]
    finally:
        for group in groups.values():
            group.shutdown()
        ray.shutdown()
    rows = [
        {
            "placement": cand.placement.describe(),
            "predicted_s": round(cand.seconds, 4),
            "measured_s": round(statistics.median(steps[cand.placement.describe()]), 4),
            "overlap_saved_s": round(statistics.median(overlap[cand.placement.describe()]), 4),
        }
        for cand in ranked
    ]
    print(
        json.dumps({"benchmark": "placement", "rounds": args.rounds, "steps": args.steps, "placements": rows})
    )


if __name__ == "__main__":
    main()
