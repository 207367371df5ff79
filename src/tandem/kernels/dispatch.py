"""Kernel backends: the Triton kernels on CUDA; on CPU compiled C kernels (decode attention,
``cpu_attention.py``; the layer operations, ``cpu_layers.py``) beside the torch references
for the rest, or the references alone.

A model holds one ``KernelOps`` and calls every kernel through it, so one switch
(``attention_backend``) moves the whole forward pass between backends. Forcing ``"triton"``
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


@dataclass(frozen=True, slots=True)
class KernelOps:
    """One backend's kernels; every pair of backends shares these signatures.

    ``cascade`` says whether ``paged_attention`` uses ``AttentionMetadata.cascade``
    (the runner builds it only then). ``causal_attention``, set only by the training kernels
    (``differentiable.py``), attends each sequence's own keys of the step, with no pool.
    """

    name: str
    cascade: bool
    store_kv: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    rms_norm: Callable[..., torch.Tensor | tuple[torch.Tensor, torch.Tensor]]
    rotary_embedding: Callable[..., None]
    silu_and_mul: Callable[..., torch.Tensor]
    causal_attention: Callable[..., torch.Tensor] | None = None


TORCH_OPS = KernelOps("torch", cascade=True, store_kv=attention.store_kv,
                      paged_attention=attention.paged_attention, rms_norm=layers.rms_norm,
                      rotary_embedding=layers.rotary_embedding,
                      silu_and_mul=layers.silu_and_mul)
# Compiled C; the decode attention reads the pool in place, and has no use for the cascade
# layout (a group's shared blocks stay in cache).
CPU_OPS = KernelOps("cpu", cascade=False, store_kv=cpu_layers.store_kv,
                    paged_attention=cpu_attention.paged_attention, rms_norm=cpu_layers.rms_norm,
                    rotary_embedding=cpu_layers.rotary_embedding,
                    silu_and_mul=cpu_layers.silu_and_mul)


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
    from . import triton_attention, triton_layers

    return KernelOps("triton", cascade=False, store_kv=triton_attention.store_kv,
                     paged_attention=triton_attention.batch_invariant_attention if exact
                     else triton_attention.paged_attention,
                     rms_norm=triton_layers.rms_norm,
                     rotary_embedding=triton_layers.rotary_embedding,
                     silu_and_mul=triton_layers.silu_and_mul)
