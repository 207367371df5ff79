"""The flat-bucket layout of a cross-process update: every tensor's bucket, dtype, shape and
byte offset, planned once and reused while the names, shapes and dtypes stay the same."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .wire import expect, expect_list, parse_json

# Every tensor starts at a multiple of this many bytes, so a bucket's bytes can be viewed
# as any dtype.
ALIGNMENT = 16

TensorEntry = tuple[str, str, tuple[int, ...]]


@dataclass(frozen=True, slots=True)
class TensorSlot:
    """Where one tensor lies in its bucket."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        """The tensor's size in bytes."""
        return math.prod(self.shape) * self.dtype.itemsize

    def view(self, buffer: torch.Tensor) -> torch.Tensor:
        """The tensor as a view into a bucket's byte buffer."""
        return buffer[self.offset:self.offset + self.nbytes].view(self.dtype).view(self.shape)


@dataclass(frozen=True, slots=True)
class Bucket:
    """One flat buffer's worth of tensors."""

    nbytes: int
    slots: tuple[TensorSlot, ...]

    def pack(self, buffer: torch.Tensor, tensors: dict[str, torch.Tensor]) -> str | None:
        """Copy this bucket's tensors into ``buffer``; the reason it failed, if it did."""
        for slot in self.slots:
            try:
                slot.view(buffer).copy_(tensors[slot.name])
            except (RuntimeError, TypeError) as exc:
                return f"could not pack tensor {slot.name!r} ({exc})"
        return None

    def views(self, buffer: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """Each of this bucket's tensors by name, as a view into ``buffer``."""
        return ((slot.name, slot.view(buffer)) for slot in self.slots)


@dataclass(frozen=True, slots=True)
class Layout:
    """Every tensor's bucket and offset: the metadata sent once and reused."""

    buckets: tuple[Bucket, ...]

    @classmethod
    def plan(cls, tensors: dict[str, torch.Tensor], bucket_bytes: int) -> Layout:
        """Pack ``tensors`` in order into buckets of at most ``bucket_bytes`` (a larger
        tensor alone in its own)."""
        buckets: list[Bucket] = []
        slots: list[TensorSlot] = []
        end = 0
        for name, tensor in tensors.items():
            offset = align_up(end)
            if slots and offset + tensor.nbytes > bucket_bytes:
                buckets.append(Bucket(end, tuple(slots)))
                slots, offset = [], 0
            slots.append(TensorSlot(name, tensor.dtype, tuple(tensor.shape), offset))
            end = offset + tensor.nbytes
        if slots:
            buckets.append(Bucket(end, tuple(slots)))
        return cls(tuple(buckets))

    def tensors(self) -> list[TensorEntry]:
        """Every tensor's ``(name, dtype name, shape)``, in order (dtype as ``"float32"``)."""
        return [(slot.name, dtype_name(slot.dtype), slot.shape)
                for bucket in self.buckets for slot in bucket.slots]

    @property
    def buffer_bytes(self) -> int:
        """The size of a buffer that holds any of the buckets."""
        return max((bucket.nbytes for bucket in self.buckets), default=0)

    def difference(self, expected: list[TensorEntry] | None) -> str | None:
        """Why this layout is not the announced ``expected`` one (None when it is, or when
        none was announced)."""
        if expected is None:
            return None
        sent = self.tensors()
        expected = [(name, dtype, tuple(shape)) for name, dtype, shape in expected]
        if sent == expected:
            return None
        first = next((i for i, (a, b) in enumerate(zip(sent, expected)) if a != b),
                     min(len(sent), len(expected)))
        return (f"the update carries {len(sent)} tensors but {len(expected)} were announced; "
                f"they first differ at tensor {first}: sent "
                f"{sent[first] if first < len(sent) else None}, announced "
                f"{expected[first] if first < len(expected) else None}")

    def to_json(self) -> str:
        """The layout as JSON: per bucket, its bytes and ``[name, dtype, shape, offset]``s."""
        return json.dumps([[bucket.nbytes, [[slot.name, dtype_name(slot.dtype),
                                              slot.shape, slot.offset] for slot in bucket.slots]]
                           for bucket in self.buckets])

    @classmethod
    def from_json(cls, text: str | bytes) -> Layout:
        """The layout ``to_json`` wrote, every value checked (it comes from the store).

        Raises:
            ValueError: naming the bucket, tensor and field when ``text`` is not such a
                layout (not JSON, a wrong type, an unknown dtype, a tensor past its bucket).
        """
        buckets = expect(parse_json(text, "the layout"), list, "the layout")
        return cls(tuple(_bucket_from_json(entry, f"layout bucket {index}")
                         for index, entry in enumerate(buckets)))


def _bucket_from_json(entry: Any, what: str) -> Bucket:
    nbytes, slots = expect_list(entry, 2, what)
    bucket = Bucket(expect(nbytes, int, f"{what}'s size"), tuple(
        _slot_from_json(slot, f"{what}, tensor {index}")
        for index, slot in enumerate(expect(slots, list, f"{what}'s tensors"))))
    for slot in bucket.slots:
        if slot.offset % ALIGNMENT or slot.offset + slot.nbytes > bucket.nbytes:
            raise ValueError(f"{what}: tensor {slot.name!r} ({slot.nbytes} bytes at offset "
                             f"{slot.offset}) must lie within the bucket's {bucket.nbytes} "
                             f"bytes at a multiple of {ALIGNMENT}")
    return bucket


def _slot_from_json(entry: Any, what: str) -> TensorSlot:
    name, dtype, shape, offset = expect_list(entry, 4, what)
    shape = tuple(expect(size, int, f"{what}'s shape") for size in
                  expect(shape, list, f"{what}'s shape"))
    return TensorSlot(expect(name, str, f"{what}'s name"), _dtype(dtype, f"{what}'s dtype"),
                      shape, expect(offset, int, f"{what}'s offset"))


def _dtype(name: Any, what: str) -> torch.dtype:
    """The torch dtype ``dtype_name`` spelled (looked up among torch's dtypes only)."""
    dtype = vars(torch).get(expect(name, str, what))
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{what} {name!r} is not a torch dtype")
    return dtype


def align_up(offset: int) -> int:
    """The first multiple of ``ALIGNMENT`` at or after ``offset``."""
    return -(-offset // ALIGNMENT) * ALIGNMENT


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype's name as ``torch`` spells its attribute (``"float32"``)."""
    return str(dtype).removeprefix("torch.")
