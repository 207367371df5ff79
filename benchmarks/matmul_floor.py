"""The machine's limit for a model's linear layers: the fastest matmul kernel at each row count.

The floors of ``grpo_cpu.py`` and ``cpu_latency.py`` come from here. For each row count of a
sweep and each linear shape of the model (q, k, v, o, gate, up, down, the LM head), every
kernel below multiplies random inputs of that many rows by each of the model's real weights of
that shape in turn (so the weights stream from memory as in a forward pass, instead of one
weight staying in cache); the best of three passes after an untimed one is that kernel's
time, and the fastest kernel's is the floor's. Kernels:

- ``F.linear``: ``torch.nn.functional.linear`` on the weight as stored;
- ``mm W^T``: ``torch.mm`` on a contiguous transposed copy of the weight;
- ``oneDNN packed``: the weight reordered once into oneDNN's blocked layout
  (``torch.ops.mkldnn._reorder_linear_weight``), then ``torch.ops.mkldnn._linear_pointwise``
  (where oneDNN packs the dtype: float32, and bfloat16 only with AVX-512 or AVX-NE-CONVERT);
- ``panels (C)``: Tandem's own ``cpu_linear.c`` on the weight in panels, in float32 or
  bfloat16 (where the C kernels build), at any row count (the ``"panels"`` layout; the
  ``"onednn"`` one takes them up to ``PANEL_ROWS`` rows in float32).

A run's floor sums, over its steps, each shape's fastest time at the step's row count,
interpolated linearly in the row count between the two nearest sweep points (exact at them).
Attention, norms, rotary embedding and sampling are left out: the floor is the matmul work
alone, which no engine avoids. A kernel ``DROPPED_BEHIND`` times slower than the fastest at
a row count is not timed at larger ones ("-" in the table).

Run::

    python benchmarks/matmul_floor.py
    python benchmarks/matmul_floor.py --dtype bfloat16 --rows 1 8 64 512
"""

from __future__ import annotations

import argparse
import bisect
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from common import (
    DTYPES,
    PROJECTIONS,
    load_hf_model,
    model_folder,
    print_table,
    setup_torch,
    timed,
)

from tandem.kernels import cpu_build
from tandem.kernels.cpu_linear import packs, panel_layout, panel_linear

Apply = Callable[[torch.Tensor], torch.Tensor]
SWEEP = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
PASSES = 3
# A kernel this many times slower than the fastest at a row count is not timed at more rows
# (its column reads "-"): on an AVX2 CPU (2026-12-04, commit 42b1960), bfloat16 `mm W^T` ran
# at 1 GFLOP/s, and timing it up to 1024 rows took longer than the benchmark it served.
DROPPED_BEHIND = 8.0


def kernels(dtype: torch.dtype) -> dict[str, Callable[[torch.Tensor], Apply]]:
    """Each kernel as ``prepare(weight) -> apply(x)``; preparing happens once, untimed."""
    found: dict[str, Callable[[torch.Tensor], Apply]] = {
        "F.linear": lambda w: lambda x: F.linear(x, w),
        "mm W^T": lambda w: (lambda wt: lambda x: torch.mm(x, wt))(w.t().contiguous()),
    }
    if packs(dtype):
        found["oneDNN packed"] = lambda w: (lambda p: lambda x: torch.ops.mkldnn._linear_pointwise(
            x, p, None, "none", [], ""))(torch.ops.mkldnn._reorder_linear_weight(w, None))
    if dtype in cpu_build.DTYPES and cpu_build.available():
        found["panels (C)"] = lambda w: (lambda p: lambda x: panel_linear(x, p, w.shape[0], None))(
            panel_layout(w))
    return found


def shape_groups(model: torch.nn.Module) -> dict[str, list[torch.Tensor]]:
    """The model's linear weights grouped by role (every layer's q_proj together, ...)."""
    groups = {name: [getattr(getattr(layer, block), name).weight.detach()
                     for layer in model.model.layers] for block, name in PROJECTIONS}
    groups["lm_head"] = [model.lm_head.weight.detach()]
    return groups


def pass_seconds(applies: list[Apply], x: torch.Tensor) -> float:
    """The best of ``PASSES`` timed passes (after one untimed) of ``x`` through every weight."""
    best = float("inf")
    for attempt in range(PASSES + 1):
        start = time.perf_counter()
        for apply in applies:
            apply(x)
        if attempt:
            best = min(best, time.perf_counter() - start)
    return best


