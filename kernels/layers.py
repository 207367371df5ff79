"""Per-token layer operations: the plain-torch references.

RMSNorm (with the residual add fused in), rotary embedding applied in place, and the
SiLU-gated product of the MLP. Each rounds to the model dtype where transformers does, so
the CPU path matches transformers; the Triton versions (``triton_layers.py``) share these
signatures.
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


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_cache: torch.Tensor, sin_cache: torch.Tensor) -> None:
    """Rotate ``query`` and ``key`` ``[tokens, heads, head_dim]`` in place (rotate-half layout).

    ``cos_cache`` and ``sin_cache`` are ``[max_position, head_dim]`` tables (float32); row
    ``positions[t]`` rotates token t.
    """
    cos = cos_cache[positions].to(query.dtype).unsqueeze(1)
    sin = sin_cache[positions].to(query.dtype).unsqueeze(1)
    for x in (query, key):
        x.copy_(x * cos + _rotate_half(x) * sin)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, the gated activation of a Llama MLP."""
    return F.silu(gate) * up
