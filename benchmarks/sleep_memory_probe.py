"""Probe ``ReleasableMemory`` and ``OffloadableWeights`` on one GPU (the CUDA half of sleep).

Checks, each a row of the table printed at the end:

- a region of ``--gib`` GiB takes that much device memory, zeroed, at a tensor viewing it;
- a pattern written over all of it reads back; a CUDA graph captured over its first and
  last pages replays;
- ``release`` frees about ``--gib`` GiB (``torch.cuda.mem_get_info``); ``restore`` from a
  fresh thread (no CUDA context current there) maps it again at the same address, zeroed,
  and it takes writes again;
- the graph captured before the release replays correctly after the restore;
- a second release and restore from this thread, then one bulk copy of the region to a
  pinned host buffer and back (the weights' path), with their seconds and GB/s;
- ``OffloadableWeights`` over a bfloat16 model of about ``--gib`` / 4 GiB: offload frees its
  memory, reload brings every parameter back to its address with its value;
- dropping the region and its views gives its memory back.

Run (the project importable, e.g. ``PYTHONPATH=src``)::

    python benchmarks/sleep_memory_probe.py [--gib 1]

(``--gib`` also sizes the pinned host buffer of the bulk copies: keep it below host memory.)

Exits 1 when a check fails, 2 without CUDA.
"""

from __future__ import annotations

import argparse
import functools
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tandem.rollout.worker.releasable_memory import ReleasableMemory
from tandem.rollout.worker.weight_offload import OffloadableWeights

GIB = 1 << 30
SLACK = 0.95  # of the expected bytes, for what mem_get_info reports freed or taken
CHUNK = 1 << 26  # int32 elements the pattern is written and checked in


class Table:
    """The checks' rows: name, ok, detail."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, bool, str]] = []

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.rows.append((name, bool(ok), detail))
        return bool(ok)

    def print(self) -> None:
        width = max(len(name) for name, _, _ in self.rows)
        print(f"| {'check':<{width}} | ok | detail")
        for name, ok, detail in self.rows:
            print(f"| {name:<{width}} | {'ok' if ok else 'NO'} | {detail}")

    @property
    def failed(self) -> bool:
        return not all(ok for _, ok, _ in self.rows)


def free_bytes(device: torch.device) -> int:
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    result = fn()
    torch.cuda.synchronize(device)
    return result, time.perf_counter() - start


def gib(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.3f} GiB"


def chunks(ints: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    return [(index, ints[start:start + CHUNK])
            for index, start in enumerate(range(0, ints.numel(), CHUNK))]


def write_pattern(ints: torch.Tensor) -> None:
    """Each chunk its element indices plus the chunk's index (no temporary, no overflow)."""
    for index, chunk in chunks(ints):
        torch.arange(chunk.numel(), dtype=torch.int32, device=ints.device, out=chunk)
        chunk.add_(index)


def pattern_holds(ints: torch.Tensor) -> bool:
    return all(bool((chunk == torch.arange(chunk.numel(), dtype=torch.int32,
                                           device=ints.device) + index).all())
               for index, chunk in chunks(ints))


