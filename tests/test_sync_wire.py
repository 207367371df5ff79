"""What a weight transfer's store carries is JSON only, checked before use: CUDA IPC handles
as plain fields rebuilt by one fixed call, layouts and headers refused naming what is wrong,
and a receiver facing a hostile store raising instead of running its payload."""

from __future__ import annotations

import inspect
import json
import pickle
import random
import re
import threading
from datetime import timedelta

import pytest
import torch
from torch.multiprocessing import reductions

from tandem.sync import WeightReceiver, WeightUpdateError
from tandem.sync.distributed import group
from tandem.sync.distributed.group import TransferGroup, rebuild_buffers, share_buffers
from tandem.sync.distributed.layout import Layout
from tests.test_sync_distributed import HOST, free_port

TIMEOUT = timedelta(seconds=10)
NUMEL = 4097  # a bucket buffer of 4 KiB plus one byte
REBUILD_PARAMETERS = [
    "tensor_cls", "tensor_size", "tensor_stride", "tensor_offset", "storage_cls", "dtype",
    "storage_device", "storage_handle", "storage_size_bytes", "storage_offset_bytes",
    "requires_grad", "ref_counter_handle", "ref_counter_offset", "event_handle",
    "event_sync_required"]


def fake_reduction(seed: int) -> tuple:
    """What ``reduce_tensor`` returns for a CUDA uint8 buffer of ``NUMEL`` bytes (as in
    torch/multiprocessing/reductions.py), with random handles."""
    rng = random.Random(seed)
    return (reductions.rebuild_cuda_tensor, (
        torch.Tensor, torch.Size([NUMEL]), (1,), 0, torch.storage.TypedStorage, torch.uint8,
        0, rng.randbytes(64), NUMEL + rng.randrange(512), rng.randrange(1 << 20), False,
        f"/torch_{rng.randrange(1 << 16)}_{rng.randrange(1 << 30)}_0".encode(),
        rng.randrange(10000), rng.randbytes(64), bool(seed % 2)))


@pytest.fixture
def rebuild_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """The arguments of every ``rebuild_cuda_tensor`` call (none runs: there is no GPU)."""
    calls: list[tuple] = []
    monkeypatch.setattr(group, "rebuild_cuda_tensor", lambda *args: calls.append(args))
    return calls


def shared_payload(monkeypatch: pytest.MonkeyPatch) -> tuple[str, list[tuple]]:
    """``share_buffers`` of two buffers whose ``reduce_tensor`` gives fake reductions."""
    reductions_by_buffer = {0: fake_reduction(1), 1: fake_reduction(2)}
    monkeypatch.setattr(group, "reduce_tensor",
                        lambda buffer: reductions_by_buffer[int(buffer[0])])
    payload = share_buffers([torch.tensor([0]), torch.tensor([1])])
    return payload, [reductions_by_buffer[i][1] for i in range(2)]


def test_rebuild_cuda_tensor_takes_the_arguments_in_the_order_we_pass_them():
    assert list(inspect.signature(reductions.rebuild_cuda_tensor).parameters) == \
        REBUILD_PARAMETERS


def test_ipc_handles_travel_as_json_and_rebuild_with_the_receivers_device(monkeypatch,
                                                                          rebuild_calls):
    payload, arguments = shared_payload(monkeypatch)
    assert all(type(value) in (str, int, bool)
               for handle in json.loads(payload) for value in handle.values())
    rebuild_buffers(payload, NUMEL, torch.device("cuda", 1))
    device = REBUILD_PARAMETERS.index("storage_device")
    assert rebuild_calls == [args[:device] + (1,) + args[device + 1:] for args in arguments]
    assert all(call[0] is torch.Tensor and call[4] is torch.storage.TypedStorage
               and call[5] is torch.uint8 for call in rebuild_calls)


def mutated(payload: str, index: int, **changes) -> str:
    """``payload`` with handle ``index``'s fields changed (a field changed to ``...`` is
    dropped)."""
    handles = json.loads(payload)
    handles[index].update(changes)
    return json.dumps([{k: v for k, v in h.items() if v is not ...} for h in handles])


@pytest.mark.parametrize("change, reason", [
    (dict(handle=123), "CUDA IPC handle 1's handle must be a string, got int 123"),
    (dict(event_handle="not base64!"), "CUDA IPC handle 1's event_handle is not base64"),
    (dict(event_sync_required=1), "event_sync_required must be a boolean, got int 1"),
    (dict(ref_counter_offset=True), "ref_counter_offset must be an integer, got bool"),
    (dict(ref_counter_offset=-1), "ref_counter_offset must not be negative"),
    (dict(numel=1 << 40), "do not fit its storage"),
    (dict(numel=NUMEL - 1), f"buffer of {NUMEL - 1} bytes, but the layout's largest bucket "
                            f"needs {NUMEL}"),
    (dict(handle=...), "wrong keys (missing ['handle'], unexpected [])"),
    (dict(rebuild="os.system"), "wrong keys (missing [], unexpected ['rebuild'])"),
], ids=lambda value: str(value)[:30])
def test_a_malformed_ipc_handle_is_refused_naming_the_field(monkeypatch, rebuild_calls,
                                                            change, reason):
    payload, _ = shared_payload(monkeypatch)
    with pytest.raises(ValueError, match=re.escape(reason)):
        rebuild_buffers(mutated(payload, 1, **change), NUMEL, torch.device("cuda", 0))
    assert rebuild_calls == []


