"""Loads: reading a reserved expert into memory, publishing it, and freeing it again.

A load takes a page-aligned slab from the pool (in the same step as the reservation, so the
idle pool never holds more than the budget's headroom), reads each extent through the read
path (or maps it, on a zero-copy backend), builds the views, and only then publishes the
entry.  A failed load removes its reservation, returns its slab and hands a
:class:`StoreError` to every waiter; the next acquire of that key tries again.

Each load in flight has an :class:`InFlight` record: the future its waiters await and the
:class:`Ticket` its reads are queued with (a demand that joins a prefetch promotes it:
:meth:`Loader.join`).  Entries of the residency table carry their memory as a :class:`Loaded`
payload, set at publish time and taken back by :meth:`Loader.free` once the entry left the
table.  Every way out of the table passes here (a failed load, a transient entry dropped, an
eviction: :meth:`Loader.evicted`), so the prefetch ledger hears of each from here alone.

Where the bytes came from (``docs/telemetry.md``): a demand load that the backend shows was
served wholly by the page cache counts in ``page_cache_misses``, any other in
``physical_misses``.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

from iosched import backends
from iosched._errors import ReadError, StoreClosed, StoreError
from iosched._layout import ExpertKey, ExpertLayout
from iosched.residency import Entry, EntryState, ResidencyTable

from . import _clock
from ._io import ReadPath
from ._prefetch import PrefetchLedger
from ._readplan import ReadPlan, pack, plan_reads
from ._room import Room
from ._scheduler import DEMAND, Ticket
from ._slab import PAGE, Slab, SlabPool, reuse_slack, round_up
from ._view import ExpertView


class Loaded:
    """A published expert's memory: a slab of ours, or a range of a zero-copy backend's."""

    __slots__ = ("slab", "view", "mapped")

    def __init__(self, slab: Slab | None, view: ExpertView, mapped: tuple[int, int, int] | None) -> None:
        self.slab = slab
        self.view = view
        self.mapped = mapped


class InFlight:
    """One load in flight: what its waiters await, and the priority of its reads."""

    __slots__ = ("future", "ticket")

    def __init__(self, future: asyncio.Future[None], ticket: Ticket) -> None:
        self.future = future
        self.ticket = ticket


class Loader:
    """Starts, tracks and finishes loads, and frees what they loaded."""

    def __init__(self, table: ResidencyTable, io: ReadPath, ledger: PrefetchLedger, room: Room) -> None:
        self._table = table
        self._io = io
        self._zero_copy = io.zero_copy
        self.submit_turns = 2 if io.backend.caps & backends.Caps.TURN_BATCHED else 1
        """Turns of the event loop from starting a load to its read reaching the device: one
        for the load's task to hand the read to the backend, one more where the backend
        gathers a turn's reads into one submission (``Caps.TURN_BATCHED``)."""
        self.undelivered = backends.undelivered_counter(io.backend)
        """Reads that finished and whose awaiting coroutine has not resumed yet (their results
        wait in the loop's queue; ``0`` for a backend that cannot tell)."""
        self._ledger = ledger
        self._room = room
        self.pool = SlabPool(huge_pages=bool(io.backend.caps & backends.Caps.DIRECT))
        self.tasks: set[asyncio.Task[Any]] = set()
        """Loads and hints in flight: ``close()`` waits for them."""
        self.in_flight: dict[ExpertKey, InFlight] = {}
        self.promoted = 0
        """Prefetch loads a demand acquire joined (:meth:`join`)."""
        self.load_errors = 0
        self.service_s = 0.0
        self.page_cache_misses = 0
        """Demand loads the page cache served wholly."""
        self.physical_misses = 0
        """The other demand loads (drive, or not known)."""
        self.hints_skipped = 0

    def headroom(self) -> int:
        """Budget bytes neither reserved nor leased: what idle slabs may hold."""
        return max(0, self._table.budget_bytes - self._table.used_bytes)

    def start(self, entry: Entry, layout: ExpertLayout, priority: int = DEMAND,
              ordered: bool = True) -> InFlight:
        """Start loading the reserved (LOADING) ``entry``; ``ordered``: see :class:`Ticket`."""
        loop = asyncio.get_running_loop()
        record = InFlight(loop.create_future(), Ticket(priority, ordered))
        self.in_flight[layout.key] = record
        if self._room:
            self._room.loading(layout.key)  # acquires waiting for room to load it join instead
        plan: ReadPlan | None = None
        slab: Slab | None = None
        if self._zero_copy is None or len(layout.extents) != 1:
            # The slab is taken in the same step as the reservation, so the idle pool never
            # holds more than the budget's headroom, not even until the load task starts: the
            # slab an eviction just returned is usually the one taken here.
            plan = plan_reads(layout, self._io.alignment)
            # Retired slabs now free: one may serve this load (up to take()'s slack larger);
            # the room asked for holds one such slab, never two (trim() would close the second).
            capacity = round_up(plan.capacity, PAGE)
            if not self.pool.fits(capacity):
                self.pool.reclaim(max(self.headroom(), self.pool.idle_bytes) + capacity + reuse_slack(capacity),
                                  2 * self._table.budget_bytes)
            slab = self.pool.take(plan.capacity)
            self.pool.trim(self.headroom())
        self._spawn(self._load(entry, layout, record, plan, slab))
        return record

    def join(self, key: ExpertKey) -> asyncio.Future[None]:
        """The future of ``key``'s load in flight, for a demand acquire that waits for it: a
        prefetch's reads are promoted to demand priority (they jump the queue)."""
        record = self.in_flight[key]
        if record.ticket.priority != DEMAND:
            record.ticket.promote()
            self.promoted += 1
        return record.future

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _load(self, entry: Entry, layout: ExpertLayout, record: InFlight, plan: ReadPlan | None,
                    slab: Slab | None) -> None:
        """Read (into ``slab`` by ``plan``) or map the expert, then publish it."""
        t0 = _clock.now()
        ticket = record.ticket
        mapped: tuple[int, int, int] | None = None
        try:
            if plan is None or slab is None:
                ext = layout.extents[0]
                view_bytes, backend_file, cached = await self._io.map(
                    layout.key, ext.file, ext.offset, ext.length, ticket)
                mapped = (backend_file, ext.offset, ext.length)
                view = ExpertView.over(layout, view_bytes)
            else:
                cached = await self._read_plan(layout, plan, slab, ticket)
                # No local keeps a memoryview of the slab: only the views do (see free()).
                view = ExpertView.over(layout, slab.buffer()[plan.data_start:plan.data_start + layout.nbytes])
        except BaseException as exc:
            self._failed(entry, layout, record, slab, mapped, exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        del self.in_flight[layout.key]
        self.service_s += _clock.now() - t0
        if not ticket.prefetch:
            if cached:
                self.page_cache_misses += 1
            else:
                self.physical_misses += 1
        self._table.publish(entry, Loaded(slab, view, mapped))
        del view  # the payload holds the views now: settle() below may free a transient entry
        record.future.set_result(None)
        self.settle(entry)

    def _failed(self, entry: Entry, layout: ExpertLayout, record: InFlight, slab: Slab | None,
                mapped: tuple[int, int, int] | None, exc: BaseException) -> None:
        """Undo a load that raised ``exc``: its reservation, its memory; tell its waiters."""
        del self.in_flight[layout.key]
        self.load_errors += 1
        self._table.remove(entry)
        self._ledger.left(entry, failed=True)
        if slab is not None:
            self.pool.give_back(slab, self.headroom())  # retired while the error's frames hold a buffer of it
        if mapped is not None and self._zero_copy is not None:
            self._zero_copy.unmap(*mapped)
        if isinstance(exc, StoreError):
            error: StoreError = exc
        elif isinstance(exc, asyncio.CancelledError):
            error = StoreClosed(f"load of expert {layout.key!r} was cancelled")
        else:
            error = ReadError(f"load of expert {layout.key!r} failed: {exc!r}")
            error.__cause__ = exc
        record.future.set_exception(error)
        record.future.exception()  # retrieved: waiters, if any, re-raise it
        self._room.wake()

    async def _read_plan(self, layout: ExpertLayout, plan: ReadPlan, slab: Slab, ticket: Ticket) -> bool:
        """Read every span into ``slab``; ``True`` when the page cache served all of them."""
        buf = slab.buffer()
        spans = plan.spans
        if len(spans) == 1:
            span = spans[0]
            _, cached = await self._io.read_span(
                layout.key, span, buf[span.slab_pos:span.slab_pos + span.length], ticket)
            return cached
        jobs = [self._io.read_span(layout.key, s, buf[s.slab_pos:s.slab_pos + s.length], ticket)
                for s in spans]
        # Every span finishes (or fails) before the slab can be recycled.
        results = await asyncio.gather(*jobs, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        pack(plan, buf)
        return all(r[1] for r in results if isinstance(r, tuple))

    def settle(self, entry: Entry) -> None:
        """A lease or pin of ``entry`` ended, or its load finished: drop it if it is a
        transient entry nobody holds any more (a prefetch the policy did not admit, unjoined,
        was wasted), and wake the acquires waiting for room."""
        if (entry.transient and entry.state is EntryState.RESIDENT and entry.leases == 0
                and entry.pins == 0 and self._table.get(entry.key) is entry):
            self._table.remove(entry)
            self._ledger.left(entry)
            self.free(entry)
        if self._room:
            self._room.wake()

    def evicted(self, entry: Entry) -> None:
        """The table evicted ``entry``: tell the ledger, give back its memory."""
        self._ledger.left(entry)
        self.free(entry)

    def free(self, entry: Entry) -> None:
        """Give back the memory of ``entry``, which left the table.

        The payload was the store's last reference to the views; once it is dropped, a slab
        that something still exports (an engine kept a view past its lease) is retired, never
        recycled (``SlabPool.give_back``): a kept view never shows another expert's bytes."""
        loaded: Loaded | None = self._table.take_payload(entry)
        if loaded is None:
            return
        slab, mapped = loaded.slab, loaded.mapped
        watched = weakref.ref(loaded.view.data)
        del loaded  # drop the views first: the pool recycles the slab only if nothing else holds one
        if slab is not None:
            # hand_over: the load of the reservation this eviction made room for takes it in
            # this step, though its page rounding does not fit the headroom (SlabPool.give_back).
            self.pool.give_back(slab, self.headroom(), entry.key, watched(), self._table.budget_bytes,
                                hand_over=True)
        if mapped is not None and self._zero_copy is not None:
            self._zero_copy.unmap(*mapped)

    def reclaim(self) -> None:
        """Take back the retired slabs whose views died since (``stats()`` calls it, so that
        ``retired_bytes`` is current; loads and frees do it anyway)."""
        self.pool.reclaim(self.headroom())

    def hint(self, layouts: list[ExpertLayout]) -> int:
        """``ExpertStore.hint``: page-cache read-ahead of the experts not in the table, queued
        behind every demand and prefetch read; the O_DIRECT backends skip it (counted)."""
        if self._io.backend.caps & backends.Caps.DIRECT:
            self.hints_skipped += len(layouts)
            return 0
        queued = 0
        for layout in layouts:
            if self._table.get(layout.key) is not None:
                continue
            for ext in layout.extents:
                self._spawn(self._io.hint(layout.key, ext.file, ext.offset, ext.length))
                queued += 1
        return queued

    async def drain(self) -> None:
        """Wait until no load nor hint is in flight (``close()``)."""
        while self.tasks:
            await asyncio.gather(*list(self.tasks), return_exceptions=True)
