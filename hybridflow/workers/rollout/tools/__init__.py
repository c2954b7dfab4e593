"""Tools the model can call during a multi-turn rollout (see ``base_tool``)."""

from hybridflow.workers.rollout.tools.base_tool import BaseTool, ToolSchema

__all__ = ["BaseTool", "ToolSchema"]
