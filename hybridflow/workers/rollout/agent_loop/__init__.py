"""Agent loops on generation servers (``actor_rollout_ref.rollout.mode=async``), with verl's interface.

- :mod:`.base` — ``AgentLoopBase``, ``AgentLoopOutput``, ``AgentLoopMetrics``, ``register``;
- :mod:`.single_turn`, :mod:`.tool_agent` — the built-in ``single_turn_agent`` and ``tool_agent``;
- :mod:`.server_manager` — ``AsyncLLMServerManager`` (sticky, least in flight);
- :mod:`.worker` — ``AgentLoopWorker`` (a chunk of the batch, rewards in the loop);
- :mod:`.manager` — ``AgentLoopManager`` (servers + workers behind ``generate_sequences``).

The servers themselves are :mod:`hybridflow.workers.rollout.replica`.
"""

from hybridflow.workers.rollout.agent_loop.base import (
    AgentLoopBase,
    AgentLoopMetrics,
    AgentLoopOutput,
    DictConfigWrap,
    register,
    registered_agent_loops,
)
from hybridflow.workers.rollout.agent_loop.server_manager import AsyncLLMServerManager
from hybridflow.workers.rollout.agent_loop.single_turn import SingleTurnAgentLoop
from hybridflow.workers.rollout.agent_loop.tool_agent import ToolAgentLoop
from hybridflow.workers.rollout.replica import TokenOutput

__all__ = [
    "AgentLoopBase",
    "AgentLoopMetrics",
    "AgentLoopOutput",
    "AsyncLLMServerManager",
    "DictConfigWrap",
    "SingleTurnAgentLoop",
    "TokenOutput",
    "ToolAgentLoop",
    "register",
    "registered_agent_loops",
]
