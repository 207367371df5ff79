"""Per-token layer operations: the plain-torch references.

RMSNorm (with the residual add fused in; Llama's, and Gemma's that scales by ``1 +
weight``), rotary embedding applied in place, the SiLU- and GELU-gated products of the MLP,
and a mixture of experts' count of tokens per expert.
Each rounds to the model dtype where transformers does, so the CPU path matches
transformers; the Triton versions (``triton_layers.py``) share these signatures.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Normalise ``x`` over its last dimension (in float32) and scale by ``weight``.

    With ``residual``, first adds it to ``x`` (in the model dtype) and returns
    ``(normalised sum, sum)``, the sum being the next layer's residual; else returns the
    normalised ``x``.
    """
    if residual is not None:
        x = x + residual
    x32 = x.float()
    normed = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return normed if residual is None else (normed, x)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None
                   ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Gemma's RMSNorm (transformers' ``Gemma3RMSNorm``, Gemma 2's too): ``x`` normalised and
    scaled by ``1 + weight`` (its weights are centred on zero), both in float32, rounded to
    the model dtype once at the end, where Llama's ``rms_norm`` rounds before it scales.
    ``residual`` as ``rms_norm``'s."""
    if residual is not None:
        x = x + residual
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    normed = (normed * (1.0 + weight.float())).to(x.dtype)
    return normed if residual is None else (normed, x)


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_cache: torch.Tensor, sin_cache: torch.Tensor) -> None:
    """Rotate ``query`` and ``key`` ``[tokens, heads, head_dim]`` in place (rotate-half layout).

    ``cos_cache`` and ``sin_cache`` are ``[max_position, head_dim]`` tables (float32) whose
    two halves are equal, as rotate-half tables are; row ``positions[t]`` rotates token t.
    Each half is rotated in place (``x1 cos - x2 sin``, ``x2 cos + x1 sin``): the same
    products and sums as transformers' ``x cos + rotate_half(x) sin``, so the same bits, with
    two temporaries instead of five and a concatenation.
    """
    half = query.shape[-1] // 2
    cos = cos_cache[positions, :half].to(query.dtype).unsqueeze(1)
    sin = sin_cache[positions, :half].to(query.dtype).unsqueeze(1)
    for x in (query, key):
        first, second = x[..., :half], x[..., half:]
        rotated = first * sin
        first.mul_(cos).sub_(second * sin)
        second.mul_(cos).add_(rotated)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, the gated activation of a Llama MLP."""
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` (GELU's tanh approximation, transformers'
    ``gelu_pytorch_tanh``), the gated activation of a Gemma MLP: the activation rounded to
    the model dtype, then the product."""
    return F.gelu(gate, approximate="tanh") * up


def expert_counts(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many of ``experts`` (a flat tensor of expert indices) name each expert,
    ``[num_experts]`` int64: a scatter-add into a fixed size, where ``bincount`` would read
    the largest index back to the host (a sync, and an error inside graph capture)."""
    counts = torch.zeros(num_experts, dtype=torch.long, device=experts.device)
    return counts.scatter_add_(0, experts, torch.ones_like(experts))
