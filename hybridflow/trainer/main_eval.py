"""Offline scoring: ``python -m hybridflow.trainer.main_eval key=value ...`` (verl's shape).

Scores every response of every row of ``data.path`` (``main_generation``'s output) with the scorer
for the row's data source — ``default_compute_score``, or ``custom_reward_function.path``/``name``
as the reward managers load it — and reports, per data source (printed as JSON, returned as a dict):

- ``num_rows``, ``num_responses``;
- ``mean_reward``: the mean score over all responses of all rows;
- ``first_response_reward``: the mean over rows of the score of each row's first response;
- ``pass@k`` for k in {1, 2, 4, ...} up to n and k = n, where n is the fewest responses any row of the
  data source has: the mean over rows of the unbiased estimator ``1 - C(n_i - c_i, k) / C(n_i, k)``
  (``n_i`` responses, ``c_i`` of them correct, i.e. scoring >= :data:`PASS_THRESHOLD`). ``pass@1`` is
  thus the mean fraction of correct responses per row, and ``pass@n`` (with equal n) the fraction of
  rows with at least one correct response.

A scorer that raises, returns a non-number or NaN is an error naming the row and the data source.
``custom_reward_function.reward_kwargs`` go to the custom function, or (no ``path``) to the built-in
scorers, each receiving those its signature names; a keyword no scorer (or the custom function) takes is
a :class:`ConfigError` before anything is scored.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import json  # noqa: E402
import math  # noqa: E402
from collections.abc import Callable  # noqa: E402

from omegaconf import DictConfig, OmegaConf  # noqa: E402

from hybridflow.trainer.hydra_entry import hydra_entry  # noqa: E402

PASS_THRESHOLD = 1.0  # a response is correct when its score is at least this


@hydra_entry("evaluation")
def main(config: DictConfig) -> None:
    run_eval(config)


def run_eval(config: DictConfig) -> dict[str, dict[str, float]]:
    """Score ``data.path``; returns ``{data_source: {metric: value}}`` (also printed as JSON)."""
    import pyarrow.parquet as pq

    OmegaConf.resolve(config)
    validate_eval_config(config)
    data = config.data
    path = os.path.expanduser(str(data.path))
    table = pq.read_table(path)
    keys = (str(data.response_key), str(data.data_source_key), str(data.reward_model_key))
    missing = [key for key in keys if key not in table.column_names]
    if missing:
        raise ValueError(f"{path} has no column(s) {missing} (columns: {table.column_names})")
    extra_infos = (
        table.column("extra_info").to_pylist() if "extra_info" in table.column_names else [None] * len(table)
    )
    score_fn = build_score_fn(config.custom_reward_function, set(table.column(keys[1]).to_pylist()))
    scores: dict[str, list[list[float]]] = {}
    columns = [table.column(key).to_pylist() for key in keys]
    for row, (responses, data_source, reward_model) in enumerate(zip(*columns, strict=True)):
        where = f"{data.path} row {row} (data_source {data_source!r})"
        scores.setdefault(data_source, []).append(
            score_row(score_fn, data_source, responses, reward_model, extra_infos[row], where)
        )
    metrics = {source: summarize(rows) for source, rows in scores.items()}
    print(json.dumps(metrics, indent=2))
    return metrics


def validate_eval_config(config: DictConfig) -> None:
    """Raise :class:`ConfigError` listing every problem of a composed evaluation config."""
    from hybridflow.trainer.config import CONFIG_DIR, ConfigError
    from hybridflow.trainer.config.honesty import evaluation_problems
    from hybridflow.trainer.config.mistakes import unknown_key_problems

    schema = OmegaConf.load(CONFIG_DIR / "evaluation.yaml")
    problems = unknown_key_problems(config, schema, "evaluation.yaml")
    problems += evaluation_problems(config)
    if not config.data.path or not os.path.isfile(os.path.expanduser(str(config.data.path))):
        problems.append(f"data.path: parquet {config.data.path!r} does not exist")
    custom = config.custom_reward_function.path
    if custom and not os.path.isfile(os.path.expanduser(str(custom))):
        problems.append(f"custom_reward_function.path: {custom!r} does not exist")
    if problems:
        raise ConfigError("invalid evaluation config:\n  - " + "\n  - ".join(problems))


def build_score_fn(custom_reward_cfg, data_sources: set[str]) -> Callable:
    """The custom reward function if a path is set, else ``default_compute_score``, with
    ``reward_kwargs`` bound. A keyword the function (or every built-in scorer of ``data_sources``) does
    not take is a :class:`ConfigError`."""
    import functools

    from hybridflow.trainer.config import ConfigError
    from hybridflow.utils.reward_score import accepted_kwargs, default_compute_score, score_kwargs_problems
    from hybridflow.workers.reward_manager.custom import load_custom_reward_function

    name = custom_reward_cfg.name or "compute_score"
    fn = load_custom_reward_function(custom_reward_cfg.path, name)
    kwargs = dict(custom_reward_cfg.get("reward_kwargs") or {})
    if fn is None:
        problems = score_kwargs_problems(kwargs, data_sources)
        fn = default_compute_score
    else:
        accepted = accepted_kwargs(fn)
        problems = [
            f"reward kwarg {key!r} is not a parameter of {name} in {custom_reward_cfg.path} (beyond "
            f"data_source, solution_str, ground_truth, extra_info it takes {_names(accepted)})"
            for key in kwargs
            if accepted is not None and key not in accepted
        ]
    if problems:
        lines = [f"custom_reward_function.reward_kwargs: {problem}" for problem in problems]
        raise ConfigError("invalid evaluation config:\n  - " + "\n  - ".join(lines))
    return functools.partial(fn, **kwargs) if kwargs else fn


def _names(accepted: frozenset[str]) -> str:
    return ", ".join(sorted(accepted)) or "nothing"


def score_row(
    score_fn: Callable, data_source: str, responses, reward_model, extra_info, where: str
) -> list[float]:
    """Scores of one row's responses, in order (a bare string counts as one response)."""
    from hybridflow.workers.reward_manager.naive import RewardScoreError

    if isinstance(responses, str):
        responses = [responses]
    if not isinstance(responses, list) or not responses:
        raise ValueError(f"{where}: responses must be a non-empty list of strings, got {responses!r:.200}")
    if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
        raise ValueError(f"{where}: reward_model has no 'ground_truth': {reward_model!r:.200}")
    scores = []
    for index, response in enumerate(responses):
        try:
            result = score_fn(
                data_source=data_source,
                solution_str=response,
                ground_truth=reward_model["ground_truth"],
                extra_info=extra_info,
            )
        except Exception as err:
            raise RewardScoreError(
                f"{where}, response {index}: scorer raised {type(err).__name__}: {err}; "
                f"response[:200]={str(response)[:200]!r}"
            ) from err
        score = result.get("score") if isinstance(result, dict) else result
        try:
            score = float(score)
        except (TypeError, ValueError):
            score = math.nan
        if not math.isfinite(score):
            raise RewardScoreError(
                f"{where}, response {index}: scorer returned {result!r:.200}, not a finite number"
            )
        scores.append(score)
    return scores


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of the chance that at least one of ``k`` of ``n`` samples (``c`` correct) is."""
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def k_values(n: int) -> list[int]:
    """1, 2, 4, ... up to ``n``, and ``n`` itself."""
    ks = [2**i for i in range(n.bit_length()) if 2**i <= n]
    return ks if ks[-1] == n else [*ks, n]


def summarize(rows: list[list[float]]) -> dict[str, float]:
    """Metrics of one data source from each row's response scores (see the module docstring)."""
    every = [score for row in rows for score in row]
    metrics: dict[str, float] = {
        "num_rows": len(rows),
        "num_responses": len(every),
        "mean_reward": sum(every) / len(every),
        "first_response_reward": sum(row[0] for row in rows) / len(rows),
    }
    correct = [sum(score >= PASS_THRESHOLD for score in row) for row in rows]
    for k in k_values(min(len(row) for row in rows)):
        per_row = [pass_at_k(len(row), c, k) for row, c in zip(rows, correct, strict=True)]
        metrics[f"pass@{k}"] = sum(per_row) / len(per_row)
    return metrics


if __name__ == "__main__":
    main()
