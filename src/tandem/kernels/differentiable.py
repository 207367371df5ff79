"""The engine's kernels as autograd functions: a trainer's forward pass through the very
kernels the engine samples with, so that its log-probs are the engine's, bit for bit (exact
log-probs, ``rollout/exact_forward.py``), on CPU (the compiled C kernels) or CUDA (Triton).

Each forward runs the engine's kernel; each backward is plain torch, within float tolerance
of autograd through the references (the gradient needs no bitwise match):

- ``panel_linear`` and ``triton_linear``: ``x W^T + b`` by the batch-invariant matmul of
  each backend (``cpu_linear.c``'s panels, a parameter's kept on it until the optimizer
  writes it; ``triton_linear.py``, which reads the weight as stored),
  backward two matmuls;
- ``training_quantized_linear(kernels, method)``: the same with the weight quantized as the
  engine quantizes it (``quantization.quantize``, kept on a parameter as its panels are)
  and multiplied by the engine's 8-bit kernel; backward, the input's gradient through the
  weight served (dequantized), the weight's straight through the rounding (quantization-
  aware training's straight-through estimator);
- ``training_ops(kernels)``: a ``KernelOps`` of the engine's RMSNorms (Llama's and
  Gemma's), rotary and gated activations (SiLU and GELU-tanh), each with its backward
  written out in float32, and a ``causal_attention`` that attends every sequence of a
  flat token stream through the engine's own attention over the stream's keys (no pool:
  the stream is a pool of one-token blocks): each sequence to itself, or, given block
  tables over the stream's rows, its queries (the last of its context, as a prefill chunk)
  to the rows its table lists, a shared prefix's among them
  (``rollout/worker/shared_prefix.py``); the engine's attention gives a token the same
  bits decoded, prefilled whole or in chunks. Backward through SDPA over the sequences
  padded in groups of like sizes (each sequence's keys gathered through its table, the
  gradients of a row read by several added in float32; masked causally from each query's
  position and to the layer's sliding window where it has one), or, for a layer with
  attention sinks or a soft cap (which SDPA cannot do), through the attention written out
  one sequence at a time, the sinks' gradient included. The model's attention calls it
  instead of storing to and reading from a pool. Where the engine's pool is FP8, the
  stream's K and V go through it as the engine's do: stored by the engine's own
  ``store_kv`` with the engine's scales (so rounded to the very bits the engine read) and
  attended from there; the backward is straight through the rounding (the gradient of the
  dequantized K and V passed to K and V, but where the clamp saturated).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function

from . import attention, cpu_linear, layers, quantization
from .attention import AttentionMetadata
from .dispatch import AttentionBackend, KernelOps, LayerKernels
from .fp8_kv import FP8, FP8_MAX, dequantize


class _Linear(Function):
    """``kernel(rows, weight, bias, parameter)``, which returns the output and the 8-bit
    codes and scales it multiplied by (None: the weight itself); the backward takes the
    input's gradient through the weight the kernel served, the weight's straight through any
    rounding."""

    @staticmethod
    def forward(ctx, rows, weight, bias, kernel):  # noqa: D102 - autograd's protocol
        ctx.save_for_backward(rows, weight)
        ctx.has_bias = bias is not None
        parameter = weight if isinstance(weight, nn.Parameter) else None
        out, ctx.codes = kernel(rows, weight.detach(), None if bias is None else bias.detach(),
                                parameter)
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        rows, weight = ctx.saved_tensors
        served = weight if ctx.codes is None else quantization.dequantize(*ctx.codes,
                                                                          weight.dtype)
        grad_rows = grad @ served if ctx.needs_input_grad[0] else None
        grad_weight = grad.t() @ rows if ctx.needs_input_grad[1] else None
        grad_bias = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_rows, grad_weight, grad_bias, None


def _kept(weight: torch.Tensor, parameter: nn.Parameter | None, name: str,
          build: Callable[[torch.Tensor, object | None], object]) -> object:
    """``build(weight, previous)`` (its panels, its 8-bit codes; ``previous`` what was built
    for the weight's last version, to write over, or None). A trainer's parameter keeps what
    was built for it under ``name`` (an attribute, dropped with it), built anew only after
    it changes: an optimizer step writes it in place, which bumps its version. A computed
    weight (a merged adapter) is built at each call."""
    if parameter is None:
        return build(weight, None)
    key = (weight.data_ptr(), parameter._version, tuple(weight.shape), weight.dtype)
    if not hasattr(parameter, "_tandem_kept"):
        parameter._tandem_kept = {}
    kept = parameter._tandem_kept
    if name not in kept or kept[name][0] != key:
        kept[name] = (key, build(weight, kept[name][1] if name in kept else None))
    return kept[name][1]


Codes = tuple[torch.Tensor, torch.Tensor]  # 8-bit codes and their scales


def _panels(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            parameter: nn.Parameter | None) -> tuple[torch.Tensor, None]:
    panels = _kept(weight, parameter, "panels", cpu_linear.panel_layout)
    return cpu_linear.panel_linear(rows, panels, weight.shape[0],
                                   None if bias is None else bias.contiguous()), None


def _triton(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            parameter: nn.Parameter | None) -> tuple[torch.Tensor, None]:
    from . import triton_linear  # only when the Triton kernels run

    return triton_linear.linear(rows, weight, bias), None  # reads the weight as stored


def _quantized_panels(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      parameter: nn.Parameter | None, method: str
                      ) -> tuple[torch.Tensor, Codes]:
    def build(w: torch.Tensor, previous: tuple[torch.Tensor, Codes] | None
              ) -> tuple[torch.Tensor, Codes]:
        codes = quantization.quantize(w, method)
        return cpu_linear.panel_layout(codes[0], previous and previous[0]), codes

    panels, codes = _kept(weight, parameter, f"panels-{method}", build)
    return cpu_linear.panel_linear(rows, panels, weight.shape[0],
                                   None if bias is None else bias.contiguous(), codes[1]), codes


def _quantized_triton(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      parameter: nn.Parameter | None, method: str
                      ) -> tuple[torch.Tensor, Codes]:
    from . import triton_linear  # only when the Triton kernels run

    codes = _kept(weight, parameter, method, lambda w, _: quantization.quantize(w, method))
    return triton_linear.linear(rows, codes[0], bias, codes[1]), codes


def _differentiable(kernel: Callable) -> Callable:
    def linear(x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        return _Linear.apply(rows, weight, bias, kernel).view(*x.shape[:-1], weight.shape[0])
    return linear


panel_linear = _differentiable(_panels)
panel_linear.__doc__ = """``x W^T + b`` by the panel kernel (``cpu_linear.c``; the weight
packed as ``_packed`` says), differentiable in all three (float32 or bfloat16): each output
row the bits the engine's panels give it."""
triton_linear = _differentiable(_triton)
triton_linear.__doc__ = """``x W^T + b`` by the batch-invariant Triton kernel
(``triton_linear.py``), differentiable in all three."""


class _RMSNorm(Function):
    """``layers.rms_norm`` (or with ``unit_offset`` ``layers.gemma_rms_norm``, scaled by
    ``1 + weight``) by ``kernel``; the backward in float32 from the saved input (the sum
    with the residual when there is one), the roundings to the model dtype taken as the
    identity."""

    @staticmethod
    def forward(ctx, x, weight, residual, eps, kernel, unit_offset):  # noqa: D102
        if residual is None:
            out, total = kernel(x, weight, eps), x
        else:
            out, total = kernel(x, weight, eps, residual)
        ctx.save_for_backward(total, weight)
        ctx.eps, ctx.has_residual, ctx.unit_offset = eps, residual is not None, unit_offset
        return (out, total) if residual is not None else out

    @staticmethod
    def backward(ctx, grad_out, grad_total=None):  # noqa: D102
        total, weight = ctx.saved_tensors
        x = total.float()
        inverse = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + ctx.eps)
        normed = x * inverse
        # Gemma's scales the float32 normalised value by 1 + w; Llama's its rounding by w.
        scale, scaled = (weight.float() + 1.0, normed) if ctx.unit_offset else \
            (weight.float(), normed.to(total.dtype).float())
        grad_normed = grad_out.float() * scale
        grad_x = inverse * (grad_normed - normed * (grad_normed * normed).mean(-1, keepdim=True))
        if grad_total is not None:
            grad_x = grad_x + grad_total.float()
        grad_weight = (grad_out.float() * scaled).reshape(-1, weight.shape[0]).sum(0).to(
            weight.dtype)
        grad_x = grad_x.to(total.dtype)
        return grad_x, grad_weight, grad_x if ctx.has_residual else None, None, None, None


