"""The CPU kernels as autograd functions: a trainer's forward pass through the very kernels
the engine samples with, so that its log-probs are the engine's, bit for bit (exact
log-probs, ``rollout/exact_forward.py``).

Each forward runs the compiled kernel; each backward is plain torch, within float tolerance
of autograd through the references (the gradient needs no bitwise match):

- ``panel_linear``: ``x W^T + b`` by ``cpu_linear.c``'s panels (the weight packed at every
  call, since a trainer's weight changes under it), backward two matmuls;
- ``causal_attention``: every sequence of a flat token stream attending to itself, by the
  compiled prefill kernel over the stream's own keys (no pool: ``cpu_attention.c`` gives a
  token the same bits as a decode over the engine's pool), backward through SDPA;
- RMSNorm, rotary and the gated activation, each recomputed by its reference under
  autograd for the backward (``recomputed``).

``TRAINING_OPS`` bundles them as a ``KernelOps`` whose ``causal_attention`` tells the
model's attention to attend the step's own keys instead of a pool.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.autograd import Function

from . import cpu_attention, cpu_layers, cpu_linear, layers
from .attention import AttentionMetadata
from .dispatch import KernelOps


class _PanelLinear(Function):
    @staticmethod
    def forward(ctx, rows, weight, bias):  # noqa: D102 - autograd's protocol
        ctx.save_for_backward(rows, weight)
        ctx.has_bias = bias is not None
        panels = cpu_linear.panel_layout(weight.detach())
        return cpu_linear.panel_linear(rows, panels, weight.shape[0],
                                       None if bias is None else bias.detach().contiguous())

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        rows, weight = ctx.saved_tensors
        grad_rows = grad @ weight if ctx.needs_input_grad[0] else None
        grad_weight = grad.t() @ rows if ctx.needs_input_grad[1] else None
        grad_bias = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_rows, grad_weight, grad_bias


def panel_linear(x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T + b`` by the panel kernel, differentiable in all three (float32 or bfloat16,
    ``cpu_build.DTYPES``): each output row the same bits as the engine's panels give it."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    return _PanelLinear.apply(rows, weight, bias).view(*x.shape[:-1], weight.shape[0])


class _Recomputed(Function):
    @staticmethod
    def forward(ctx, kernel, reference, *tensors):  # noqa: D102
        ctx.reference = reference
        ctx.save_for_backward(*tensors)
        return kernel(*tensors)

    @staticmethod
    def backward(ctx, *grads):  # noqa: D102
        inputs = [t.detach().requires_grad_(needs)
                  for t, needs in zip(ctx.saved_tensors, ctx.needs_input_grad[2:])]
        with torch.enable_grad():
            outputs = ctx.reference(*inputs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(out, grad) for out, grad in zip(outputs, grads) if grad is not None]
        wanted = [t for t in inputs if t.requires_grad]
        found = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs],
                                          allow_unused=True))
        return None, None, *(next(found) if t.requires_grad else None for t in inputs)


def recomputed(kernel: Callable, reference: Callable, *tensors: torch.Tensor):
    """``kernel(*tensors)`` (a tensor or a tuple), differentiable through ``reference``,
    which computes the same function in torch and is recomputed for the backward."""
    return _Recomputed.apply(kernel, reference, *tensors)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``layers.rms_norm`` by the C kernel, differentiable."""
    if residual is None:
        return recomputed(lambda x, w: cpu_layers.rms_norm(x, w, eps),
                          lambda x, w: layers.rms_norm(x, w, eps), x, weight)
    return recomputed(lambda x, w, r: cpu_layers.rms_norm(x, w, eps, r),
                      lambda x, w, r: layers.rms_norm(x, w, eps, r), x, weight, residual)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``layers.silu_and_mul`` by the C kernel, differentiable."""
    return recomputed(cpu_layers.silu_and_mul, layers.silu_and_mul, gate, up)


class _Rotary(Function):
    """One tensor rotated in place (autograd allows one dirty view per function)."""

    @staticmethod
    def forward(ctx, x, positions, cos_cache, sin_cache):  # noqa: D102
        cpu_layers.rotary_embedding(positions, x, x[:, :0], cos_cache, sin_cache)
        ctx.mark_dirty(x)
        ctx.save_for_backward(positions, cos_cache, sin_cache)
        return x

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        positions, cos_cache, sin_cache = ctx.saved_tensors
        grad = grad.clone()
        # A rotation's transpose is the rotation by minus the angle.
        layers.rotary_embedding(positions, grad, grad[:, :0], cos_cache, -sin_cache)
        return grad, None, None, None


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_cache: torch.Tensor, sin_cache: torch.Tensor) -> None:
    """``layers.rotary_embedding`` (in place) by the C kernel, differentiable."""
    _Rotary.apply(query, positions, cos_cache, sin_cache)
    _Rotary.apply(key, positions, cos_cache, sin_cache)


class _CausalAttention(Function):
    @staticmethod
    def forward(ctx, query, key, value, cu_seqlens, scale):  # noqa: D102
        ctx.save_for_backward(query, key, value, cu_seqlens)
        ctx.scale = scale
        starts, lengths = cu_seqlens[:-1], cu_seqlens[1:] - cu_seqlens[:-1]
        width = int(lengths.max())
        # The stream itself as a pool of one-token blocks: row t of each sequence's table is
        # its t-th token (the kernels' arithmetic does not depend on the block size).
        tables = (starts[:, None] + torch.arange(width)).clamp(max=key.shape[0] - 1)
        metadata = AttentionMetadata(torch.empty(0, dtype=torch.long), tables, lengths,
                                     cu_seqlens, num_decodes=0, max_query_len=width)
        return cpu_attention.paged_attention(query.contiguous(), key.contiguous().unsqueeze(1),
                                             value.contiguous().unsqueeze(1), metadata, scale)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        query, key, value, cu_seqlens = ctx.saved_tensors
        inputs = [t.detach().requires_grad_() for t in (query, key, value)]
        with torch.enable_grad():
            out = _sdpa_reference(*inputs, cu_seqlens, ctx.scale)
        grads = torch.autograd.grad(out, inputs, grad)
        return *grads, None, None


def _sdpa_reference(query, key, value, cu_seqlens, scale):
    """Each sequence's causal attention through SDPA, its KV heads repeated for their
    query heads."""
    group = query.shape[1] // key.shape[1]
    outs = []
    bounds = cu_seqlens.tolist()
    for start, stop in zip(bounds, bounds[1:]):
        q, k, v = (t[start:stop].transpose(0, 1) for t in (query, key, value))
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        outs.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
                    .transpose(0, 1))
    return torch.cat(outs)


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     metadata: AttentionMetadata, scale: float) -> torch.Tensor:
    """Each sequence of the flat stream (``metadata.cu_seqlens_q``; every token a query)
    attending to its own tokens up to each one, by the compiled kernel, differentiable."""
    return _CausalAttention.apply(query, key, value, metadata.cu_seqlens_q, scale)


def _no_pool(*args, **kwargs):
    raise RuntimeError("the training kernels attend the step's own keys: there is no pool")


TRAINING_OPS = KernelOps("cpu-training", cascade=False, store_kv=_no_pool,
                         paged_attention=_no_pool, rms_norm=rms_norm,
                         rotary_embedding=rotary_embedding, silu_and_mul=silu_and_mul,
                         causal_attention=causal_attention)
