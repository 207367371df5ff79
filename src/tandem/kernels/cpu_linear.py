"""The CPU linear layers: each weight in the layout this machine multiplies fastest.

``torch.nn.functional.linear`` on CPU multiplies by the weight as it is stored, ``[out, in]``
row-major. Two other layouts can be faster, by how much depending on the machine (both are
in ``benchmarks/matmul_floor.py``):

- ``"transposed"``: the weight itself stored column-major (``store_column_major``: still
  ``[out, in]``, the same parameter, its storage a contiguous ``[in, out]`` matrix), so
  ``F.linear`` multiplies by it with no transpose (BLAS's fast case on an AVX-512 Xeon:
  ``benchmarks/cpu_layouts.py``). No copy: an update written
  into the parameter is what the next step multiplies by.
- ``"onednn"``: oneDNN's blocked layout (what vLLM's CPU build and inductor's freezing use):
  a copy (``PackedWeight``: ``torch.ops.mkldnn._reorder_linear_weight`` once, then
  ``_linear_pointwise``), layers that read the same input packed as one matrix. On an AVX2
  EPYC it beats ``F.linear`` at every row count from 1 to 256; in bfloat16 on AMX it is the
  only fast one. In float32 the copy comes with a second one in panels (``panel_layout``)
  that the compiled ``cpu_linear.c`` multiplies at up to ``PANEL_ROWS`` rows (a decode
  step of a few sequences): there a projection is bound by reading its weight, which the
  panels stream at about the machine's read bandwidth, 1.1-1.6x faster than oneDNN, and
  with a shorter rounding chain (``benchmarks/matmul_floor.py``).
- ``"panels"`` (float32 or bfloat16, where the C kernels build): the panels alone, a copy
  that ``cpu_linear.c`` multiplies at every row count, the rows in tiles that stay in L2.
  On an AVX2 EPYC its 6-row register blocks beat oneDNN from 1 to 128 rows (1.15-1.9x) and
  tie it beyond, with one copy of the weights instead of two and a shorter rounding chain
  in the LM head at a GRPO step's 64 rows too; in bfloat16, which that CPU's oneDNN does
  not pack, they convert as they load and run about 7x faster than ``F.linear``. The only
  layout of 8-bit weights (``quantization.py``: int8 or fp8 codes beside a float32 scale
  per output channel, with float32 or bfloat16 activations).

``fastest_layout`` times the candidates (``None``, plain ``F.linear`` on row-major weights,
among them) on the model's own leading layers when the engine loads, so each machine gets
its own best. The choice is remembered in a JSON file per machine (CPU model, threads, torch
version, dtype, the weights' shapes, the candidates and the compiled kernels' code), so
every later engine there takes the same layout:
timing noise must not make two runs of one job differ in their last bits.

A copy (oneDNN's or the panels) is a cache: it is rebuilt whenever any of its weights'
storage or version counter (bumped by every in-place write, such as a weight update's
``copy_``) changes, so it never serves stale weights. A weight whose values change without
either (an aliased trainer tensor) must not be copied: the model drops its copies then
(``pack_linear_weights(None)``).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_build
from .quantization import is_quantized

LAYOUTS = ("transposed", "onednn", "panels")
COPIES = ("onednn", "panels")  # the layouts that multiply through a copy (PackedWeight)
# Decode steps of one sequence, of a few (a server's streams) and of a GRPO batch. Without the
# middle one, an AVX2 EPYC where oneDNN ties F.linear at 1 and 64 rows but is 1.8x faster at 8
# took F.linear, and with it the unpacked LM head (3x slower at 8 rows).
CALIBRATION_ROWS = (1, 8, 64)
CALIBRATION_REPEATS = 3
# A copy doubles the weights' memory: it must beat F.linear by more than the noise.
COPY_MARGIN = 1.05
CHOICE_RULES = 5  # part of a remembered choice's key: bumped when what is timed changes
PANEL = 16  # output rows per panel, as cpu_linear.c's PANEL
# In the "onednn" layout, float32 multiplies through the panels up to this many rows: on
# an AVX2 EPYC faster than oneDNN while the weight's bytes bound the time.
PANEL_ROWS = 16
# The panels' weight formats, as cpu_linear.c's F32, BF16, INT8, FP8.
WEIGHT_FORMATS = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2, torch.float8_e4m3fn: 3}
_POINTER, _INT = ctypes.c_void_p, ctypes.c_int64


def packs(dtype: torch.dtype) -> bool:
    """True when this machine's oneDNN packs weights of ``dtype`` (float32 always; bfloat16
    only with the AVX-512 or AVX-NE-CONVERT instructions its kernels need)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def candidate_layouts(dtype: torch.dtype) -> list[str | None]:
    """The layouts worth timing for ``dtype``: none (``F.linear``), ``"transposed"``,
    ``"onednn"`` where oneDNN packs the dtype, ``"panels"`` for float32 and bfloat16 where
    the C kernels build."""
    panels = dtype in cpu_build.DTYPES and cpu_build.available()
    return [None, "transposed", *(["onednn"] if packs(dtype) else []),
            *(["panels"] if panels else [])]


