"""A synthetic visual question task whose answers only the image gives, generated offline.

Each image is ``IMAGE_SIZE x IMAGE_SIZE`` (56) pixels on black, cut into a 2 x 2 grid of 28-pixel cells
(with Qwen2-VL's 14-pixel patches merged 2 x 2, one image token per cell: 4 tokens per image). A shape
is a filled 20-pixel square placed at a random offset inside its cell. Three question types, the same
question text for every image of a type, so the text alone never tells the answer; the text lists the
type's allowed answers (fair, and it shows a model that sees nothing the words a valid answer uses):

=========  ============================================  =====================  ======
type       image                                         answers                chance
=========  ============================================  =====================  ======
colour     one square of that colour                     red green blue yellow  1/4
count      1-3 white squares in distinct cells           one two three          1/3
side       one white square in the left or right column  left right             1/2
=========  ============================================  =====================  ======

Rows follow verl's geo3k layout: ``prompt`` holds one user message with an ``<image>`` placeholder,
``images`` a list of ``{"bytes": png}`` dicts, ``reward_model.ground_truth`` the answer word. A split
made with ``balanced=True`` holds every answer of every type equally often, so a policy that ignores
the image (the blank-image control) scores exactly chance on it if it answers with a valid word.
"""

from __future__ import annotations

import io
import random
from dataclasses import dataclass

IMAGE_SIZE = 56
CELL = 28
SQUARE = 20
DATA_SOURCE = "hybridflow/visual"

COLOURS = {"red": (230, 30, 30), "green": (30, 200, 30), "blue": (40, 60, 240), "yellow": (240, 220, 20)}
WHITE = (255, 255, 255)
CELLS = [(0, 0), (1, 0), (0, 1), (1, 1)]  # (column, row)


@dataclass(frozen=True)
class QuestionType:
    name: str
    question: str
    answers: tuple[str, ...]


QUESTION_TYPES = (
    QuestionType("colour", "What colour is the square? Answer red, green, blue or yellow.", tuple(COLOURS)),
    QuestionType("count", "How many squares are there? Answer one, two or three.", ("one", "two", "three")),
    QuestionType("side", "Is the square on the left or the right? Answer left or right.", ("left", "right")),
)
TYPES = {q.name: q for q in QUESTION_TYPES}


def chance(types: list[str]) -> float:
    """Expected accuracy of a policy that ignores the image, on a split balanced per type: the mean of
    1 / (number of answers) over the rows' question types."""
    return sum(1.0 / len(TYPES[t].answers) for t in types) / len(types)


def draw(squares: list[tuple[int, int, tuple[int, int, int]]]):
    """A black PIL RGB image with a filled square whose top-left pixel is ``(x, y)`` per entry."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (0, 0, 0))
    pen = ImageDraw.Draw(image)
    for x, y, colour in squares:
        pen.rectangle([x, y, x + SQUARE - 1, y + SQUARE - 1], fill=colour)
    return image


def blank_image():
    """The control's image: all black, the background of every task image."""
    return draw([])


def _place(cell: tuple[int, int], rng: random.Random) -> tuple[int, int]:
    column, row = cell
    return column * CELL + rng.randint(0, CELL - SQUARE), row * CELL + rng.randint(0, CELL - SQUARE)


def make_example(kind: str, answer: str, rng: random.Random):
    """``(image, answer)`` for question type ``kind`` whose right answer is ``answer``."""
    if kind == "colour":
        return draw([(*_place(rng.choice(CELLS), rng), COLOURS[answer])]), answer
    if kind == "count":
        cells = rng.sample(CELLS, TYPES["count"].answers.index(answer) + 1)
        return draw([(*_place(c, rng), WHITE) for c in cells]), answer
    if kind == "side":
        column = 0 if answer == "left" else 1
        return draw([(*_place((column, rng.randint(0, 1)), rng), WHITE)]), answer
    raise ValueError(f"unknown question type {kind!r}; choose one of {list(TYPES)}")


def png_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def make_rows(per_answer: int, seed: int, split: str = "train", blank: bool = False) -> list[dict]:
    """``per_answer`` rows for every answer of every type (balanced), shuffled; verl's geo3k layout.
    ``blank``: every image replaced by :func:`blank_image` (the control), answers unchanged."""
    rng = random.Random(f"{seed}-{split}")
    rows = []
    for qtype in QUESTION_TYPES:
        for answer in qtype.answers:
            for _ in range(per_answer):
                image, truth = make_example(qtype.name, answer, rng)
                rows.append((qtype, blank_image() if blank else image, truth))
    rng.shuffle(rows)
    return [
        {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": "<image>" + qtype.question}],
            "images": [{"bytes": png_bytes(image)}],
            "ability": "vision",
            "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"index": i, "split": split, "question_type": qtype.name},
        }
        for i, (qtype, image, truth) in enumerate(rows)
    ]


def write_parquet(rows: list[dict], path) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)


def answer_of(solution_str: str) -> str:
    """The first word of a response, lower-cased, without trailing punctuation."""
    words = solution_str.strip().split()
    return words[0].strip(".,!?").lower() if words else ""


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """1.0 when the response's first word is the answer, else 0.0 (verl's compute_score signature)."""
    return float(answer_of(solution_str) == str(ground_truth).lower())


def task_texts() -> list[str]:
    """Texts that train the tiny model's tokenizer: every question and answer, in chat form."""
    texts = []
    for qtype in QUESTION_TYPES:
        for answer in qtype.answers:
            texts.append(f"user\n{qtype.question}\nassistant\n{answer}\n")
    return texts * 20


def decoy(truth: str, kind: str) -> str:
    """The weak teacher's wrong answer to a question of type ``kind``: the type's first answer word,
    or its second when the first is right."""
    answers = TYPES[kind].answers
    return answers[1] if truth == answers[0] else answers[0]


def weak_teacher_answer(truth: str, kind: str, rng: random.Random, accuracy: float) -> str:
    """The SFT warm start's teacher: the right answer with probability ``accuracy``, else the type's
    :func:`decoy`. Below 1/2 its most frequent answer is the wrong one, so a model that copies it well
    answers wrongly when greedy while it samples the right answer ``accuracy`` of the time: the image
    is read, the choice is left to GRPO."""
    return truth if rng.random() < accuracy else decoy(truth, kind)
