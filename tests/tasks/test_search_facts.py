"""The search agent's task (:mod:`hybridflow.tasks.search_facts`) and the example's warm-start layout."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import random
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from hybridflow.tasks import search_facts as task

EXAMPLE = Path(__file__).parents[2] / "examples" / "search_agent" / "run_search_grpo.py"


def _example():
    spec = importlib.util.spec_from_file_location("run_search_grpo", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_people_are_distinct_seeded_and_the_test_split_is_unseen_in_training():
    people = task.make_people(1200, seed=0)
    assert len({p.name for p in people}) == 1200
    assert task.make_people(1200, seed=0) == people and task.make_people(1200, seed=1) != people
    train, test = task.split_people(people, 200)
    assert len(test) == 200 and not {p.name for p in train} & {p.name for p in test}
    cities = {p.city for p in people}
    assert cities == set(task.CITIES) and {p.job for p in people} == set(task.JOBS)
    assert task.chance() == pytest.approx(1 / 8)
    with pytest.raises(ValueError, match="num_test"):
        task.split_people(people, 0)


def test_rows_are_search_r1_rows_scored_by_verls_exact_match(tmp_path):
    paths = task.write_task(tmp_path, num_people=40, num_test=10, seed=0)
    train, test = pd.read_parquet(paths["train"]), pd.read_parquet(paths["test"])
    assert len(train) == 60 and len(test) == 20  # both questions of every person
    row = test.iloc[1]
    assert row["data_source"] == task.DATA_SOURCE and row["prompt"][0]["content"] == task.SYSTEM_PROMPT
    person = next(p for p in task.make_people(40, 0) if p.name == row["extra_info"]["name"])
    kind = row["extra_info"]["question_type"]
    assert row["prompt"][1]["content"] == task.question(person, kind)
    truth = row["reward_model"]["ground_truth"]  # as the reward manager gets it back from parquet
    right, wrong = person.fact(kind), next(v for v in task.QUESTIONS[kind][1] if v != person.fact(kind))
    assert task.compute_score(task.DATA_SOURCE, f"searched. {task.answer_text(right)}", truth) == 1.0
    assert task.compute_score(task.DATA_SOURCE, f"<answer>{wrong}</answer>", truth) == 0.0
    assert task.compute_score(task.DATA_SOURCE, right, truth) == 0.0  # no answer tag
    corpus = [json.loads(line) for line in paths["corpus"].read_text().splitlines()]
    first = task.make_people(40, 0)[0]
    assert len(corpus) == 80 and [c["contents"] for c in corpus[:2]] == [
        first.passage("city"),
        first.passage("job"),
    ]
    no_tool = task.make_row(person, "city", "test", 0, with_tool=False)
    assert no_tool["prompt"][0]["content"] == task.NO_TOOL_SYSTEM_PROMPT and "tool_call" not in str(no_tool)


def test_a_search_finds_the_asked_fact_and_never_the_other_one_s_value():
    """Searching a fact finds its passage first, whose last word is the value; searching the person's
    other fact shows a value that is never a right answer to the asked one. The memory teacher is right
    with its accuracy, else answers the fact's first value."""
    from hybridflow.retrieval.corpus import BM25Index, Document
    from hybridflow.workers.rollout.tools.search_r1_like_utils import search_result

    rng = random.Random(0)
    answers = [task.teacher_answer("Oslo", "city", rng, 0.4) for _ in range(4000)]
    assert answers.count(task.answer_text("Oslo")) / len(answers) == pytest.approx(0.4, abs=0.03)
    assert set(answers) == {task.answer_text("Oslo"), task.answer_text(task.CITIES[0])}

    people = task.make_people(1200, 0)
    index = BM25Index([Document(str(i), p.passage(k)) for i, p in enumerate(people) for k in task.QUESTIONS])
    for kind in task.QUESTIONS:
        hits = index.search([task.search_query(p.name, kind) for p in people[:50]], k=1)
        answers = [{"result": [[{"document": d.as_dict(), "score": s} for d, s in h]]} for h in hits]
        shown = [task.passage_value(search_result(["q"], answer, None)[0]) for answer in answers]
        assert shown == [p.fact(kind) for p in people[:50]]  # the asked fact's value
        other = next(k for k in task.QUESTIONS if k != kind)
        hits = index.search([task.search_query(p.name, other) for p in people[:50]], k=1)
        answers = [{"result": [[{"document": d.as_dict(), "score": s} for d, s in h]]} for h in hits]
        shown = [task.passage_value(search_result(["q"], answer, None)[0]) for answer in answers]
        assert shown == [p.fact(other) for p in people[:50]]  # the other fact: never a right answer
        assert not set(shown) & set(task.QUESTIONS[kind][1])
    truth = {"target": ["Oslo"]}
    assert task.compute_score(task.DATA_SOURCE, task.teacher_answer("Oslo", "city", rng, 1.0), truth) == 1.0


