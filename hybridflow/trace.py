"""Read a rollout trace back: ``python -m hybridflow.trace show RUN_DIR [--step N] [--sample ID]``.

``RUN_DIR`` is the run's log directory (``outputs/{project_name}/{experiment_name}``, the one holding
``metrics.jsonl``), or the trace directory itself (``rollout.trace.dir``). Written by
``actor_rollout_ref.rollout.trace.backend=jsonl`` (:mod:`hybridflow.utils.rollout_trace`):

- no ``--step``: the traced steps and how many records each holds;
- ``--step N``: that step's samples, one line each (calls by kind, turns, reward);
- ``--step N --sample ID``: the conversation, call by call in the order they started: the prompt,
  each generation (its text with ``token2text``, else its token ids; how it stopped), each tool call
  with its arguments and answer, the reward. ``ID`` is a dataset index (all its ``rollout.n``
  samples) or ``index:n`` (one sample). A sample aborted and resumed (partial rollout) shows both
  runs of its loop, the cut generation marked ``stopped: aborted``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

PREVIEW = 400  # characters of a long text shown without --full


def trace_directory(run_dir: str | Path) -> Path:
    """The directory holding ``step_*.jsonl``: ``RUN_DIR/rollout_trace`` or ``RUN_DIR`` itself."""
    run_dir = Path(run_dir)
    for candidate in (run_dir / "rollout_trace", run_dir):
        if any(candidate.glob("*step_*.jsonl")):
            return candidate
    raise FileNotFoundError(
        f"no rollout trace under {run_dir} (looked for rollout_trace/step_*.jsonl and step_*.jsonl; "
        "runs write one with actor_rollout_ref.rollout.trace.backend=jsonl)"
    )


def load_step(directory: Path, step: int, validate: bool = False) -> list[dict]:
    """A step's records (every worker's), ordered by start time then call number."""
    path = directory / f"{'val_' if validate else ''}step_{step}.jsonl"
    if not path.exists():
        steps = ", ".join(str(s) for s in list_steps(directory, validate)) or "none"
        raise FileNotFoundError(f"no trace of step {step} in {directory} (traced steps: {steps})")
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not a JSON record ({error})") from None
    return sorted(records, key=lambda r: (r.get("t_start", 0.0), r.get("seq", 0)))


def list_steps(directory: Path, validate: bool = False) -> list[int]:
    prefix = "val_step_" if validate else "step_"
    steps = []
    for path in directory.glob(f"{prefix}*.jsonl"):
        number = path.stem[len(prefix) :]
        if number.lstrip("-").isdigit():
            steps.append(int(number))
    return sorted(steps)


def sample_of(record: dict) -> tuple:
    return (record.get("sample_index"), record.get("rollout_n"))


def select(records: list[dict], sample: str | None) -> dict[tuple, list[dict]]:
    """Records grouped by sample; ``sample``: ``"index"`` (its group) or ``"index:n"``."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for record in records:
        groups[sample_of(record)].append(record)
    if sample is None:
        return dict(groups)
    index, _, n = sample.partition(":")
    chosen = {
        key: value for key, value in groups.items() if str(key[0]) == index and (not n or str(key[1]) == n)
    }
    if not chosen:
        known = ", ".join(f"{i}:{r}" for i, r in sorted(groups, key=str))
        raise KeyError(f"sample {sample} is not in this step's trace (traced samples: {known})")
    return chosen


def summary_line(key: tuple, records: list[dict]) -> str:
    kinds: dict[str, int] = defaultdict(int)
    for record in records:
        kinds[record.get("kind", "call")] += 1
    rewards = [r["output"].get("score") for r in records if r.get("kind") == "reward" and r.get("output")]
    errors = sum(1 for r in records if r.get("error"))
    parts = [f"{kind} x{count}" for kind, count in sorted(kinds.items())]
    reward = f"reward {rewards[-1]}" if rewards else "no reward"
    failed = f", {errors} raised" if errors else ""
    return f"sample {key[0]}:{key[1]}  {len(records)} calls ({', '.join(parts)}{failed}), {reward}"


