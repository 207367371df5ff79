"""The staged weight-update protocol every transport runs: begin → load* → commit | abort.

``load`` validates each tensor (known name, shape, floating dtype, finite) and stages a
copy in the engine's dtype on the engine's device; nothing touches the serving weights until
``commit``, which copies every staged tensor in place (``param.copy_``, so views and
captured graphs stay valid) under the engine's lock, between steps, and bumps the weight
version. A failed or abandoned update leaves the old weights serving.

Aliasing (``alias=True``) is a different contract: the engine's parameters become the
trainer's tensors, so later updates cost nothing, but they are not atomic: the engine
serves whatever those tensors hold. Its ``commit`` only checks they are finite and bumps
the version; the trainer must not step while the engine generates.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Protocol

import torch

from .names import engine_name


class WeightUpdateError(RuntimeError):
    """A weight update was refused or failed; the engine still serves its previous weights."""


class UpdateTarget(Protocol):
    """What an engine offers to a weight update."""

    weight_version: int

    def weight_parameters(self) -> dict[str, torch.Tensor]:
        """Every updatable parameter by Hugging Face name (a tied one under one name)."""

    def tied_parameter_names(self) -> set[str]:
        """Names that share another parameter's tensor (accepted and ignored)."""

    def commit_weights(self, staged: dict[str, torch.Tensor], version: int,
                       alias: bool) -> None:
        """Swap the staged tensors in between steps and move to ``version``."""


class LoraTarget(UpdateTarget, Protocol):
    """What an engine offers to ``LoraSync``: a weight update's target (merged adapters go
    through ``commit_weights``) that can also serve an adapter at run time."""

    def commit_lora(self, factors: dict[str, tuple[torch.Tensor, torch.Tensor, float]],
                    version: int, lora_id: int) -> None:
        """Serve a run-time adapter from the next step on, in place of any earlier one.

        ``factors`` maps a weight name (``...q_proj.weight``) to ``(A, B, scale)``; the
        targeted layers add ``scale · (x A^T) B^T``, the others serve their plain weights.
        Moves to ``version``, with ``lora_id`` in the prefix-cache key.

        Raises:
            ValueError: for a weight that has no run-time LoRA layer.
        """


class WeightUpdate(AbstractContextManager):
    """One staged update of a target's weights (begin is construction).

    Args:
        target: the engine.
        version: the new weight version (default: current + 1); must exceed the current one.
        full: every parameter must be loaded before ``commit`` (False allows a subset).
        alias: adopt the given tensors instead of copying them (see the module docstring).

    Raises:
        ValueError: for a version not above the current one.
    """

    def __init__(self, target: UpdateTarget, version: int | None = None, full: bool = True,
                 alias: bool = False) -> None:
        self.target = target
        self.version = next_version(target, version)
        self.full = full
        self.alias = alias
        self.parameters = target.weight_parameters()
        self.tied = target.tied_parameter_names()
        self.staged: dict[str, torch.Tensor] = {}
        self.closed = False

    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Validate and stage tensors; callable any number of times (streaming).

        Raises:
            WeightUpdateError: on an unknown name, a wrong shape, a non-floating dtype or a
                non-finite value; the update is aborted and the engine keeps its weights.
        """
        self._check_open()
        try:
            for trainer_name, tensor in named_tensors:
                name = engine_name(trainer_name)
                if name not in self.tied:
                    self.staged[name] = self._stage(name, trainer_name, tensor)
        except WeightUpdateError:
            self.abort()
            raise

    def commit(self) -> int:
        """Swap the staged weights in and return the new weight version.

        Raises:
            WeightUpdateError: when a full update lacks parameters; nothing is applied.
        """
        self._check_open()
        try:
            self._check_complete()
        except WeightUpdateError:
            self.abort()
            raise
        self.target.commit_weights(self.staged, self.version, self.alias)
        self.closed = True
        self.staged = {}
        return self.version

    def abort(self) -> None:
        """Drop everything staged; the engine keeps its weights."""
        self.staged = {}
        self.closed = True

    def __exit__(self, exc_type, exc, traceback) -> None:
        if self.closed:
            return
        if exc_type is None:
            self.commit()
        else:
            self.abort()

    def _check_complete(self) -> None:
        missing = sorted(set(self.parameters) - set(self.staged)) if self.full else []
        if missing:
            raise WeightUpdateError(f"full weight update lacks {len(missing)} parameters, "
                                    f"e.g. {missing[:5]}; nothing was applied (send them all, "
                                    "or use full=False for a partial update).")
        if self.alias:
            for name, tensor in self.staged.items():
                check_finite(name, tensor)

    def _check_open(self) -> None:
        if self.closed:
            raise WeightUpdateError("this weight update is already committed or aborted; "
                                    "begin a new one.")

    def _stage(self, name: str, trainer_name: str, tensor: torch.Tensor) -> torch.Tensor:
        param = self.parameters.get(name)
        if param is None:
            raise WeightUpdateError(f"unknown weight {trainer_name!r} (engine name {name!r}); "
                                    "the engine's names are Hugging Face's, e.g. "
                                    f"{next(iter(self.parameters))!r}.")
        if tensor.shape != param.shape:
            raise WeightUpdateError(f"weight {name!r} has shape {tuple(tensor.shape)}, the "
                                    f"engine expects {tuple(param.shape)}.")
        if not tensor.is_floating_point():
            raise WeightUpdateError(f"weight {name!r} has dtype {tensor.dtype}; send floating "
                                    "point tensors.")
        if self.alias:
            if tensor.dtype != param.dtype or tensor.device != param.device:
                raise WeightUpdateError(
                    f"cannot alias {name!r}: it is {tensor.dtype} on {tensor.device}, the "
                    f"engine runs {param.dtype} on {param.device}; update by copy instead.")
            return tensor.detach()
        staged = tensor.detach().to(device=param.device, dtype=param.dtype, copy=True)
        check_finite(name, staged)
        return staged


def next_version(target: UpdateTarget, version: int | None) -> int:
    """The version an update moves ``target`` to: ``version``, or the current one plus one.

    Raises:
        ValueError: for a version not above the target's current one.
    """
    version = target.weight_version + 1 if version is None else version
    if version <= target.weight_version:
        raise ValueError(f"weight version {version} is not above the engine's current "
                         f"{target.weight_version}: pass a larger version or None.")
    return version


def check_finite(name: str, tensor: torch.Tensor) -> None:
    """Raise WeightUpdateError when ``tensor`` holds NaN or infinite values.

    A finite sum proves every value finite (NaN and infinities propagate), in one pass
    without a temporary; only a non-finite sum, which finite values can also give by
    overflowing, is checked value by value (``isfinite`` takes four passes: 60% of a CPU
    update's time).
    """
    if tensor.is_floating_point() and math.isfinite(float(tensor.sum(dtype=torch.float32))):
        return
    if not bool(torch.isfinite(tensor).all()):
        raise WeightUpdateError(f"weight {name!r} holds NaN or infinite values (in the "
                                "engine's dtype); nothing was applied.")
