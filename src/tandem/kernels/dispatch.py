"""Kernel backends: the Triton kernels on CUDA; on CPU compiled C kernels (decode attention,
``cpu_attention.py``; the layer operations, ``cpu_layers.py``) beside the torch references
for the rest, or the references alone.

A model holds one ``KernelOps`` and calls every kernel through it: an ``AttentionBackend``
(the attention kernels, and what they can do: graph capture, the pool's layout, the static
metadata of captured steps) and ``LayerKernels`` (norms, rotary, activation, how linear
layers multiply). One switch (``attention_backend``) picks both today. Forcing ``"triton"``
on a CPU needs the Triton interpreter (``TRITON_INTERPRET=1`` set before Triton is first
imported), which runs the very kernels a GPU runs, slowly, on numpy.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import attention, cpu_attention, cpu_build, cpu_layers, layers

BACKENDS = ("auto", "triton", "cpu", "torch")
# The layer kernels a model calls, copied onto ``KernelOps``.
LAYER_KERNELS = ("rms_norm", "gemma_rms_norm", "rotary_embedding", "silu_and_mul",
                 "gelu_tanh_and_mul")


@dataclass(frozen=True, slots=True)
class AttentionBackend:
    """One attention backend: its kernels and what it can do, which is all the engine asks
    of it (no code outside ``kernels/`` tests a backend's name).

    Attributes:
        name: what ``stats()`` and errors report.
        store_kv, paged_attention: the kernels (``attention.py``'s signatures).
        cascade: ``paged_attention`` reads ``AttentionMetadata.cascade``, so the runner
            lays a step's decode groups out for it.
        captures_graphs: a decode step's kernels queue without waiting for the device, so
            they can be captured in CUDA graphs.
        shards: runs under tensor parallelism on CUDA (its graphs capture the all-reduces).
        kv_layout: the pool's storage shape and the permutation that views it logically
            (``pool_layout``'s signature).
        decode_buffers: the static metadata of captured decode steps, built as
            ``decode_buffers(max_size, max_blocks_per_seq, device, num_groups)`` (a slot
            mapping and block tables per KV group).
    """

    name: str
    store_kv: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    cascade: bool = False
    captures_graphs: bool = False
    shards: bool = True
    kv_layout: Callable[[tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...]]] = \
        attention.pool_layout
    decode_buffers: Callable[..., attention.DecodeBuffers] = attention.DecodeBuffers


@dataclass(frozen=True, slots=True)
class LayerKernels:
    """The kernels of everything but attention: norms, rotary, the gated activations, and
    how linear layers multiply.

    Attributes:
        rms_norm, gemma_rms_norm: Llama's RMSNorm and Gemma's (scaled by ``1 + weight``),
            each ``norm(x, weight, eps, residual=None)`` (``layers.py``'s signatures).
        silu_and_mul, gelu_tanh_and_mul: the gated activations ``act(gate) * up``.
        cpu_linear_layouts: on a CPU the linear layers multiply in the layouts of
            ``cpu_linear.py`` (timed, or the batch-invariant panels).
        batch_invariant_linear: the matmul whose rows' bits do not depend on the row count,
            where it is a kernel of its own (Triton's); None where the panels are.
        fused_moe: a mixture of experts' whole expert computation in grouped matmuls
            (``triton_moe.fused_moe``'s signature), or None (the experts loop in torch).
        quantized_linear: the matmul of 8-bit weights, ``linear(x, codes, bias,
            weight_scale)`` (``quantization.py``), where it is a kernel of its own
            (Triton's); None where the CPU panels multiply them, or nothing does.
    """

    name: str
    rms_norm: Callable[..., torch.Tensor | tuple[torch.Tensor, torch.Tensor]]
    rotary_embedding: Callable[..., None]
    silu_and_mul: Callable[..., torch.Tensor]
    gemma_rms_norm: Callable[..., torch.Tensor | tuple[torch.Tensor, torch.Tensor]]
    gelu_tanh_and_mul: Callable[..., torch.Tensor]
    cpu_linear_layouts: bool = True
    batch_invariant_linear: Callable[..., torch.Tensor] | None = None
    fused_moe: Callable[..., torch.Tensor] | None = None
    quantized_linear: Callable[..., torch.Tensor] | None = None


@dataclass(frozen=True)
class KernelOps:
    """The kernels a model calls: an attention backend and the layer kernels, with each
    kernel also an attribute of its own (``ops.rms_norm``), so a layer calls it in one
    lookup. ``causal_attention``, set only by the training kernels (``differentiable.py``),
    attends each sequence's own keys of the step, with no pool."""

    attention: AttentionBackend
    layers: LayerKernels
    causal_attention: Callable[..., torch.Tensor] | None = None

    def __post_init__(self) -> None:
        for name in ("store_kv", "paged_attention"):
            object.__setattr__(self, name, getattr(self.attention, name))
        for name in LAYER_KERNELS:
            object.__setattr__(self, name, getattr(self.layers, name))


TORCH_ATTENTION = AttentionBackend("torch", attention.store_kv, attention.paged_attention,
                                   cascade=True, shards=False)
TORCH_LAYERS = LayerKernels("torch", layers.rms_norm, layers.rotary_embedding,
                            layers.silu_and_mul, layers.gemma_rms_norm,
                            layers.gelu_tanh_and_mul)
TORCH_OPS = KernelOps(TORCH_ATTENTION, TORCH_LAYERS)
# Compiled C; the decode attention reads the pool in place, and has no use for the cascade
# layout (a group's shared blocks stay in cache).
CPU_ATTENTION = AttentionBackend("cpu", cpu_layers.store_kv, cpu_attention.paged_attention)
CPU_LAYERS = LayerKernels("cpu", cpu_layers.rms_norm, cpu_layers.rotary_embedding,
                          cpu_layers.silu_and_mul, cpu_layers.gemma_rms_norm,
                          cpu_layers.gelu_tanh_and_mul)
CPU_OPS = KernelOps(CPU_ATTENTION, CPU_LAYERS)


def check_backend(backend: str) -> None:
    """Raise ValueError, naming the valid ones, unless ``backend`` is one of ``BACKENDS``."""
    if backend not in BACKENDS:
        raise ValueError(f"attention_backend={backend!r} is invalid: use one of "
                         f"{', '.join(map(repr, BACKENDS))}.")


def select_kernels(backend: str, device: torch.device, exact: bool = False) -> KernelOps:
    """The kernels for ``backend`` on ``device``: ``"auto"`` is Triton on CUDA, and on CPU
    the compiled C kernels where they build (``cpu_build.available``), else torch. With
    ``exact`` (batch-invariant kernels, ``EngineConfig.exact_logprobs``) Triton's attention
    runs every query through its prefill kernel (the C kernels are batch-invariant as
    they are).

    Raises:
        ValueError: for an unknown backend, ``"cpu"`` off the CPU or where its kernel does
            not build, or ``"triton"`` on a CPU without the Triton interpreter.
    """
    check_backend(backend)
    if backend == "auto" and device.type == "cpu":
        backend = "cpu" if cpu_build.available() else "torch"
    if backend == "cpu":
        return _cpu_ops(device)
    if backend == "torch" or (backend == "auto" and device.type != "cuda"):
        return TORCH_OPS
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"attention_backend='triton' on {device.type} needs the Triton "
                         "interpreter: set TRITON_INTERPRET=1 before Triton is imported, or "
                         "use attention_backend='torch'.")
    return _triton_ops(exact)


def batch_invariance_gap(backend: str, device: torch.device, dtype: torch.dtype,
                         opted_in: bool) -> str | None:
    """Why the kernels ``backend`` selects on ``device`` give no batch-invariant log-probs
    in ``dtype`` (``EngineConfig.exact_logprobs``), or None when they do: the compiled CPU
    kernels in their dtypes, and Triton's only when ``opted_in`` (unmeasured on a GPU)."""
    if backend == "torch":
        return "needs the compiled CPU kernels or Triton's, not attention_backend='torch'"
    if backend == "triton" or device.type == "cuda":
        return None if opted_in else "is opt-in on CUDA until the GPU check measures it"
    if not cpu_build.available():
        return "needs the compiled CPU kernels (a C compiler: gcc or $CC)"
    if dtype not in cpu_build.DTYPES:
        return f"takes float32 or bfloat16 on CPU, not {dtype}"
    return None


def check_quantized(ops: KernelOps, device: torch.device, method: str) -> None:
    """Raise ValueError, naming the fallback, when ``ops`` cannot multiply ``method``'s 8-bit
    weights (``quantization.py``) on ``device``: on CPU the compiled panels (a C compiler),
    on CUDA a layer kernel of 8-bit weights (Triton's), and for fp8 a GPU that converts fp8
    (compute capability 8.9 or newer: Ada, Hopper, Blackwell)."""
    layers = ops.layers
    if layers.cpu_linear_layouts and not cpu_build.available():
        raise ValueError(f"quantization={method!r} on CPU multiplies through the compiled "
                         "panels, which need a C compiler (gcc or $CC): install one, or use "
                         "quantization=None.")
    if not layers.cpu_linear_layouts and layers.quantized_linear is None:
        raise ValueError(f"quantization={method!r} needs the Triton kernels on CUDA, not "
                         f"{layers.name!r}: use attention_backend='auto', or quantization=None.")
    if method == "fp8" and device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            raise ValueError(f"quantization='fp8' needs a GPU of compute capability 8.9 or "
                             f"newer to convert fp8 weights; this one is {capability[0]}."
                             f"{capability[1]}: use quantization='int8', or None.")


def _cpu_ops(device: torch.device) -> KernelOps:
    if device.type != "cpu":
        raise ValueError(f"attention_backend='cpu' runs on the CPU, not {device.type}: use "
                         "'auto' or 'triton'.")
    if not cpu_build.available():
        raise ValueError("attention_backend='cpu' needs a C compiler to build its kernels "
                         "(set $CC or install gcc), or use attention_backend='torch'.")
    return CPU_OPS


def _triton_ops(exact: bool) -> KernelOps:
    # Imported here so that the CPU path never imports Triton.
    from . import triton_attention, triton_layers, triton_linear, triton_moe

    attention = AttentionBackend(
        "triton", triton_attention.store_kv, triton_attention.batch_invariant_attention
        if exact else triton_attention.paged_attention, captures_graphs=True)
    return KernelOps(attention, LayerKernels(
        "triton", triton_layers.rms_norm, triton_layers.rotary_embedding,
        triton_layers.silu_and_mul, triton_layers.gemma_rms_norm,
        triton_layers.gelu_tanh_and_mul, cpu_linear_layouts=False,
        batch_invariant_linear=triton_linear.linear, fused_moe=triton_moe.fused_moe,
        quantized_linear=triton_linear.linear))


def check_sharded(ops: KernelOps, device: torch.device) -> None:
    """Raise ValueError, naming the fix, when ``ops`` cannot run tensor-parallel on
    ``device`` (the torch references on CUDA)."""
    if device.type == "cuda" and not ops.attention.shards:
        raise ValueError(f"tensor parallelism on CUDA needs an attention backend that shards, "
                         f"not {ops.attention.name!r}: use attention_backend='auto' or "
                         "'triton'.")