class _GatedActivation(Function):
    """``act(gate) * up`` by ``kernel``, saving both inputs; a subclass gives the backward."""

    @staticmethod
    def forward(ctx, gate, up, kernel):  # noqa: D102
        ctx.save_for_backward(gate, up)
        return kernel(gate, up)


class _SiluAndMul(_GatedActivation):
    """``layers.silu_and_mul`` by ``kernel``; the backward in float32."""

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        gate, up = (t.float() for t in ctx.saved_tensors)
        grad, sigmoid = grad.float(), torch.sigmoid(gate)
        grad_up = grad * gate * sigmoid
        grad_gate = grad * up * sigmoid * (1 + gate * (1 - sigmoid))
        return grad_gate.to(ctx.saved_tensors[0].dtype), grad_up.to(ctx.saved_tensors[1].dtype), \
            None


class _GeluTanhAndMul(_GatedActivation):
    """``layers.gelu_tanh_and_mul`` by ``kernel``; the backward in float32: with u =
    sqrt(2/pi) (g + 0.044715 g^3), gelu = g s for s = (1 + tanh u) / 2, whose derivative is
    s + g (1 - tanh^2 u) u' / 2."""

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        gate, up = (t.float() for t in ctx.saved_tensors)
        beta = math.sqrt(2 / math.pi)
        tanh = torch.tanh(beta * (gate + 0.044715 * gate.pow(3)))
        half = 0.5 * (1 + tanh)
        slope = half + 0.5 * gate * (1 - tanh * tanh) * beta * (1 + 3 * 0.044715 * gate * gate)
        grad = grad.float()
        return (grad * up * slope).to(ctx.saved_tensors[0].dtype), \
            (grad * gate * half).to(ctx.saved_tensors[1].dtype), None


