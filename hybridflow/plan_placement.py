"""Rank placements for a run::

    python -m hybridflow.plan_placement --profile profile.json --actor MODEL [--critic MODEL] [--ref]
        [--reward-model MODEL] --devices N [--nodes M] --batch B [--n N] --prompt-length P
        --response-length R [--device-memory-gb G] [--link-gb-per-s L] [--top K] [key=value ...]

``MODEL`` is a local Hugging Face model directory (only its ``config.json`` is read). ``--devices``
counts the devices in all (GPUs, or 1-thread CPU worker processes), ``--nodes`` the machines they are
on. The ranking comes from the cost model the profile calibrates
(:mod:`hybridflow.placement.cost_model`); the first line is what ``trainer.placement=auto`` picks for
the same run. Extra ``key=value`` overrides go into the
run's config (as for ``main_ppo``), e.g. ``actor_rollout_ref.actor.ppo_mini_batch_size=16``.

Each line ends with the Ulysses sequence-parallel size of each role: raised above 1 only where the
device memory needs it for long sequences (:mod:`hybridflow.placement.memory`), at the cost of the
attention all-to-alls over ``--link-gb-per-s`` (default: the profile's ``link_gb_per_s``, else
:data:`hybridflow.placement.cost_model.DEFAULT_LINK_GB_PER_S`). An sp > 1 set with
``actor_rollout_ref.actor.ulysses_sequence_parallel_size=...`` (etc.) is kept.
"""

from __future__ import annotations

import argparse


def plan_overrides(args: argparse.Namespace) -> list[str]:
    """The config overrides that describe the run the arguments name."""
    if args.devices % args.nodes:
        raise SystemExit(f"--devices {args.devices} must be a multiple of --nodes {args.nodes}")
    values = {
        "actor_rollout_ref.model.path": args.actor,
        "trainer.nnodes": args.nodes,
        "trainer.n_gpus_per_node": args.devices // args.nodes,
        "trainer.device": args.device,
        "data.train_batch_size": args.batch,
        "actor_rollout_ref.actor.ppo_mini_batch_size": args.batch,
        "actor_rollout_ref.rollout.n": args.n,
        "data.max_prompt_length": args.prompt_length,
        "data.max_response_length": args.response_length,
        "actor_rollout_ref.actor.use_kl_loss": bool(args.ref),
        "critic.enable": args.critic is not None,
    }
    if args.critic:
        values["critic.model.path"] = args.critic
    if args.reward_model:
        values.update({"reward_model.enable": True, "reward_model.model.path": args.reward_model})
    return [f"{k}={v}" for k, v in values.items()] + list(args.overrides)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--profile", required=True, help="profile JSON (python -m hybridflow.profile_placement)"
    )
    parser.add_argument("--actor", required=True, help="actor (and reference) model directory")
    parser.add_argument("--critic", default=None, help="critic model directory (omit: no critic, e.g. GRPO)")
    parser.add_argument("--ref", action="store_true", help="a reference policy is used (KL loss or penalty)")
    parser.add_argument("--reward-model", default=None, help="reward model directory (omit: rule reward)")
    parser.add_argument(
        "--devices", type=int, required=True, help="devices in all (split evenly over --nodes)"
    )
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--batch", type=int, required=True, help="prompts per step")
    parser.add_argument("--n", type=int, default=1, help="responses per prompt")
    parser.add_argument("--prompt-length", type=int, required=True)
    parser.add_argument("--response-length", type=int, required=True)
    parser.add_argument("--device-memory-gb", type=float, default=None, help="default: the profile's")
    parser.add_argument(
        "--link-gb-per-s",
        type=float,
        default=None,
        help="a worker's link for SP's all-to-alls, 1e9 bytes/s (default: the profile's, else 25)",
    )
    parser.add_argument("--top", type=int, default=None, help="print only the best K")
    parser.add_argument("overrides", nargs="*", help="more config overrides, key=value")
    return parser


def main(argv: list[str] | None = None) -> None:
    from hybridflow.placement.planner import format_ranking, load_profile, rank_placements
    from hybridflow.trainer.config import load_config

    args = build_parser().parse_args(argv)
    config = load_config(plan_overrides(args))
    model, profile = load_profile(args.profile)
    memory = args.device_memory_gb or profile.get("device_memory_gb")
    if args.link_gb_per_s is not None:
        if args.link_gb_per_s <= 0:
            raise SystemExit(f"--link-gb-per-s {args.link_gb_per_s}: must be positive")
        model.link_gb_per_s = args.link_gb_per_s
    ranked = rank_placements(config, model, memory)
    if not ranked:
        raise SystemExit(
            "no placement fits: check --device-memory-gb (at every allowed ulysses_sequence_parallel_size) "
            "and that --batch x --n splits over the devices"
        )
    print(format_ranking(ranked, args.top))


if __name__ == "__main__":
    main()
