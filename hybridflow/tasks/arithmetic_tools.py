"""The built-in multi-turn task: big-number multiplication where the Python tool genuinely helps.

Problems are ``"What is 48213 * 9172?"`` with 5-8 digit operands — beyond what a small model
multiplies reliably in its head, but one ``print(48213 * 9172)`` away with the sandboxed
``code_interpreter`` tool. The system message explains the tool and the Hermes call format; each row
carries ``extra_info.tools_kwargs`` (verl's per-sample tool arguments). Rewards use the arithmetic
scorer (the last integer of the response must equal the product).

    python -m hybridflow.tasks.arithmetic_tools --out DIR   # train/test parquet + tool_config.yaml
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hybridflow.tasks.arithmetic import DATA_SOURCE, ArithmeticTaskConfig, _write_parquet, generate_splits

TOOL_NAME = "code_interpreter"
SYSTEM_PROMPT = (
    "You can run Python code with the code_interpreter tool; it replies with what the code prints. "
    "To call it, write "
    '<tool_call>{"name": "code_interpreter", "arguments": {"code": "print(2 * 3)"}}</tool_call>. '
    "When you know the result, reply with the number only."
)
TOOL_CONFIG = {
    "tools": [
        {
            "class_name": "hybridflow.workers.rollout.tools.python_tool.PythonTool",
            "config": {"wall_timeout_s": 5.0, "memory_mb": 256, "max_output_bytes": 1024},
            "tool_schema": {
                "type": "function",
                "function": {
                    "name": TOOL_NAME,
                    "description": "Run Python code in a sandbox and return what it prints.",
                    "parameters": {
                        "type": "object",
                        "properties": {"code": {"type": "string", "description": "Python source to run"}},
                        "required": ["code"],
                    },
                },
            },
        }
    ]
}


def task_config(num_train: int = 2000, num_test: int = 100, seed: int = 0) -> ArithmeticTaskConfig:
    return ArithmeticTaskConfig(
        min_digits=5,
        max_digits=8,
        ops=("*",),
        num_train=num_train,
        num_test=num_test,
        seed=seed,
        instruction="",
    )


def make_tool_row(problem: dict, split: str, index: int) -> dict:
    """One row in verl's schema, with the tool instructions and per-sample ``tools_kwargs``."""
    question = f"What is {problem['a']} * {problem['b']}?"
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(problem["answer"])},
        "extra_info": {
            "split": split,
            "index": index,
            "need_tools_kwargs": True,
            "tools_kwargs": {TOOL_NAME: {"create_kwargs": {"ground_truth": str(problem["answer"])}}},
        },
    }


def write_tool_task(out_dir: str | Path, cfg: ArithmeticTaskConfig | None = None) -> tuple[Path, Path, Path]:
    """Write ``train.parquet``, ``test.parquet`` and ``tool_config.yaml`` (the Python tool) under
    ``out_dir``."""
    cfg = cfg or task_config()
    train, test = generate_splits(cfg)
    out = Path(out_dir)
    train_path = _write_parquet(
        [make_tool_row(p, "train", i) for i, p in enumerate(train)], out / "train.parquet"
    )
    test_path = _write_parquet(
        [make_tool_row(p, "test", i) for i, p in enumerate(test)], out / "test.parquet"
    )
    tools_path = out / "tool_config.yaml"
    tools_path.write_text(json.dumps(TOOL_CONFIG, indent=2))  # JSON is valid YAML
    return train_path, test_path, tools_path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--num-train", type=int, default=2000)
    parser.add_argument("--num-test", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    paths = write_tool_task(args.out, task_config(args.num_train, args.num_test, args.seed))
    print("\n".join(str(p) for p in paths))


if __name__ == "__main__":
    main()
