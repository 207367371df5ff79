"""Per-token layer operations in Triton, with the signatures of ``layers.py``.

Each kernel converts what it loads to float32 and rounds to the model dtype where the
reference does, so the two backends agree to the last bit on most elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ELEMENTWISE_BLOCK = 1024


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``layers.rms_norm`` (same arguments, results and rounding) as one Triton program per
    row."""
    return _rms_norm(x, weight, eps, residual, unit_offset=False)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None
                   ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``layers.gemma_rms_norm`` (scaled by ``1 + weight`` in float32), as ``rms_norm``."""
    return _rms_norm(x, weight, eps, residual, unit_offset=True)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
              residual: torch.Tensor | None, unit_offset: bool
              ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    x = x.contiguous()
    out = torch.empty_like(x)
    summed = out if residual is None else torch.empty_like(x)
    num_rows = x.numel() // x.shape[-1]
    if num_rows:
        _rms_norm_kernel[(num_rows,)](
            x, x if residual is None else residual.contiguous(), weight, out, summed,
            x.shape[-1], eps, HAS_RESIDUAL=residual is not None, UNIT_OFFSET=unit_offset,
            BLOCK=triton.next_power_of_2(x.shape[-1]))
    return out if residual is None else (out, summed)


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_cache: torch.Tensor, sin_cache: torch.Tensor) -> None:
    """Rotate ``query`` and ``key`` ``[tokens, heads, head_dim]`` in place (rotate-half layout).

    ``cos_cache`` and ``sin_cache`` are ``[max_position, head_dim]`` tables (float32); row
    ``positions[t]`` rotates token t.
    """
    num_tokens, num_heads, head_dim = query.shape
    if num_tokens == 0:
        return
    num_kv_heads = key.shape[1]
    _rotary_kernel[(num_tokens,)](
        positions, query, key, cos_cache, sin_cache, query.stride(0), query.stride(1),
        key.stride(0), key.stride(1), cos_cache.stride(0), num_heads, num_kv_heads,
        head_dim // 2, BLOCK_H=triton.next_power_of_2(max(num_heads, num_kv_heads)),
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2))


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, the gated activation of a Llama MLP."""
    return _gated_activation(gate, up, _silu_and_mul_kernel)


def gelu_tanh_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up``, the gated activation of a Gemma MLP (``layers.py``'s)."""
    return _gated_activation(gate, up, _gelu_tanh_and_mul_kernel)


def _gated_activation(gate: torch.Tensor, up: torch.Tensor, kernel: triton.JITFunction
                      ) -> torch.Tensor:
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    numel = gate.numel()
    if numel:
        kernel[(triton.cdiv(numel, ELEMENTWISE_BLOCK),)](gate, up, out, numel,
                                                         BLOCK=ELEMENTWISE_BLOCK)
    return out


@triton.jit
def _rms_norm_kernel(x, residual, weight, out, summed, hidden, eps, HAS_RESIDUAL: tl.constexpr,
                     UNIT_OFFSET: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * hidden + tl.arange(0, BLOCK)
    mask = tl.arange(0, BLOCK) < hidden
    values = tl.load(x + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        values += tl.load(residual + offsets, mask=mask, other=0.0).to(tl.float32)
        values = values.to(summed.dtype.element_ty)
        tl.store(summed + offsets, values, mask=mask)
        values = values.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(values * values, 0) / hidden + eps)
    scale = tl.load(weight + tl.arange(0, BLOCK), mask=mask, other=0.0).to(tl.float32)
    if UNIT_OFFSET:  # Gemma's: scaled by 1 + weight in float32, rounded once
        tl.store(out + offsets, values * inv_rms * (1.0 + scale), mask=mask)
    else:
        normed = (values * inv_rms).to(out.dtype.element_ty).to(tl.float32)
        tl.store(out + offsets, normed * scale, mask=mask)


@triton.jit
def _rotate_heads(x, stride_h, num_heads, cos, sin, half, BLOCK_H: tl.constexpr,
                  BLOCK_HALF: tl.constexpr):
    """Rotate ``num_heads`` heads of one token at ``x`` by ``cos``/``sin`` ``[BLOCK_HALF]``."""
    h = tl.arange(0, BLOCK_H)[:, None]
    i = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < num_heads) & (i < half)
    first = x + h * stride_h + i
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + half, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, x1 * cos[None, :] - x2 * sin[None, :], mask=mask)
    tl.store(first + half, x2 * cos[None, :] + x1 * sin[None, :], mask=mask)


@triton.jit
def _rotary_kernel(positions, query, key, cos_cache, sin_cache, stride_qt, stride_qh,
                   stride_kt, stride_kh, stride_cos, num_heads, num_kv_heads, half,
                   BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    token = tl.program_id(0)
    position = tl.load(positions + token)
    i = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cos_cache + position * stride_cos + i, mask=i < half, other=0.0)
    sin = tl.load(sin_cache + position * stride_cos + i, mask=i < half, other=0.0)
    _rotate_heads(query + token * stride_qt, stride_qh, num_heads, cos, sin, half, BLOCK_H,
                  BLOCK_HALF)
    _rotate_heads(key + token * stride_kt, stride_kh, num_kv_heads, cos, sin, half, BLOCK_H,
                  BLOCK_HALF)


@triton.jit
def _silu_and_mul_kernel(gate, up, out, numel, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    g = tl.load(gate + offsets, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up + offsets, mask=mask, other=0.0).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(out.dtype.element_ty).to(tl.float32)
    tl.store(out + offsets, silu * u, mask=mask)


@triton.jit
def _gelu_tanh_and_mul_kernel(gate, up, out, numel, BLOCK: tl.constexpr):
    # 0.5 g (1 + tanh(inner)) as g sigmoid(2 inner), as cpu_layers.c computes it (e <= 1)
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    g = tl.load(gate + offsets, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up + offsets, mask=mask, other=0.0).to(tl.float32)
    inner = 0.7978845608028654 * (g + 0.044715 * (g * g * g))
    e = tl.exp(-2.0 * tl.abs(inner))
    gelu = g * tl.where(inner >= 0, 1.0, e) / (1.0 + e)
    gelu = gelu.to(out.dtype.element_ty).to(tl.float32)
    tl.store(out + offsets, gelu * u, mask=mask)
