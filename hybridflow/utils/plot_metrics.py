"""Training curves from a ``metrics.jsonl`` written by the ``jsonl`` tracker, rendered to a PNG.

One subplot per metric, x = step: the raw series as a light line and an exponential moving average
(TensorBoard-style, bias-corrected) on top. Metrics logged on only some steps (validation) are drawn
as markers joined by a line, unsmoothed: a moving average over a handful of points only lags.
Uses matplotlib's Agg canvas directly, so no display or pyplot state is involved.

    python -m hybridflow.utils.plot_metrics outputs/proj/exp/metrics.jsonl --out curves.png [--keys k1 k2]
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
from pathlib import Path

__all__ = ["DEFAULT_KEYS", "load_metrics", "plot_metrics", "smooth", "main"]

# Plotted in this order when present; glob patterns expand to every matching key (sorted).
DEFAULT_KEYS = [
    "critic/score/mean",
    "val-core/*/reward/mean@*",
    "actor/pg_loss",
    "actor/entropy",
    "actor/ppo_kl",
    "response_length/mean",
    "critic/vf_loss",
    "perf/throughput",
]


def load_metrics(jsonl_path: str | Path) -> tuple[dict[str, list[tuple[int, float]]], int]:
    """``({key: [(step, value), ...]}, number_of_records)``; non-finite and non-numeric values are dropped."""
    series: dict[str, list[tuple[int, float]]] = {}
    n_records = 0
    with open(jsonl_path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            record = json.loads(line)
            step = int(record.pop("step", n_records))
            n_records += 1
            for key, value in record.items():
                if isinstance(value, bool | int | float) and math.isfinite(value):
                    series.setdefault(key, []).append((step, float(value)))
    return series, n_records


def smooth(values: list[float], weight: float = 0.8) -> list[float]:
    """Bias-corrected exponential moving average (TensorBoard's smoothing)."""
    out, ema = [], 0.0
    for i, value in enumerate(values, start=1):
        ema = weight * ema + (1 - weight) * value
        out.append(ema / (1 - weight**i))
    return out


def _select_keys(patterns: list[str], available: list[str], strict: bool) -> list[str]:
    """Expand ``patterns`` (exact names or globs) against ``available``, keeping order, no duplicates."""
    keys: list[str] = []
    for pattern in patterns:
        if any(c in pattern for c in "*?["):
            matches = sorted(fnmatch.filter(available, pattern))
        else:
            matches = [pattern] if pattern in available else []
        if strict and not matches:
            raise ValueError(f"metric {pattern!r} is not in the file; available: {sorted(available)[:30]}")
        keys.extend(k for k in matches if k not in keys)
    return keys


def plot_metrics(
    jsonl_path: str | Path, out_png: str | Path, keys: list[str] | None = None, smoothing: float = 0.8
) -> Path:
    """Render one subplot per metric of ``jsonl_path`` into ``out_png`` and return its path.

    ``keys`` lists metric names or glob patterns; every one must match. By default the standard
    diagnostics in ``DEFAULT_KEYS`` that the file contains are plotted.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    series, n_records = load_metrics(jsonl_path)
    selected = _select_keys(keys or DEFAULT_KEYS, list(series), strict=keys is not None)
    if not selected:
        available = sorted(series)[:30]
        raise ValueError(f"none of {DEFAULT_KEYS} is in {jsonl_path}; pass keys= (available: {available})")

    ncols = min(3, len(selected))
    nrows = math.ceil(len(selected) / ncols)
    fig = Figure(figsize=(4.5 * ncols, 3.2 * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    for i, key in enumerate(selected):
        ax = fig.add_subplot(nrows, ncols, i + 1)
        steps, values = zip(*series[key])
        # A metric present on under half of the records (validation every k steps) gets markers.
        sparse = len(values) < 0.5 * n_records or len(values) <= 3
        if sparse:
            ax.plot(steps, values, color="tab:blue", alpha=0.8, lw=1, marker="o", ms=4)
        else:
            ax.plot(steps, values, color="tab:blue", alpha=0.3, lw=1)
            ax.plot(steps, smooth(list(values), smoothing), color="tab:blue", lw=1.8)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(Path(jsonl_path).parent.name or str(jsonl_path), fontsize=10)
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Plot training curves from a metrics.jsonl file.")
    parser.add_argument("jsonl", help="metrics.jsonl written by the jsonl tracker")
    parser.add_argument("--out", default="curves.png", help="output PNG path")
    parser.add_argument("--keys", nargs="+", default=None, help="metric names or glob patterns")
    args = parser.parse_args(argv)
    print(plot_metrics(args.jsonl, args.out, args.keys))


if __name__ == "__main__":
    main()