def capture_graph(head: torch.Tensor, tail: torch.Tensor) -> torch.cuda.CUDAGraph:
    """A graph that doubles-plus-one ``head`` and adds one to ``tail``, in place."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch advises
        head.mul_(2).add_(1)
        tail.add_(1)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        head.mul_(2).add_(1)
        tail.add_(1)
    return graph


def replays(graph: torch.cuda.CUDAGraph, head: torch.Tensor, tail: torch.Tensor) -> bool:
    head.fill_(1.0)
    tail.fill_(0.0)
    graph.replay()
    torch.cuda.synchronize(head.device)
    return bool((head == 3.0).all()) and bool((tail == 1.0).all())


def restore_in_new_thread(memory: ReleasableMemory) -> BaseException | None:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            memory.restore()
        except BaseException as error:  # noqa: BLE001 - reported as a failed check
            errors.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return errors[0] if errors else None


def probe_region(table: Table, device: torch.device, num_bytes: int) -> None:
    start_free = free_bytes(device)
    memory, seconds = timed(lambda: ReleasableMemory(num_bytes, device), device)
    taken = start_free - free_bytes(device)
    address = memory.tensor.data_ptr()
    table.check("create: takes the memory", taken >= SLACK * num_bytes,
                f"{gib(taken)} taken, {seconds * 1e3:.1f} ms (reserve, map, zero)")
    table.check("create: a zeroed view on the device", memory.tensor.device == device
                and not memory.tensor.count_nonzero(), f"address {address:#x}")
    ints = memory.view(0, (num_bytes // 4,), torch.int32)
    write_pattern(ints)
    table.check("write: a pattern over all of it reads back", pattern_holds(ints))
    head = memory.view(0, (1 << 20,), torch.float32)
    tail = memory.view(num_bytes - 4096, (1024,), torch.float32)
    graph = capture_graph(head, tail)
    table.check("graph: captured over the first and last pages replays",
                replays(graph, head, tail))

    before_release = free_bytes(device)
    _, seconds = timed(memory.release, device)
    freed = free_bytes(device) - before_release
    table.check("release: frees the memory", freed >= SLACK * num_bytes,
                f"{gib(freed)} freed, {seconds * 1e3:.1f} ms")
    before_restore = free_bytes(device)
    error, seconds = timed(functools.partial(restore_in_new_thread, memory), device)
    retaken = before_restore - free_bytes(device)
    table.check("restore (fresh thread): no error", error is None, repr(error))
    table.check("restore: same address, memory taken again",
                memory.tensor.data_ptr() == address and retaken >= SLACK * num_bytes,
                f"{gib(retaken)} taken, {seconds * 1e3:.1f} ms (map, zero)")
    table.check("restore: zeroed", not memory.tensor.count_nonzero())
    table.check("graph: captured before the release replays after the restore",
                replays(graph, head, tail))
    write_pattern(ints)
    table.check("write: the pattern again reads back", pattern_holds(ints))

    probe_bulk_copies(table, memory, ints)
    del graph, head, tail, ints
    after_probe = free_bytes(device)
    del memory
    returned = free_bytes(device) - after_probe
    table.check("drop: the region's memory goes back", returned >= SLACK * num_bytes,
                f"{gib(returned)} returned")


def probe_bulk_copies(table: Table, memory: ReleasableMemory, ints: torch.Tensor) -> None:
    device, num_bytes = memory.device, memory.num_bytes
    _, release = timed(memory.release, device)
    _, restore = timed(memory.restore, device)
    table.check("release + restore again (this thread)", not memory.released,
                f"{release * 1e3:.1f} + {restore * 1e3:.1f} ms")
    write_pattern(ints)
    host, pin = timed(lambda: torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True),
                      device)
    _, down = timed(lambda: host.copy_(memory.tensor), device)
    memory.release()
    memory.restore()
    _, up = timed(lambda: memory.tensor.copy_(host, non_blocking=True), device)
    table.check("bulk copy to pinned host and back: pattern kept", pattern_holds(ints),
                f"pin {pin * 1e3:.0f} ms, D2H {num_bytes / down / 1e9:.1f} GB/s, "
                f"H2D {num_bytes / up / 1e9:.1f} GB/s")


def probe_weights(table: Table, device: torch.device, num_bytes: int) -> None:
    torch.manual_seed(0)
    width = 4096
    rows = max(1, num_bytes // (2 * width * 2))
    model = nn.Sequential(nn.Embedding(rows, width), nn.Linear(width, width),
                          nn.Linear(width, rows, bias=False)).to(device, torch.bfloat16)
    model[2].weight = model[0].weight  # tied, as Qwen3-0.6B's head
    weights, packing = timed(lambda: OffloadableWeights(model, device), device)
    values = [param.detach().clone() for param in model.parameters()]
    addresses = [param.data_ptr() for param in model.parameters()]
    size = weights.region.num_bytes
    awake = free_bytes(device)
    _, offload = timed(lambda: weights.offload(model), device)
    freed = free_bytes(device) - awake
    table.check("weights: offload frees the region", freed >= SLACK * size,
                f"{gib(freed)} of {gib(size)}, pack {packing * 1e3:.0f} ms, offload (first: "
                f"pins) {offload * 1e3:.0f} ms")
    _, reload = timed(lambda: weights.reload(model), device)
    _, offload = timed(lambda: weights.offload(model), device)
    _, reload = timed(lambda: weights.reload(model), device)
    same = [param.data_ptr() for param in model.parameters()] == addresses and all(
        torch.equal(param, value) for param, value in zip(model.parameters(), values))
    table.check("weights: reload keeps every address and value", same and weights.holds(model),
                f"offload {offload * 1e3:.1f} ms, reload {reload * 1e3:.1f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="the region's size in GiB")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to probe")
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    torch.zeros(1, device=device)  # the runtime makes the primary context, as in an engine
    print(torch.cuda.get_device_name(device), "torch", torch.__version__,
          "CUDA", torch.version.cuda)
    num_bytes = int(args.gib * GIB) // 4096 * 4096
    table = Table()
    for probe in (probe_region, probe_weights):
        try:
            probe(table, device, num_bytes if probe is probe_region else num_bytes // 4)
        except Exception as error:  # noqa: BLE001 - a crash is a failed check too
            table.check(f"{probe.__name__}: ran to the end", False, repr(error))
    table.print()
    return 1 if table.failed else 0


if __name__ == "__main__":
    sys.exit(main())
