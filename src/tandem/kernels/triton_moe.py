"""A mixture of experts' layer in Triton: tokens grouped by expert, one grouped matmul per
projection for every expert at once.

``fused_moe`` lays the token-expert pairs out by expert on the device, each expert's pairs
padded to whole ``BLOCK_M`` blocks (no host sync, so a decode step is captured in a CUDA
graph: the counts are a scatter-add into ``[num_experts]`` and the layout's size is a bound
known from the token count, ``max_pairs``), then runs ``_grouped_kernel`` twice: gate/up over the
tokens' hidden states, and down over the pairs' activations. Each program multiplies one
block of one expert's rows by one tile of that expert's weight, summing over K in fixed
``BLOCK_K`` chunks in order (``triton_linear.tile_matmul``, with its fixed tiles), so a
token's outputs keep their bits whatever batch it is in. Each token then adds its experts'
outputs, weighted, in ascending expert order. Expert biases (GPT-OSS's) are added on the
device after each matmul, as transformers adds them (after the matmul's rounding), each
layout row taking its block's expert's; the activation is the caller's, of the gate and up
outputs (halves, or GPT-OSS's interleaved even and odd outputs).

Under Triton's interpreter (CPU), the operands are converted to float32 after loading.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from .layers import expert_counts
from .triton_linear import TILES, tile_matmul


def max_pairs(num_tokens: int, top_k: int, num_experts: int, block_m: int) -> int:
    """Rows of the padded layout: every pair, and up to ``block_m - 1`` padding rows per
    expert, rounded up to whole blocks."""
    return triton.cdiv(num_tokens * top_k + num_experts * (block_m - 1), block_m) * block_m


def group_by_expert(experts: torch.Tensor, num_experts: int, block_m: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The padded layout of ``experts`` ``[tokens, k]``: per layout row the token it reads
    (-1: padding), per block its expert (-1: past the last), and per pair (``t * k + j``)
    its layout row."""
    num_tokens, top_k = experts.shape
    device, size = experts.device, max_pairs(num_tokens, top_k, num_experts, block_m)
    flat = experts.flatten()
    order = flat.argsort(stable=True)
    counts = expert_counts(flat, num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    starts = ends - padded
    first_sorted = counts.cumsum(0) - counts  # each expert's first index in ``order``
    sorted_experts = flat[order]
    rank = torch.arange(flat.numel(), device=device) - first_sorted[sorted_experts]
    row_of_pair = torch.empty_like(flat)
    row_of_pair[order] = starts[sorted_experts] + rank
    token_of_row = torch.full((size,), -1, dtype=torch.long, device=device)
    token_of_row[row_of_pair] = torch.arange(flat.numel(), device=device) // top_k
    block_starts = torch.arange(0, size, block_m, device=device)
    block_expert = torch.searchsorted(ends, block_starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return token_of_row, block_expert, row_of_pair


def grouped_linear(x: torch.Tensor, token_of_row: torch.Tensor, block_expert: torch.Tensor,
                   weight: torch.Tensor) -> torch.Tensor:
    """``out[r] = x[token_of_row[r]] W_e^T`` for every layout row ``r`` of a block of
    expert ``e`` (zeros where ``token_of_row`` is -1); ``weight`` ``[E, out, in]``."""
    num_rows = token_of_row.shape[0]
    _, out_features, in_features = weight.shape
    out = torch.empty(num_rows, out_features, dtype=x.dtype, device=x.device)
    block_m, block_n, block_k, warps = TILES[x.dtype]
    grid = (num_rows // block_m, triton.cdiv(out_features, block_n))
    _grouped_kernel[grid](
        x, token_of_row, block_expert, weight, out, out_features, in_features, x.stride(0),
        weight.stride(0), weight.stride(1), weight.stride(2), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        UPCAST=os.environ.get("TRITON_INTERPRET") == "1", num_warps=warps)
    return out


def fused_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
              experts: torch.Tensor, weights: torch.Tensor,
              activation: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
              gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
              interleaved: bool = False) -> torch.Tensor:
    """Every token's experts' weighted sum: ``sum_j w_j down_e(act(gate_e x, up_e x))`` for
    ``x`` ``[tokens, hidden]``, stacked ``gate_up`` ``[E, 2I, H]`` (gate rows first, or with
    ``interleaved`` gate and up alternating) and ``down`` ``[E, H, I]`` (any strides: a
    transposed view reads as stored), ``experts``/``weights`` ``[tokens, k]``, ``activation``
    the ``silu_and_mul`` of a Llama MLP or another of the same signature; with their biases
    ``[E, 2I]`` and ``[E, H]`` added after each matmul."""
    num_tokens, top_k = experts.shape
    block_m = TILES[x.dtype][0]
    token_of_row, block_expert, row_of_pair = group_by_expert(experts, gate_up.shape[0],
                                                              block_m)
    gate_up_out = grouped_linear(x.contiguous(), token_of_row, block_expert, gate_up)
    if gate_up_bias is not None:  # padding rows (past the last expert: -1) take any bias
        gate_up_out += gate_up_bias[block_expert.clamp(min=0).repeat_interleave(block_m)]
    gate, up = (gate_up_out[:, ::2], gate_up_out[:, 1::2]) if interleaved \
        else gate_up_out.chunk(2, -1)
    hidden = activation(gate.contiguous(), up.contiguous())
    rows = torch.where(token_of_row >= 0, torch.arange(token_of_row.shape[0],
                                                       device=x.device), -1)
    outputs = grouped_linear(hidden, rows, block_expert, down)[row_of_pair]
    if down_bias is not None:
        outputs += down_bias[experts.flatten()]
    outputs = outputs.view(num_tokens, top_k, -1) * weights.to(x.dtype).unsqueeze(-1)
    ordered = experts.argsort(dim=-1)  # each token adds its experts in ascending order
    total = torch.zeros_like(x)
    for j in range(top_k):
        total += outputs.gather(1, ordered[:, j, None, None].expand(-1, 1, x.shape[1]))[:, 0]
    return total


@triton.jit
def _grouped_kernel(x, token_of_row, block_expert, weight, out, out_features, in_features,
                    stride_xm, stride_we, stride_wn, stride_wk, stride_om,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    UPCAST: tl.constexpr):
    block = tl.program_id(0)
    expert = tl.load(block_expert + block)
    rm = block * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < out_features
    if expert < 0:  # past the last expert's rows: zeros, never read
        tl.store(out + rm[:, None].to(tl.int64) * stride_om + rn[None, :],
                 tl.zeros([BLOCK_M, BLOCK_N], dtype=out.dtype.element_ty),
                 mask=n_mask[None, :])
        return
    tokens = tl.load(token_of_row + rm)
    acc = tile_matmul(x, tokens, tokens >= 0, weight + expert.to(tl.int64) * stride_we, rn,
                      n_mask, in_features, stride_xm, stride_wn, stride_wk, BLOCK_M, BLOCK_N,
                      BLOCK_K, UPCAST)
    tl.store(out + rm[:, None].to(tl.int64) * stride_om + rn[None, :],
             acc.to(out.dtype.element_ty), mask=n_mask[None, :])