def column_major(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` ``[out, in]`` with its values stored ``[in, out]`` (itself if already)."""
    return tensor.t().contiguous().t()


def store_column_major(weight: nn.Parameter, as_column_major: bool) -> None:
    """Re-store ``weight`` ``[out, in]`` column-major (its storage ``[in, out]``, the
    ``"transposed"`` layout) or back row-major, in place of its data (values unchanged)."""
    data = weight.data
    if as_column_major and not data.t().is_contiguous():
        weight.data = column_major(data)
    elif not as_column_major and not data.is_contiguous():
        weight.data = data.contiguous()


def panel_layout(weights: torch.Tensor | Sequence[torch.Tensor],
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """``weights`` ``[out, in]`` (one tensor, or several stacked along their outputs) as
    ``cpu_linear.c``'s panels ``[ceil(out / PANEL), in, PANEL]``: each panel ``PANEL`` output
    rows, stored input-major, the last padded with zero rows. Written into ``out`` where it
    is of that shape and dtype (the panels of an earlier version of the weights: a re-layout
    after an update touches no new memory), else into new panels; one strided copy per
    tensor, without stacking them first."""
    pieces = [weights] if isinstance(weights, torch.Tensor) else list(weights)
    if any(piece.shape[0] % PANEL for piece in pieces[:-1]):  # one would start mid-panel
        pieces = [torch.cat(pieces)]
    out_features, in_features = sum(piece.shape[0] for piece in pieces), pieces[0].shape[1]
    shape = (-(-out_features // PANEL), in_features, PANEL)
    if out is None or out.shape != shape or out.dtype != pieces[0].dtype:
        out = pieces[0].new_empty(shape)
    rows = out.transpose(1, 2)  # [panels, PANEL, in]: each panel's rows
    panel = 0
    for piece in pieces:
        full, rest = divmod(piece.shape[0], PANEL)
        rows[panel:panel + full].copy_(piece[:full * PANEL].reshape(full, PANEL, in_features))
        if rest:
            rows[panel + full, :rest].copy_(piece[full * PANEL:])
            rows[panel + full, rest:].zero_()
        panel += full
    return out


def panel_linear(x: torch.Tensor, panels: torch.Tensor, out_features: int,
                 bias: torch.Tensor | None, scales: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T + b`` for ``x`` ``[rows, in]`` (its last dimension contiguous), W given as
    ``panel_layout(W)`` and b, by the compiled kernel: x, b and the panels all float32 or all
    bfloat16 (``cpu_build.DTYPES``), or the panels 8-bit codes (int8 or fp8 e4m3) with their
    float32 ``scales`` ``[out_features]`` (W = scales · codes, ``quantization.py``).

    Raises:
        ValueError: for 8-bit panels without scales, or scales beside float panels.
        MemoryError: when the kernel cannot allocate its float32 copy of a bfloat16 ``x``.
    """
    _check_scales(panels, scales)
    out = torch.empty(x.shape[0], out_features, dtype=x.dtype)
    kernel = cpu_build.kernel("tandem_panel_linear", (
        _POINTER, _INT, _INT, _INT, _POINTER, _INT, _POINTER, _POINTER, _POINTER, _INT,
        ctypes.c_int32, ctypes.c_int32, ctypes.c_int32), ctypes.c_int32)
    _check(kernel(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], panels.data_ptr(),
                  out_features, _pointer(scales), _pointer(bias), out.data_ptr(), out_features,
                  cpu_build.DTYPES[x.dtype], WEIGHT_FORMATS[panels.dtype],
                  torch.get_num_threads()))
    return out


def grouped_panel_linear(x: torch.Tensor, panels: torch.Tensor, offsets: torch.Tensor,
                         out_features: int, scales: torch.Tensor | None = None) -> torch.Tensor:
    """Each expert's rows of ``x`` times its own weight in one call: rows ``offsets[e]`` to
    ``offsets[e + 1]`` of ``x`` ``[rows, in]`` times ``W_e^T``, ``panels`` ``[E, ...]``
    holding each ``panel_layout(W_e)`` (8-bit codes with ``scales`` ``[E, out_features]``,
    as ``panel_linear``), ``offsets`` int64 ``[E + 1]`` from 0. A row's outputs have the
    bits ``panel_linear`` gives it alone (the mixture of experts' CPU path: one call per
    projection instead of one per expert).

    Raises:
        ValueError: for 8-bit panels without scales, or scales beside float panels.
        MemoryError: when the kernel cannot allocate its float32 copy of a bfloat16 ``x``.
    """
    _check_scales(panels, scales)
    out = torch.empty(x.shape[0], out_features, dtype=x.dtype)
    kernel = cpu_build.kernel("tandem_grouped_panel_linear", (
        _POINTER, _INT, _POINTER, _INT, _INT, _POINTER, _INT, _INT, _POINTER, _POINTER,
        _POINTER, _INT, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32), ctypes.c_int32)
    offsets = offsets.to(torch.int64).contiguous()
    _check(kernel(x.data_ptr(), x.stride(0), offsets.data_ptr(), len(offsets) - 1, x.shape[1],
                  panels.data_ptr(), panels[0].numel(), out_features, _pointer(scales), None,
                  out.data_ptr(), out_features, cpu_build.DTYPES[x.dtype],
                  WEIGHT_FORMATS[panels.dtype], torch.get_num_threads()))
    return out


def _check_scales(panels: torch.Tensor, scales: torch.Tensor | None) -> None:
    """Raise ValueError unless 8-bit panels come with their float32 scales, and only they."""
    if is_quantized(panels.dtype) != (scales is not None) or \
            (scales is not None and scales.dtype != torch.float32):
        raise ValueError(f"{panels.dtype} panels take "
                         f"{'float32 scales' if is_quantized(panels.dtype) else 'no scales'}")


def _pointer(tensor: torch.Tensor | None) -> int | None:
    """A contiguous tensor's data pointer for the kernels (None for None)."""
    if tensor is None:
        return None
    if not tensor.is_contiguous():
        raise ValueError("the panel kernel reads biases and scales contiguous")
    return tensor.data_ptr()


def _check(status: int) -> None:
    if status != 0:
        raise MemoryError("the panel kernel could not allocate its float32 copy of the input")


class PackedWeight:
    """A copy of the weights of one or more linear layers that read the same input (q/k/v,
    gate/up), stacked along their outputs, with their biases, in ``layout`` (one of
    ``COPIES``): ``"onednn"``, oneDNN's packed copy and in float32 also the panels
    (``panel_layout``) for up to ``PANEL_ROWS`` rows; ``"panels"``, the panels alone (float32
    or bfloat16 weights, ``cpu_build.DTYPES``, or 8-bit codes with each layer's
    ``weight_scale``, float32 per output channel: ``quantization.py``). Rebuilt whenever any
    of the layers changes. Calling it multiplies by all of them at once."""

    __slots__ = ("layers", "layout", "out_features", "key", "weight", "bias", "panels",
                 "scales")

    def __init__(self, layers: Sequence[nn.Linear], layout: str = "onednn") -> None:
        if layout not in COPIES:
            raise ValueError(f"layout {layout!r} is not a copy: use one of {COPIES}")
        self.layers = tuple(layers)
        self.layout = layout
        self.out_features = sum(layer.out_features for layer in self.layers)
        self.key: tuple[tuple[int, int], ...] | None = None
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self.panels: torch.Tensor | None = None
        self.scales: torch.Tensor | None = None

    def current(self) -> torch.Tensor | None:
        """Refresh the copies if the layers changed; the stacked bias (None without)."""
        tensors = [t for layer in self.layers for t in (layer.weight, layer.bias,
                                                         _weight_scale(layer)) if t is not None]
        key = tuple((t.data_ptr(), t._version) for t in tensors)
        if key != self.key:
            weights = [layer.weight.detach() for layer in self.layers]
            dtype, onednn = weights[0].dtype, self.layout == "onednn"
            _check_panel_dtype(dtype, onednn)
            self.weight = torch.ops.mkldnn._reorder_linear_weight(_stacked(weights), None) \
                if onednn else None
            self.bias = self._stacked_bias()
            self.panels = panel_layout(weights, self.panels) if not onednn or (
                dtype == torch.float32 and cpu_build.available()) else None
            self.scales = _stacked([_weight_scale(layer) for layer in self.layers]) \
                if is_quantized(dtype) else None
            self.key = key
        return self.bias

    def _stacked_bias(self) -> torch.Tensor | None:
        """The layers' biases end to end (zeros for a layer without), None if none has one."""
        biases = [layer.bias for layer in self.layers]
        given = next((bias for bias in biases if bias is not None), None)
        if given is None:
            return None
        return torch.cat([given.new_zeros(layer.out_features) if bias is None
                          else bias.detach() for layer, bias in zip(self.layers, biases)])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W^T + b`` for ``x`` ``[..., in]``, W and b the layers' stacked weights and
        biases: their outputs side by side."""
        bias = self.current()
        if self.weight is not None and (self.panels is None or x.dtype != self.panels.dtype
                                        or x.numel() > PANEL_ROWS * x.shape[-1]):
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, bias, "none", [], "")
        takes = cpu_build.DTYPES if self.scales is not None else (self.panels.dtype,)
        if x.dtype not in takes:
            raise TypeError(f"the panels of {self.panels.dtype} weights multiply "
                            f"{' or '.join(map(str, takes))} inputs, not {x.dtype}")
        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = panel_linear(rows, self.panels, self.out_features, bias, self.scales)
        return out.view(*x.shape[:-1], self.out_features)


def _weight_scale(layer: nn.Module) -> torch.Tensor | None:
    """A layer's per-channel scale of its 8-bit weight (None: not quantized)."""
    return getattr(layer, "weight_scale", None)


def _stacked(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors end to end along their first dimension, contiguous."""
    return (tensors[0] if len(tensors) == 1 else torch.cat(tensors)).contiguous()


def _check_panel_dtype(dtype: torch.dtype, onednn: bool) -> None:
    """Raise TypeError, naming what to use, for weights of ``dtype`` the layout cannot take."""
    if is_quantized(dtype) and onednn:
        raise TypeError(f"{dtype} weights multiply through the panels only: use layout "
                        "'panels'")
    if not onednn and dtype not in cpu_build.DTYPES and not is_quantized(dtype):
        raise TypeError(f"the panels take float32, bfloat16 or 8-bit weights, not {dtype}: "
                        "use plain F.linear (layout None)")


def fastest_layout(groups: Sequence[Sequence[nn.Linear]], dtype: torch.dtype,
                   remembered: Path | None = None) -> str | None:
    """The candidate layout (``candidate_layouts``) that multiplies ``groups`` (each a list
    of layers reading the same input, multiplied as one) fastest: the least sum over
    ``CALIBRATION_ROWS`` of its seconds per pass relative to the fastest candidate's at
    that row count, so no row count dominates; a layout that copies the weights
    (``COPIES``) must be ``COPY_MARGIN`` faster than ``F.linear`` on them. With
    ``remembered`` (a JSON file), a choice made before on this machine for the same shapes
    is taken untimed, and a new one is written there."""
    key = _machine_key(groups, dtype)
    choices = _read_choices(remembered)
    if key in choices:
        return choices[key]
    choice = _timed_choice(groups, dtype)
    if remembered is not None:
        _write_choices(remembered, {**_read_choices(remembered), key: choice})
    return choice


def _timed_choice(groups: Sequence[Sequence[nn.Linear]], dtype: torch.dtype) -> str | None:
    candidates = candidate_layouts(dtype)
    seconds = {layout: [_pass_seconds(groups, layout, rows) for rows in CALIBRATION_ROWS]
               for layout in candidates}
    best = [min(times[i] for times in seconds.values()) for i in range(len(CALIBRATION_ROWS))]
    return min(candidates, key=lambda layout: (COPY_MARGIN if layout in COPIES else 1.0) * sum(
        t / b for t, b in zip(seconds[layout], best, strict=True)))


def _machine_key(groups: Sequence[Sequence[nn.Linear]], dtype: torch.dtype) -> str:
    """A digest of what the timing depends on: the CPU, threads, torch, dtype, shapes, the
    candidates and the compiled kernels' code (a layout added or a kernel changed is timed
    anew, not shadowed by a choice among the old ones)."""
    shapes = [[list(layer.weight.shape) for layer in group] for group in groups]
    parts = [cpu_build.cpu_name(), os.cpu_count(), torch.get_num_threads(), torch.__version__,
             str(dtype), shapes, CHOICE_RULES, candidate_layouts(dtype),
             cpu_build.library_key()]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:32]


def _read_choices(path: Path | None) -> dict[str, str | None]:
    try:
        return json.loads(path.read_text()) if path is not None else {}
    except (OSError, ValueError):  # absent, or torn by a crash: time again
        return {}


def _write_choices(path: Path, choices: dict[str, str | None]) -> None:
    """Write atomically (rename), so concurrent engines never read a partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    staged.write_text(json.dumps(choices, indent=1))
    staged.replace(path)


def _pass_seconds(groups: Sequence[Sequence[nn.Linear]], layout: str | None, rows: int) -> float:
    """The least of ``CALIBRATION_REPEATS`` timed passes of ``rows`` random rows through
    every group in ``layout`` (None: ``F.linear`` per layer; ``"transposed"``: the same on
    column-major copies), after an untimed one."""
    weight = groups[0][0].weight
    inputs = {layer.in_features: torch.randn(rows, layer.in_features, dtype=weight.dtype,
                                             device=weight.device)
              for group in groups for layer in group}
    if layout in COPIES:
        calls = [PackedWeight(group, layout) for group in groups]
        sizes = [group[0].in_features for group in groups]
    else:
        weights = [(column_major(layer.weight.detach()) if layout else layer.weight,
                    layer.bias) for group in groups for layer in group]
        calls = [lambda x, w=w, b=b: F.linear(x, w, b) for w, b in weights]
        sizes = [w.shape[1] for w, _ in weights]
    best = float("inf")
    with torch.no_grad():
        for repeat in range(CALIBRATION_REPEATS + 1):
            start = time.perf_counter()
            for call, size in zip(calls, sizes, strict=True):
                call(inputs[size])
            if repeat:
                best = min(best, time.perf_counter() - start)
    return best
