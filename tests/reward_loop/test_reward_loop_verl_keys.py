"""The reward loop as verl's own command lines set it (issue 44 items 2, 3): DAPO's overlong keys under
``reward_model.reward_kwargs``, a manager class loaded with ``importlib`` under both of verl's key sets,
``reward_model.reward_kwargs`` reaching no reward function in the loop; the classes are written for verl
and imported through the ``verl`` alias (in a subprocess, as a verl user's process would)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hybridflow.models.tiny import build_tokenizer
from hybridflow.tasks.arithmetic import task_texts
from hybridflow.trainer.config import ConfigError, load_config, validate_config
from hybridflow.trainer.config.honesty import honesty_problems
from tests.workers.reward_manager.test_reward_managers import make_batch

REPO = Path(__file__).resolve().parents[2]

# verl's DAPO recipe (recipe/dapo/run_dapo_*.sh): the overlong buffer under reward_model.reward_kwargs
DAPO = [
    "reward_model.reward_manager=dapo",
    "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=true",
    "+reward_model.reward_kwargs.overlong_buffer_cfg.len=4",
    "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
    "+reward_model.reward_kwargs.overlong_buffer_cfg.log=true",
    "+reward_model.reward_kwargs.max_resp_len=8",
    "data.max_response_length=8",
]

# A manager class written for verl's reward loop, and a batch one written for verl's load_reward_manager.
MANAGERS = '''
from verl.experimental.reward_loop.reward_manager.base import RewardManagerBase
from verl.workers.reward_manager.abstract import AbstractRewardManager
import torch


class MyRewardManager(RewardManagerBase):
    """Scores 0.25 for every sample, plus 0.5 when the function says 1 (verl's loop interface)."""

    def __init__(self, config, tokenizer, compute_score=None, reward_router_address=None,
                 reward_model_tokenizer=None):
        super().__init__(config, tokenizer, compute_score, reward_router_address, reward_model_tokenizer)

    async def run_single(self, data):
        sample = self.sample(data)
        base = self.compute_score(data_source=sample.data_source, solution_str=sample.response_str,
                                  ground_truth=sample.ground_truth, extra_info=sample.extra_info)
        return {"reward_score": 0.25 + 0.5 * float(base), "reward_extra_info": {"mine": 1}}


class MyBatchManager(AbstractRewardManager):
    """verl's legacy interface: whole batches; its reward_kwargs arrive in the constructor."""

    def __init__(self, tokenizer, num_examine, compute_score=None, reward_fn_key="data_source", bonus=0.0):
        self.bonus, self.reward_fn_key = bonus, reward_fn_key

    def __call__(self, data, return_dict=False):
        reward = torch.zeros(data.batch["responses"].shape, dtype=torch.float32)
        reward[:, 0] = 1.0 + self.bonus
        return {"reward_tensor": reward, "reward_extra_info": {}} if return_dict else reward
'''

RUNNER = r"""
import json, sys
import hybridflow.verl_compat
hybridflow.verl_compat.install()
from hybridflow.models.tiny import build_tokenizer
from hybridflow.tasks.arithmetic import task_texts
from hybridflow.trainer.config import load_config, validate_config
from hybridflow.workers.reward_loop import RewardLoop
from hybridflow.workers.reward_manager import build_reward_manager
from tests.workers.reward_manager.test_reward_managers import make_batch

tokenizer = build_tokenizer(task_texts(n=300))
batch = make_batch(tokenizer, ["3", "5"], ["3", "4"])
for overrides in json.loads(sys.argv[1]):
    config = load_config(overrides)
    validate_config(config)
    if config.reward_model.use_reward_loop:
        manager = RewardLoop(config, tokenizer)
        name = type(manager.manager).__name__
    else:
        manager = build_reward_manager(config.reward_model, config.custom_reward_function, tokenizer, 0,
            reward_fn_key=str(config.data.reward_fn_key), manager_section=config.get("reward_manager"))
        name = type(manager).__name__
    out = manager(batch, return_dict=True)
    print(json.dumps({"class": name, "scores": out["reward_tensor"].sum(-1).tolist()}))
"""


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(task_texts(n=300))


@pytest.fixture(scope="module")
def managers(tmp_path_factory):
    path = tmp_path_factory.mktemp("verl_managers") / "my_managers.py"
    path.write_text(textwrap.dedent(MANAGERS))
    return str(path)


@pytest.fixture(scope="module")
def base(tiny_model_dir, arithmetic_data):
    train, test = arithmetic_data
    return [
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        f"data.train_files={train}",
        f"data.val_files={test}",
    ]


def _loop(overrides, tokenizer):
    from hybridflow.workers.reward_loop import RewardLoop

    config = load_config(overrides)
    validate_config(config)
    return RewardLoop(config, tokenizer)


def test_dapo_reads_verls_overlong_keys_in_the_loop_and_the_batch_path(tokenizer, base):
    """An 8-token right answer at max_resp_len 8 with a 4-token buffer: 1 - 4/4 = 0.0 (verl's), where the
    loop scored 1.0 before (it read reward_model.overlong_buffer only); a 1-token answer keeps its 1.0."""
    from hybridflow.workers.reward_manager import build_reward_manager

    long_answer = "1+1+11=3"  # 8 tokens, its last number right
    batch = make_batch(tokenizer, [long_answer, "3"], ["3", "3"], t_r=8)
    assert int(batch.batch["attention_mask"][0, -8:].sum()) == 8  # the first response fills all 8
    out = _loop([*base, "reward_model.use_reward_loop=true", *DAPO], tokenizer)(batch, return_dict=True)
    assert out["reward_tensor"].sum(-1).tolist() == [0.0, 1.0]
    assert out["reward_extra_info"]["overlong_reward"] == [-1.0, 0.0]
    config = load_config(DAPO)
    batch_manager = build_reward_manager(config.reward_model, config.custom_reward_function, tokenizer, 0, 8)
    assert batch_manager(batch).sum(-1).tolist() == [0.0, 1.0]  # the batch path reads them too


def test_dapo_refuses_what_verl_asserts_and_two_sources(tokenizer):
    from hybridflow.workers.reward_loop import RewardLoop

    no_max = [o for o in DAPO if "max_resp_len" not in o]
    with pytest.raises(ValueError, match="needs reward_model.reward_kwargs.max_resp_len"):
        RewardLoop(load_config(["reward_model.use_reward_loop=true", *no_max]), tokenizer)
    both = ["reward_model.use_reward_loop=true", *DAPO, "reward_model.overlong_buffer.enable=true"]
    with pytest.raises(ValueError, match="keep one"):
        RewardLoop(load_config(both), tokenizer)


def test_reward_kwargs_reach_no_function_in_the_loop_and_other_keys_are_refused(tokenizer, tmp_path, base):
    """verl's loop managers pass the function only verl's four arguments: a function with no **kwargs runs
    under dapo's keys (before, every reward_kwargs key reached it: TypeError on every sample)."""
    scorer = tmp_path / "strict.py"
    scorer.write_text(
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(solution_str.strip() == ground_truth)\n"
    )
    custom = [f"custom_reward_function.path={scorer}", "custom_reward_function.name=score"]
    loop = _loop([*base, "reward_model.use_reward_loop=true", *DAPO, *custom], tokenizer)
    assert loop(make_batch(tokenizer, ["3", "4"], ["3", "3"]), return_dict=True)["reward_tensor"].sum(
        -1
    ).tolist() == [1.0, 0.0]
    problems = honesty_problems(
        load_config(["reward_model.use_reward_loop=true", "+reward_model.reward_kwargs.use_math_verify=true"])
    )
    (line,) = [p for p in problems if "use_math_verify" in p]
    assert "passes reward_model.reward_kwargs to no reward function" in line
    assert "custom_reward_function.reward_kwargs.<key>" in line


def test_batch_timeout_under_the_loop_is_refused(base):
    with pytest.raises(ConfigError, match="batch_timeout_s is read by the batch managers only"):
        validate_config(
            load_config([*base, "reward_model.use_reward_loop=true", "reward_model.batch_timeout_s=60"])
        )


def _through_alias(*runs: list[str]) -> list[dict]:
    """Each override list's manager built and called in one process with the verl alias installed."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-c", RUNNER, json.dumps(runs)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads(line) for line in run.stdout.strip().splitlines()[-len(runs) :]]


def test_an_importlib_manager_written_for_verl_under_both_key_sets(managers, base):
    """verl's reward-loop keys (reward_loop_source/module_path/class_name), verl's load_reward_manager keys
    with the loop (reward_manager.source=importlib, the class in reward_manager.name: it failed before,
    looked up by module.name), and the same keys without the loop for a batch class, whose
    reward_model.reward_kwargs reach its constructor (verl's)."""
    loop_keys = [
        *base,
        "reward_model.use_reward_loop=true",
        "reward_model.reward_loop_source=importlib",
        f"reward_model.reward_loop_module_path={managers}",
        "reward_model.reward_loop_class_name=MyRewardManager",
    ]
    legacy_keys = [
        *base,
        "reward_manager.source=importlib",
        f"reward_manager.module.path={managers}",
    ]
    expected = [0.75, 0.25]  # "3" right (1), "5" wrong (0): 0.25 + 0.5 x score
    with_loop = ["reward_model.use_reward_loop=true", *legacy_keys, "reward_manager.name=MyRewardManager"]
    batch = [*legacy_keys, "reward_manager.name=MyBatchManager", "+reward_model.reward_kwargs.bonus=0.5"]
    assert _through_alias(loop_keys, with_loop, batch) == [
        {"class": "MyRewardManager", "scores": expected},
        {"class": "MyRewardManager", "scores": expected},
        {"class": "MyBatchManager", "scores": [1.5, 1.5]},
    ]


def test_importlib_mistakes_name_the_key(managers, base, tmp_path):
    with pytest.raises(ConfigError, match="needs reward_model.reward_loop_class_name"):
        validate_config(
            load_config(
                [
                    *base,
                    "reward_model.use_reward_loop=true",
                    "reward_model.reward_loop_source=importlib",
                    f"reward_model.reward_loop_module_path={managers}",
                ]
            )
        )
    with pytest.raises(ConfigError, match="reward_loop_source=importlib is read by the reward loop"):
        validate_config(load_config([*base, "reward_model.reward_loop_source=importlib"]))
    from hybridflow.workers.reward_manager.custom import load_class_from_file

    plain = tmp_path / "plain.py"
    plain.write_text("class Mine:\n    pass\n")
    with pytest.raises(AttributeError, match=r"reward_manager.name: .* has no class 'Nope' \(classes there"):
        load_class_from_file(str(plain), "Nope", "reward_manager.name")
