"""examples/genrm/reward.py against a judge served by our stack (the session's ``genrm``: the tiny model
behind the router): its score is the parsed verdict of the judge's own reply to the question it builds,
whatever the ground truth says (the judge alone decides on training rows); held-out rows get the rule."""

import asyncio
import importlib.util
from pathlib import Path

from hybridflow.tasks.arithmetic_judge import judge_question, parse_verdict
from hybridflow.utils.served_client import chat_complete

REWARD = Path(__file__).parents[2] / "examples" / "genrm" / "reward.py"


def _reward_module():
    spec = importlib.util.spec_from_file_location("genrm_reward", REWARD)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_genrm_reward_is_the_served_judges_verdict(genrm):
    compute_score = _reward_module().compute_score
    address = genrm.address
    extra_info = {"a": 47, "op": "+", "b": 5, "split": "train"}

    async def scores():
        asked = {
            "model": "judge",
            "messages": [{"role": "user", "content": judge_question(47, "+", 5, "52")}],
            "max_tokens": 8,
            "temperature": 0,
        }
        reply = (await chat_complete(address, asked, timeout_s=60)).choices[0].message.content
        kwargs = {"reward_router_address": address, "judge_model": "judge"}
        right = await compute_score("hybridflow/arithmetic", " 52", "52", extra_info, **kwargs)
        wrong_truth = await compute_score("hybridflow/arithmetic", " 52", "99", extra_info, **kwargs)
        return reply, right, wrong_truth

    reply, right, wrong_truth = asyncio.run(scores())
    assert right == wrong_truth == parse_verdict(reply)  # greedy: the same reply; ground truth unread
    assert right in (0.0, 1.0)


def test_genrm_reward_scores_held_out_rows_by_the_rule():
    """Validation rows (split "test") are the recipe's measurement: the exact-answer rule, no judge asked
    (no router address given)."""
    compute_score = _reward_module().compute_score
    extra_info = {"a": 47, "op": "+", "b": 5, "split": "test"}
    right = asyncio.run(compute_score("hybridflow/arithmetic", "52", "52", extra_info))
    wrong = asyncio.run(compute_score("hybridflow/arithmetic", "42", "52", extra_info))
    assert (right, wrong) == (1.0, 0.0)
