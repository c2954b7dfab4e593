"""``@hydra_entry(config_name)``: hybridflow's ``@hydra.main`` (``config_path="config"`` beside the entry
module), with config mistakes answered in one line, with the fix, and exit code 2:

- before Hydra composes, each ``key=value`` / ``+key=value`` override of a key the entry point's
  validation refuses is answered with the nearest valid key
  (:func:`~hybridflow.trainer.config.mistakes.override_problems`) instead of Hydra's "Could not override
  ... not in struct", whose ``+key=`` suggestion only leads to a second error;
- a :class:`~hybridflow.trainer.config.ConfigError` raised by the run (the validation before Ray starts)
  is printed as ``hybridflow: error: ...`` (a list of problems: one line each, after the first) instead of
  Hydra's banner and traceback.

``HYDRA_FULL_ERROR=1`` keeps the traceback. Used by ``main_ppo``, ``fully_async_main``,
``main_generation``, ``main_eval`` and ``sft_trainer``.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable

EXIT_CONFIG_ERROR = 2  # as argparse's usage errors: the command line or config is wrong, nothing ran

# Hydra's own flags: these take a value (the next argument) ...
_FLAGS_WITH_VALUE = frozenset(
    {"-cp", "--config-path", "-cn", "--config-name", "-cd", "--config-dir", "-c", "--cfg", "-p", "--package"}
)
# ... and with these Hydra runs nothing (help, info, shell completion, rerun): no check.
_FLAGS_THAT_RUN_NOTHING = frozenset(
    {
        "-h",
        "--help",
        "--hydra-help",
        "--version",
        "-i",
        "--info",
        "-sc",
        "--shell-completion",
        "--experimental-rerun",
    }
)


def hydra_entry(config_name: str) -> Callable:
    """Decorate an entry point's ``main(config)`` as ``@hydra.main(config_path="config",
    config_name=config_name, version_base=None)`` does, plus the one-line config errors above."""
    import hydra

    def decorate(task: Callable) -> Callable:
        @functools.wraps(task)
        def task_with_one_line_errors(config):
            from hybridflow.trainer.config import ConfigError

            try:
                return task(config)
            except ConfigError as err:
                if full_error_wanted():
                    raise
                exit_config_error(err)

        hydra_main = hydra.main(config_path="config", config_name=config_name, version_base=None)(
            task_with_one_line_errors
        )

        @functools.wraps(task)
        def main(cfg_passthrough=None):
            if cfg_passthrough is None:  # a command line (not a config handed in by a caller)
                check_command_line(config_name, sys.argv[1:])
            return hydra_main(cfg_passthrough)

        return main

    return decorate


def check_command_line(config_name: str, argv: list[str]) -> None:
    """Exit with one line per override of a key the entry point's validation refuses (the nearest valid
    key named), before Hydra composes; return when there is none."""
    parsed = command_line_overrides(argv)
    if parsed is None:
        return
    overrides, config_dirs = parsed
    from hybridflow.trainer.config import ConfigError
    from hybridflow.trainer.config.mistakes import override_problems

    problems = override_problems(overrides, config_name, config_dirs)
    if problems:
        err = ConfigError("invalid command line:\n  - " + "\n  - ".join(problems))
        if full_error_wanted():
            raise err
        exit_config_error(err)


def command_line_overrides(argv: list[str]) -> tuple[list[str], list[str]] | None:
    """``(overrides, config folders named by --config-path / --config-dir)`` of a Hydra command line;
    None when Hydra is asked to run nothing (--help, --info, ...)."""
    overrides: list[str] = []
    config_dirs: list[str] = []
    flag = None
    for arg in argv:
        if flag is not None:
            if flag in ("-cp", "--config-path", "-cd", "--config-dir"):
                config_dirs.append(arg)
            flag = None
            continue
        name, has_value, value = arg.partition("=")
        if name in _FLAGS_THAT_RUN_NOTHING:
            return None
        if name in _FLAGS_WITH_VALUE:
            if not has_value:
                flag = name
            elif name in ("-cp", "--config-path", "-cd", "--config-dir"):
                config_dirs.append(value)
            continue
        if arg.startswith("-"):  # --multirun, --run, --resolve
            continue
        overrides.append(arg)
    return overrides, config_dirs


def full_error_wanted() -> bool:
    """Hydra's switch for the whole traceback (``HYDRA_FULL_ERROR=1``)."""
    return os.environ.get("HYDRA_FULL_ERROR") == "1"


def one_line(err: BaseException) -> str:
    """The error's message; a list of one problem is put on its header's line."""
    lines = str(err).splitlines()
    if len(lines) == 2 and lines[1].startswith("  - "):
        return f"{lines[0]} {lines[1][4:]}"
    return "\n".join(lines)


def exit_config_error(err: BaseException) -> None:
    print(f"hybridflow: error: {one_line(err)}", file=sys.stderr, flush=True)
    sys.exit(EXIT_CONFIG_ERROR)
