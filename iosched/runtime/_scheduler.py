"""Per-device queues: a queue-depth limit and priority classes, demand first.

Each drive admits at most ``depth`` reads at once (its queue depth: deeper queues add latency
without bandwidth once the drive is saturated, see docs/benchmarks.md).  Reads waiting for a
slot are served by class, then in arrival order:

* ``DEMAND``: an engine awaits the expert now;
* ``PREFETCH``: a real prefetch, a load with a reserved slot that nobody awaits yet;
* ``HINT``: a page-cache hint (``posix_fadvise(WILLNEED)``), which owns nothing and goes only
  when no read of a higher class waits.

Speculative reads (``PREFETCH``, ``HINT``) use only a drive's idle time: one starts only when
no demand read is in flight on the drive or waiting for it, and at most
``speculative_depth`` of them (default ``max(1, depth // 4)``) are in flight at once, so a
demand read that arrives waits behind at most that many.  Measured why (docs/tried-and-dropped.md,
real-I/O replay): with 2.25 MiB experts on the development VM's disk, prefetches let into
every free slot moved 73 % more bytes than LRU and raised the felt wait per token by 42 % at
one token cycle, though they doubled the hit rate; the drive was the bottleneck, and a
prefetch competing with demand for it delays the very reads it was meant to spare.

Each drive also admits at most ``inflight_bytes`` of reads at once (the setting of that name; a
read larger than it starts alone when nothing else is in flight).  Why: reads in flight share
the drive's bandwidth and finish together (processor sharing), while an engine computing each
expert as it lands (``acquire_as_ready``) could have started on the first one long before the
last; served one after another (first come, first served), the first of a layer's ``n`` misses
lands after about ``1/n`` of the time and the compute overlaps the rest (docs/benchmarks.md,
"One expert at a time on the drive": 2.25 MiB experts, one token cycle, felt wait 84-100 ms a
token with eight reads in flight, 42-45 ms capped).  Smaller reads still go several at once, as
many as fill the cap (576 KiB experts: three), since one alone leaves the drive's latency bare.
The reads of an ``acquire_many`` group, which its engine awaits whole, pass the cap
(``Ticket.ordered`` false; only ``queue_depth`` holds them): order buys them nothing, and one
read at a time moved 8-17 % fewer MB/s at 2.5 MiB (``iosched bench-readpath``) and cost an
engine awaiting whole layers 3-4 % of its tokens/s (same section).  Capped reads still wait
behind them, in order.

A demand acquire that joins a queued prefetch *promotes* it (:meth:`Ticket.promote`): its reads
jump the queue instead of a second read being issued.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools

from . import _clock

DEMAND = 0
PREFETCH = 1
HINT = 2


class Ticket:
    """The priority of one load, shared by all its reads; promotion re-queues waiting reads.
    ``prefetch`` says what started the load and stays when a demand promotes it: its bytes
    were moved ahead of demand (``migration_bytes``) either way.  ``ordered``: the load is
    consumed as it lands, so its reads go through the drive's byte cap (``inflight_bytes``),
    one expert after another; an ``acquire_many`` that awaits its whole group clears it, as
    order buys such a group nothing and the cap costs it bandwidth (module docstring)."""

    __slots__ = ("priority", "prefetch", "ordered", "_waiting")

    def __init__(self, priority: int, ordered: bool = True) -> None:
        self.priority = priority
        self.prefetch = priority == PREFETCH
        self.ordered = ordered
        self._waiting: list[tuple[DeviceQueue, _Waiter]] = []

    def promote(self) -> None:
        if self.priority == DEMAND:
            return
        self.priority = DEMAND
        for queue, waiter in self._waiting:
            if waiter.fut.done():
                continue  # granted (or cancelled) already: no longer counted as waiting
            queue._live_speculative -= 1
            queue._live_demand += 1
            queue._push(waiter, DEMAND)
            queue._dispatch()


class _Waiter:
    __slots__ = ("fut", "priority", "speculative", "nbytes", "capped")

    def __init__(self, fut: asyncio.Future[None], priority: int, nbytes: int, capped: bool) -> None:
        self.fut = fut
        self.priority = priority
        self.nbytes = nbytes
        self.capped = capped
        self.speculative = False
        """Whether the slot it was granted counts as speculative (set when granted)."""


class DeviceQueue:
    def __init__(self, depth: int, speculative_depth: int | None = None, inflight_bytes: int = 0) -> None:
        self.depth = depth
        self.inflight_bytes = inflight_bytes
        """The most bytes in flight at once (0: no limit); a read larger than it starts alone."""
        self.bytes_in_flight = 0
        self.speculative_depth = max(1, depth // 4) if speculative_depth is None else speculative_depth
        self.in_flight = 0
        self.speculative_in_flight = 0
        self._heap: list[tuple[int, int, _Waiter]] = []
        self._seq = itertools.count()
        self._live_demand = 0
        self._live_speculative = 0
        """Waiters not yet served nor cancelled, by class (the heap also holds stale entries)."""
        self.waited = 0
        """Reads that found no slot they could take and waited."""
        self._busy_s = 0.0
        self._busy_since = 0.0

    def busy_seconds(self) -> float:
        """Total time with at least one read in flight on the drive (up to now)."""
        if self.in_flight:
            return self._busy_s + _clock.now() - self._busy_since
        return self._busy_s

    @property
    def queued(self) -> int:
        """Reads waiting for a slot now."""
        return self._live_demand + self._live_speculative

    def _may_start(self, priority: int, nbytes: int, capped: bool = True) -> bool:
        if self.in_flight >= self.depth:
            return False
        if (capped and self.in_flight and self.inflight_bytes
                and self.bytes_in_flight + nbytes > self.inflight_bytes):
            return False
        if priority == DEMAND:
            return True
        return (self.in_flight == self.speculative_in_flight and self._live_demand == 0
                and self.speculative_in_flight < self.speculative_depth)

    def _grant(self, priority: int, nbytes: int) -> bool:
        if self.in_flight == 0:
            self._busy_since = _clock.now()
        self.in_flight += 1
        self.bytes_in_flight += nbytes
        speculative = priority != DEMAND
        self.speculative_in_flight += speculative
        return speculative

    def _push(self, waiter: _Waiter, priority: int) -> None:
        waiter.priority = priority
        heapq.heappush(self._heap, (priority, next(self._seq), waiter))  # older entries go stale

    async def acquire(self, ticket: Ticket, nbytes: int = 0) -> bool:
        """Wait for a slot on this device for a read of ``nbytes``, in ``ticket``'s class;
        cancellation-safe.  Returns whether the slot is a speculative one (pass it back to
        :meth:`release` with the same ``nbytes``)."""
        priority = ticket.priority
        ahead = self._live_demand if priority == DEMAND else self.queued
        capped = ticket.ordered
        if ahead == 0 and self._may_start(priority, nbytes, capped):
            return self._grant(priority, nbytes)
        self.waited += 1
        if priority == DEMAND:
            self._live_demand += 1
        else:
            self._live_speculative += 1
        waiter = _Waiter(asyncio.get_running_loop().create_future(), priority, nbytes, capped)
        self._push(waiter, priority)
        entry = (self, waiter)
        ticket._waiting.append(entry)
        try:
            await waiter.fut
        except asyncio.CancelledError:
            if waiter.fut.done() and not waiter.fut.cancelled():
                self.release(waiter.speculative, nbytes)  # the slot was handed over as we were cancelled
            else:
                if waiter.priority == DEMAND:
                    self._live_demand -= 1
                else:
                    self._live_speculative -= 1
                waiter.fut.cancel()  # its heap entries are skipped from now on
                self._dispatch()  # a cancelled demand may have held speculative reads back
            raise
        finally:
            ticket._waiting.remove(entry)
        return waiter.speculative

    def release(self, speculative: bool = False, nbytes: int = 0) -> None:
        self.in_flight -= 1
        self.bytes_in_flight -= nbytes
        self.speculative_in_flight -= speculative
        if self.in_flight == 0:
            self._busy_s += _clock.now() - self._busy_since
        self._dispatch()

    def _dispatch(self) -> None:
        """Hand free slots to waiters, best class first, while the first may start."""
        heap = self._heap
        while heap:
            priority, _, waiter = heap[0]
            if waiter.fut.done() or priority != waiter.priority:
                heapq.heappop(heap)
                continue  # cancelled, or a stale entry left behind by a promotion
            if not self._may_start(priority, waiter.nbytes, waiter.capped):
                return
            heapq.heappop(heap)
            if priority == DEMAND:
                self._live_demand -= 1
            else:
                self._live_speculative -= 1
            waiter.speculative = self._grant(priority, waiter.nbytes)
            waiter.fut.set_result(None)