class _Rotary(Function):
    """One tensor rotated in place (autograd allows one dirty view per function)."""

    @staticmethod
    def forward(ctx, x, positions, cos_cache, sin_cache, kernel):  # noqa: D102
        kernel(positions, x, x[:, :0], cos_cache, sin_cache)
        ctx.mark_dirty(x)
        ctx.save_for_backward(positions, cos_cache, sin_cache)
        return x

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        positions, cos_cache, sin_cache = ctx.saved_tensors
        grad = grad.clone()
        # A rotation's transpose is the rotation by minus the angle.
        layers.rotary_embedding(positions, grad, grad[:, :0], cos_cache, -sin_cache)
        return grad, None, None, None, None


class _CausalAttention(Function):
    """``kernels.paged_attention`` over the stream itself as a pool of one-token blocks
    (row t of the stream is block t), each sequence reading its context through its block
    table (``_with_tables``); the backward through ``_sdpa_reference`` or, with sinks or a
    soft cap, ``_written_out_grads``."""

    @staticmethod
    def forward(ctx, query, key, value, metadata, scale, kernels,  # noqa: D102
                k_scale, v_scale, window, sinks, softcap):
        # The kernels' arithmetic does not depend on the block size.
        metadata = _with_tables(metadata, key.shape[0])
        k_pool, v_pool = key.contiguous().unsqueeze(1), value.contiguous().unsqueeze(1)
        if k_scale is not None:
            k_pool, v_pool = _through_fp8_pool(key, value, kernels.store_kv, k_scale, v_scale)
        ctx.save_for_backward(query, key, value, k_pool, v_pool, sinks)
        ctx.stream, ctx.scale, ctx.scales, ctx.window, ctx.softcap = metadata, scale, \
            (k_scale, v_scale), window, softcap
        return kernels.paged_attention(query.contiguous(), k_pool, v_pool, metadata, scale,
                                       k_scale, v_scale, sliding_window=window, sinks=sinks,
                                       softcap=softcap)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        query, key, value, k_pool, v_pool, sinks = ctx.saved_tensors
        k_scale, v_scale = ctx.scales
        attended = (key, value) if k_scale is None else (
            dequantize(k_pool[:, 0], k_scale).to(key.dtype),
            dequantize(v_pool[:, 0], v_scale).to(value.dtype))
        grad_sinks = None
        if sinks is None and ctx.softcap is None:
            inputs = [t.detach().requires_grad_() for t in (query, *attended)]
            with torch.enable_grad():
                out = _sdpa_reference(*inputs, ctx.stream, ctx.scale, ctx.window)
            grad_query, grad_key, grad_value = torch.autograd.grad(out, inputs, grad)
        else:
            grad_query, grad_key, grad_value, grad_sinks = _written_out_grads(
                grad, query, *attended, sinks, ctx.stream, ctx.scale, ctx.window,
                ctx.softcap)
        if k_scale is not None:  # straight through the rounding, not the saturation
            grad_key = grad_key * _unsaturated(key, k_scale)
            grad_value = grad_value * _unsaturated(value, v_scale)
        return (grad_query, grad_key, grad_value, None, None, None, None, None, None,
                grad_sinks, None)


