"""What ``reward_model.use_reward_loop`` and its keys need, checked before Ray starts (issue 35).

- the loop on: ``reward_model.reward_manager`` (or the top-level ``reward_manager.name``) must be a
  reward-loop manager (``naive``, ``dapo``, ``rate_limited``/``limited`` or one registered into
  :mod:`hybridflow.workers.reward_loop.registry`); a served reward model in the loop
  (``reward_model.enable=true``) is not started by main_ppo yet: start ``python -m hybridflow.serve`` and
  hand its address to an async reward function through ``reward_model.reward_kwargs``;
- the loop off: the rate-limit keys and the top-level ``reward_manager`` section other than
  ``source=register`` have no reader, and are refused when set;
- the limits themselves: ``max_concurrent`` >= 1, ``max_rpm``/``max_tpm`` > 0 or null, ``timeout`` > 0,
  ``max_retries`` >= 0.
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

LIMIT_DEFAULTS = {"max_concurrent": 1, "max_rpm": None, "max_tpm": None, "timeout": 300, "max_retries": 0}


def _get(config: DictConfig, key: str, default=None):
    value = OmegaConf.select(config, key, throw_on_missing=False, default=default)
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, DictConfig) else value


def _limit_problems(rm) -> list[str]:
    problems = []
    concurrent = rm.get("max_concurrent", 1)
    if not isinstance(concurrent, int) or isinstance(concurrent, bool) or concurrent < 1:
        problems.append(f"reward_model.max_concurrent={concurrent!r} must be an integer >= 1")
    for key in ("max_rpm", "max_tpm"):
        value = rm.get(key)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int | float) or value <= 0
        ):
            problems.append(f"reward_model.{key}={value!r} must be a positive number or null (no limit)")
    timeout = rm.get("timeout", 300)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
        problems.append(f"reward_model.timeout={timeout!r} must be a positive number of seconds")
    retries = rm.get("max_retries", 0)
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        problems.append(f"reward_model.max_retries={retries!r} must be an integer >= 0")
    return problems


def reward_loop_problems(config: DictConfig) -> list[str]:
    """One line per reward-loop setting hybridflow would not deliver (empty: all honest)."""
    from hybridflow.workers.reward_loop.registry import REWARD_LOOP_MANAGERS

    rm = _get(config, "reward_model") or {}
    section = _get(config, "reward_manager") or {}
    source = section.get("source", "register")
    name = section.get("name") or rm.get("reward_manager") or "naive"
    problems = _limit_problems(rm)
    if source not in ("register", "importlib"):
        problems.append(f"reward_manager.source={source!r}: choose register or importlib")
    if not rm.get("use_reward_loop", False):
        changed = [k for k, default in LIMIT_DEFAULTS.items() if rm.get(k, default) != default]
        if changed:
            problems.append(
                f"reward_model.{', '.join(changed)} are read by the reward loop's limited manager: set "
                "reward_model.use_reward_loop=true and reward_model.reward_manager=limited"
            )
        if source != "register":
            problems.append(
                "reward_manager.source=importlib is read by the reward loop: set use_reward_loop=true"
            )
        if name in ("limited", "rate_limited"):
            problems.append(
                f"reward_model.reward_manager={name} scores in the reward loop: set "
                "reward_model.use_reward_loop=true"
            )
        return problems
    if source == "register" and name not in REWARD_LOOP_MANAGERS:
        problems.append(
            f"reward_model.reward_manager={name!r} is not a reward-loop manager (registered: "
            f"{', '.join(sorted(REWARD_LOOP_MANAGERS))}); set use_reward_loop=false for the batch managers"
        )
    if source == "importlib" and not (section.get("module") or {}).get("path"):
        problems.append("reward_manager.source=importlib needs reward_manager.module.path")
    limited = name in ("limited", "rate_limited")
    changed = [k for k, default in LIMIT_DEFAULTS.items() if rm.get(k, default) != default]
    if changed and not limited and source == "register":
        problems.append(
            f"reward_model.{', '.join(changed)} are read only by reward_manager=limited (this run's: {name})"
        )
    if rm.get("enable", False):
        problems.append(
            "reward_model.enable=true with use_reward_loop=true: main_ppo does not start a served reward "
            "model (GenRM/DisRM) yet; start `python -m hybridflow.serve --model <RM>` and pass its address "
            "to an async custom reward function with "
            "reward_model.reward_kwargs.reward_router_address=<host:port>"
        )
    return problems
