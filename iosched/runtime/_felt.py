"""The engine's felt wait: how long it waited for the store, as it happens.

The felt wait is the union of the intervals during which some acquire was waiting (six
experts awaited together for 2 ms cost the engine 2 ms, not 12), plus the time a compute
thread of the engine's blocked for a group's next batch (``ArrivalGroup.in_thread``).  The
acquire side writes it (:class:`~iosched.runtime._acquire.Acquirer`); the prefetcher reads it
(:class:`~iosched.runtime._prefetch.EngineWait`) to place the policy's batch-end work, and a
policy that weighs its own CPU reads :meth:`FeltWait.felt_so_far`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from . import _clock
from ._lease import ThreadArrivals


class FeltWait:
    """The engine's wait: acquires waiting now, threads taking batches, and the seconds so far."""

    __slots__ = ("felt_wait_s", "waiting", "_since", "_takers", "_awaited", "_undelivered")

    def __init__(self, undelivered: Callable[[], int]) -> None:
        """``undelivered()``: reads finished whose coroutine has not resumed yet (the backend's
        count, ``Loader.undelivered``)."""
        self.felt_wait_s = 0.0
        """The waits ended so far (a thread's blocked time joins at its group's exit)."""
        self.waiting = 0
        """Acquires waiting now; the felt wait runs while it is above zero."""
        self._since = 0.0
        self._takers: list[ThreadArrivals] = []
        """Threads of the engine's taking a group's batches (``in_thread``), until its exit:
        their blocked time is felt wait as it runs (:meth:`felt_so_far`)."""
        self._awaited: list[asyncio.Future[object]] = []
        """What a group's collect awaits as the engine's felt wait, while it does (empty
        otherwise)."""
        self._undelivered = undelivered

    def starts(self) -> float:
        """One more acquire waits: the felt wait runs from the first; the time now."""
        now = _clock.now()
        if self.waiting == 0:
            self._since = now
        self.waiting += 1
        return now

    def ends(self) -> float:
        """One acquire stopped waiting: the felt wait adds its interval at the last; the time
        now."""
        self.waiting -= 1
        now = _clock.now()
        if self.waiting == 0:
            self.felt_wait_s += now - self._since
        return now

    def awaiting(self, futures: list[asyncio.Future[object]]) -> None:
        """What the engine's felt wait in a group's collect awaits now (``[]``: nothing)."""
        self._awaited = futures

    def thread_takes(self, taker: ThreadArrivals) -> None:
        self._takers.append(taker)

    def thread_done(self, taker: ThreadArrivals) -> None:
        self._takers.remove(taker)
        self.felt_wait_s += taker.blocked_s(_clock.now())

    def engine_waiting(self) -> bool:
        """Whether the engine waits for a load now: an acquire on the loop, or a thread of
        its blocked for a group's batch."""
        return self.waiting > 0 or any(taker.blocked for taker in self._takers)

    def felt_so_far(self) -> float:
        """The felt wait up to now: the waits ended, the one running, and the blocked time of
        the threads taking batches (the stats add those at the group's exit)."""
        now = _clock.now()
        felt = self.felt_wait_s + (now - self._since if self.waiting else 0.0)
        for taker in self._takers:
            felt += taker.blocked_s(now)
        return felt

    def engine_resumes_first(self) -> bool:
        """Whether batch-end work due now should let the engine resume first: a result its
        felt wait awaits is on its way (a read finished whose coroutine has not resumed, or an
        awaited load is done), and the engine will wait again in this group (more loads are
        open than results on their way), where the work can run instead.  Only for a group's
        collect (``acquire_as_ready``): an ``acquire_many`` waits once a batch, so the work
        put off would come after the next batch started, too late (see
        ``Prefetcher._policy_batch_end``)."""
        awaited = self._awaited
        if not awaited:
            return False
        open_loads = sum(1 for f in awaited if not f.done())
        on_the_way = self._undelivered()
        return (on_the_way > 0 or open_loads < len(awaited)) and open_loads > on_the_way
