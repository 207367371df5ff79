"""The GPU check's decode-during-receive section (issue 56): decode tokens/s while full weight
updates arrive, against the same decode with none in flight.

A sender process (a trainer's end: ``WeightSender``) pushes new weights 8 times over CUDA
IPC (both processes on the one GPU; gloo on CPU); a thread of the engine's process receives
them (``WeightReceiver``, as the server's weight-transfer endpoints do), each committed
between two steps, while the main thread decodes 64 sequences with overlapped steps. The
row: decode tok/s in that window and with no update in flight, each update's seconds, and
whether every weight afterwards equals the one sent, bit for bit, at the version 8 updates
later. ``gpu_check_devices.py`` runs the same pair over NCCL, the engine on a second GPU.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import torch
import torch.multiprocessing as mp
from gpu_check_common import Recorder, collect, make_llm, sync
from gpu_check_engine import perturbed, save_weights
from gpu_check_throughput import decode_tok_s, decoding
from safetensors.torch import load_file
from serve_client import free_port

from tandem.rollout import LLM
from tandem.sync import WeightReceiver, WeightSender

HOST = "127.0.0.1"
TIMEOUT = timedelta(seconds=60)  # any wait of the pair (a sender starts in seconds)


def sender_process(checkpoint: str, port: int, updates: int, device: str) -> None:
    """The trainer's end: ``checkpoint``'s tensors on ``device``, pushed ``updates`` times
    back to back once the engine has joined."""
    state = load_file(checkpoint, device=device)
    sender = WeightSender(HOST, port, world_size=2, device=device, timeout=TIMEOUT)
    for _ in range(updates):
        sender.send(state.items())


class Receiving:
    """A thread receiving ``updates`` updates into an engine: each one's seconds, the version
    after the last, and the first error's text (a receiver that failed ends the thread)."""

    def __init__(self, receiver: WeightReceiver, updates: int) -> None:
        self.receiver = receiver
        self.updates = updates
        self.seconds: list[float] = []
        self.version: int | None = None
        self.error: str | None = None
        self.thread = threading.Thread(target=self._receive, daemon=True)

    def _receive(self) -> None:
        try:
            for _ in range(self.updates):
                start = time.perf_counter()
                self.version = self.receiver.receive()
                self.seconds.append(time.perf_counter() - start)
        except Exception as error:  # noqa: BLE001 - reported in the row
            self.error = f"{type(error).__name__}: {error}"[:300]

    def row(self) -> dict:
        """The updates' figures for a result row."""
        return dict(updates=len(self.seconds), mode=self.receiver.group.mode,
                    receive_s=round(statistics.median(self.seconds), 4) if self.seconds
                    else None, version=self.version, error=self.error)


@contextmanager
def receiving(llm: LLM, checkpoint: Path, updates: int, sender_device: str
              ) -> Iterator[Receiving]:
    """A sender process on ``sender_device`` pushing ``checkpoint`` ``updates`` times and the
    ``Receiving`` of ``llm``'s end, joined (not started); the sender is ended after."""
    port = free_port()
    sender = mp.get_context("spawn").Process(
        target=sender_process, args=(str(checkpoint), port, updates, sender_device),
        daemon=True)
    sender.start()
    try:
        yield Receiving(WeightReceiver(llm, HOST, port, world_size=2, rank=1,
                                       timeout=TIMEOUT), updates)
    finally:
        sender.join(timeout=30)
        if sender.is_alive():
            sender.terminate()
            sender.join()


def decode_while_receiving(llm: LLM, batch: int, receiving: Receiving,
                           max_steps: int) -> tuple[int, float]:
    """Start ``receiving`` and decode ``batch`` sequences until it ends (at most
    ``max_steps`` steps): the steps run and their seconds, device work included."""
    engine = llm.engine
    with decoding(llm, batch, max_steps):
        sync()
        start = time.perf_counter()
        receiving.thread.start()
        steps = 0
        while receiving.thread.is_alive() and steps < max_steps:
            engine.step()
            steps += 1
        sync()
        seconds = time.perf_counter() - start
    receiving.thread.join()
    return steps, seconds


def weights_sent(llm: LLM, checkpoint: Path) -> dict:
    """How many of the engine's weights equal ``checkpoint``'s tensors bit for bit, of how
    many the checkpoint holds."""
    sent = load_file(checkpoint, device=str(llm.engine.runner.device))
    held = llm.engine.weight_parameters()
    equal = sum(name in held and torch.equal(held[name], tensor) for name, tensor in sent.items())
    return dict(weights_equal=f"{equal}/{len(sent)}", all_equal=equal == len(sent))


def new_weights(llm: LLM, base: Path, folder: Path) -> Path:
    """``llm``'s weights perturbed (``perturbed``, seed 3), saved as a model folder beside
    ``base``'s config; returns its checkpoint."""
    weights = perturbed({n: p.detach() for n, p in llm.engine.weight_parameters().items()}, 3)
    return save_weights(base, folder, weights) / "model.safetensors"


def check_receive_decode(rec: Recorder, folder: Path, work: Path) -> None:
    """Decode tok/s with updates in flight against none (see the module docstring)."""
    batch, updates, max_steps = (4, 2, 16) if rec.smoke else (64, 8, 256)
    llm = make_llm(rec, folder)
    checkpoint = new_weights(llm, folder, work / "received")
    decode_tok_s(llm, batch, 4)  # warm-up: both measurements find the engine warm
    quiet = decode_tok_s(llm, batch, 4 if rec.smoke else 64)
    before = llm.engine.weight_version
    with receiving(llm, checkpoint, updates, str(rec.device)) as updating:
        steps, seconds = decode_while_receiving(llm, batch, updating, max_steps)
    row = updating.row()
    sent = weights_sent(llm, checkpoint)
    busy = batch * steps / seconds
    rec.record("receive_decode", "decode tok/s during full updates over none", batch=batch,
               steps=steps, receiving_tok_s=round(busy, 1), quiet_tok_s=round(quiet, 1),
               ratio=round(busy / quiet, 3), **row, **sent,
               ok=sent["all_equal"] and row["error"] is None
               and row["version"] == before + updates)
    del llm
    collect()