def _short(value, full: bool) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    if full or len(text) <= PREVIEW:
        return text
    return f"{text[: PREVIEW // 2]} ... ({len(text)} chars) ... {text[-PREVIEW // 2 :]}"


def render_call(record: dict, full: bool = False) -> list[str]:
    """One record as lines of the conversation."""
    kind, inputs, output = record.get("kind"), record.get("inputs") or {}, record.get("output")
    head = f"[{record.get('seq')}] {kind} {record.get('call')} ({record.get('duration_s', 0):.3f} s)"
    if record.get("error"):
        return [head, f"    raised: {record['error']}"]
    if kind == "agent_loop":
        return _render_loop(head, inputs, output or {}, full)
    if kind == "generate":
        output = output or {}
        tokens = output.get("token_ids") or []
        said = output.get("text") if "text" in output else tokens
        stop = output.get("stop_reason")
        return [f"{head}: {len(tokens)} tokens, stopped: {stop}", f"    assistant: {_short(said, full)}"]
    if kind == "tool":
        call = inputs.get("call") if isinstance(inputs.get("call"), dict) else {}
        name = call.get("name") or record.get("call", "").rsplit(".", 2)[0]
        arguments = call.get("arguments", inputs.get("parameters", {}))
        answer = output[0] if isinstance(output, list) and output else output
        if isinstance(answer, dict) and "text" in answer:  # verl's ToolResponse
            answer = answer["text"]
        return [f"{head}: {name}({_short(arguments, full)})", f"    tool: {_short(answer, full)}"]
    if kind == "reward":
        return [f"{head}: {_short(output, full)}"]
    return [f"{head}: {_short(inputs, full)} -> {_short(output, full)}"]


def _render_loop(head: str, inputs: dict, output: dict, full: bool) -> list[str]:
    lines = [head]
    resumed = inputs.get("partial_output") is not None
    if resumed:
        lines[0] += " (resumed from its partial output)"
    else:
        for message in inputs.get("raw_prompt") or []:
            if isinstance(message, dict):
                lines.append(f"    {message.get('role')}: {_short(message.get('content'), full)}")
    extra = output.get("extra_fields") or {}
    state = "partial (aborted; resumed later)" if extra.get("is_partial") else "finished"
    lines.append(
        f"    -> {state}: {len(output.get('response_ids') or [])} response tokens, "
        f"{output.get('num_turns')} turns, {extra.get('tool_calls', 0)} tool calls"
    )
    return lines


def show(run_dir: str, step: int | None, sample: str | None, validate: bool, full: bool, out=None) -> None:
    out = out or sys.stdout
    directory = trace_directory(run_dir)
    if step is None:
        for number in list_steps(directory, validate):
            records = load_step(directory, number, validate)
            print(
                f"step {number}: {len(records)} calls, {len({sample_of(r) for r in records})} samples",
                file=out,
            )
        return
    groups = select(load_step(directory, step, validate), sample)
    if sample is None:
        for key in sorted(groups, key=str):
            print(summary_line(key, groups[key]), file=out)
        return
    for key in sorted(groups, key=str):
        print(f"=== step {step}, {summary_line(key, groups[key])}", file=out)
        for record in groups[key]:
            for line in render_call(record, full):
                print(line, file=out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybridflow.trace", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    show_cmd = commands.add_parser("show", help="print a step's samples, or one sample's conversation")
    show_cmd.add_argument("run_dir", help="the run's log directory, or the trace directory")
    show_cmd.add_argument("--step", type=int, default=None)
    show_cmd.add_argument("--sample", default=None, help="a dataset index, or index:n for one sample")
    show_cmd.add_argument("--validate", action="store_true", help="the validation trace of the step")
    show_cmd.add_argument("--full", action="store_true", help="do not shorten long texts")
    args = parser.parse_args(argv)
    try:
        show(args.run_dir, args.step, args.sample, args.validate, args.full)
    except (FileNotFoundError, KeyError, ValueError) as error:
        print(f"error: {error.args[0] if error.args else error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
