"""A batch-invariant linear layer in Triton: ``x W^T + b`` whose rows have the same bits
whatever the row count (exact log-probs on CUDA, ``EngineConfig.exact_logprobs``).

cuBLAS picks its kernel (tile shape, split-K) by the problem's shape, so a row's last bits
change with the batch it is multiplied in. Here the tiles are fixed per dtype and K is
never split: every output element sums its products over K in ``BLOCK_K`` chunks, in order,
each chunk by the same ``tl.dot`` instruction, into a float32 accumulator, whatever M is.
The row count is a run-time argument Triton does not specialise on (a specialisation for
M == 1 or M % 16 == 0 would compile other code). The weight is read as it is stored
(``[out, in]``, any strides): no copy, so an aliased or updated weight is always current.

8-bit weights (``quantization.py``: int8 or fp8 e4m3 codes, a float32 scale per output
channel) are read as stored, a quarter or half of the bytes, and converted in registers to
the activations' dtype (exactly: 8-bit codes fit bfloat16's and float16's mantissas) before
the same ``tl.dot``; each output is multiplied by its channel's scale after the sum. This is
weight-only quantization, for the whole engine on CUDA (not only exact log-probs), rather
than vLLM's W8A8 (activations quantized per row, an fp8 ``tl.dot``): the matmul keeps the
activations' precision, so the sampler's log-probs move only by the weights' rounding, the
trainer's exact forward reproduces it with the same definition as the CPU panels, and a
decode step of RL's batch sizes is bound by reading the weights, which is what it halves.
fp8 codes need a GPU that converts them (compute capability 8.9+, ``check_quantized``);
int8 ones compile for sm_80 too.

Under Triton's interpreter (CPU), the operands are converted to float32 after loading, as in
the attention kernels.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps) per operand dtype: 16-bit operands feed the tensor
# cores; float32 ones multiply on the FMA units at full precision (no TF32), in tiles small
# enough to stay in registers.
TILES = {torch.float32: (32, 32, 32, 4), torch.bfloat16: (64, 32, 64, 4),
         torch.float16: (64, 32, 64, 4)}


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T + b`` for ``x`` ``[..., in]``, ``weight`` ``[out, in]``, ``bias`` ``[out]``
    (all one dtype, or ``weight`` 8-bit codes with their float32 ``weight_scale`` ``[out]``:
    W = weight_scale · codes), batch-invariant (see the module docstring)."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    num_rows, (out_features, in_features) = rows.shape[0], weight.shape
    out = torch.empty(num_rows, out_features, dtype=x.dtype, device=x.device)
    if num_rows:
        block_m, block_n, block_k, warps = TILES[x.dtype]
        grid = (triton.cdiv(num_rows, block_m), triton.cdiv(out_features, block_n))
        _linear_kernel[grid](
            rows, weight, rows if bias is None else bias,
            rows if weight_scale is None else weight_scale, out, num_rows, out_features,
            in_features, rows.stride(0), weight.stride(0), weight.stride(1), out.stride(0),
            HAS_BIAS=bias is not None, HAS_SCALE=weight_scale is not None, BLOCK_M=block_m,
            BLOCK_N=block_n, BLOCK_K=block_k,
            UPCAST=os.environ.get("TRITON_INTERPRET") == "1", num_warps=warps)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out_features)


@triton.jit(do_not_specialize=["num_rows"])
def _linear_kernel(x, weight, bias, weight_scale, out, num_rows, out_features, in_features,
                   stride_xm, stride_wn, stride_wk, stride_om, HAS_BIAS: tl.constexpr,
                   HAS_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = rm < num_rows, rn < out_features
    acc = tile_matmul(x, rm, m_mask, weight, rn, n_mask, in_features, stride_xm, stride_wn,
                      stride_wk, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST)
    if HAS_SCALE:  # 8-bit weights: each output channel's scale, after the sum
        acc *= tl.load(weight_scale + rn, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out + rm[:, None].to(tl.int64) * stride_om + rn[None, :],
             acc.to(out.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def tile_matmul(x, rows, m_mask, weight, rn, n_mask, in_features, stride_xm, stride_wn,
                stride_wk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    """The float32 tile ``x[rows] W[rn]^T``: K in ``BLOCK_K`` chunks, in order, each by one
    ``tl.dot`` (the one sum order every batch-invariant matmul here shares); 8-bit weight
    codes converted to the activations' dtype as loaded (exact)."""
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(0, in_features, BLOCK_K):
        k = k_start + rk
        k_mask = k < in_features
        a = tl.load(x + rows[:, None].to(tl.int64) * stride_xm + k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(weight + rn[None, :].to(tl.int64) * stride_wn + k[:, None] * stride_wk,
                    mask=n_mask[None, :] & k_mask[:, None], other=0.0)
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b.to(a.dtype), acc, input_precision="ieee")
    return acc
