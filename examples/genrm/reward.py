"""The GenRM reward function of ``examples/genrm``: on training samples the served judge alone decides.

``custom_reward_function.path=examples/genrm/reward.py`` (name ``compute_score``) with
``reward_model.use_reward_loop=true``: the reward loop calls it once per finished sample with verl's
signature and ``reward_router_address`` (the judge main_ppo serves, behind its router). main_ppo scores
validation with the same function (as verl does), so the held-out rows (``extra_info["split"] ==
"test"``) are scored by the task's exact-answer rule: the validation curve is true correctness, the
training reward is the judge's.
"""

from hybridflow.tasks.arithmetic_judge import judge_question, parse_verdict
from hybridflow.utils.reward_score import default_compute_score
from hybridflow.utils.served_client import chat_complete


async def compute_score(data_source, solution_str, ground_truth, extra_info, **kwargs):
    """A training sample: 1.0 when the judge's reply ends in ``correct``, else 0.0.

    It never reads ``ground_truth`` on a training sample: the judge alone decides. The judge sees the
    problem (rebuilt from ``extra_info``'s ``a``, ``op``, ``b``, as the task's rows carry them) and the
    policy's answer as written (its first 12 characters), and replies with the sum it works out and its
    verdict (:mod:`hybridflow.tasks.arithmetic_judge`). ``kwargs``: ``reward_router_address``
    (``host:port``) and ``judge_model`` (the served name,
    ``custom_reward_function.reward_kwargs.judge_model``).

    A held-out sample (``extra_info["split"] == "test"``, validation only, never trained on): the rule's
    score, the measurement of the recipe (module docstring).
    """
    if extra_info.get("split") == "test":  # validation: measured by the rule, never a training reward
        rule = default_compute_score(data_source, solution_str, ground_truth, extra_info)
        return float(rule["score"] if isinstance(rule, dict) else rule)
    del ground_truth  # the judge alone decides
    question = judge_question(extra_info["a"], extra_info["op"], extra_info["b"], solution_str.strip()[:12])
    request = {
        "model": kwargs.get("judge_model", "judge"),
        "messages": [{"role": "user", "content": question}],
        "max_tokens": 8,
        "temperature": 0,
    }
    result = await chat_complete(kwargs["reward_router_address"], request, timeout_s=60, max_retries=2)
    return parse_verdict(result.choices[0].message.content or "")
