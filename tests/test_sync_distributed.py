"""Weight updates across processes over gloo: equal to a fresh engine, many updates without a
restart, refusals surfacing in the trainer, a killed trainer detected within the timeout."""

from __future__ import annotations

import itertools
import os
import signal
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tandem.rollout import LLM
from tandem.sync import WeightReceiver, WeightSender, WeightUpdateError
from tandem.sync.distributed.layout import ALIGNMENT, Bucket, Layout, align_up
from tests.test_weight_update import completions, fresh_completions, trainer_model

HOST = "127.0.0.1"
TIMEOUT = timedelta(seconds=5)
# The tiny Llama's weights take ~450 kB: several buckets, and its embedding (80 kB) needs one
# of its own.
BUCKET_BYTES = 64 << 10
PATIENCE = 120.0  # seconds to wait for a child process's answer before failing the test
# Engines run where LLM puts them (CUDA when there is one); a sender on CPU uses gloo, one on
# the engine's GPU uses CUDA IPC.
SENDER_DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


def engine_process(folder: str, port: int, conn: Connection, options: dict | None = None
                   ) -> None:
    """An engine (of ``options``) in its own process: on each command, receives an update,
    generates, or returns its weights."""
    torch.set_num_threads(1)
    llm = LLM(folder, **(options or {}))
    conn.send("ready")
    receiver = WeightReceiver(llm, HOST, port, world_size=2, rank=1, timeout=TIMEOUT)
    for command in iter(conn.recv, "stop"):
        if command == "generate":
            conn.send((completions(llm), llm.stats()["weight_version"]))
            continue
        if command == "weights":
            conn.send({n: p.detach().to("cpu", copy=True)
                       for n, p in llm.engine.weight_parameters().items()})
            continue
        try:
            conn.send(receiver.receive(wait=timedelta(seconds=PATIENCE)))
        except WeightUpdateError as exc:
            conn.send(str(exc))


def trainer_that_stops_process(folder: str, port: int, conn: Connection,
                               signal_number: int) -> None:
    """A trainer that sends itself ``signal_number`` as it packs its third bucket, after two
    went out: SIGKILL closes its sockets, SIGSTOP leaves them open and silent."""
    torch.set_num_threads(1)
    state = trainer_model(Path(folder), seed=9).state_dict()
    packed = itertools.count()
    pack = Bucket.pack

    def pack_then_stop(*args):
        if next(packed) == 2:
            os.kill(os.getpid(), signal_number)
        return pack(*args)

    Bucket.pack = pack_then_stop
    conn.send("ready")
    sender = WeightSender(HOST, port, 2, bucket_bytes=BUCKET_BYTES, timeout=TIMEOUT)
    sender.send(state.items())


def answer(conn: Connection):
    assert conn.poll(PATIENCE), "the other process did not answer"
    return conn.recv()


@contextmanager
def child(target, folder: Path, *args) -> Iterator[tuple[int, Connection, mp.Process]]:
    """Start ``target(folder, port, conn, *args)`` in a spawned process; yield its port, pipe
    and process once it is ready."""
    context = mp.get_context("spawn")
    conn, child_conn = context.Pipe()
    port = free_port()
    process = context.Process(target=target, args=(str(folder), port, child_conn, *args),
                              daemon=True)
    process.start()
    try:
        assert answer(conn) == "ready"
        yield port, conn, process
    finally:
        if process.is_alive():
            conn.send("stop")
            process.join(10)
        if process.is_alive():
            process.kill()


@contextmanager
def remote_engine(folder: Path, device: str = "cpu", options: dict | None = None
                  ) -> Iterator[tuple[WeightSender, Connection]]:
    """A sender on ``device`` here and an engine (``engine_process``, of ``options``) in a
    child process."""
    with child(engine_process, folder, options) as (port, conn, _):
        yield WeightSender(HOST, port, 2, device, BUCKET_BYTES, TIMEOUT), conn


