"""The acquire path: what a lease asks of the store (``iosched.runtime._lease.LeaseSource``).

1. **hit**: the key's entry is resident: take a lease, return the views made at publish time.
   No await, no allocation beyond the lease object.
2. **join**: the entry is loading: pin it, await the load's future (shielded, so a cancelled
   waiter never cancels the load others wait on), then turn the pin into a lease.
3. **miss**: reserve the expert's bytes in the residency table (evicting what the policy
   names, never a leased, pinned or loading entry); when nothing can be freed now, wait in
   the :class:`~iosched.runtime._room.Room` until a lease or a load ends.  Then start the load, and
   join it like any other waiter.

A group's misses (``acquire_many``) take the same three paths in :meth:`Acquirer.wait_for_group`,
one coroutine for all of them, unless the policy weighs each acquire's own wait.

Each acquire of a known key is counted once, by what it found when it asked (``hits``,
``misses``, ``joins``), and its wait is the engine's felt wait (:class:`FeltWait`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import cast

import numpy as np

from iosched._errors import StoreClosed, StoreError, UnknownExpertError
from iosched._layout import CheckpointIndex, ExpertKey, ExpertLayout
from iosched.residency import Entry, EntryState, ResidencyTable

from . import _clock
from ._autogrow import AutoGrow
from ._felt import FeltWait
from ._lease import ThreadArrivals
from ._loads import Loader
from ._prefetch import Prefetcher, PrefetchLedger
from ._room import Lifecycle, Room
from ._stats import RequestCounts


def _strict_key(key: object) -> ExpertKey:
    """``key`` as a tuple of Python ints when it is a ``(layer, expert)`` pair of integers
    (numpy integers included); :class:`UnknownExpertError` for anything else: ``(True, False)``
    must not serve expert ``(1, 0)``, nor ``(1.0, 2.0)`` expert ``(1, 2)``."""
    if isinstance(key, tuple) and len(key) == 2 and all(
            isinstance(part, (int, np.integer)) and not isinstance(part, (bool, np.bool_)) for part in key):
        return int(key[0]), int(key[1])
    raise UnknownExpertError(f"expert key must be a (layer, expert) tuple of ints, got {key!r}")


class Acquirer:
    """Leases experts: the hit path, the wait for a load or for room, and releases."""

    def __init__(self, index: CheckpointIndex, table: ResidencyTable, loader: Loader,
                 prefetcher: Prefetcher, ledger: PrefetchLedger, room: Room, lifecycle: Lifecycle,
                 counts: RequestCounts, growth: AutoGrow | None, felt: FeltWait,
                 owner: Callable[[], None] = lambda: None) -> None:
        """``felt``: the engine's felt wait, which the acquires' waits make up; ``owner()``
        raises unless the running loop is the store's (checked before a wait)."""
        self._index = index
        self._layouts: Mapping[ExpertKey, ExpertLayout] = index.experts
        self._table = table
        self._on_request = table.policy.on_request
        """Bound once: a policy that changes mode swaps a part of its own, never its hooks."""
        self._lease_resident = table.lease_resident
        self._on_wait = table.hooks.on_wait
        self._loader = loader
        self._prefetcher = prefetcher
        self._ledger = ledger
        self._room = room
        self._lifecycle = lifecycle
        self.counts = counts
        self._growth = growth
        self._felt = felt
        self._owner = owner

    def layout_of(self, key: ExpertKey) -> ExpertLayout:
        """The layout of ``key``, a ``(layer, expert)`` tuple of true integers (``int`` or a
        numpy integer; never a ``bool`` or a ``float``, which hash like the integers they
        equal); :class:`UnknownExpertError` naming the key otherwise."""
        if type(key) is tuple and len(key) == 2 and type(key[0]) is int and type(key[1]) is int:
            layout = self._layouts.get(key)  # the hit path's check: exact types, no conversion
        else:
            layout = self._layouts.get(_strict_key(key))
        if layout is None:
            layers = self._index.layers()
            raise UnknownExpertError(f"no expert {key!r} in {self._index.root} "
                                     f"(layers {layers[0]}..{layers[-1]})")
        return layout

    def try_hit(self, layout: ExpertLayout) -> Entry | None:
        if self._lifecycle.closed:
            return None
        entry = self._lease_resident(layout.key)
        if entry is None:
            return None
        counts = self.counts
        counts.requests += 1
        counts.hits += 1
        self._on_request(layout.key, layout.nbytes, True)
        if self._ledger.unused:
            self._ledger.leased(entry)
        return entry

    async def wait_for(self, layout: ExpertLayout) -> Entry:
        """Acquire when the expert is not resident (or the store is closed)."""
        self._owner()
        self._lifecycle.check_open()
        started = self._felt.starts()
        concurrent = self._felt.waiting  # the acquires this one's wait is shared with, so far
        band = self._count_miss(layout)
        try:
            return await self._lease_when_loaded(layout)
        finally:
            self._waited(layout, band, started, self._felt.ends(), concurrent)

    async def wait_counted(self, layout: ExpertLayout, band: int | None) -> Entry:
        """:meth:`wait_for` of an acquire already counted (:meth:`_count_miss` gave ``band``)
        whose wait is not the engine's own: the engine may compute meanwhile, and whoever
        awaits this counts the felt wait (:class:`GroupWait`)."""
        started = _clock.now()
        try:
            return await self._lease_when_loaded(layout)
        finally:
            self._waited(layout, band, started, _clock.now(), max(self._felt.waiting, 1))

    def _count_miss(self, layout: ExpertLayout) -> int | None:
        """Count an acquire that was no hit; the budget growth's band it missed in, if any."""
        entry = self._table.get(layout.key)
        self._count(layout, entry)
        if entry is None and self._growth is not None:
            return self._growth.missed(layout.key)
        return None

    def _waited(self, layout: ExpertLayout, band: int | None, started: float, now: float, concurrent: int) -> None:
        """An acquire's wait from ``started`` to ``now``, shared with ``concurrent`` others:
        the miss cost the policy weighs, the budget growth's credit."""
        if self._on_wait is not None:
            self._on_wait(layout.key, now - started)
        if band is not None and self._growth is not None:
            self._growth.credit(band, (now - started) / concurrent)

    async def _lease_when_loaded(self, layout: ExpertLayout) -> Entry:
        """Reserve and start the load if nobody did, wait for it, lease the entry."""
        table, key, room = self._table, layout.key, self._room
        entry: Entry | None = None
        ticket: int | None = None  # its place in the room's line, once it waited
        woken = False
        try:
            while True:
                entry = table.get(key)
                if entry is None:
                    entry = table.reserve(key, layout.nbytes)
                    if entry is None:
                        if woken:  # woken but still short: so is every larger need
                            room.pass_below(layout.nbytes)
                        if ticket is None:
                            ticket = room.ticket()
                        woken = await room.wait(key, layout.nbytes, ticket, again=woken)
                        self._lifecycle.check_open()
                        continue
                    self._loader.start(entry, layout)
                if woken:  # reserved, or found it loading or loaded: the next may find room too
                    woken = False
                    room.pass_on()
                if entry.state is EntryState.RESIDENT:
                    self._lease(entry)
                    return entry
                loaded = self._join(entry, key)
                try:
                    await asyncio.shield(loaded)
                finally:
                    table.unpin(entry)
                # The load published the entry (a failed load raised above); the pin kept it
                # from eviction until this line turns it into a lease.
                self._lease(entry)
                return entry
        except BaseException:
            if entry is not None:
                self._loader.settle(entry)
            raise

    @property
    def groups_fast(self) -> bool:
        """Whether :meth:`wait_for_group` may serve a group's misses: not when the policy
        weighs each acquire's own wait (``on_wait``) or the budget grows by them, which need
        each acquire's own end time (:meth:`wait_for` in a task of its own gives it)."""
        return self._on_wait is None and self._growth is None

    async def wait_for_group(self, layouts: list[ExpertLayout]) -> list[Entry | BaseException]:
        """:meth:`wait_for` of each of ``layouts`` (a group's acquires that :meth:`try_hit`
        found not resident), awaited together in this one coroutine (:meth:`start_group`, then
        one wait for all of them).

        Why not a task per acquire, each awaiting its load through ``asyncio.shield``: a warm
        loop of 36 KiB misses in groups of 8 (``lru``, ``pread``, the 2-core VM) cost 165-190 µs
        of CPU a miss with them and 105-140 without, where the hand-written engine's whole miss
        costs 55-80 (docs/benchmarks.md, "Read path against 8 pread threads").

        Returns, in order, each acquire's leased entry or its error (the caller releases the
        leases if any failed).  Cancelled, it releases what it leased, unpins what it pinned,
        cancels the tasks it started and re-raises; the loads go on for whoever else waits.
        The group counts as one waiter for the felt wait (a union of intervals anyway)."""
        self._owner()
        self._lifecycle.check_open()
        self._felt.starts()
        try:
            group = self.start_group(layouts, ordered=False)  # awaited whole (see Ticket.ordered)
            out: list[Entry | BaseException | None] = [None] * len(layouts)
            try:
                while group.pending:
                    for i, got in await group.collect(every=True):
                        out[i] = got
                for i, got in group.collect_done():
                    out[i] = got
            except BaseException:
                await group.abandon()
                for held in out:
                    if isinstance(held, Entry):
                        self.release(held)
                raise
            return cast("list[Entry | BaseException]", out)
        finally:
            self._felt.ends()

    async def submitted(self) -> None:
        """Return once the loads started in this step have reached the device: as many turns
        of the event loop as the backend takes (``Loader.submit_turns``), so that an engine
        about to compute on the loop does not hold its reads back until its next await."""
        for _ in range(self._loader.submit_turns):
            await asyncio.sleep(0)

    def start_group(self, layouts: list[ExpertLayout], ordered: bool = True) -> GroupWait:
        """Start (or join) the load of each of ``layouts`` in the caller's step and return
        them in flight (:class:`GroupWait`): per acquire, its count, the policy's
        ``on_request``, its reservation and load (or the load it joins); only an acquire that
        finds no room now waits in a task of its own (:meth:`_lease_when_loaded`, the Room's
        line), and every acquire does when the policy weighs each one's own wait
        (:attr:`groups_fast` false: :meth:`wait_counted`).  Counts no felt wait: whoever awaits the group does."""
        self._owner()
        self._lifecycle.check_open()
        return GroupWait(self, layouts, ordered)

    def _count(self, layout: ExpertLayout, entry: Entry | None) -> None:
        """Count an acquire that was no hit, by what it found (``entry``: loading, or ``None``),
        and tell the policy."""
        self.counts.requests += 1
        self._on_request(layout.key, layout.nbytes, entry is not None)
        if entry is None:
            self.counts.misses += 1
        else:
            self.counts.joins += 1

    def _join(self, entry: Entry, key: ExpertKey) -> asyncio.Future[None]:
        """Pin the LOADING ``entry`` (of ``key``) for a waiter and give the future of its load,
        which the loader promotes to demand if a prefetch started it."""
        loaded = self._loader.join(key)
        self._table.pin(entry)
        return loaded

    def _lease(self, entry: Entry) -> None:
        self._table.lease(entry)
        self._ledger.leased(entry)

    def release(self, entry: Entry) -> None:
        if self._table.release(entry):
            self._loader.settle(entry)

    def batch_done(self) -> None:
        self._prefetcher.batch_done()

    def thread_takes(self, taker: ThreadArrivals) -> None:
        self._felt.thread_takes(taker)

    def thread_done(self, taker: ThreadArrivals) -> None:
        self._felt.thread_done(taker)

    def felt_so_far(self) -> float:
        """The engine's felt wait up to now (:meth:`FeltWait.felt_so_far`)."""
        return self._felt.felt_so_far()


