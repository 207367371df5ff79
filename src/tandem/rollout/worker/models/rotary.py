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

Gemma 3 rotates each attention layer type its own way: transformers 5 keys its
``rope_parameters`` by layer type (``{"sliding_attention": {... theta 1e4},
"full_attention": {... theta 1e6, maybe linear scaling}}``). Each type's parameters are
checked and tabulated as a config of one set would be, and one ``RotaryEmbedding`` holds
every type's tables side by side (``tables(layer_type)``).
"""

from __future__ import annotations

from numbers import Number

import torch
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rope_layer_types(config: PretrainedConfig) -> list[str]:
    """The layer types the config keys its rope parameters by (Gemma 3's), in the order
    ``layer_types`` first names them; empty where one set of parameters serves every
    layer."""
    params = getattr(config, "rope_parameters", None) or {}
    layer_types = dict.fromkeys(getattr(config, "layer_types", None) or ())
    return [layer_type for layer_type in layer_types if layer_type in params]


def rope_parameters(config: PretrainedConfig, layer_type: str | None = None) -> dict:
    """The config's rope parameters (transformers 5 keeps them in ``rope_parameters``):
    ``layer_type``'s where the config keys them by layer type (``rope_layer_types``)."""
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type in rope_layer_types(config):
        params = params[layer_type] or {}
    return {"rope_type": "default", **params}


def rotary_dim(config: PretrainedConfig, head_dim: int) -> int:
    """How many leading dimensions of each head rotate: ``partial_rotary_factor`` of them
    (Phi-4-mini's 0.75), all by default."""
    factor = rope_parameters(config).get("partial_rotary_factor") or \
        getattr(config, "partial_rotary_factor", None) or 1.0
    return int(head_dim * factor)


def check_rope_type(config: PretrainedConfig, head_dim: int) -> None:
    """Raise ValueError when the config asks for a rope type Tandem does not implement, or
    gives LongRoPE no original length or factors that do not fit the rotated dimensions;
    where it keys its parameters by layer type, for each type, and when a layer's type has
    none or rotates part of each head (transformers' default rope of such a config rotates
    all of it)."""
    by_type = rope_layer_types(config)
    for layer_type in by_type or [None]:
        where = f" (rope_parameters[{layer_type!r}])" if layer_type else ""
        params = rope_parameters(config, layer_type)
        rope_type = params["rope_type"]
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_type {rope_type!r}{where} is not supported; supported rope "
                             f"types: {', '.join(SUPPORTED_ROPE_TYPES)}.")
        if rope_type == "longrope":
            _check_longrope(params, rotary_dim(config, head_dim))
        if layer_type and params.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"partial_rotary_factor{where} is not supported per layer type: "
                             "remove it (every layer type rotates whole heads).")
    if by_type:
        _check_every_type_has_rope(config)


def _check_every_type_has_rope(config: PretrainedConfig) -> None:
    params = config.rope_parameters
    for layer_type in dict.fromkeys(config.layer_types):
        if not isinstance(params.get(layer_type), dict):
            raise ValueError(f"rope_parameters keys its layer types' rotary parameters but "
                             f"gives {layer_type!r} layers none: add rope_parameters"
                             f"[{layer_type!r}] (a rope_type and its rope_theta).")


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
    layout; ``rotary_dim`` the head size unless the config rotates part of each head), one
    pair per rope layer type (``rope_layer_types``; one for the whole model where the config
    has one set of parameters), side by side in ``cos`` and ``sin``; ``tables(layer_type)``
    is one type's.

    They are computed once in float32, as transformers computes them; the kernels'
    ``rotary_embedding`` looks a step's positions up in them. LongRoPE's factors are the
    ones transformers uses for a sequence of ``max_position`` tokens (see the module
    docstring). Not a module: the tables are neither parameters nor model-dtype buffers, and
    stay put when the model is built on the meta device. One object for every layer type,
    so the runner moves all of them with the weights and the decode graphs' addresses
    (``cuda_graphs.graph_addresses``) cover them.
    """

    def __init__(self, config: PretrainedConfig, head_dim: int, max_position: int,
                 device: torch.device) -> None:
        self.layer_types: list[str | None] = rope_layer_types(config) or [None]
        with torch.device("cpu"):  # real tables even while the model is built on meta
            positions = torch.arange(max_position, dtype=torch.float32)
            tables = [_tables(config, head_dim, positions, layer_type)
                      for layer_type in self.layer_types]
        self.cos = torch.cat([cos for cos, _ in tables], dim=1).to(device)
        self.sin = torch.cat([sin for _, sin in tables], dim=1).to(device)

    def tables(self, layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos and sin tables ``[max_position, rotary_dim]`` of ``layer_type``'s layers
        (views; the whole tables where the config has one set of rope parameters)."""
        if len(self.layer_types) == 1:
            return self.cos, self.sin
        width = self.cos.shape[1] // len(self.layer_types)
        start = self.layer_types.index(layer_type) * width
        return self.cos[:, start:start + width], self.sin[:, start:start + width]


def _tables(config: PretrainedConfig, head_dim: int, positions: torch.Tensor,
            layer_type: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``layer_type``'s cos and sin tables at ``positions`` (float32)."""
    inv_freq, attention_scaling = _inv_freq(config, head_dim, len(positions), layer_type)
    emb = torch.outer(positions, inv_freq).repeat(1, 2)
    return emb.cos() * attention_scaling, emb.sin() * attention_scaling


def _inv_freq(config: PretrainedConfig, head_dim: int, max_position: int,
              layer_type: str | None) -> tuple[torch.Tensor, float]:
    params = rope_parameters(config, layer_type)
    if params["rope_type"] == "default":
        dim = rotary_dim(config, head_dim)
        exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
        return 1.0 / (params["rope_theta"] ** exponents), 1.0
    # seq_len: LongRoPE's choice of factors (the other types ignore it; dynamic is refused)
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](
        config, "cpu", seq_len=max_position, layer_type=layer_type)
    return inv_freq.float(), float(attention_scaling)
