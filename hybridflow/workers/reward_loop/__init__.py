"""The reward loop (verl's ``verl.experimental.reward_loop``): samples scored one by one as they finish.

- :mod:`.base`: the manager contract (``async run_single(data_of_one_row)``), sync/async reward functions;
- managers, by name (:mod:`.registry`): ``naive``, ``dapo``, ``rate_limited``/``limited`` (token buckets
  and a semaphore, :mod:`.token_bucket`), ``remote`` (sync scorers in Ray worker processes);
- :mod:`.loop`: :class:`RewardLoop`, what the trainer and the agent loops call; its metrics.

``reward_model.use_reward_loop=true`` turns it on (docs/algorithms.md#rewards).
"""

from hybridflow.workers.reward_loop import dapo, limited, naive, remote  # noqa: F401  (registration)
from hybridflow.workers.reward_loop.base import RewardManagerBase, decode_one, is_async_function
from hybridflow.workers.reward_loop.dapo import DAPORewardManager
from hybridflow.workers.reward_loop.limited import RateLimitedRewardManager
from hybridflow.workers.reward_loop.loop import RewardLoop, manager_class
from hybridflow.workers.reward_loop.naive import NaiveRewardManager
from hybridflow.workers.reward_loop.registry import REWARD_LOOP_MANAGERS, get_reward_manager_cls, register
from hybridflow.workers.reward_loop.remote import RemoteRewardManager
from hybridflow.workers.reward_loop.token_bucket import AsyncTokenBucket

__all__ = [
    "REWARD_LOOP_MANAGERS",
    "AsyncTokenBucket",
    "DAPORewardManager",
    "NaiveRewardManager",
    "RateLimitedRewardManager",
    "RemoteRewardManager",
    "RewardLoop",
    "RewardManagerBase",
    "decode_one",
    "get_reward_manager_cls",
    "is_async_function",
    "manager_class",
    "register",
]
