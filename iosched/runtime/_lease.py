"""Leases: what ``acquire`` and ``acquire_many`` return.

A lease holds one reference on a resident entry of the store's residency table; while any
lease is held the entry cannot be evicted nor its buffer reused.  A lease knows the store
only through :class:`LeaseSource`, the operations of the acquire path
(``iosched/runtime/_acquire.py``), and remembers which entry it holds, so releasing twice is harmless.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol, cast

from iosched._errors import StoreError
from iosched._layout import ExpertKey, ExpertLayout
from iosched.residency import Entry

from . import _clock
from ._view import ExpertView


class PendingGroup(Protocol):
    """A group's acquires in flight (implemented by ``iosched.runtime._acquire.GroupWait``)."""

    @property
    def pending(self) -> bool:
        """Whether some acquire has not finished yet."""

    async def collect(self, every: bool = False, felt: bool = False) -> list[tuple[int, Entry | BaseException]]:
        """Those finished since the last collect (awaiting one, or ``every`` one), leased."""

    def collect_done(self) -> list[tuple[int, Entry | BaseException]]:
        """Those finished since the last collect, leased, without awaiting."""

    def on_each_finish(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` on the loop as each acquire still open finishes (and once soon
        if some finished already)."""

    async def abandon(self) -> None:
        """Release, unpin or cancel whatever was not collected."""


class LeaseSource(Protocol):
    """What a lease asks of the store (implemented by ``iosched.runtime._acquire.Acquirer``)."""

    def layout_of(self, key: ExpertKey) -> ExpertLayout:
        """The key's layout; :class:`UnknownExpertError` naming it when there is none."""

    def try_hit(self, layout: ExpertLayout) -> Entry | None:
        """Lease a resident expert without awaiting; ``None`` when it is not resident."""

    async def wait_for(self, layout: ExpertLayout) -> Entry:
        """Lease the expert once it is loaded (joining or starting its load)."""

    @property
    def groups_fast(self) -> bool:
        """Whether :meth:`wait_for_group` may serve a group's misses."""

    async def wait_for_group(self, layouts: list[ExpertLayout]) -> list[Entry | BaseException]:
        """:meth:`wait_for` of each, awaited together: each one's leased entry or its error."""

    def start_group(self, layouts: list[ExpertLayout]) -> PendingGroup:
        """Start (or join) the loads of ``layouts``, the acquires :meth:`try_hit` missed."""

    async def submitted(self) -> None:
        """Return once the loads just started have reached the device."""

    def release(self, entry: Entry) -> None:
        """End one lease of ``entry``."""

    def batch_done(self) -> None:
        """An ``acquire_many`` holds all its leases: the engine computes on that layer now."""

    def thread_takes(self, taker: ThreadArrivals) -> None:
        """A thread of the engine's takes a group's batches: its blocked time is felt wait."""

    def thread_done(self, taker: ThreadArrivals) -> None:
        """The group exited: its thread's blocked time joins the felt wait for good."""


def _view_of(entry: Entry) -> ExpertView:
    view: ExpertView = entry.payload.view
    return view


class Lease:
    """``async with store.acquire(key) as view``: holds the expert resident until exit."""

    __slots__ = ("_source", "_key", "_entry")

    def __init__(self, source: LeaseSource, key: ExpertKey) -> None:
        self._source = source
        self._key = key
        self._entry: Entry | None = None

    async def __aenter__(self) -> ExpertView:
        if self._entry is not None:
            raise StoreError(f"lease of {self._key!r} entered twice")
        source = self._source
        layout = source.layout_of(self._key)
        entry = source.try_hit(layout)
        if entry is None:
            entry = await source.wait_for(layout)
        self._entry = entry
        return _view_of(entry)

    async def __aexit__(self, *exc_info: object) -> None:
        self.release()

    def release(self) -> None:
        """End the lease (what ``__aexit__`` does); a no-op when not held."""
        entry, self._entry = self._entry, None
        if entry is not None:
            self._source.release(entry)


class LeaseGroup:
    """``async with store.acquire_many(keys) as views``: all of a layer's experts at once.

    The loads run concurrently; the group is entered when every lease is held.  If one
    acquire fails or the caller is cancelled, the leases already taken are released before
    the error propagates, so a group never leaks a lease.
    """

    __slots__ = ("_source", "_keys", "_leases")

    def __init__(self, source: LeaseSource, keys: Iterable[ExpertKey]) -> None:
        self._source = source
        self._keys = list(keys)
        self._leases: list[Lease] = []

    async def __aenter__(self) -> list[ExpertView]:
        source = self._source
        layouts = [source.layout_of(key) for key in self._keys]
        leases = [Lease(source, key) for key in self._keys]
        views: list[ExpertView | None] = [None] * len(leases)
        pending: dict[asyncio.Task[ExpertView], int] = {}
        missed: list[int] = []
        try_hit = source.try_hit
        for i, (lease, layout) in enumerate(zip(leases, layouts, strict=True)):
            entry = try_hit(layout)
            if entry is not None:
                lease._entry = entry
                views[i] = entry.payload.view
            else:
                missed.append(i)
        if missed and not source.groups_fast:
            for i in missed:
                pending[asyncio.ensure_future(leases[i].__aenter__())] = i
            missed = []
        try:
            if missed:
                got = await source.wait_for_group([layouts[i] for i in missed])
                error: BaseException | None = None
                for i, result in zip(missed, got, strict=True):
                    if isinstance(result, BaseException):
                        error = error or result
                    else:
                        leases[i]._entry = result
                        views[i] = result.payload.view
                if error is not None:
                    raise error
            if pending:
                await _settle(list(pending))
                for task in pending:
                    error = task.exception()
                    if error is not None:
                        raise error
                for task, i in pending.items():
                    views[i] = task.result()
        except BaseException:
            for lease in leases:
                lease.release()
            raise
        self._leases = leases
        source.batch_done()
        return [v for v in views if v is not None]

    async def __aexit__(self, *exc_info: object) -> None:
        leases, self._leases = self._leases, []
        for lease in leases:
            lease.release()


class ArrivalGroup:
    """``async with store.acquire_as_ready(keys) as arrivals: async for views in arrivals``:
    a layer's experts in the order they become resident, so the engine computes on those at
    hand while the others load.

    The first batch is every expert resident on entry (no await); each next batch awaits at
    least one more load and holds every load finished by then, so the last batch ends the
    iteration.  A view is leased from the batch that brings it until the group's exit, which
    releases every lease and gives up the loads not collected yet (they go on for whoever else
    waits for them).  A failed acquire (a ``StoreError`` naming the expert) is raised by the
    ``__anext__`` after the batch that held the others finished with it; iterating on yields
    the rest.  The policy's batch-end work is scheduled on entry, once every load of the group
    started, and runs at the engine's next await (its compute in a thread, or its wait for
    the next batch).  The felt wait counts only the awaits of ``__anext__``.  Entering lets
    the loop turn when some experts are at hand and others missed (once, twice on a backend
    that submits a turn's reads at the next: ``LeaseSource.submitted``), so that their reads
    are submitted before an engine that computes on the loop starts on the first batch.

    Why: ``acquire_many`` holds the engine until a layer's slowest read is in, with every
    resident expert of that layer ready to compute.  Computing those meanwhile takes the reads
    off the critical path as far as the compute lasts (docs/benchmarks.md, "Compute on what is
    at hand").

    An engine that computes in a thread of its own takes the batches there instead, with
    :meth:`in_thread`: one hand-off to that thread a layer rather than one a batch
    (:class:`ThreadArrivals`).
    """

    __slots__ = ("_source", "_keys", "_entries", "_group", "_first", "_errors", "_entered", "_consumer")

    def __init__(self, source: LeaseSource, keys: Iterable[ExpertKey]) -> None:
        self._source = source
        self._keys = list(keys)
        self._entries: list[Entry] = []
        """Every lease the group holds (released at exit)."""
        self._group: PendingGroup | None = None
        self._first: list[ExpertView] | None = None
        self._errors: list[BaseException] = []
        self._entered = False
        self._consumer: ThreadArrivals | None = None
        """The thread's iterator (:meth:`in_thread`), while the group has one."""

    async def __aenter__(self) -> ArrivalGroup:
        if self._entered:
            raise StoreError("an acquire_as_ready group entered twice")
        self._entered = True
        source = self._source
        layouts = [source.layout_of(key) for key in self._keys]  # an unknown key raises here
        first: list[ExpertView] = []
        missed: list[ExpertLayout] = []
        try_hit = source.try_hit
        for layout in layouts:
            entry = try_hit(layout)
            if entry is None:
                missed.append(layout)
            else:
                self._entries.append(entry)
                first.append(_view_of(entry))
        if missed:
            try:
                self._group = source.start_group(missed)
                if first:
                    # The loop turns before the engine gets the experts at hand: the loads
                    # just started are tasks (and io_uring submits a turn's reads at the next
                    # turn), and an engine that computes on the loop would hold them
                    # unsubmitted until its next await, its reads then following its compute
                    # instead of beside it (docs/benchmarks.md, "Compute on what is at hand":
                    # with io_uring, no turn left them queued and tripled the felt wait).
                    # Only while some experts are at hand: else the engine's first
                    # ``__anext__`` awaits at once.
                    await source.submitted()
            except BaseException:
                await self._abandon()
                raise
        self._first = first
        source.batch_done()
        return self

    def __aiter__(self) -> ArrivalGroup:
        return self

    async def __anext__(self) -> list[ExpertView]:
        if self._consumer is not None:
            raise StoreError("this acquire_as_ready group hands its batches to a thread (in_thread): "
                             "iterate there, not here")
        first, self._first = self._first, None
        if first:
            return first
        while True:
            if self._errors:
                raise self._errors.pop(0)
            group = self._group
            if group is None:
                raise StopAsyncIteration
            if not group.pending:  # this collect takes the last ones, without awaiting
                self._group = None
            views = self._take(await group.collect(felt=True))
            if views:
                return views

    def in_thread(self) -> ThreadArrivals:
        """The group's batches for a thread other than the event loop's, the engine's compute
        thread: ``for views in arrivals.in_thread()`` there, blocking until each next batch
        is in.  Call it on the loop, inside the group, instead of iterating here; then await
        the thread's work before the group exits (its exit releases every lease).

        Why: an engine whose compute runs in a thread would otherwise hand each batch over
        with its own round trip between the loop and that thread (``run_in_executor``: a
        submit, a wake-up, a result back through the loop's self-pipe), as many a layer as
        batches land apart.  Here the thread blocks on a queue that the loop fills as each load
        finishes (a done callback on the load, no task step): one round trip a layer
        (docs/benchmarks.md, "Batches handed to the compute thread": a round trip costs 51 us
        on uvloop, 57 on asyncio).  The time the thread
        blocks counts as felt wait, as an ``__anext__``'s await does: the store sees it while
        it runs (the policy's batch-end work inside it is left out of what the policy is
        told, and hands no GIL over to a thread that waits)."""
        if not self._entered:
            raise StoreError("in_thread() needs the acquire_as_ready group entered (async with)")
        if self._consumer is not None or self._first is None:
            raise StoreError("this acquire_as_ready group's batches were already taken (in_thread, or async for)")
        first, self._first = self._first, None
        consumer = ThreadArrivals(threading.get_ident())
        self._consumer = consumer
        self._source.thread_takes(consumer)
        if first:
            consumer.put(first)
        group = self._group
        if group is None:
            consumer.put(_END)
        else:
            group.on_each_finish(self._landed)
        return consumer

    def _landed(self) -> None:
        """On the loop, as one of the group's acquires finished: what finished, leased, to the
        thread (views first, then each error, as ``__anext__`` orders them), and the end once
        none is open.  Nothing after the group exited."""
        consumer, group = self._consumer, self._group
        if consumer is None or group is None:
            return
        views = self._take(group.collect_done())
        if views:
            consumer.put(views)
        errors, self._errors = self._errors, []
        for error in errors:
            consumer.put(error)
        if not group.pending:
            self._group = None
            consumer.put(_END)

    def _take(self, got: list[tuple[int, Entry | BaseException]]) -> list[ExpertView]:
        """The views of the leased entries in ``got`` (held from now on); errors kept for the
        next ``__anext__``."""
        views = []
        for _, result in got:
            if isinstance(result, BaseException):
                self._errors.append(result)
            else:
                self._entries.append(result)
                views.append(_view_of(result))
        return views

    async def __aexit__(self, *exc_info: object) -> None:
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            consumer.close()
            self._source.thread_done(consumer)
        await self._abandon()

    async def _abandon(self) -> None:
        """Give up the loads not collected (they go on) and release every lease held."""
        group, self._group = self._group, None
        try:
            if group is not None:
                await group.abandon()
        finally:
            self._release()

    def _release(self) -> None:
        entries, self._entries = self._entries, []
        for entry in entries:
            self._source.release(entry)


_END = object()
"""The last item a :class:`ThreadArrivals` queue holds: the group has no batch left."""


class ThreadArrivals:
    """``for views in arrivals.in_thread()``: an ``acquire_as_ready`` group's batches in a
    thread other than the event loop's (:meth:`ArrivalGroup.in_thread`), each ``next``
    blocking until at least one expert is in and holding every one in by then (the first
    batch: at least those resident on entry), a failed acquire raised after the batch that
    held the others, as ``async for`` gives them.

    The loop puts each batch on a ``queue.SimpleQueue`` (a C queue: a put wakes a blocked
    ``get`` without the loop's help) as the group's loads finish; the thread takes them.  The
    views are leased by the group until it exits, so the engine awaits its thread's work
    inside the group; a batch taken after the exit raises ``StoreError`` instead of handing
    over released views, and a thread blocked when the group exits is woken and stops.
    Invariant: only the loop puts, only one thread takes, and the blocked time
    (:meth:`blocked_s`) is written by that thread alone, in one assignment, so that the loop
    reads it whole at any moment."""

    __slots__ = ("_queue", "_loop_thread", "_closed", "_held", "_blocked")

    def __init__(self, loop_thread: int) -> None:
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._loop_thread = loop_thread
        self._closed = False
        self._held: object = None
        """An item taken while gathering a batch that ends it (an error, the end): the next's."""
        self._blocked: tuple[float, float | None] = (0.0, None)
        """Seconds the taking thread blocked for a batch (the engine's felt wait) before the
        present block, and when the present one began (``None``: not blocked)."""

    def put(self, item: object) -> None:
        self._queue.put(item)

    def close(self) -> None:
        """The group exits: wake a blocked thread, refuse what is left."""
        self._closed = True
        self._queue.put(_END)

    @property
    def blocked(self) -> bool:
        """Whether the thread is blocked for a batch now."""
        return self._blocked[1] is not None

    def blocked_s(self, now: float) -> float:
        """Seconds the thread blocked for a batch so far, the present block up to ``now``."""
        done, since = self._blocked
        return done if since is None else done + max(0.0, now - since)

    def __iter__(self) -> Iterator[list[ExpertView]]:
        return self

    def __next__(self) -> list[ExpertView]:
        if threading.get_ident() == self._loop_thread:
            raise StoreError("ThreadArrivals blocks until a load finishes: iterate in the engine's compute "
                             "thread, not on the event loop (there, use async for)")
        q = self._queue
        item, self._held = self._held, None
        if item is None:
            try:
                item = q.get_nowait()
            except queue.Empty:
                done = self._blocked[0]
                started = _clock.now()
                self._blocked = (done, started)
                try:
                    item = q.get()
                finally:
                    self._blocked = (done + (_clock.now() - started), None)
        if item is _END:
            self._held = _END  # every later next stops too
            raise StopIteration
        if self._closed:
            raise StoreError("the acquire_as_ready group exited before its thread took this batch: its "
                             "leases are released (await the thread's work inside the group)")
        if isinstance(item, BaseException):
            raise item
        views = list(cast("list[ExpertView]", item))
        while True:  # every load in by now joins this batch, as with async for
            try:
                more = q.get_nowait()
            except queue.Empty:
                break
            if isinstance(more, list):
                views += more
            else:  # an error or the end: the next call's
                self._held = more
                break
        return views


async def _settle(tasks: list[asyncio.Task[ExpertView]]) -> None:
    """Wait until every task is done; on cancellation cancel them, wait again, re-raise."""
    try:
        await asyncio.wait(tasks)
    except asyncio.CancelledError:
        for task in tasks:
            task.cancel()
        while not all(t.done() for t in tasks):
            try:
                await asyncio.wait(tasks)
            except asyncio.CancelledError:
                continue
        for task in tasks:
            if not task.cancelled():
                task.exception()
        raise
