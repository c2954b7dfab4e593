"""hybridflow against TRL's GRPOTrainer on the same CPU, assets and settings (issue 14's comparison).

    python benchmarks/vs_trl.py [--workloads A,B] [--reps 2] [--workers 1|2] [--bf16] [--trl-dir DIR]

Drives the peer harness in ``../shared/peers`` (``vs_trl.py``: TRL and ``main_ppo`` alternate on one
machine, GRPO, 16 prompts x 4, lr 1e-5 constant, no KL; workload A = a warm-started 3M model with
~4-token answers, 20 steps; B = a random 3M model with ~104-token answers, 10 steps). The TRL venv and
the deterministic assets are built once by ``setup_trl_peer.sh`` (~8 min) when ``--trl-dir`` lacks them.
``--bf16``: bf16 on both sides (TRL's ``--bf16 true`` autocast; our FSDP mixed precision and a bf16
engine). Prints the harness's JSON lines (one per run, then the median tokens/s ratio ours / TRL) and
a first line describing the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT.parent / "shared" / "peers"
BF16_OURS = (
    "actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype:bf16,reduce_dtype:fp32} "
    "actor_rollout_ref.rollout.dtype=bf16"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", default="A,B")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument(
        "--workers", type=int, default=1, help="our worker processes (2 cores / workers threads each)"
    )
    parser.add_argument("--bf16", action="store_true", help="bf16 compute on both sides")
    parser.add_argument(
        "--trl-dir", default=os.environ.get("TRL_DIR", str(Path.home() / ".cache/hybridflow-peer-trl"))
    )
    args = parser.parse_args()
    if not (PEERS / "vs_trl.py").exists():
        sys.exit(f"the peer harness is not at {PEERS} (a checkout beside ../shared is needed)")
    trl_dir = Path(args.trl_dir)
    if not (trl_dir / "venv" / ".ready").exists() or not (trl_dir / "assets" / ".ready").exists():
        subprocess.run(
            ["bash", str(PEERS / "setup_trl_peer.sh")],
            check=True,
            env={**os.environ, "TRL_DIR": str(trl_dir)},
        )
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    if args.bf16:
        env["TRL_EXTRA"] = (env.get("TRL_EXTRA", "") + " --bf16 true").strip()
        env["OURS_EXTRA"] = (env.get("OURS_EXTRA", "") + " " + BF16_OURS).strip()
    print(
        json.dumps(
            {
                "benchmark": "vs_trl",
                "cpu": platform.processor() or platform.machine(),
                "cores": os.cpu_count(),
                "workers": args.workers,
                "precision": "bf16" if args.bf16 else "fp32",
            }
        ),
        flush=True,
    )
    cmd = [
        sys.executable,
        str(PEERS / "vs_trl.py"),
        str(ROOT / ".venv" / "bin" / "python"),
        str(trl_dir),
        str(trl_dir / "verl_data"),
        f"--workloads={args.workloads}",
        f"--reps={args.reps}",
        f"--workers={args.workers}",
    ]
    subprocess.run(cmd, check=True, env=env, cwd=ROOT)


if __name__ == "__main__":
    main()