class GroupWait:
    """A group's misses in flight (:meth:`Acquirer.start_group`), collected as they finish.

    Each acquire is *joined* (its entry pinned, awaiting its load's future), *parked* (a task
    of its own: waiting for room, or every acquire where the policy weighs each one's wait),
    or *done* (leased, or its error).  :meth:`collect` hands over what finished, leased: from
    then on the caller owns those leases.  :meth:`abandon` is the way out for whatever was not
    collected: it unpins and settles the joined, cancels the parked, and releases every lease
    it still holds; the loads go on for whoever else waits.

    Invariant: every position is in exactly one of ``_joined``, ``_parked`` and ``_done``
    until it is collected."""

    __slots__ = ("_acquirer", "_keys", "_joined", "_parked", "_done")

    def __init__(self, acquirer: Acquirer, layouts: list[ExpertLayout], ordered: bool = True) -> None:
        """``ordered``: the loads this group starts are consumed as they land (see
        :class:`~iosched.runtime._scheduler.Ticket`); an ``acquire_many`` awaiting them whole says no."""
        self._acquirer = acquirer
        self._keys = [layout.key for layout in layouts]
        self._joined: dict[int, tuple[Entry, asyncio.Future[None]]] = {}
        self._parked: dict[int, asyncio.Task[Entry]] = {}
        self._done: list[tuple[int, Entry | BaseException]] = []
        table, loader = acquirer._table, acquirer._loader
        per_acquire = not acquirer.groups_fast
        try:
            for i, layout in enumerate(layouts):
                if per_acquire:  # counted now, so the batch-end work sees the whole group
                    band = acquirer._count_miss(layout)
                    self._parked[i] = asyncio.ensure_future(acquirer.wait_counted(layout, band))
                    continue
                key = layout.key
                entry = table.get(key)
                acquirer._count(layout, entry)
                if entry is None:
                    try:
                        entry = table.reserve(key, layout.nbytes)
                    except StoreError as exc:  # larger than the budget: this acquire fails
                        self._done.append((i, exc))
                        continue
                    if entry is None:  # no room now: the Room's line, in a task of its own
                        self._parked[i] = asyncio.ensure_future(acquirer._lease_when_loaded(layout))
                        continue
                    loader.start(entry, layout, ordered=ordered)
                if entry.state is EntryState.RESIDENT:
                    acquirer._lease(entry)
                    self._done.append((i, entry))
                    continue
                self._joined[i] = entry, acquirer._join(entry, key)
        except BaseException:
            self._drop()
            raise

    @property
    def pending(self) -> bool:
        """Whether some acquire has not finished yet."""
        return bool(self._joined or self._parked)

    def collect_done(self) -> list[tuple[int, Entry | BaseException]]:
        """What finished so far and was not collected, as ``(position, leased entry or
        error)``, without awaiting; the caller owns the leases."""
        acquirer = self._acquirer
        table = acquirer._table
        for i, (entry, future) in list(self._joined.items()):
            if not future.done():
                continue
            del self._joined[i]
            table.unpin(entry)
            error = (StoreClosed(f"load of expert {entry.key!r} was cancelled") if future.cancelled()
                     else future.exception())
            if error is None:
                acquirer._lease(entry)  # the pin kept it from eviction until here
                self._done.append((i, entry))
            else:
                acquirer._loader.settle(entry)
                self._done.append((i, error))
        for i, task in list(self._parked.items()):
            if task.done():
                del self._parked[i]
                self._done.append((i, StoreClosed(f"acquire of expert {self._keys[i]!r} was cancelled")
                                   if task.cancelled() else task.exception() or task.result()))
        done, self._done = self._done, []
        return done

    def on_each_finish(self, callback: Callable[[], None]) -> None:
        """``callback()`` on the loop as each acquire still open finishes (a done callback on
        its load's future or its task), and once soon if some finished already; a callback
        after :meth:`abandon` must do nothing (the caller's to check)."""
        for _, future in self._joined.values():
            future.add_done_callback(lambda _: callback())
        for task in self._parked.values():
            task.add_done_callback(lambda _: callback())
        if self._done:
            asyncio.get_running_loop().call_soon(callback)

    async def collect(self, every: bool = False, felt: bool = False) -> list[tuple[int, Entry | BaseException]]:
        """:meth:`collect_done`, once at least one acquire finished since the last collect
        (awaiting one when none did; ``every``: awaiting all of them).  ``felt``: count the
        await as the engine's felt wait.  Cancelled, it re-raises and holds what it held
        (:meth:`abandon` releases it)."""
        waits = [cast("asyncio.Future[object]", f) for _, f in self._joined.values()]
        waits += [cast("asyncio.Future[object]", t) for t in self._parked.values()]
        if waits and (every or not (self._done or any(w.done() for w in waits))):
            engine = self._acquirer._felt
            if felt:
                engine.starts()
                engine.awaiting(waits)
            try:  # asyncio.wait cancels nothing it waits for when cancelled
                await asyncio.wait(waits, return_when=asyncio.ALL_COMPLETED if every else asyncio.FIRST_COMPLETED)
            finally:
                if felt:
                    engine.awaiting([])
                    engine.ends()
        return self.collect_done()

    async def abandon(self) -> None:
        """Give up on whatever was not collected: unpin and settle the joined entries, cancel
        the parked tasks (waiting until they end), release the leases they and the finished
        ones hold."""
        parked = self._parked
        for task in parked.values():
            task.cancel()
        while not all(t.done() for t in parked.values()):
            try:
                await asyncio.wait(list(parked.values()))
            except asyncio.CancelledError:
                continue
        self._drop()

    def _drop(self) -> None:
        """Unpin and settle the joined, release what finished (parked tasks must be done)."""
        acquirer = self._acquirer
        for entry, _ in self._joined.values():
            acquirer._table.unpin(entry)
            acquirer._loader.settle(entry)
        self._joined.clear()
        for i, task in list(self._parked.items()):
            if task.done() and not task.cancelled() and task.exception() is None:
                self._done.append((i, task.result()))
            if task.done():
                del self._parked[i]
        for task in self._parked.values():  # only on an error in __init__: nothing awaited them yet
            task.cancel()
        self._parked.clear()
        done, self._done = self._done, []
        for _, got in done:
            if isinstance(got, Entry):
                acquirer.release(got)