def push(sender: WeightSender, conn: Connection, named_tensors, **kwargs):
    """Send an update; the sender's result (version or error) and the engine's answer."""
    conn.send("receive")
    try:
        sent = sender.send(named_tensors, **kwargs)
    except WeightUpdateError as exc:
        sent = exc
    return sent, answer(conn)


def remote_completions(conn: Connection) -> tuple[list[list[int]], int]:
    conn.send("generate")
    return answer(conn)


def assert_engine_holds(conn: Connection, state: dict[str, torch.Tensor]) -> None:
    conn.send("weights")
    weights = answer(conn)
    assert weights.keys() == state.keys()
    assert all(torch.equal(weights[name], tensor) for name, tensor in state.items())


def test_layout_packs_in_order_and_gives_a_large_tensor_its_own_bucket():
    generator = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(3, generator=generator),           # 12 bytes
               "b": torch.randn(1, generator=generator).half(),    # at 16
               "big": torch.randn(40, generator=generator),        # 160 bytes > a bucket
               "c": torch.randn(2, 3, generator=generator).double()}
    layout = Layout.plan(tensors, bucket_bytes=64)
    assert [[slot.name for slot in bucket.slots] for bucket in layout.buckets] == [
        ["a", "b"], ["big"], ["c"]]
    assert [slot.offset for slot in layout.buckets[0].slots] == [0, 16]
    assert [bucket.nbytes for bucket in layout.buckets] == [18, 160, 48]
    assert Layout.from_json(layout.to_json()) == layout
    buffer = torch.zeros(layout.buffer_bytes, dtype=torch.uint8)
    for slot in layout.buckets[0].slots:
        slot.view(buffer).copy_(tensors[slot.name])
    assert all(torch.equal(slot.view(buffer), tensors[slot.name])
               for slot in layout.buckets[0].slots)


def test_align_up_rounds_to_the_next_multiple_of_the_alignment():
    assert [align_up(offset) for offset in (0, 1, ALIGNMENT - 1, ALIGNMENT, ALIGNMENT + 1)] == [
        0, ALIGNMENT, ALIGNMENT, ALIGNMENT, 2 * ALIGNMENT]


@pytest.mark.parametrize("sender_device", SENDER_DEVICES)
def test_update_across_processes_equals_fresh_engine_from_saved_weights(llama_dir, tmp_path,
                                                                        sender_device):
    trainer = trainer_model(llama_dir, seed=1)
    with remote_engine(llama_dir, sender_device) as (sender, conn):
        before, _ = remote_completions(conn)
        assert push(sender, conn, trainer.state_dict().items()) == (1, 1)
        after, version = remote_completions(conn)
        assert_engine_holds(conn, trainer.state_dict())
    assert len(sender.layout.buckets) > 3 and version == 1
    assert after != before
    assert after == fresh_completions(trainer, llama_dir, tmp_path)


def test_a_quantized_engine_quantizes_what_the_sender_sends(llama_dir, tmp_path):
    # The trainer sends float weights; the receiving engine quantizes them in its commit:
    # it then serves what a fresh quantized engine on the saved weights serves.
    trainer = trainer_model(llama_dir, seed=8)
    with remote_engine(llama_dir, options={"quantization": "int8"}) as (sender, conn):
        before, _ = remote_completions(conn)
        assert push(sender, conn, trainer.state_dict().items()) == (1, 1)
        after, _ = remote_completions(conn)
    trainer.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((llama_dir / name).read_bytes())
    assert after != before
    assert after == completions(LLM(str(tmp_path), quantization="int8"))