@pytest.mark.parametrize("payload, reason", [
    (b"\x80\x04K\x01.", "the CUDA IPC handles is not JSON"),
    ('{"handle": 1}', "the CUDA IPC handles must be a list, got dict"),
    ("[]", "must be 2 (one per bucket buffer), got 0"),
    ('[1, 2]', "CUDA IPC handle 0 must be an object, got int 1"),
])
def test_ipc_handles_that_are_not_two_json_objects_are_refused(rebuild_calls, payload,
                                                               reason):
    with pytest.raises(ValueError, match=re.escape(reason)):
        rebuild_buffers(payload, 1, torch.device("cuda", 0))
    assert rebuild_calls == []


def test_a_layout_round_trips_through_json():
    generator = torch.Generator().manual_seed(3)
    layout = Layout.plan({"a": torch.randn(17, generator=generator),
                          "b": torch.randn(2, 3, generator=generator).half(),
                          "c": torch.randn((), generator=generator)}, bucket_bytes=64)
    assert Layout.from_json(layout.to_json().encode()) == layout


@pytest.mark.parametrize("text, reason", [
    (b"\xff\xfe", "the layout is not JSON"),
    ("[[64, [[\"a\", \"float32\", [2], 0]]]", "the layout is not JSON"),
    ('{"a": 1}', "the layout must be a list, got dict"),
    ("[[64]]", "layout bucket 0 must hold 2 items, got 1"),
    ('[[64, [["a", "load", [2], 0]]]]', "layout bucket 0, tensor 0's dtype 'load' is not a "
                                        "torch dtype"),
    ('[[64, [["a", "float32", [2.5], 0]]]]', "tensor 0's shape must be an integer"),
    ('[[64, [["a", "float32", [2], 0]]], [8, [["b", "float32", [4], 0]]]]',
     "layout bucket 1: tensor 'b' (16 bytes at offset 0) must lie within the bucket's 8 "
     "bytes at a multiple of 16"),
    ('[[64, [["a", "float32", [2], 8]]]]', "(8 bytes at offset 8) must lie within"),
    ('[[-64, []]]', "layout bucket 0's size must not be negative"),
])
def test_a_malformed_layout_is_refused_naming_what_is_wrong(text, reason):
    with pytest.raises(ValueError, match=re.escape(reason)):
        Layout.from_json(text)


class RecordingEngine:
    """The little of an engine a receiver touches, recording what happens to its update."""

    weight_version = 0

    def __init__(self) -> None:
        self.aborted = False

    def weight_update(self, version: int | None, full: bool) -> RecordingEngine:
        return self

    def abort(self) -> None:
        self.aborted = True


def detonate() -> None:
    raise AssertionError("the receiver ran code from the store")


class Exploit:
    def __reduce__(self):
        return detonate, ()


def hostile_pair() -> tuple[TransferGroup, WeightReceiver, RecordingEngine]:
    """A store (rank 0) that writes whatever a test likes, and a receiver joined to it."""
    port, hosts = free_port(), []
    thread = threading.Thread(target=lambda: hosts.append(
        TransferGroup(HOST, port, 2, 0, torch.device("cpu"), TIMEOUT)))
    thread.start()
    engine = RecordingEngine()
    receiver = WeightReceiver(engine, HOST, port, 2, 1, device="cpu", timeout=TIMEOUT)
    thread.join()
    return hosts[0], receiver, engine


HEADER = json.dumps({"layout": 1, "version": None, "full": True})


@pytest.mark.parametrize("header, layout, reason", [
    (HEADER, pickle.dumps(Exploit()), "malformed entry (the layout is not JSON"),
    (HEADER, '[[64, [["a", "float32", [99], 0]]]]', "tensor 'a' (396 bytes at offset 0)"),
    (pickle.dumps(Exploit()), "[]", "malformed entry (the update header is not JSON"),
    ('{"layout": "1", "version": null, "full": true}', "[]",
     "the update header's layout must be an integer, got str '1'"),
    ('{"layout": 1, "full": true}', "[]", "the update header has the wrong keys (missing "
                                          "['version']"),
], ids=["pickled-layout", "tensor-past-bucket", "pickled-header", "string-layout-number",
        "missing-version"])
def test_a_receiver_refuses_a_malformed_store_entry_and_aborts(header, layout, reason):
    store, receiver, engine = hostile_pair()
    try:
        store.store.set("layout/1", layout)
        store.store.set("update/1", header)
        with pytest.raises(WeightUpdateError, match=re.escape(reason)) as refusal:
            receiver.receive(wait=TIMEOUT)
    finally:
        store.abort()
    assert "keeps serving weight version 0; build a new sender and receivers" in \
        str(refusal.value)
    assert engine.aborted is (header == HEADER)


