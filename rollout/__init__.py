"""Tandem's rollout engine: ``LLM``, ``SamplingParams`` and the ``LLMEngine`` underneath."""

from .config import EngineConfig
from .engine import LLMEngine
from .llm import LLM
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "LLMEngine", "RequestOutput",
           "SamplingParams"]