@pytest.mark.parametrize("sender_device", SENDER_DEVICES)
def test_ten_updates_without_restart_reuse_the_layout_until_it_changes(llama_dir, tmp_path,
                                                                       sender_device):
    trainer = trainer_model(llama_dir, seed=2)
    with remote_engine(llama_dir, sender_device) as (sender, conn):
        for step in range(10):
            with torch.no_grad():
                for param in trainer.parameters():
                    param.mul_(1.0 + 0.01 * step)
            named = [(f"module.{n}", t) for n, t in trainer.state_dict().items()]
            partial = step == 5  # a subset: a new layout, then the full one again
            named = named[:4] if partial else named
            assert push(sender, conn, named, full=not partial) == (step + 1, step + 1)
            remote_completions(conn)
        final, version = remote_completions(conn)
        assert_engine_holds(conn, trainer.state_dict())
    assert version == 10 and sender.layout_number == 3
    assert final == fresh_completions(trainer, llama_dir, tmp_path)


def refused_updates(state: dict[str, torch.Tensor]):
    """(the rank that refuses, what its reason says, the tensors) for each refusal."""
    name = "model.layers.1.mlp.down_proj.weight"
    yield 1, "NaN", {**state, name: state[name].clone().fill_(float("nan"))}
    yield 1, "unknown weight", {**state, "model.layers.0.extra.weight": state[name]}
    yield 1, "lacks 1 parameters", {n: t for n, t in state.items() if n != name}
    yield 0, "could not pack", {**state, name: torch.empty_like(state[name], device="meta")}


def test_refused_update_raises_in_the_sender_and_the_engine_keeps_serving(llama_dir):
    state = trainer_model(llama_dir, seed=3).state_dict()
    with remote_engine(llama_dir) as (sender, conn):
        before = remote_completions(conn)
        for rank, reason, tensors in refused_updates(state):
            sent, received = push(sender, conn, tensors.items())
            assert isinstance(sent, WeightUpdateError)
            assert reason in str(sent) and reason in received
            assert f"rank {rank}: " in str(sent) + received
            assert "keeps serving weight version 0" in received
            assert remote_completions(conn) == before
        assert push(sender, conn, state.items()) == (1, 1)


@pytest.mark.parametrize("signal_number", [signal.SIGKILL, signal.SIGSTOP],
                         ids=["killed", "stopped"])
def test_lost_sender_is_detected_within_the_timeout(llama_dir, signal_number):
    llm = LLM(str(llama_dir))
    before = completions(llm)
    with child(trainer_that_stops_process, llama_dir, signal_number) as (port, _, process):
        receiver = WeightReceiver(llm, HOST, port, world_size=2, rank=1, timeout=TIMEOUT)
        start = time.monotonic()
        with pytest.raises(WeightUpdateError, match="lost the sender.*keeps serving weight "
                                                    "version 0"):
            receiver.receive(wait=timedelta(seconds=PATIENCE))
        elapsed = time.monotonic() - start
        if signal_number == signal.SIGKILL:
            process.join(timeout=5)  # a killed child is alive until it is reaped
        assert process.is_alive() == (signal_number == signal.SIGSTOP)
        process.kill()
    assert elapsed < TIMEOUT.total_seconds() + 2
    assert receiver.update_number == 1 and receiver.layout_number == 1
    assert llm.stats()["weight_version"] == 0 and completions(llm) == before


def test_an_update_unlike_the_announced_one_is_refused_naming_the_difference():
    generator = torch.Generator().manual_seed(0)
    layout = Layout.plan({"a": torch.randn(2, generator=generator),
                          "b": torch.randn(3, generator=generator).half()}, bucket_bytes=64)
    assert layout.tensors() == [("a", "float32", (2,)), ("b", "float16", (3,))]
    assert layout.difference(None) is None
    assert layout.difference([["a", "float32", [2]], ["b", "float16", [3]]]) is None
    reason = layout.difference([("a", "float32", (2,)), ("b", "float32", (3,))])
    assert "first differ at tensor 1" in reason and "'float16'" in reason
    assert "2 tensors but 1 were announced" in layout.difference([("a", "float32", (2,))])
