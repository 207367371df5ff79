"""Model registry: Hugging Face architecture names to Tandem implementations."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from tandem.kernels import KernelOps

from ...parallel.tensor_parallel import TensorParallel
from .llama import ArchitectureSpec, LlamaForCausalLM
from .rotary import check_rope_type

ARCHITECTURES: dict[str, ArchitectureSpec] = {
    "LlamaForCausalLM": ArchitectureSpec(bias_from_config=True),
    "MistralForCausalLM": ArchitectureSpec(),
    "Qwen2ForCausalLM": ArchitectureSpec(qkv_bias=True),
    "Qwen3ForCausalLM": ArchitectureSpec(qk_norm=True, bias_from_config=True),
}


def architecture_of(config: PretrainedConfig) -> str:
    """The config's architecture name, checked against the supported ones.

    Raises:
        ValueError: naming the architecture and listing the supported ones.
    """
    names = list(getattr(config, "architectures", None) or [])
    for name in names:
        if name in ARCHITECTURES:
            check_rope_type(config)
            return name
    raise ValueError(f"unsupported architecture {names or config.model_type!r}; Tandem supports: "
                     f"{', '.join(ARCHITECTURES)}.")


def build_model(config: PretrainedConfig, dtype: torch.dtype, device: torch.device,
                max_position: int, ops: KernelOps,
                tp: TensorParallel | None = None) -> LlamaForCausalLM:
    """An uninitialised model of the config's architecture, on ``device`` in ``dtype`` (this
    rank's slice of it under tensor parallelism ``tp``).

    Every kernel of its forward pass runs through ``ops``. Its linear layers multiply by
    their weights as stored until ``pack_linear_weights`` (see ``ModelRunner``).
    """
    spec = ARCHITECTURES[architecture_of(config)]
    with torch.device("meta"):
        model = LlamaForCausalLM(config, spec, max_position, device, ops,
                                 tp or TensorParallel())
    model = model.to_empty(device=device).to(dtype)
    model.tie_weights()
    return model