def _with_tables(metadata: AttentionMetadata, num_rows: int) -> AttentionMetadata:
    """``metadata`` of a stream of ``num_rows`` tokens as the kernels read it: as given
    when it has block tables (rows of the stream: a shared prefix's sequences, see
    ``rollout/worker/shared_prefix.py``); without, each sequence attends its own query
    rows (its table its rows, its context its queries)."""
    if metadata.block_tables.numel():
        return metadata
    cu_seqlens = metadata.cu_seqlens_q
    starts, lengths = cu_seqlens[:-1], cu_seqlens[1:] - cu_seqlens[:-1]
    width = int(lengths.max())
    tables = (starts[:, None] + torch.arange(width, device=starts.device)).clamp(
        max=num_rows - 1)
    return AttentionMetadata(torch.empty(0, dtype=torch.long, device=starts.device), tables,
                             lengths, cu_seqlens, num_decodes=0, max_query_len=width)


def _through_fp8_pool(key: torch.Tensor, value: torch.Tensor, store: Callable[..., None],
                      k_scale: torch.Tensor, v_scale: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``key`` and ``value`` ``[tokens, kv_heads, head_dim]`` stored by the engine's ``store``
    into an FP8 pool of one-token blocks (the stream's), with the engine's scales."""
    k_pool = torch.empty(key.shape[0], 1, *key.shape[1:], dtype=FP8, device=key.device)
    v_pool = torch.empty_like(k_pool)
    slots = torch.arange(key.shape[0], device=key.device)
    store(key.detach(), value.detach(), k_pool, v_pool, slots, k_scale, v_scale)
    return k_pool, v_pool


def _unsaturated(x: torch.Tensor, kv_scale: torch.Tensor) -> torch.Tensor:
    """Where ``x`` ``[tokens, kv_heads, head_dim]`` lies within its FP8 range (the clamp
    passes a gradient), as ``x``'s dtype."""
    return ((x.float() / kv_scale[:, None]).abs() <= FP8_MAX).to(x.dtype)


class _Gather(Function):
    """``x.index_select(0, rows)`` whose backward adds the gradients of repeated rows (a
    shared prefix's keys, read by every sequence after it) in float32."""

    @staticmethod
    def forward(ctx, x, rows):  # noqa: D102
        ctx.rows, ctx.shape = rows, x.shape
        return x.index_select(0, rows)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        total = grad.new_zeros(ctx.shape, dtype=torch.float32)
        return total.index_add_(0, ctx.rows, grad.float()).to(grad.dtype), None


def _sdpa_reference(query, key, value, metadata, scale, window):
    """Each sequence's attention (its queries the last positions of its context, read
    through its block table; within its last ``window`` positions where one is given) by
    SDPA, the sequences of like sizes padded together (``_sizes``), its KV heads grouped
    (GQA); the stream's rows in order."""
    query_lens = metadata.cu_seqlens_q.diff()
    rows, outs = [], []
    for members in _sizes(query_lens, metadata.context_lens):
        members = torch.tensor(members, device=query.device)
        bucket_rows, out = _padded_attention(query, key, value, metadata, members, scale,
                                             window)
        rows.append(bucket_rows)
        outs.append(out)
    return query.new_zeros(query.shape).index_copy(0, torch.cat(rows), torch.cat(outs))


def _sizes(query_lens: torch.Tensor, context_lens: torch.Tensor) -> list[list[int]]:
    """The sequences grouped by size, so that padding a group to its longest wastes at
    most half: by whether the queries are the whole context, and by the bit lengths of
    their query and context lengths."""
    groups: dict[tuple[bool, int, int], list[int]] = {}
    for index, (queries, context) in enumerate(zip(query_lens.tolist(),
                                                   context_lens.tolist())):
        key = (queries == context, queries.bit_length(), context.bit_length())
        groups.setdefault(key, []).append(index)
    return list(groups.values())


def _padded_attention(query, key, value, metadata, members, scale, window):
    """The attention of sequences ``members`` through one SDPA call over them padded at
    the end (queries and context) to the longest; the stream rows of their queries and
    those rows' outputs."""
    starts = metadata.cu_seqlens_q[members]
    query_lens = metadata.cu_seqlens_q[members + 1] - starts
    context_lens = metadata.context_lens[members]
    width, depth = int(query_lens.max()), int(context_lens.max())
    slots, keys = (torch.arange(n, device=query.device) for n in (width, depth))
    real = slots < query_lens[:, None]
    padding = query.shape[0]  # a row of zeros appended
    query_rows = torch.where(real, starts[:, None] + slots, padding)
    key_rows = torch.where(keys < context_lens[:, None], metadata.block_tables[members, :depth],
                           padding)
    positions = (context_lens - query_lens)[:, None] + slots
    whole = bool((query_lens == context_lens).all())
    # Whole sequences need the causal mask alone: a real query sees keys 0..position, all
    # real, and a padded one's output is dropped (so its gradients are zero); no mask
    # tensor keeps SDPA's causal path, which skips the blocks above the diagonal.
    causal = whole and (window is None or window >= depth)
    mask = None if causal else _visible(positions, depth, window) | \
        (~real[..., None] & (keys == 0))  # a padded query sees one key: no NaN
    out = F.scaled_dot_product_attention(
        *(_padded(x, rows) for x, rows in ((query, query_rows), (key, key_rows),
                                           (value, key_rows))),
        attn_mask=None if mask is None else mask[:, None], is_causal=causal, scale=scale,
        enable_gqa=query.shape[1] > key.shape[1])
    kept = real.flatten().nonzero().squeeze(1)
    out = out.transpose(1, 2).reshape(-1, *query.shape[1:]).index_select(0, kept)
    return query_rows.flatten()[kept], out


def _padded(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` ``[seqs, width]`` of ``x`` ``[tokens, heads, head_dim]`` (``tokens``:
    a row of zeros) as ``[seqs, heads, width, head_dim]``."""
    x = torch.cat([x, x.new_zeros(1, *x.shape[1:])])
    picked = _Gather.apply(x, rows.flatten())
    return picked.view(*rows.shape, *x.shape[1:]).transpose(1, 2)


def _written_out_grads(grad, query, key, value, sinks, metadata, scale, window, softcap):
    """The gradients of ``query``, ``key``, ``value`` and ``sinks`` (None: none) through each
    sequence's attention written out (``attention.softmax_attention``, in float32: SDPA
    takes no sink and no soft cap), one sequence at a time, so that one sequence's scores
    are held at once; the keys' and values' read by several sequences, and the sinks',
    summed over them."""
    grad_query = torch.zeros_like(query)
    grad_key, grad_value = (torch.zeros(t.shape, device=t.device) for t in (key, value))
    grad_sinks = None if sinks is None else torch.zeros(sinks.shape, device=sinks.device)
    bounds = metadata.cu_seqlens_q.tolist()
    for index, context in enumerate(metadata.context_lens.tolist()):
        start, end = bounds[index], bounds[index + 1]
        table = metadata.block_tables[index, :context]
        rows = [query[start:end].detach().requires_grad_(),
                *(t.index_select(0, table).detach().requires_grad_() for t in (key, value))]
        sink = None if sinks is None else sinks.detach().requires_grad_()
        with torch.enable_grad():
            out = _sequence_attention(*rows, sink, scale, window, softcap)
        found = torch.autograd.grad(out, rows if sink is None else [*rows, sink],
                                    grad[start:end])
        grad_query[start:end] = found[0]
        grad_key.index_add_(0, table, found[1].float())
        grad_value.index_add_(0, table, found[2].float())
        if sink is not None:
            grad_sinks += found[3]
    return (grad_query, grad_key.to(key.dtype), grad_value.to(value.dtype),
            None if sinks is None else grad_sinks.to(sinks.dtype))


def _sequence_attention(query, key, value, sinks, scale, window, softcap):
    """One sequence's attention of ``query`` ``[queries, heads, head_dim]`` (the last
    positions of its context) over ``key``/``value`` ``[context, kv_heads, head_dim]``
    (within its last ``window`` positions where one is given), its KV heads repeated for
    their query heads, written out in float32 with ``sinks`` and ``softcap``; in
    ``query``'s dtype."""
    group = query.shape[1] // key.shape[1]
    keys, values = (t.float().repeat_interleave(group, 1).transpose(0, 1) for t in (key, value))
    positions = torch.arange(key.shape[0] - query.shape[0], key.shape[0], device=query.device)
    mask = _visible(positions, key.shape[0], window)
    out = attention.softmax_attention(query.float().transpose(0, 1), keys, values, mask, scale,
                                      None if sinks is None else sinks.float(), softcap)
    return out.transpose(0, 1).to(query.dtype)


def _visible(positions: torch.Tensor, depth: int, window: int | None) -> torch.Tensor:
    """``[..., depth]``: True where the query at position ``positions[...]`` sees key
    position k (of ``depth``): ``position - window < k <= position``."""
    offset = positions[..., None] - torch.arange(depth, device=positions.device)
    return (offset >= 0) & (offset < window) if window is not None else offset >= 0


def training_ops(kernels: KernelOps) -> KernelOps:
    """The engine's kernels ``kernels`` (the compiled CPU ones, or the Triton ones with the
    batch-invariant attention) made differentiable for a trainer's forward pass: each runs
    forward as the engine runs it, its backward in torch; ``causal_attention`` attends each
    sequence of the step's flat stream to its own keys, or to the stream rows its block
    table lists (``metadata.block_tables``: a shared prefix's), through
    ``kernels.paged_attention`` (given an FP8 pool's scales, through an FP8 pool filled by
    ``kernels.store_kv``), within the layer's ``sliding_window`` where it has one, with its
    ``sinks`` (differentiable: a trained parameter) and ``softcap``.
    """
    def rms_norm(x, weight, eps, residual=None):
        return _RMSNorm.apply(x, weight, residual, eps, kernels.rms_norm, False)

    def gemma_rms_norm(x, weight, eps, residual=None):
        return _RMSNorm.apply(x, weight, residual, eps, kernels.gemma_rms_norm, True)

    def rotary_embedding(positions, query, key, cos_cache, sin_cache) -> None:
        _Rotary.apply(query, positions, cos_cache, sin_cache, kernels.rotary_embedding)
        _Rotary.apply(key, positions, cos_cache, sin_cache, kernels.rotary_embedding)

    def causal_attention(query, key, value, metadata: AttentionMetadata, scale: float,
                         k_scale=None, v_scale=None, sliding_window=None, sinks=None,
                         softcap=None):
        return _CausalAttention.apply(query, key, value, metadata, scale, kernels, k_scale,
                                      v_scale, sliding_window, sinks, softcap)

    def silu_and_mul(gate, up):
        return _SiluAndMul.apply(gate, up, kernels.silu_and_mul)

    def gelu_tanh_and_mul(gate, up):
        return _GeluTanhAndMul.apply(gate, up, kernels.gelu_tanh_and_mul)

    layers = kernels.layers
    return KernelOps(AttentionBackend(f"{kernels.attention.name}-training", _no_pool, _no_pool),
                     LayerKernels(f"{layers.name}-training", rms_norm, rotary_embedding,
                                  silu_and_mul, gemma_rms_norm, gelu_tanh_and_mul,
                                  layers.cpu_linear_layouts),
                     causal_attention=causal_attention)


def training_linear(kernels: KernelOps) -> Callable[..., torch.Tensor]:
    """The differentiable twin of the engine's batch-invariant matmul for ``kernels``: the
    panels where the linear layers use the CPU layouts, the Triton matmul otherwise."""
    return panel_linear if kernels.layers.cpu_linear_layouts else triton_linear


def training_quantized_linear(kernels: KernelOps, method: str) -> Callable[..., torch.Tensor]:
    """``linear(x, weight, bias)`` of a trainer's float weight as the engine serves it with
    ``quantization=method``: quantized by ``quantization.quantize`` and multiplied by the
    engine's 8-bit kernel for ``kernels`` (the panels, or the Triton matmul), so each output
    row has the engine's bits; differentiable, the weight's gradient passing straight
    through the rounding (``_Linear``)."""
    kernel = _quantized_panels if kernels.layers.cpu_linear_layouts else _quantized_triton
    return _differentiable(functools.partial(kernel, method=method))


def _no_pool(*args, **kwargs):
    raise RuntimeError("the training kernels attend the step's own keys: there is no pool")
