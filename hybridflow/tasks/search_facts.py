"""The search agent's task: facts about invented people that only a search of the corpus tells.

Every person has an invented name (``"Dalo Kolt"``: one of 40 first names and one of 40 last names), a
city and a job; the corpus holds one passage per fact in Search-R1's jsonl (``{"id": "34", "contents":
"Dalo Kolt\\nThe city of Dalo Kolt is Lima."}``, and ``"...The job of Dalo Kolt is pilot."``). A question
asks one fact (``"What is the city of Dalo Kolt?"``). Train and test questions are about different people
(their names are new pairs of known first and last names), so a model that memorised the training facts
knows nothing of the test ones: without the tool it scores chance on the test split (1/8: each fact takes
one of 8 values; :func:`chance`). Searching ``"the city of Dalo Kolt"`` (:func:`search_query`) returns
that passage first (the same person's other fact and namesakes' passages score lower), and the answer is
its last word. Every name, fact word and value is one token after a space, in the question, the call, the
passage and the answer alike: the agent copies tokens.

The answer is scored by verl's Search-R1 exact match (``<answer> Lima</answer>``,
:mod:`hybridflow.utils.reward_score.search_r1_like_qa_em`): :func:`compute_score` is the file's
``custom_reward_function``. The example's warm start (``examples/search_agent``) teaches a reluctant
searcher: it can search the asked fact (:func:`search_query`) and answer with the value that came back
(:func:`passage_value`), but more often answers from memory (:func:`teacher_answer`), which on held-out
people is chance; learning that the search pays is left to reinforcement learning.

    python -m hybridflow.tasks.search_facts --out DIR   # corpus.jsonl, train/test parquet, tool config
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path

DATA_SOURCE = "hybridflow/search_facts"
TOOL_NAME = "search"
CITIES = ("Lima", "Oslo", "Cairo", "Perth", "Quito", "Dakar", "Hanoi", "Riga")
JOBS = ("baker", "pilot", "tailor", "farmer", "nurse", "judge", "miner", "chef")
FIRST_NAMES = (
    "Dalo", "Venrik", "Matu", "Selkor", "Pazin", "Belmo", "Raten", "Vigar", "Noshi", "Feldor",
    "Kalu", "Toma", "Brisel", "Orin", "Zaket", "Lumi", "Heko", "Sarn", "Ilda", "Pero",
    "Juno", "Kesta", "Marl", "Nedo", "Oska", "Quen", "Ruvi", "Sibo", "Tarn", "Ulla",
    "Vesk", "Wendo", "Yara", "Zeno", "Adri", "Bosk", "Cira", "Dumo", "Elko", "Fira",
)  # fmt: skip
LAST_NAMES = (
    "Kolt", "Varna", "Drumel", "Sovik", "Thale", "Mirsk", "Pendra", "Lask", "Orvel", "Quist",
    "Brand", "Calder", "Dusk", "Erwin", "Fosk", "Gallo", "Hest", "Irvan", "Jarl", "Korrin",
    "Lund", "Morv", "Nask", "Oberl", "Pask", "Rund", "Stav", "Tork", "Ulm", "Vack",
    "Wesk", "Yost", "Zorn", "Arvo", "Belk", "Crane", "Dorm", "Eld", "Frey", "Grim",
)  # fmt: skip
QUESTIONS = {
    "city": ("What is the city of {name}?", CITIES),
    "job": ("What is the job of {name}?", JOBS),
}
SYSTEM_PROMPT = "Look the person up with the search tool, then answer as <answer> ...</answer>."
NO_TOOL_SYSTEM_PROMPT = "Answer as <answer> ...</answer>."


def tool_config(retrieval_url: str, topk: int = 3) -> dict:
    """verl's search tool config (``examples/tools/search_tool_config.yaml``'s layout) for a retrieval
    server at ``retrieval_url`` (``http://H:P/retrieve``)."""
    return {
        "tools": [
            {
                "class_name": "verl.tools.search_tool.SearchTool",
                "config": {
                    "retrieval_service_url": retrieval_url,
                    "topk": topk,
                    "timeout": 30,
                    "num_workers": 64,
                    "rate_limit": 64,
                    "type": "native",
                },
                "tool_schema": {
                    "type": "function",
                    "function": {
                        "name": TOOL_NAME,
                        "description": "Searches the knowledge base for passages about the queries.",
                        "parameters": {
                            "type": "object",
                            "properties": {
                                "query_list": {
                                    "type": "array",
                                    "item": {"type": "string"},
                                    "description": "Queries; the tool returns passages for each.",
                                }
                            },
                            "required": ["query_list"],
                        },
                    },
                },
            }
        ]
    }


@dataclass(frozen=True)
class Person:
    name: str
    city: str
    job: str

    def passage(self, kind: str) -> str:
        """The corpus's ``contents`` for fact ``kind``: ``"Title\\ntext"``."""
        return f"{self.name}\nThe {kind} of {self.name} is {self.fact(kind)}."

    def fact(self, kind: str) -> str:
        return self.city if kind == "city" else self.job


def make_people(count: int, seed: int = 0) -> list[Person]:
    """``count`` people with distinct names, cities and jobs drawn uniformly (``seed`` fixes them)."""
    rng = random.Random(seed)
    if count > len(FIRST_NAMES) * len(LAST_NAMES):
        raise ValueError(f"at most {len(FIRST_NAMES) * len(LAST_NAMES)} distinct names, asked for {count}")
    names: set[str] = set()
    people = []
    while len(people) < count:
        name = f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}"
        if name in names:
            continue
        names.add(name)
        people.append(Person(name, rng.choice(CITIES), rng.choice(JOBS)))
    return people


