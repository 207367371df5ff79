"""Rotary position embedding with the rope scaling types Tandem supports.

LongRoPE (Phi-3's ``rope_type: "longrope"``) rescales each frequency by a short factor or a
long one. transformers picks per forward pass by the sequence's length (short up to
``original_max_position_embeddings``); an engine cannot: a token's rotation must not depend
on what else is in its batch (exact log-probs), chunked prefill must equal whole prefill,
and keys cached under one factor would be stale under the other once a sequence grows past
the original length. So Tandem picks once per engine, by ``max_model_len``, as vLLM does:
the long factors when it exceeds ``original_max_position_embeddings``, the short ones
otherwise. Up to that length the tables are transformers' (every sequence is short), so its
outputs match transformers'; an engine allowed longer sequences rotates every position with
the long factors (transformers' choice for a sequence longer than the original length, and
the one the model was fitted with for long contexts).
"""

from __future__ import annotations

from numbers import Number

import torch
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rope_parameters(config: PretrainedConfig) -> dict:
    """The config's rope parameters (transformers 5 keeps them in ``rope_parameters``)."""
    params = getattr(config, "rope_parameters", None) or {}
    return {"rope_type": "default", **params}


def rotary_dim(config: PretrainedConfig, head_dim: int) -> int:
    """How many leading dimensions of each head rotate: ``partial_rotary_factor`` of them
    (Phi-4-mini's 0.75), all by default."""
    factor = rope_parameters(config).get("partial_rotary_factor") or \
        getattr(config, "partial_rotary_factor", None) or 1.0
    return int(head_dim * factor)


def check_rope_type(config: PretrainedConfig, head_dim: int) -> None:
    """Raise ValueError when the config asks for a rope type Tandem does not implement, or
    gives LongRoPE no original length or factors that do not fit the rotated dimensions."""
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported rope types: "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}.")
    if rope_type == "longrope":
        _check_longrope(params, rotary_dim(config, head_dim))


def _check_longrope(params: dict, dim: int) -> None:
    original = params.get("original_max_position_embeddings")
    if not isinstance(original, int) or original <= 0:
        raise ValueError(f"rope_type 'longrope' needs original_max_position_embeddings (the "
                         f"pretraining length) as a positive integer, got {original!r}: set "
                         "it in the config (or in its rope_scaling).")
    for name in ("short_factor", "long_factor"):
        factors = params.get(name)
        if not isinstance(factors, (list, tuple)) or len(factors) != dim // 2 or \
                not all(isinstance(f, Number) and f > 0 for f in factors):
            raise ValueError(f"rope_type 'longrope' needs {name} as a list of {dim // 2} "
                             f"positive numbers (one per rotated frequency: rotary dim "
                             f"{dim} / 2), got {factors!r}: give the config's rope_scaling "
                             f"the checkpoint's {name}.")


class RotaryEmbedding:
    """cos and sin tables ``[max_position, rotary_dim]`` of every position (rotate-half
    layout; ``rotary_dim`` the head size unless the config rotates part of each head).

    They are computed once in float32, as transformers computes them; the kernels'
    ``rotary_embedding`` looks a step's positions up in them. LongRoPE's factors are the
    ones transformers uses for a sequence of ``max_position`` tokens (see the module
    docstring). Not a module: the tables are neither parameters nor model-dtype buffers, and
    stay put when the model is built on the meta device.
    """

    def __init__(self, config: PretrainedConfig, head_dim: int, max_position: int,
                 device: torch.device) -> None:
        with torch.device("cpu"):  # real tables even while the model is built on meta
            inv_freq, attention_scaling = _inv_freq(config, head_dim, max_position)
            positions = torch.arange(max_position, dtype=torch.float32)
            emb = torch.outer(positions, inv_freq).repeat(1, 2)
        self.cos = (emb.cos() * attention_scaling).to(device)
        self.sin = (emb.sin() * attention_scaling).to(device)


def _inv_freq(config: PretrainedConfig, head_dim: int, max_position: int
              ) -> tuple[torch.Tensor, float]:
    params = rope_parameters(config)
    if params["rope_type"] == "default":
        dim = rotary_dim(config, head_dim)
        exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
        return 1.0 / (params["rope_theta"] ** exponents), 1.0
    # seq_len: LongRoPE's choice of factors (the other types ignore it; dynamic is refused)
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](
        config, "cpu", seq_len=max_position)
    return inv_freq.float(), float(attention_scaling)
