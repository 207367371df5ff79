"""Rotary position embedding with the rope scaling types Tandem supports."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_parameters(config: PretrainedConfig) -> dict:
    """The config's rope parameters (transformers 5 keeps them in ``rope_parameters``)."""
    params = getattr(config, "rope_parameters", None) or {}
    return {"rope_type": "default", **params}


def check_rope_type(config: PretrainedConfig) -> None:
    """Raise ValueError when the config asks for a rope type Tandem does not implement."""
    rope_type = rope_parameters(config)["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported rope types: "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}.")


class RotaryEmbedding:
    """cos and sin tables ``[max_position, head_dim]`` of every position (rotate-half layout).

    They are computed once in float32, as transformers computes them; the kernels'
    ``rotary_embedding`` looks a step's positions up in them. Not a module: the tables are
    neither parameters nor model-dtype buffers, and stay put when the model is built on the
    meta device.
    """

    def __init__(self, config: PretrainedConfig, head_dim: int, max_position: int,
                 device: torch.device) -> None:
        with torch.device("cpu"):  # real tables even while the model is built on meta
            inv_freq, attention_scaling = _inv_freq(config, head_dim)
            positions = torch.arange(max_position, dtype=torch.float32)
            emb = torch.outer(positions, inv_freq).repeat(1, 2)
        self.cos = (emb.cos() * attention_scaling).to(device)
        self.sin = (emb.sin() * attention_scaling).to(device)


def _inv_freq(config: PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    params = rope_parameters(config)
    if params["rope_type"] == "default":
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
        return 1.0 / (params["rope_theta"] ** exponents), 1.0
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu")
    return inv_freq.float(), float(attention_scaling)
