"""The synthetic visual task: every answer is in the image and only there, the splits are balanced (so
chance is 1/3 and an image-blind policy scores exactly that), the reward is exact match of the first word,
and the weak teacher's most frequent answer is wrong."""

import io
import random
from collections import Counter

import numpy as np
from PIL import Image

from hybridflow.tasks import visual


def _pixels(row) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(row["images"][0]["bytes"])).convert("RGB"))


def test_each_answer_is_read_from_the_image():
    rows = visual.make_rows(3, seed=1, split="train")
    for row in rows:
        kind, truth = row["extra_info"]["question_type"], row["reward_model"]["ground_truth"]
        pixels = _pixels(row)
        lit = pixels.any(axis=-1)  # non-black pixels
        assert lit.sum() == visual.SQUARE**2 * (
            visual.TYPES["count"].answers.index(truth) + 1 if kind == "count" else 1
        )
        if kind == "colour":
            assert tuple(pixels[lit][0]) == visual.COLOURS[truth]
        if kind == "side":
            columns = np.nonzero(lit.any(axis=0))[0]
            half = visual.IMAGE_SIZE // 2
            assert (columns < half).all() if truth == "left" else (columns >= half).all()
        # the text alone never tells: one question per type, whatever the answer
        assert row["prompt"] == [{"role": "user", "content": "<image>" + visual.TYPES[kind].question}]


def test_splits_are_balanced_and_chance_is_a_third():
    rows = visual.make_rows(2, seed=0, split="test")
    counts = Counter((r["extra_info"]["question_type"], r["reward_model"]["ground_truth"]) for r in rows)
    assert set(counts.values()) == {2} and len(counts) == 9
    types = [r["extra_info"]["question_type"] for r in rows]
    assert abs(visual.chance(types) - 1 / 3) < 1e-12  # (4 * 1/4 + 3 * 1/3 + 2 * 1/2) / 9
    blank = visual.make_rows(2, seed=0, split="test", blank=True)
    assert all(not _pixels(r).any() for r in blank)
    assert [r["reward_model"] for r in blank] == [r["reward_model"] for r in rows]  # same questions


def test_reward_is_the_first_word():
    assert visual.compute_score("x", "Red.", "red") == 1.0
    assert visual.compute_score("x", " two squares", "two") == 1.0
    assert visual.compute_score("x", "blue red", "red") == 0.0
    assert visual.compute_score("x", "", "red") == 0.0


def test_weak_teacher_is_mostly_wrong_below_a_half():
    rng = random.Random(0)
    answers = Counter(visual.weak_teacher_answer("blue", "colour", rng, 0.4) for _ in range(2000))
    assert set(answers) == {"blue", "red"} and answers.most_common(1)[0][0] == "red"
    assert abs(answers["blue"] / 2000 - 0.4) < 0.04
    assert visual.decoy("red", "colour") == "green"
