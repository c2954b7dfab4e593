"""Built-in tasks generated offline: datasets in verl's parquet schema plus their rule-based reward.

``hybridflow.tasks.arithmetic``: multi-digit arithmetic (``data_source="hybridflow/arithmetic"``).
"""

from hybridflow.tasks.arithmetic import (
    ArithmeticTaskConfig,
    make_problem,
    task_texts,
    write_rl_dataset,
    write_sft_dataset,
)

__all__ = ["ArithmeticTaskConfig", "make_problem", "task_texts", "write_rl_dataset", "write_sft_dataset"]
