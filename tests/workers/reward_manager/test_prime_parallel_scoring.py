"""verl's module-level helpers of the prime reward manager (``parallel_compute_score_async``,
``run_reward_scoring``): rows scored in a process pool, a failing or timed-out row scored 0.0."""

import asyncio
import time

from hybridflow.workers.reward_manager.prime import parallel_compute_score_async, run_reward_scoring


def evaluate(task, completion, reference, extra_info):
    """A picklable scorer: verl's argument order (data source, completion, reference, extra info)."""
    if completion == "hang":
        time.sleep(60)
    if completion == "raise":
        raise ValueError("bad row")
    if task == "tuple":
        return (completion == reference, {"meta": 1})
    if task == "dict":
        return {"score": 0.5}
    return completion == reference


def test_rows_scored_in_processes_failures_and_timeouts_zero():
    started = time.monotonic()
    scores = asyncio.run(
        parallel_compute_score_async(
            evaluate,
            completions=["a", "b", "raise", "hang", "c", "x"],
            references=["a", "z", "a", "a", "c", "x"],
            tasks=["t", "t", "t", "t", "tuple", "dict"],
            num_processes=2,
            timeout=1.0,
        )
    )
    assert scores == [1.0, 0.0, 0.0, 0.0, 1.0, 0.5]
    assert time.monotonic() - started < 30  # the hanging worker was ended, not waited for
    assert run_reward_scoring(evaluate, ["a"], ["a"], ["t"], extra_info=[{"k": 1}], num_processes=1) == [1.0]


def test_verl_import_path():
    from hybridflow import verl_compat

    assert verl_compat.install()
    try:
        from verl.workers.reward_manager.prime import parallel_compute_score_async as verl_parallel
        from verl.workers.reward_manager.prime import run_reward_scoring as verl_run

        assert verl_parallel is parallel_compute_score_async and verl_run is run_reward_scoring
    finally:
        verl_compat.uninstall()
