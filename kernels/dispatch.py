"""Kernel backends: the Triton kernels on CUDA, the torch references on CPU.

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

from . import attention, layers

BACKENDS = ("auto", "triton", "torch")


@dataclass(frozen=True, slots=True)
class KernelOps:
    """One backend's kernels; every pair of backends shares these signatures.

    ``cascade`` says whether ``paged_attention`` uses ``AttentionMetadata.cascade``
    (the runner builds it only then).
    """

    name: str
    cascade: bool
    store_kv: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    rms_norm: Callable[..., torch.Tensor | tuple[torch.Tensor, torch.Tensor]]
    rotary_embedding: Callable[..., None]
    silu_and_mul: Callable[..., torch.Tensor]


TORCH_OPS = KernelOps("torch", cascade=True, store_kv=attention.store_kv,
                      paged_attention=attention.paged_attention, rms_norm=layers.rms_norm,
                      rotary_embedding=layers.rotary_embedding,
                      silu_and_mul=layers.silu_and_mul)


def check_backend(backend: str) -> None:
    """Raise ValueError, naming the valid ones, unless ``backend`` is one of ``BACKENDS``."""
    if backend not in BACKENDS:
        raise ValueError(f"attention_backend={backend!r} is invalid: use one of "
                         f"{', '.join(map(repr, BACKENDS))}.")


def select_kernels(backend: str, device: torch.device) -> KernelOps:
    """The kernels for ``backend`` on ``device``: ``"auto"`` is Triton on CUDA, else torch.

    Raises:
        ValueError: for an unknown backend, or ``"triton"`` on a CPU without the Triton
            interpreter.
    """
    check_backend(backend)
    if backend == "torch" or (backend == "auto" and device.type != "cuda"):
        return TORCH_OPS
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"attention_backend='triton' on {device.type} needs the Triton "
                         "interpreter: set TRITON_INTERPRET=1 before Triton is imported, or "
                         "use attention_backend='torch'.")
    return _triton_ops()


def _triton_ops() -> KernelOps:
    # Imported here so that the CPU path never imports Triton.
    from . import triton_attention, triton_layers

    return KernelOps("triton", cascade=False, store_kv=triton_attention.store_kv,
                     paged_attention=triton_attention.paged_attention,
                     rms_norm=triton_layers.rms_norm,
                     rotary_embedding=triton_layers.rotary_embedding,
                     silu_and_mul=triton_layers.silu_and_mul)
