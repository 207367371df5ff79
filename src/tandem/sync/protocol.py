"""The staged weight-update protocol every transport runs: begin → load* → commit | abort.

``load`` validates each tensor (known name, shape, floating dtype, finite) and stages it in
the engine's dtype on the engine's device: a copy by default, so the caller may reuse or
change its tensor once ``load`` returns (a streaming receiver refills two buffers). With
``copy=False`` a tensor that already has the engine's dtype and device is staged by
reference: the update then reads each weight twice (the finiteness check, the commit's copy)
and writes it once, and the caller must keep those tensors unchanged until ``commit`` or
``abort`` (``update_weights`` chooses this for a list or a dict's items, see
``LLMEngine.update_weights``). The tensors of one ``load`` are checked together, with one
wait for the device. Nothing touches the serving weights until ``commit``, which copies
every staged tensor in place (one batched ``torch._foreach_copy_``: views and captured
graphs stay valid) under the engine's lock, between steps, and bumps the weight version. A
failed or abandoned update leaves the old weights serving.

Aliasing (``alias=True``) is a different contract: the engine's parameters become the
trainer's tensors, so later updates cost nothing, but they are not atomic: the engine
serves whatever those tensors hold. Its ``commit`` only checks they are finite and bumps
the version; the trainer must not step while the engine generates.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from contextlib import AbstractContextManager
from functools import cached_property
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

    def unalias(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
        """A tensor under another layout's name (transformers' stacked experts) as the
        updatable names and tensors it holds (views), or None for an unknown name."""

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
        copy: stage a copy of every loaded tensor (the caller may change its own once ``load``
            returns); False stages one already in the engine's dtype on its device by
            reference, and the caller keeps it unchanged until ``commit`` or ``abort``.

    Raises:
        ValueError: for a version not above the current one.
    """

    def __init__(self, target: UpdateTarget, version: int | None = None, full: bool = True,
                 alias: bool = False, copy: bool = True) -> None:
        self.target = target
        self.version = next_version(target, version)
        self.full = full
        self.alias = alias
        self.copy = copy
        self.parameters = target.weight_parameters()
        self.staged: dict[str, torch.Tensor] = {}
        self.closed = False

    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Validate and stage tensors; callable any number of times (streaming). The
        finiteness of the tensors of one call is checked together (of aliased ones at
        ``commit``).

        Raises:
            WeightUpdateError: on an unknown name, a wrong shape, a non-floating dtype or a
                non-finite value; the update is aborted and the engine keeps its weights.
        """
        self._check_open()
        try:
            staged = self._stage_all(named_tensors)
            if not self.alias:
                check_all_finite(staged.items())
        except WeightUpdateError:
            self.abort()
            raise
        self.staged.update(staged)

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
            check_all_finite(self.staged.items())

    def _check_open(self) -> None:
        if self.closed:
            raise WeightUpdateError("this weight update is already committed or aborted; "
                                    "begin a new one.")

    def _stage_all(self, named_tensors: Iterable[tuple[str, torch.Tensor]]
                   ) -> dict[str, torch.Tensor]:
        staged = {}
        for trainer_name, tensor in named_tensors:
            name = engine_name(trainer_name)
            if name in self.parameters:
                staged[name] = self._stage(name, trainer_name, tensor)
            elif name not in self.tied:
                for alias, part in self.target.unalias(name, tensor) or [(name, tensor)]:
                    staged[alias] = self._stage(alias, trainer_name, part)
        return staged

    @cached_property
    def tied(self) -> set[str]:
        """The target's tied names, asked for only when a loaded name is not a parameter
        (finding them walks the model's modules twice, about as long as staging a whole
        update)."""
        return self.target.tied_parameter_names()

    def _stage(self, name: str, trainer_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` validated against parameter ``name``, as the update keeps it: by
        reference when aliased (or, without ``copy``, when it already has the parameter's
        dtype and device), else a copy in the parameter's dtype on its device."""
        param = self._parameter(name, trainer_name, tensor)
        tensor = tensor.detach()
        served_as_is = tensor.dtype == param.dtype and tensor.device == param.device
        if self.alias and not served_as_is:
            raise WeightUpdateError(
                f"cannot alias {name!r}: it is {tensor.dtype} on {tensor.device}, the "
                f"engine runs {param.dtype} on {param.device}; update by copy instead.")
        if self.alias or (served_as_is and not self.copy):
            return tensor
        return tensor.to(device=param.device, dtype=param.dtype, copy=True)

    def _parameter(self, name: str, trainer_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The parameter ``tensor`` updates; raises WeightUpdateError when it does not fit."""
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
        return param


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
    """Raise WeightUpdateError when ``tensor`` holds NaN or infinite values (see
    ``check_all_finite``)."""
    check_all_finite([(name, tensor)])


def check_all_finite(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Raise WeightUpdateError naming the first tensor that holds NaN or infinite values.

    Each floating tensor is reduced to a scalar that is finite when all its values are
    (``_finite_witnesses``), and the scalars are checked together: one wait for the device
    per call, not one per tensor (about 300 for a 0.6B model, which cost more than the
    copies). Only a tensor whose scalar is not finite, which finite values can give when a
    sum overflows, is checked value by value (``isfinite`` takes four passes).
    """
    named = [(name, t) for name, t in named_tensors if t.is_floating_point() and t.numel()]
    if not named:
        return
    witnesses = _finite_witnesses([tensor for _, tensor in named])
    if bool(torch.isfinite(witnesses).all()):
        return
    for (name, tensor), witness in zip(named, witnesses.tolist()):
        if not math.isfinite(witness) and not bool(torch.isfinite(tensor).all()):
            raise WeightUpdateError(f"weight {name!r} holds NaN or infinite values (in the "
                                    "engine's dtype); nothing was applied.")


def _finite_witnesses(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Per tensor (floating, non-empty) a scalar that is NaN or infinite when any of its
    values is, and finite otherwise except where a sum overflows.

    On CPU each tensor's float32 sum: one pass without a temporary, ten times faster there
    than ``torch._foreach_norm``. On an accelerator the largest magnitude (``max |x|``,
    NaN-propagating, never overflowing) of every tensor from ``torch._foreach_norm``, a few
    kernel launches for them all: a reduction per tensor would spend longer launching than
    the device spends reading the weights. Tensors on several devices (never an update's,
    which are all on the engine's) are summed and read back one by one.
    """
    if len({tensor.device for tensor in tensors}) > 1:
        return torch.tensor([float(tensor.sum(dtype=torch.float32)) for tensor in tensors])
    if tensors[0].device.type == "cpu":
        return torch.stack([tensor.sum(dtype=torch.float32) for tensor in tensors])
    return torch.stack(torch._foreach_norm(tensors, math.inf))
