"""Tandem's rollout engine: ``LLM``, ``SamplingParams`` and the ``LLMEngine`` underneath."""

from tandem.sync import WeightUpdateError

from .config import EngineConfig
from .core.held import Continuation
from .engine import LLMEngine
from .errors import EngineAsleepError
from .llm import LLM
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams
from .structured_outputs import StructuredOutputsParams
from .worker.models import CausalLM, register_model

__all__ = ["LLM", "CausalLM", "CompletionOutput", "Continuation", "EngineAsleepError",
           "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams",
           "StructuredOutputsParams", "WeightUpdateError", "register_model"]
