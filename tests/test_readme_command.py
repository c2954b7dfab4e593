"""The README's first ``main_ppo`` command holds together, as pasted (issue 46), without Ray.

The README's first bash block that runs ``python -m hybridflow.trainer.main_ppo`` is read as a user
pastes it: the commands before it that write the data and the model (``hybridflow.tasks.arithmetic``,
``hybridflow.models.tiny``) run in-process with ``$PWD`` and ``$HOME`` pointing into a temporary folder,
then the main_ppo command's overrides go through ``load_config`` + ``validate_config`` (every key known,
every file there, the batch sizes dividing), and the data is measured against the command's lengths:
every prompt fits ``data.max_prompt_length`` and every answer (with its end of turn) fits
``data.max_response_length``. Every entry-point command (``main_ppo``, ``fully_async_main``,
``main_generation``, ``main_eval``, ``sft_trainer``) in a bash block of the README, docs/*.md and
examples/*/README.md must at least compose: no misspelled or removed key.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAIN_PPO = "hybridflow.trainer.main_ppo"
BLOCK = re.compile(r"^```(?:bash|sh)\n(.*?)^```", re.S | re.M)


def commands(markdown: str) -> list[list[str]]:
    """Every command of every bash block, continuation lines joined and comments dropped."""
    out = []
    for block in BLOCK.findall(markdown):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                out.append(words)
    return out


def expand(word: str, pwd: Path, home: Path) -> str:
    assert "~" not in word.partition("=")[2], f"{word}: bash leaves ~ after key= unexpanded"
    return word.replace("$PWD", str(pwd)).replace("$HOME", str(home))


def first_run_block() -> list[list[str]]:
    """The commands of the README's first bash block that runs main_ppo."""
    for block in BLOCK.findall((ROOT / "README.md").read_text(encoding="utf-8")):
        found = commands(f"```bash\n{block}```\n")
        if any(MAIN_PPO in words for words in found):
            return found
    raise AssertionError(f"README.md has no bash block running python -m {MAIN_PPO}")


def module_args(words: list[str]) -> tuple[str | None, list[str]]:
    """``python -m MODULE ARGS`` -> (MODULE, ARGS); anything else -> (None, [])."""
    if len(words) >= 3 and words[0] in ("python", "python3") and words[1] == "-m":
        return words[2], words[3:]
    return None, []


def test_the_readme_command_validates_and_its_lengths_fit(tmp_path: Path):
    from hybridflow.models import tiny
    from hybridflow.tasks import arithmetic
    from hybridflow.trainer.config import load_config, validate_config

    pwd, home = tmp_path / "clone", tmp_path / "home"
    pwd.mkdir()
    home.mkdir()
    writers = {"hybridflow.tasks.arithmetic": arithmetic.main, "hybridflow.models.tiny": tiny.main}
    overrides = None
    for words in first_run_block():
        module, args = module_args(words)
        args = [expand(a, pwd, home) for a in args]
        if module in writers:
            writers[module](args)
        elif module == MAIN_PPO:
            overrides = args
    assert overrides, "no main_ppo command in the block"
    config = load_config(overrides)
    validate_config(config)  # unknown keys, files, batch sizes, names: all before Ray in a real run

    # the lengths: every prompt and every answer of the data fit the command's limits
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(config.actor_rollout_ref.model.path))
    rows = []
    for files in (config.data.train_files, config.data.val_files):
        for path in [files] if isinstance(files, str) else list(files):
            rows += pq.read_table(path).to_pylist()[:2000]
    prompts = [
        tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows
    ]
    longest_prompt = max(len(ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"])
    answers = [str(r["reward_model"]["ground_truth"]) for r in rows]
    longest_answer = max(len(ids) for ids in tokenizer(answers, add_special_tokens=False)["input_ids"]) + 1
    assert longest_prompt <= config.data.max_prompt_length, (longest_prompt, config.data.max_prompt_length)
    assert longest_answer <= config.data.max_response_length, (
        longest_answer,
        config.data.max_response_length,
    )
    assert int(config.trainer.test_freq) > 0, "the README's run should validate during training"
    assert config.trainer.time_budget_minutes, "the README's run should stop itself within minutes"


# The Hydra entry points and their config names: every documented command line must compose.
ENTRY_CONFIGS = {
    MAIN_PPO: "ppo_trainer",
    "hybridflow.trainer.fully_async_main": "fully_async_ppo_trainer",
    "hybridflow.trainer.main_generation": "generation",
    "hybridflow.trainer.main_eval": "evaluation",
    "hybridflow.trainer.sft_trainer": "sft_trainer",
}
DOCS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "examples").glob("*/README.md")),
]


def documented_runs() -> list[tuple[str, str, list[str]]]:
    """``(where, module, overrides)`` of every entry-point command in a bash block of the docs."""
    runs = []
    for doc in DOCS:
        for words in commands(doc.read_text(encoding="utf-8")):
            module, args = module_args(words)
            if module in ENTRY_CONFIGS:
                runs.append((str(doc.relative_to(ROOT)), module, [a for a in args if "=" in a]))
    return runs


def test_every_documented_entry_point_command_composes(tmp_path: Path):
    """No misspelled or removed key in any documented command (``...`` and other placeholders aside)."""
    from hybridflow.trainer.config import ConfigError, load_config

    runs = documented_runs()
    assert any(where == "README.md" and module == MAIN_PPO for where, module, _ in runs)
    problems = []
    for where, module, args in runs:
        try:
            load_config([expand(a, tmp_path, tmp_path) for a in args], config_name=ENTRY_CONFIGS[module])
        except ConfigError as err:
            problems.append(f"{where}: python -m {module}: {err}")
    assert not problems, "\n".join(problems)


def test_the_first_hour_helpers_exit_cleanly():
    """``--help`` of the verl alias's runner exits 0, and the task writer runs without runpy's warning
    about a module imported before its execution (issue 46)."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "hybridflow.verl_compat", "--help"], capture_output=True, text=True, cwd=ROOT
    )
    assert done.returncode == 0 and "usage: python -m hybridflow.verl_compat" in done.stdout, done
    bare = subprocess.run([sys.executable, "-m", "hybridflow.verl_compat"], capture_output=True, text=True)
    assert bare.returncode != 0 and "usage" in bare.stderr  # no script named: still an error
    done = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-m", "hybridflow.tasks.arithmetic", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 0 and "--out" in done.stdout and "RuntimeWarning" not in done.stderr, done