@dataclass
class MatmulFloor:
    """Per role and sweep row count, each kernel's seconds for one pass over the role's weights."""

    groups: dict[str, list[torch.Tensor]]
    sweep: tuple[int, ...] = SWEEP
    seconds: dict[tuple[str, str, int], float] = field(default_factory=dict)

    @classmethod
    def measure(cls, model: torch.nn.Module, sweep: tuple[int, ...] = SWEEP,
                role: str | None = None) -> MatmulFloor:
        """Time every kernel on every role of ``model`` (or on ``role`` alone) at every row
        count of ``sweep``."""
        groups = shape_groups(model)
        floor = cls({role: groups[role]} if role else groups, tuple(sorted(sweep)))
        dtype = next(iter(floor.groups.values()))[0].dtype
        with torch.inference_mode():
            for role, weights in floor.groups.items():
                applies = {kernel: [prepare(w) for w in weights]
                           for kernel, prepare in kernels(dtype).items()}
                for rows in floor.sweep:
                    x = torch.randn(rows, weights[0].shape[1], dtype=dtype)
                    for kernel, calls in applies.items():
                        floor.seconds[kernel, role, rows] = pass_seconds(calls, x) \
                            if calls else math.inf
                    fastest = floor.fastest(role, rows)
                    for kernel in applies:  # far behind: not timed at more rows
                        if floor.seconds[kernel, role, rows] > DROPPED_BEHIND * fastest:
                            applies[kernel] = []
        return floor

    def kernel_names(self) -> list[str]:
        """The kernels measured, in measuring order."""
        return list(dict.fromkeys(kernel for kernel, _, _ in self.seconds))

    def fastest(self, role: str, rows: int) -> float:
        """The fastest kernel's seconds for ``role`` at sweep point ``rows``."""
        return min(self.seconds[k, role, rows] for k in self.kernel_names())

    def role_seconds(self, role: str, rows: int) -> float:
        """The floor's seconds for ``role`` at any row count, interpolated between sweep points."""
        if rows <= 0:
            return 0.0
        sweep = self.sweep
        if rows >= sweep[-1]:
            return self.fastest(role, sweep[-1]) * rows / sweep[-1]
        upper = bisect.bisect_left(sweep, rows)
        if sweep[upper] == rows or upper == 0:
            return self.fastest(role, sweep[upper]) * (rows / sweep[upper] if upper == 0 else 1)
        low, high = sweep[upper - 1], sweep[upper]
        weight = (rows - low) / (high - low)
        return (1 - weight) * self.fastest(role, low) + weight * self.fastest(role, high)

    def step_seconds(self, rows: int, head_rows: int) -> float:
        """The floor of one step: ``rows`` rows through every projection, ``head_rows`` through
        the LM head."""
        return sum(self.role_seconds(role, head_rows if role == "lm_head" else rows)
                   for role in self.groups)

    def run_seconds(self, steps: list[tuple[int, int]]) -> float:
        """The floor of a run: the sum over its ``(rows, LM-head rows)`` steps."""
        return sum(self.step_seconds(rows, head_rows) for rows, head_rows in steps)

    def flops(self, rows: int, roles: list[str]) -> float:
        """The floating-point operations of ``rows`` rows through the layers of ``roles``."""
        return sum(2 * rows * w.numel() for role in roles for w in self.groups[role])

    def table(self, role: str | None = None) -> list[tuple[str, ...]]:
        """GFLOP/s per row count over the whole model (or over ``role``'s layers alone):
        each kernel, then the fastest per role (the floor)."""
        names, roles = self.kernel_names(), [role] if role else list(self.groups)
        rows_out = [("rows", *names, "floor", "fastest")]
        for rows in self.sweep:
            per_kernel = [sum(self.seconds[k, r, rows] for r in roles) for k in names]
            floor = sum(self.fastest(r, rows) for r in roles)
            best = names[per_kernel.index(min(per_kernel))]
            flops = self.flops(rows, roles)
            rows_out.append((str(rows), *(f"{flops / s / 1e9:.1f}" if s < math.inf else "-"
                                          for s in per_kernel),
                             f"{flops / floor / 1e9:.1f}", best))
        return rows_out


def floor_seconds(model: torch.nn.Module, steps: list[tuple[int, int]]) -> tuple[float, float]:
    """The floor of a run of ``steps`` (``(rows, LM-head rows)`` each) on ``model``'s weights,
    with the other processes' CPU share while the sweep was measured. The sweep stops at the
    first point at or above the run's largest row count (beyond 1024 rows, extrapolated)."""
    largest = max(max(step) for step in steps)
    sweep = tuple(rows for rows in SWEEP if rows < largest) + (
        next((rows for rows in SWEEP if rows >= largest), SWEEP[-1]),)
    floor, _, others_cpu = timed(lambda: MatmulFloor.measure(model, sweep))
    return floor.run_seconds(steps), others_cpu


def parse_args() -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--rows", type=int, nargs="+", default=list(SWEEP))
    parser.add_argument("--role", choices=[name for _, name in PROJECTIONS] + ["lm_head"],
                        help="time this layer role alone (default: every linear layer)")
    return parser.parse_args()


def main() -> None:
    """Measure the sweep on the embedded model and print whole-model GFLOP/s per kernel."""
    args = parse_args()
    setup_torch()
    model = load_hf_model(model_folder(), args.dtype)
    floor = MatmulFloor.measure(model, tuple(args.rows), args.role)
    layers = args.role or "q/k/v/o/gate/up/down and the LM head"
    print(f"matmul floor: embedded SmolLM2-135M-Instruct linear layers, {args.dtype}, "
          f"threads={torch.get_num_threads()}; GFLOP/s over {layers} "
          "(floor: the fastest kernel per layer role)")
    print_table(floor.table(args.role))


if __name__ == "__main__":
    main()
