"""Tandem's rollout engine: ``LLM``, ``SamplingParams`` and the ``LLMEngine`` underneath."""

from tandem.sync import WeightUpdateError

from .config import EngineConfig
from .engine import LLMEngine
from .errors import EngineAsleepError
from .held import Continuation
from .llm import LLM
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams
from .structured_outputs import StructuredOutputsParams

__all__ = ["LLM", "CompletionOutput", "Continuation", "EngineAsleepError", "EngineConfig",
           "LLMEngine", "RequestOutput", "SamplingParams", "StructuredOutputsParams",
           "WeightUpdateError"]
