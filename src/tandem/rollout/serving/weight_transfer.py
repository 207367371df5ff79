"""The server's end of the weight-transfer endpoints: a ``WeightReceiver`` driven over HTTP.

vLLM's four phases map onto ``tandem.sync.distributed`` like this:

- ``init``: join the trainer's group (its ``WeightSender`` hosts the store at
  ``master_address:master_port`` as rank 0; this engine is rank ``rank_offset``).
- ``start``: open an update; only one is open at a time.
- ``update``: receive one ``WeightSender.send`` (streamed, bucketed, all or nothing), after
  checking it carries the announced names, dtypes and shapes; may repeat.
- ``finish``: close the update; returns the weight version now served.

The receiver lives beside the engine, in the engine core (a process of its own, or a
thread of this one): its join and each receive run there as threaded core calls, so each
received update commits between two steps (through the engine's lock) while generation
goes on; every completion reports the weight versions it was sampled under.
"""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from typing import TYPE_CHECKING

from prometheus_client import Histogram

if TYPE_CHECKING:
    from .async_engine import AsyncLLMEngine


class WeightTransferStateError(RuntimeError):
    """A weight-transfer call came out of order (e.g. ``update`` before ``start``)."""


class WeightTransferTimeoutError(RuntimeError):
    """The trainer's group did not form within the weight-transfer timeout."""


class WeightTransfer:
    """One engine's weight-transfer state: whether its core's receiver joined a group, and
    the update now open.

    Args:
        async_engine: drives the engine core whose receiver it runs.
        timeout: the longest wait of any step of the group (joining, each update).
        sync_seconds: where each received update's duration is recorded.
    """

    def __init__(self, async_engine: AsyncLLMEngine, timeout: timedelta,
                 sync_seconds: Histogram) -> None:
        self.async_engine = async_engine
        self.timeout = timeout
        self.sync_seconds = sync_seconds
        self.joined = False
        self.update_open = False
        self._busy = asyncio.Lock()

    async def init(self, master_address: str, master_port: int, rank_offset: int,
                   world_size: int) -> None:
        """Join the trainer's group; returns once the sender and every engine connected.

        Raises:
            ValueError: for a rank outside 1..world_size - 1.
            WeightTransferStateError: while an update is being received.
            WeightTransferTimeoutError: when the group did not form within the timeout
                (nothing is kept: a later init starts afresh).
        """
        async with self._exclusive():
            self.joined = False
            self.update_open = False
            try:
                await self.async_engine.call_core(
                    "join_weight_group", master_address, master_port, world_size,
                    rank_offset, self.timeout, threaded=True)
            except TimeoutError as exc:  # the store unreachable, or a rank missing
                raise WeightTransferTimeoutError(self._no_group(master_address, master_port,
                                                                exc)) from exc
            self.joined = True

    def _no_group(self, master_address: str, master_port: int, exc: Exception) -> str:
        cause = str(exc).partition("\n")[0].rstrip(".")  # drop a C++ stack trace
        return (f"no weight-transfer group formed with the trainer's store at "
                f"{master_address}:{master_port} within {self.timeout.total_seconds():g} s "
                f"({cause}): start the trainer's WeightSender (which hosts the store) before "
                "this call, or raise --weight-transfer-timeout.")

    def start(self) -> None:
        """Open an update.

        Raises:
            WeightTransferStateError: before ``init``, or while another update is open.
        """
        self._check_ready()
        if self.update_open:
            raise WeightTransferStateError("a weight update is already open: call "
                                           "/finish_weight_update first.")
        self.update_open = True

    async def update(self, expected: list[tuple[str, str, tuple[int, ...]]] | None) -> int:
        """Receive one update from the sender and commit it; returns the new weight version.

        Raises:
            WeightTransferStateError: before ``init`` or ``start``, or during another receive.
            WeightUpdateError: when the update was refused or the sender was lost; the
                engine keeps serving its previous weights.
        """
        self._check_open()
        async with self._exclusive():
            start = time.perf_counter()
            version = await self.async_engine.call_core("receive_weights", self.timeout,
                                                        expected, threaded=True)
            self.sync_seconds.observe(time.perf_counter() - start)
            return version

    def finish(self) -> int:
        """Close the open update; returns the weight version now served.

        Raises:
            WeightTransferStateError: when no update is open.
        """
        self._check_open()
        self.update_open = False
        return self.async_engine.engine.weight_version

    def _check_ready(self) -> None:
        if not self.joined:
            raise WeightTransferStateError("weight transfer is not initialised: call "
                                           "/init_weight_transfer_engine first.")

    def _check_open(self) -> None:
        self._check_ready()
        if not self.update_open:
            raise WeightTransferStateError("no weight update is open: call "
                                           "/start_weight_update first.")

    def _exclusive(self) -> asyncio.Lock:
        if self._busy.locked():
            raise WeightTransferStateError("a weight transfer call is already running: wait "
                                           "for it to return.")
        return self._busy
