"""A model's weight spec: where each Hugging Face tensor goes in the engine's parameters.

A checkpoint, a trainer's ``named_parameters()`` and a weight update all speak Hugging
Face's names and shapes. A model family may store them otherwise: several tensors stacked
in one parameter (vLLM's ``gate_up_proj``; a mixture of experts' stacked experts). The spec
maps each Hugging Face name to a ``WeightTarget``: the parameter, how tensor parallelism
splits the tensor, and the slot of the parameter it fills. The loader, tensor parallelism,
weight updates, LoRA and the trainer's exact forward read it; no name table lives outside
the model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

# A slot: per level, (index, parts) selects along dim 0 the index-th of ``parts`` equal
# parts, or with parts a tuple of row counts the index-th of parts of those sizes (q, k and v
# of grouped-query attention), or with parts None the index-th entry of a stacked dimension
# (removing it).
Slot = tuple[tuple[int, int | tuple[int, ...] | None], ...]


@dataclass(frozen=True, slots=True)
class WeightTarget:
    """Where one Hugging Face tensor goes.

    Attributes:
        parameter: the engine parameter's name.
        split: how tensor parallelism splits the Hugging Face tensor
            (``tensor_parallel.SPLITS``; None: every rank holds it whole).
        slot: the part of the parameter (on this rank) the tensor fills; empty: all of it.
    """

    parameter: str
    split: str | None = None
    slot: Slot = ()

    def view(self, parameter: torch.Tensor) -> torch.Tensor:
        """The part of ``parameter`` (this rank's) that this tensor fills, as a view."""
        for index, parts in self.slot:
            if parts is None:
                parameter = parameter[index]
            elif isinstance(parts, tuple):
                start = sum(parts[:index])
                parameter = parameter[start:start + parts[index]]
            else:
                size = parameter.shape[0] // parts
                parameter = parameter[index * size:(index + 1) * size]
        return parameter


WeightSpec = Mapping[str, WeightTarget]


def views(spec: WeightSpec, parameters: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every Hugging Face tensor of ``spec`` as a view of the parameter part it fills."""
    return {name: target.view(parameters[target.parameter]) for name, target in spec.items()}


def assemble(spec: WeightSpec, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The engine's parameters, by name, built from Hugging Face ``tensors`` (differentiably:
    a parameter of several slots is their concatenation or stack, one of one slot the tensor
    itself). A name ``spec`` lacks passes through as it is."""
    slotted: dict[str, list[tuple[tuple, torch.Tensor]]] = {}
    out = {}
    for name, tensor in tensors.items():
        target = spec.get(name)
        if target is None or not target.slot:
            out[target.parameter if target else name] = tensor
        else:
            slotted.setdefault(target.parameter, []).append((target.slot, tensor))
    for parameter, pieces in slotted.items():
        out[parameter] = _join(sorted(pieces, key=lambda piece: piece[0]))
    return out


def _join(pieces: list[tuple[tuple, torch.Tensor]]) -> torch.Tensor:
    """The tensor whose slots are ``pieces`` (sorted), one level at a time."""
    if not pieces[0][0]:
        return pieces[0][1]
    groups: dict[int, list[tuple[tuple, torch.Tensor]]] = {}
    for slot, tensor in pieces:
        groups.setdefault(slot[0][0], []).append((slot[1:], tensor))
    joined = [_join(groups[index]) for index in sorted(groups)]
    stacked = pieces[0][0][0][1] is None
    return torch.stack(joined) if stacked else torch.cat(joined)
