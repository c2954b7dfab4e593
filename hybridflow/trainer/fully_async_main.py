"""Entry point: ``python -m hybridflow.trainer.fully_async_main key=value ...`` (verl's fully-async
trainer: ``recipe/fully_async_policy``), with ``config/fully_async_ppo_trainer.yaml``.

Exit codes as ``main_ppo``: 0 done; 2 a config mistake (one line, before Ray starts); 1 an error
reported in one line; 128 + signal after a SIGTERM/SIGINT stop (the step finishes, a checkpoint is
saved).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from omegaconf import DictConfig  # noqa: E402

from hybridflow.trainer.hydra_entry import hydra_entry  # noqa: E402
from hybridflow.trainer.ppo.preemption import TrainingPreempted  # noqa: E402


@hydra_entry("fully_async_ppo_trainer")
def main(config: DictConfig) -> None:
    from hybridflow.trainer.fully_async.main import run_fully_async
    from hybridflow.trainer.fully_async.message_queue import RolloutStopped
    from hybridflow.trainer.main_ppo import one_line_errors

    try:
        run_fully_async(config)
    except TrainingPreempted as stop:
        print(f"hybridflow: {stop} (exit code {stop.exit_code})", file=sys.stderr, flush=True)
        sys.exit(stop.exit_code)
    except (*one_line_errors(), RolloutStopped) as err:
        print(f"hybridflow: error: {err}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
