"""Which requests the server's loop accepts, and for how long each may run.

``Admission`` bounds the requests accepted but not yet running (``max_num_waiting``): past
the bound, or once the server drains for shutdown, a new request is refused with
``ServerUnavailableError`` (503) while every accepted one goes on. A ``Deadline``
(``request_timeout``, or a request's own ``timeout``) ends a request with
``RequestTimeoutError`` (504) once it passes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import TypeVar

RETRY_AFTER_SECONDS = 1  # about one batch's worth of steps: the queue moves within it
T = TypeVar("T")


class ServerUnavailableError(Exception):
    """A request refused for now: ``max_num_waiting`` requests already wait, or the server
    is shutting down. ``retry_after`` is the seconds to wait before retrying, None when
    retrying this server is pointless (it is going away)."""

    def __init__(self, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RequestTimeoutError(Exception):
    """A request that passed its deadline (``request_timeout`` or its ``timeout``); it has
    been aborted and its blocks are freed."""


@dataclass(slots=True)
class Admission:
    """The count of requests accepted but not yet running, and the check against its bound.

    ``num_queued`` are accepted but not yet added to the engine (a pause holds some, others
    wait for the engine thread); ``engine_waiting`` are the ids in the scheduler's waiting
    queue, as of the last engine call. A request counts once whatever its ``n`` (its group
    waits as one sequence and is admitted at once).
    """

    max_num_waiting: int | None
    num_queued: int = 0
    engine_waiting: set[str] = field(default_factory=set)
    draining: bool = False

    @property
    def num_waiting(self) -> int:
        """Requests accepted but not yet running."""
        return self.num_queued + len(self.engine_waiting)

    def check_open(self) -> None:
        """Refuse every request once the server drains for shutdown.

        Raises:
            ServerUnavailableError: while draining.
        """
        if self.draining:
            raise ServerUnavailableError("the server is shutting down and takes no new "
                                         "requests: send them to another replica.")

    def check(self, num_requests: int) -> None:
        """Refuse ``num_requests`` more requests unless they can be accepted now.

        Raises:
            ServerUnavailableError: while draining, or when they would pass
                ``max_num_waiting``.
            ValueError: for more requests at once than ``max_num_waiting`` ever allows.
        """
        self.check_open()
        bound = self.max_num_waiting
        if bound is None:
            return
        if num_requests > bound:
            raise ValueError(f"{num_requests} prompts in one request exceed max_num_waiting="
                             f"{bound} (--max-num-waiting): send fewer at once.")
        if self.num_waiting + num_requests > bound:
            raise ServerUnavailableError(
                f"the server is overloaded: {self.num_waiting} requests already wait to run, "
                f"the most max_num_waiting={bound} (--max-num-waiting) allows; retry after "
                f"{RETRY_AFTER_SECONDS} s.", RETRY_AFTER_SECONDS)


@dataclass(frozen=True, slots=True)
class Deadline:
    """When a request must be done: ``at`` on ``time.monotonic()``'s clock, ``timeout``
    seconds after it was queued."""

    timeout: float
    at: float

    @classmethod
    def after(cls, timeout: float | None) -> Deadline | None:
        """The deadline ``timeout`` seconds from now (None: no deadline)."""
        return None if timeout is None else cls(timeout, time.monotonic() + timeout)


async def within(deadline: Deadline | None, awaitable: Awaitable[T]) -> T:
    """``awaitable``'s result, unless ``deadline`` passes first (then it is cancelled).

    Raises:
        RequestTimeoutError: at the deadline.
    """
    if deadline is None:
        return await awaitable
    try:
        return await asyncio.wait_for(awaitable, max(deadline.at - time.monotonic(), 0))
    except TimeoutError:
        raise RequestTimeoutError(
            f"the request passed its deadline of {deadline.timeout:g} s (--request-timeout "
            "or its timeout field) and was aborted.") from None
