"""vLLM as the rollout (``actor_rollout_ref.rollout.name=vllm``): see :mod:`.rollout`.

Importing this package registers the name; vLLM itself is imported only when an engine starts, so
hybridflow imports (and ``rollout.name=engine`` runs) without it installed.
"""

from hybridflow.workers.rollout.vllm_rollout.config import vllm_unavailable_reason
from hybridflow.workers.rollout.vllm_rollout.rollout import (
    VLLMRollout,
    VLLMRolloutError,
    vllm_config_problems,
)

__all__ = ["VLLMRollout", "VLLMRolloutError", "vllm_config_problems", "vllm_unavailable_reason"]
