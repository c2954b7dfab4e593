"""An async GenRM reward function for the reward-loop tests: the rule score of the arithmetic task, and a
greedy verdict asked of the served judge through ``reward_router_address`` (verl's signature)."""

from hybridflow.utils.reward_score import default_compute_score
from hybridflow.utils.served_client import chat_complete


async def compute_score(data_source, solution_str, ground_truth, extra_info, reward_router_address, **kwargs):
    request = {
        "model": kwargs["judge_model"],
        "messages": [{"role": "user", "content": f"{solution_str} = {ground_truth}?"}],
        "max_tokens": 2,
        "temperature": 0,
    }
    result = await chat_complete(reward_router_address, request, timeout_s=60)
    verdict = result.choices[0].message.content
    rule = default_compute_score(data_source, solution_str, ground_truth, extra_info)
    score = rule["score"] if isinstance(rule, dict) else float(rule)
    return {"score": score, "verdict_chars": len(verdict)}
