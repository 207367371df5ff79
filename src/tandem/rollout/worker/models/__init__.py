"""Model families over the paged KV cache: the contract (``base.py``), the shared layers
(``layers.py``), the weight spec (``weight_spec.py``), the registry (``registry.py``) and
the Llama family (``llama.py``)."""

from .base import CausalLM, KVShape
from .registry import (
    build_model,
    external_models,
    model_class,
    register_model,
    supported_architectures,
)
from .weight_spec import WeightTarget

__all__ = ["CausalLM", "KVShape", "WeightTarget", "build_model", "external_models",
           "model_class", "register_model", "supported_architectures"]
