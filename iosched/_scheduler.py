"""Per-device queues: a queue-depth limit and priority classes, demand first.

Each drive admits at most ``depth`` reads at once (its queue depth: deeper queues add latency
without bandwidth once the drive is saturated, see docs/benchmarks.md).  Reads waiting for a
slot are served by class, then in arrival order:

* ``DEMAND``: an engine awaits the expert now;
* ``PREFETCH``: a real prefetch, a load with a reserved slot that nobody awaits yet;
* ``HINT``: a page-cache hint (``posix_fadvise(WILLNEED)``), which owns nothing and goes only
  when no read of a higher class waits.

A demand acquire that joins a queued prefetch *promotes* it (:meth:`Ticket.promote`): its reads
jump the queue instead of a second read being issued.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools

DEMAND = 0
PREFETCH = 1
HINT = 2


class Ticket:
    """The priority of one load, shared by all its reads; promotion re-queues waiting reads.
    ``prefetch`` says what started the load and stays when a demand promotes it: its bytes
    were moved ahead of demand (``migration_bytes``) either way."""

    __slots__ = ("priority", "prefetch", "_waiting")

    def __init__(self, priority: int) -> None:
        self.priority = priority
        self.prefetch = priority == PREFETCH
        self._waiting: list[tuple["DeviceQueue", "_Waiter"]] = []

    def promote(self) -> None:
        if self.priority == DEMAND:
            return
        self.priority = DEMAND
        for queue, waiter in self._waiting:
            queue._push(waiter, DEMAND)


class _Waiter:
    __slots__ = ("fut", "priority")

    def __init__(self, fut: "asyncio.Future[None]", priority: int) -> None:
        self.fut = fut
        self.priority = priority


class DeviceQueue:
    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.in_flight = 0
        self._heap: list[tuple[int, int, _Waiter]] = []
        self._seq = itertools.count()
        self._live = 0
        """Waiters not yet served nor cancelled (the heap also holds stale entries)."""
        self.waited = 0
        """Reads that found the queue full and waited for a slot."""

    @property
    def queued(self) -> int:
        """Reads waiting for a slot now."""
        return self._live

    def _push(self, waiter: _Waiter, priority: int) -> None:
        waiter.priority = priority
        heapq.heappush(self._heap, (priority, next(self._seq), waiter))  # older entries go stale

    async def acquire(self, ticket: Ticket) -> None:
        """Wait for a slot on this device, in ``ticket``'s class; cancellation-safe."""
        if self.in_flight < self.depth and self._live == 0:
            self.in_flight += 1
            return
        self.waited += 1
        self._live += 1
        waiter = _Waiter(asyncio.get_running_loop().create_future(), ticket.priority)
        self._push(waiter, ticket.priority)
        entry = (self, waiter)
        ticket._waiting.append(entry)
        try:
            await waiter.fut
        except asyncio.CancelledError:
            if waiter.fut.done() and not waiter.fut.cancelled():
                self.release()  # the slot was handed over as we were cancelled: pass it on
            else:
                self._live -= 1
                waiter.fut.cancel()  # its heap entries are skipped from now on
            raise
        finally:
            ticket._waiting.remove(entry)

    def release(self) -> None:
        self.in_flight -= 1
        while self._heap and self.in_flight < self.depth:
            priority, _, waiter = heapq.heappop(self._heap)
            if waiter.fut.done() or priority != waiter.priority:
                continue  # cancelled, or a stale entry left behind by a promotion
            self.in_flight += 1
            self._live -= 1
            waiter.fut.set_result(None)