def test_names_and_answers_are_the_same_tokens_where_the_model_copies_them():
    """Names and facts are one token each, after a space, in the question, the call, the passage and
    the answer: a copy is a copy of a token."""
    from hybridflow.models.tiny import build_tokenizer

    people = task.make_people(1200, 0)
    tokenizer = build_tokenizer(task.task_texts(people), vocab_size=768)
    words = [*task.FIRST_NAMES, *task.LAST_NAMES, *task.CITIES, *task.JOBS]
    assert all(len(tokenizer.encode(f" {w}", add_special_tokens=False)) == 1 for w in words)
    person = people[0]
    first, last = (tokenizer.encode(f" {w}", add_special_tokens=False)[0] for w in person.name.split())
    city = tokenizer.encode(f" {person.city}", add_special_tokens=False)[0]
    for text, wanted in (
        (task.question(person, "city"), [first, last]),
        (task.tool_call_text(task.search_query(person.name, "city")), [first, last]),
        (person.passage("city"), [first, last, city]),
        (task.answer_text(person.city), [city]),
    ):
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert all(token in ids for token in wanted), text


def test_the_agents_search_finds_the_asked_passage():
    """BM25 over the corpus (the index the server serves), queried as the agent queries: the asked
    fact's passage is the first hit for every test question (not the same person's other fact, not a
    namesake's)."""
    from hybridflow.retrieval.corpus import BM25Index, Document

    people = task.make_people(1200, 0)
    passages = [p.passage(kind) for p in people for kind in task.QUESTIONS]
    index = BM25Index([Document(str(i), text) for i, text in enumerate(passages)])
    _, test = task.split_people(people, 200)
    asked = [(p, kind) for p in test for kind in task.QUESTIONS]
    hits = index.search([task.search_query(p.name, kind) for p, kind in asked], k=3)
    assert all(h[0][0].contents == p.passage(kind) for (p, kind), h in zip(asked, hits))


def test_the_warm_start_shows_the_model_what_the_search_tool_returns(tmp_path):
    """The example's tool texts (asked of a real retrieval server) are the real ``SearchTool``'s answer
    to the same call, so the warm start and the agent loop show the model the same tokens."""
    from hybridflow.workers.rollout.tools.search_tool import SearchTool

    example = _example()
    people = task.make_people(30, 0)
    corpus = task.write_corpus(people, tmp_path / "corpus.jsonl")
    server, url = example.start_retrieval_server(corpus, tmp_path / "server.log")
    try:
        asked = [(p.name, kind) for p in people[:3] for kind in task.QUESTIONS]
        texts = example.tool_texts(url, [task.search_query(*key) for key in asked], topk=2)
        config = task.tool_config(url, topk=2)["tools"][0]
        tool = SearchTool(config["config"])

        async def calls():
            return [await tool.execute("i", {"query_list": [query]}) for query in texts]

        for (name, kind), (text, _, metrics) in zip(asked, asyncio.run(calls())):
            assert metrics["status"] == "success" and text == texts[task.search_query(name, kind)]
            assert json.loads(text)["result"].startswith(f"Doc 1 (Title: {name})\nThe {kind} of {name} is")
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_the_task_writes_its_files_from_the_command_line(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "hybridflow.tasks.search_facts",
            "--out",
            str(tmp_path),
            "--num-people",
            "30",
            "--num-test",
            "5",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert [Path(p).name for p in out] == [
        "corpus.jsonl",
        "train.parquet",
        "test.parquet",
        "search_tool_config.yaml",
    ]
    config = json.loads((tmp_path / "search_tool_config.yaml").read_text())
    assert config["tools"][0]["class_name"] == "verl.tools.search_tool.SearchTool"
