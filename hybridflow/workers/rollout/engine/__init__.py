"""hybridflow's embedded generation engine (the default rollout): see ``llm_engine``."""

from hybridflow.workers.rollout.engine.llm_engine import LLMEngine
from hybridflow.workers.rollout.engine.model import EngineModel, ModelSpec
from hybridflow.workers.rollout.engine.requests import Completion, EngineRequestError, GenerationResult
from hybridflow.workers.rollout.engine.sampling import SamplingParams

__all__ = [
    "Completion",
    "EngineModel",
    "EngineRequestError",
    "GenerationResult",
    "LLMEngine",
    "ModelSpec",
    "SamplingParams",
]
