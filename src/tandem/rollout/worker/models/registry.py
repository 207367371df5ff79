"""Model families by Hugging Face architecture name (``config.architectures``).

The families Tandem ships are registered here; one defined elsewhere registers with
``register_model`` (as ``vllm.ModelRegistry.register_model``), by class or by
``"module:Class"`` (imported when first built). A tensor-parallel engine's worker processes
import what was registered from outside (``external_models``), so a family registered in
the driver's process runs on every rank.
"""

from __future__ import annotations

import importlib

import torch
from transformers import PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from tandem.kernels import KernelOps

from ...parallel.tensor_parallel import TensorParallel
from .base import CausalLM

_PACKAGE = "tandem.rollout.worker.models"
_MODELS: dict[str, type[CausalLM] | str] = {
    **{name: f"{_PACKAGE}.llama:{name}" for name in
       ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")},
    **{name: f"{_PACKAGE}.mixtures:{name}" for name in
       ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM")},
    **{name: f"{_PACKAGE}.gemma3:{name}" for name in
       ("Gemma3ForCausalLM", "Gemma2ForCausalLM")},
    "Phi3ForCausalLM": f"{_PACKAGE}.phi3:Phi3ForCausalLM",
    "GptOssForCausalLM": f"{_PACKAGE}.gpt_oss:GptOssForCausalLM"}
_EXTERNAL: dict[str, str] = {}


def register_model(architecture: str, model: type[CausalLM] | str) -> None:
    """Serve ``architecture`` with ``model``: a ``CausalLM`` subclass, or ``"module:Class"``
    naming one (replacing any family registered under that name).

    Raises:
        TypeError: for a class that is not a ``CausalLM``.
    """
    if not isinstance(model, str) and not (isinstance(model, type)
                                           and issubclass(model, CausalLM)):
        raise TypeError(f"register_model({architecture!r}, ...) takes a CausalLM subclass "
                        f"or 'module:Class', not {model!r}.")
    _MODELS[architecture] = model
    _EXTERNAL[architecture] = model if isinstance(model, str) \
        else f"{model.__module__}:{model.__qualname__}"


def external_models() -> dict[str, str]:
    """The families registered with ``register_model``, as ``"module:Class"`` by name."""
    return dict(_EXTERNAL)


def supported_architectures() -> list[str]:
    """Every registered architecture name."""
    return list(_MODELS)


def model_class(config: PretrainedConfig) -> type[CausalLM]:
    """The family of the config's architecture (``config.architectures``, or for a config
    built in code without them transformers' causal LM of its ``model_type``), its config
    checked (``check_config``).

    Raises:
        ValueError: naming the architecture and the supported ones, or what the family
            refuses in the config.
    """
    names = list(getattr(config, "architectures", None) or [])
    if not names and config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        names = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]  # a config built in code
    for name in names:
        if name in _MODELS:
            model = _MODELS[name]
            if isinstance(model, str):
                module, _, qualname = model.partition(":")
                model = _MODELS[name] = getattr(importlib.import_module(module), qualname)
            model.check_config(config)
            return model
    raise ValueError(f"unsupported architecture {names or config.model_type!r}; Tandem supports: "
                     f"{', '.join(_MODELS)} (register another with register_model).")


def build_model(config: PretrainedConfig, dtype: torch.dtype, device: torch.device,
                max_position: int, ops: KernelOps,
                tp: TensorParallel | None = None) -> CausalLM:
    """An uninitialised model of the config's architecture, on ``device`` in ``dtype`` (this
    rank's slice of it under tensor parallelism ``tp``).

    Every kernel of its forward pass runs through ``ops``. Its linear layers multiply by
    their weights as stored until ``pack_linear_weights`` (see ``ModelRunner``).
    """
    family = model_class(config)
    with torch.device("meta"):
        model = family(config, max_position, device, ops, tp or TensorParallel())
    model = model.to_empty(device=device).to(dtype)
    model.tie_weights()
    return model