def split_people(people: list[Person], num_test: int) -> tuple[list[Person], list[Person]]:
    """Train and test people: the last ``num_test`` are the test split's (no test fact in training)."""
    if not 0 < num_test < len(people):
        raise ValueError(f"num_test must be between 1 and {len(people) - 1}, got {num_test}")
    return people[:-num_test], people[-num_test:]


def question(person: Person, kind: str) -> str:
    return QUESTIONS[kind][0].format(name=person.name)


def make_row(person: Person, kind: str, split: str, index: int, with_tool: bool = True) -> dict:
    """One row in verl's schema (Search-R1's ``reward_model.ground_truth = {"target": [...]}``)."""
    system = SYSTEM_PROMPT if with_tool else NO_TOOL_SYSTEM_PROMPT
    return {
        "data_source": DATA_SOURCE,
        "prompt": [
            {"role": "system", "content": system},
            {"role": "user", "content": question(person, kind)},
        ],
        "ability": "fact-reasoning",
        "reward_model": {"style": "rule", "ground_truth": {"target": [person.fact(kind)]}},
        "extra_info": {"split": split, "index": index, "question_type": kind, "name": person.name},
    }


def make_rows(people: list[Person], split: str, with_tool: bool = True) -> list[dict]:
    """Both questions of every person, interleaved (``index`` counts the rows)."""
    pairs = [(person, kind) for person in people for kind in QUESTIONS]
    return [make_row(p, kind, split, i, with_tool) for i, (p, kind) in enumerate(pairs)]


def search_query(name: str, kind: str) -> str:
    """The query for fact ``kind`` of ``name``: ``"the city of Dalo Kolt"``, the question's own words
    (BM25 drops "the" and "of")."""
    return f"the {kind} of {name}"


def tool_call_text(query: str) -> str:
    """The assistant's search call for ``query`` (Hermes format, as the tool agent loop parses it)."""
    call = {"name": TOOL_NAME, "arguments": {"query_list": [query]}}
    return f"<tool_call>{json.dumps(call)}</tool_call>"


def answer_text(value: str) -> str:
    """``<answer> value</answer>``: the value after a space, the same token as in the passage (the
    scorer strips it)."""
    return f"<answer> {value}</answer>"


def passage_value(tool_text: str) -> str:
    """The value the search tool's text shows (the last word of its first passage): what the teacher
    answers after a search."""
    first = json.loads(tool_text)["result"].split("\n\n")[0]
    return first.rstrip(".").split()[-1]


def teacher_answer(truth: str, kind: str, rng: random.Random, accuracy: float) -> str:
    """An answer from memory (the control's teacher, and the reluctant searcher's when it does not
    search): ``truth`` with probability ``accuracy``, else the fact's first value (``Lima``,
    ``baker``); it can only have memorised the training people's facts."""
    values = QUESTIONS[kind][1]
    return answer_text(truth if rng.random() < accuracy else values[0])


def chance() -> float:
    """The expected test accuracy of a model that answers each question with a uniformly drawn value of
    the asked fact (both facts take 8 values)."""
    return sum(1 / len(values) for _, values in QUESTIONS.values()) / len(QUESTIONS)


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """verl's ``custom_reward_function`` signature: Search-R1's exact match of the last ``<answer>``."""
    from hybridflow.utils.reward_score.search_r1_like_qa_em import compute_score as exact_match

    return float(exact_match(solution_str, ground_truth))


def task_texts(people: list[Person]) -> list[str]:
    """Texts that train the tiny model's tokenizer: prompts, questions, passages, calls and answers."""
    texts = [SYSTEM_PROMPT, NO_TOOL_SYSTEM_PROMPT, json.dumps({"result": "Doc 1 (Title: x)\nx\n\nDoc 2"})]
    for person in people:
        for kind in QUESTIONS:
            texts += [person.passage(kind), tool_call_text(search_query(person.name, kind))]
            texts.append(question(person, kind) + answer_text(person.fact(kind)))
    return texts


def write_corpus(people: list[Person], path: str | Path) -> Path:
    """Search-R1's jsonl, one passage per fact of each person."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    passages = [person.passage(kind) for person in people for kind in QUESTIONS]
    lines = [json.dumps({"id": str(i), "contents": text}) for i, text in enumerate(passages)]
    path.write_text("\n".join(lines) + "\n")
    return path


def write_parquet(rows: list[dict], path: str | Path) -> Path:
    import pandas as pd

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(path)
    return path


def write_task(
    out_dir: str | Path, num_people: int = 1000, num_test: int = 200, seed: int = 0, with_tool: bool = True
) -> dict[str, Path]:
    """``corpus.jsonl`` (every person), ``train.parquet`` and ``test.parquet`` under ``out_dir``."""
    out = Path(out_dir)
    people = make_people(num_people, seed)
    train, test = split_people(people, num_test)
    return {
        "corpus": write_corpus(people, out / "corpus.jsonl"),
        "train": write_parquet(make_rows(train, "train", with_tool), out / "train.parquet"),
        "test": write_parquet(make_rows(test, "test", with_tool), out / "test.parquet"),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--num-people", type=int, default=1000)
    parser.add_argument("--num-test", type=int, default=200, help="people of the test split")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--retrieval-url", default="http://127.0.0.1:8000/retrieve")
    args = parser.parse_args(argv)
    paths = write_task(args.out, args.num_people, args.num_test, args.seed)
    tools = Path(args.out) / "search_tool_config.yaml"
    tools.write_text(json.dumps(tool_config(args.retrieval_url), indent=2))  # JSON is valid YAML
    print("\n".join(str(p) for p in [*paths.values(), tools]))


if __name__ == "__main__":
    main()
