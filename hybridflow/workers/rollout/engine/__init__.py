"""hybridflow's embedded generation engine (the default rollout): see ``llm_engine``."""

from hybridflow.workers.rollout.engine.llm_engine import Completion, GenerationResult, LLMEngine
from hybridflow.workers.rollout.engine.model import EngineModel, ModelSpec
from hybridflow.workers.rollout.engine.sampling import SamplingParams

__all__ = ["Completion", "EngineModel", "GenerationResult", "LLMEngine", "ModelSpec", "SamplingParams"]
