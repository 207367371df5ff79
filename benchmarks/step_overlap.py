"""Overlapped steps on a CPU: how much of the host's work per step they hide from a device.

A CPU runs the engine's "device" work synchronously, so it cannot show the overlap by
itself. Here the device is emulated: the engine (Tandem's own, over host_overhead.py's
null model: the host's work is real, the forward pass costs nothing) launches each step
onto a timeline that finishes it ``--device-ms`` after the device is free, and a step's
samples become readable only then (``HostCopy.result`` waits for it, as for a CUDA event).
With overlap off the host waits for each step before it schedules the next: a step costs
the host's work plus the device's. With overlap on (``async_scheduling``) the host prepares
step N+1 while the device runs step N: a step costs the larger of the two.

The table gives, per batch at a 1k-token context, the emulated device time (defaults: an
H200 decoding Qwen3-0.6B: 0.35 ms at batch 1, 2 ms at 64, 6 ms at 256), the wall time per
step both ways, and the device's busy fraction (device time over wall time) both ways,
against issue 46's target of 0.9 (measured on a GPU by the GPU check's profiler row).

Run::

    python benchmarks/step_overlap.py
    python benchmarks/step_overlap.py --batch-sizes 256 --device-ms 3
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from common import print_table, setup_torch
from host_overhead import build_engine, null_forward, prefill, save_tiny_model

from tandem.rollout import LLM
from tandem.rollout.worker.model_runner import ModelRunner

DEVICE_MS = {1: 0.35, 64: 2.0, 256: 6.0}
TARGET_BUSY = 0.9


class EmulatedDevice:
    """One stream of steps, each taking ``ms`` once the previous is done; patches
    ``ModelRunner.launch`` so each step's samples are readable only when it is."""

    def __init__(self) -> None:
        self.ms = 0.0
        self.free_at = 0.0
        self.busy_seconds = 0.0
        launch = ModelRunner.launch

        def emulated(runner, batch, **kwargs):
            copy = launch(runner, batch, **kwargs)
            self.free_at = max(time.perf_counter(), self.free_at) + self.ms / 1e3
            self.busy_seconds += self.ms / 1e3
            return _Delayed(copy, self.free_at)

        ModelRunner.launch = emulated


class _Delayed:
    """A ``HostCopy`` whose result is ready at ``ready_at`` (``perf_counter`` seconds)."""

    def __init__(self, copy, ready_at: float) -> None:
        self.copy, self.ready_at = copy, ready_at
        self.prompt_logprobs = copy.prompt_logprobs

    def result(self):
        wait = self.ready_at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        return self.copy.result()


def step_ms(llm: LLM, device: EmulatedDevice, batch: int, context: int, steps: int,
            overlap: bool) -> tuple[float, float]:
    """Wall milliseconds per decode step and the device's busy fraction, over ``steps``
    steps at ``batch`` x ``context`` (prefilled first; every request aborted after)."""
    engine = llm.engine
    engine.steps.overlap = overlap
    prefill(llm, batch, context, steps + 2, seeded=False)
    device.busy_seconds = 0.0
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    engine.steps.drain(engine.scheduler)  # the last step's samples, as a sync would wait
    wall = time.perf_counter() - start
    busy = device.busy_seconds / wall
    for request_id in list(engine.requests):
        engine.abort_request(request_id)
    return wall * 1e3 / steps, busy


def main() -> None:
    """Measure each batch both ways (median of ``--repeats``) and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device-ms", type=float, default=None,
                        help="one device time for every batch (default: per batch, H200-like)")
    args = parser.parse_args()
    setup_torch()
    device = EmulatedDevice()
    rows = [("batch", "context", "device ms", "off: ms/step", "on: ms/step", "off: busy",
             "on: busy", "target", "met")]
    with tempfile.TemporaryDirectory() as tmp:
        llm = build_engine(save_tiny_model(Path(tmp)), max(args.batch_sizes), args.steps + 2)
        null_forward(llm)
        for batch in args.batch_sizes:
            device.ms = args.device_ms if args.device_ms is not None else DEVICE_MS.get(batch, 2.0)
            results = {}
            for overlap in (False, True):
                step_ms(llm, device, batch, args.context, 8, overlap)  # warm-up
                runs = sorted(step_ms(llm, device, batch, args.context, args.steps, overlap)
                              for _ in range(args.repeats))
                results[overlap] = runs[len(runs) // 2]
            (off_ms, off_busy), (on_ms, on_busy) = results[False], results[True]
            rows.append((str(batch), str(args.context), f"{device.ms:.2f}", f"{off_ms:.2f}",
                         f"{on_ms:.2f}", f"{off_busy:.2f}", f"{on_busy:.2f}",
                         f">= {TARGET_BUSY}", "yes" if on_busy >= TARGET_BUSY else "no"))
    print(f"decode steps against an emulated device (null model, {args.steps} steps, median "
          f"of {args.repeats}); busy: device time over wall time")
    print_table(rows)


if __name__ == "__main__":
    main()
