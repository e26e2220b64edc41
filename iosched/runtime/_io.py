"""The read path below the store: replicas, routing, per-device queues, failover, accounting.

For each read of an expert's extent the store calls :meth:`ReadPath.read_span`, which

1. asks the :class:`Router` for the replicas holding the file, best first;
2. waits for a slot in that drive's :class:`DeviceQueue` (queue depth, bytes in flight, demand
   before prefetch);
3. has the backend read into the caller's buffer, and counts reads, bytes, errors, in-flight
   per device and per replica (and ``migration_bytes``, the bytes of loads a prefetch started);
   the backend also says whether the page cache served the read (``backends.read_tiered``),
   which the caller gets back with the count;
4. with a :class:`~iosched.formats._verify.Verifier` (``verify="reads"``), hashes the extent's bytes
   and compares them with the manifest before returning: a mismatch is that replica's failed
   read for this extent (``_verify.py`` says how it is counted and attributed);
5. on an error, a short read (a truncated or removed replica) or a mismatch tries the next
   replica, counting a retry, and a *failover* when another replica then serves it; only when
   every replica failed does the error reach the store, naming the last file.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Mapping, Sequence
from typing import TypeVar, cast

from iosched import _settings, backends
from iosched._errors import ChecksumError, InvariantError, ReadError, StoreError
from iosched.formats._verify import Verifier
from iosched.topology._topology import DEFAULT_QUEUE_DEPTH, Discovery

from ._readplan import Span
from ._router import Replica, Router
from ._scheduler import HINT, DeviceQueue, Ticket
from ._stats import DeviceCounters, ReplicaCounters

T = TypeVar("T")


def _fadvise_willneed(path: str, offset: int, length: int) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
    finally:
        os.close(fd)


def _let_go(view: memoryview) -> None:
    """Release ``view`` (the slab's export it held ends now, whoever still refers to it);
    a backend still exporting it would be reading into it yet, so then it is left alone
    (the slab then waits, retired, until that ends: never recycled under a read)."""
    with contextlib.suppress(BufferError):
        view.release()


class ReadPath:
    def __init__(
        self,
        backend: backends.Backend,
        replicas: Sequence[Sequence[str]],
        roots: Sequence[str],
        weights: Mapping[str, float],
        routing: str,
        queue_depth: int | Mapping[str, int],
        stripe_threshold: int = 4 << 20,
        verifier: Verifier | None = None,
        inflight_bytes: int | Mapping[str, int] | None = None,
    ) -> None:
        """``replicas[i]``: the paths holding checkpoint file ``i``, primary first; the backend
        was opened on all of them, flattened in that order.  ``roots[j]``: the primary's or the
        j-th mirror's root, each path's replica root found by prefix; ``weights`` by root;
        ``queue_depth`` one for every drive, or by drive name (``DEFAULT_QUEUE_DEPTH`` for the
        drives not named).  Drives are named as ``iosched topology`` names them.  ``verifier``:
        every extent read is checked against its manifest (``None``: not checked);
        ``inflight_bytes`` the most bytes in flight per drive, one for every drive or by drive
        name (``None``, or a drive not named: the setting of that name; ``iosched/runtime/_scheduler.py``
        says why)."""
        self.backend = backend
        self.zero_copy: backends.ZeroCopyBackend | None = (
            cast("backends.ZeroCopyBackend", backend) if backend.caps & backends.Caps.ZERO_COPY else None
        )
        self._read_tiered = backends.tiered_reader(backend)
        self.devices: dict[str, DeviceCounters] = {}
        self.queues: dict[str, DeviceQueue] = {}
        self.per_replica: dict[str, ReplicaCounters] = {root: ReplicaCounters() for root in roots}
        self._root_of: dict[int, str] = {}
        table: list[list[Replica]] = []
        discovery = Discovery()
        default_cap = int(_settings.get("inflight_bytes")) if not isinstance(inflight_bytes, int) else inflight_bytes
        caps = inflight_bytes if isinstance(inflight_bytes, Mapping) else {}
        n = 0
        for paths in replicas:
            row = []
            for path in paths:
                device = discovery.drive_of(path).name
                self.devices.setdefault(device, DeviceCounters())
                depth = (queue_depth if isinstance(queue_depth, int)
                         else queue_depth.get(device, DEFAULT_QUEUE_DEPTH))
                self.queues.setdefault(device, DeviceQueue(depth, inflight_bytes=caps.get(device, default_cap)))
                root = next((r for r in roots if path == r or path.startswith(r.rstrip("/") + "/")), roots[0])
                self._root_of[n] = root
                row.append(Replica(path, device, n, weight=float(weights.get(root, 1.0))))
                n += 1
            table.append(row)
        self.router = Router(table, routing,
                             pending=lambda replica: self.per_replica[self._root_of[replica.file]].pending)
        self._align = [max(backend.alignment(r.file) for r in row) for row in table]
        self.bytes_read = 0
        self.migration_bytes = 0
        """The part of ``bytes_read`` read by loads a prefetch started (promoted or not)."""
        self.retries = 0
        self.failovers = 0
        self.stripe_threshold = stripe_threshold
        self.striping = bool(backend.caps & backends.Caps.DIRECT) and self.zero_copy is None
        """Only O_DIRECT reads are striped: buffered legs would put the expert in the page
        cache of two drives' files, twice."""
        self.stripes = 0
        self.stripe_redos = 0
        self.hints = 0
        self.verifier = verifier

    def alignment(self, file: int) -> int:
        """The alignment reads of checkpoint file ``file`` need on every replica."""
        return self._align[file]

    def paths(self) -> list[str]:
        return [r.path for row in self.router.replicas for r in row]

    async def read_span(self, key: Hashable, span: Span, buf: memoryview, ticket: Ticket) -> tuple[int, bool]:
        """Read ``span`` of checkpoint file ``span.file`` into ``buf``, failing over between
        replicas; returns the count, at least ``span.head + span.need``, and whether the page
        cache served the read that succeeded.  A large O_DIRECT read of a file with several
        healthy replicas is striped across them first (a drive read).  With a verifier the
        extent's bytes are checked against the manifest after each replica's read; a mismatch
        fails that attempt like an I/O error does."""
        verifier, start = self.verifier, span.offset + span.head
        extent = buf if verifier is None else buf[span.head:span.head + span.need]  # the bytes hashed
        if self.striping and span.length >= self.stripe_threshold:
            got = await self._striped(key, span, buf, ticket)
            if got is not None:
                if verifier is None or await verifier.matches(span.file, start, extent):
                    return got, False
                self.stripe_redos += 1  # which leg was wrong is unknown: read it whole, checked per replica

        if verifier is None and len(row := self.router.replicas[span.file]) == 1:
            # The common read: one replica, nothing to check.  What _failover does for it,
            # without its layers (a closure, the order, a coroutine each: 3 % of the event
            # loop's time on 36 KiB misses, sampled with py-spy; docs/benchmarks.md, "Read
            # path against 8 pread threads").
            replica = row[0]
            try:
                got, cached = await self._one(replica, span.offset, span.length, buf, ticket)
                if got < span.head + span.need:
                    raise self._short(replica, key, span, got)
            except StoreError:
                self._failed(replica)
                raise
            self.router.succeeded(replica)
            return got, cached

        async def attempt(replica: Replica) -> tuple[int, bool]:
            got, cached = await self._one(replica, span.offset, span.length, buf, ticket)
            if got < span.head + span.need:
                raise self._short(replica, key, span, got)
            if verifier is not None:
                await verifier.check(key, replica.file, span.file, start, extent)
            return got, cached

        return await self._failover(key, span.file, start, attempt)

    @staticmethod
    def _short(replica: Replica, key: Hashable, span: Span, got: int) -> ReadError:
        return ReadError(
            f"{replica.path}: short read of expert {key!r}: the file ends at "
            f"{span.offset + got}, before the extent's end at "
            f"{span.offset + span.head + span.need}; was it truncated?"
        )

    async def _striped(self, key: Hashable, span: Span, buf: memoryview, ticket: Ticket) -> int | None:
        """Split ``span`` into block-aligned legs, one per healthy replica, each as long as its
        drive's weight says, and read them at once.  ``None`` (the caller then reads the whole
        span from the routed replica) when there is one replica, or a leg failed or came back
        short: a stripe is all or nothing, so no half-read expert is ever assembled."""
        now, start = self.router.clock(), span.offset + span.head
        legs_of = [r for r in self._order(key, span.file, start) if r.healthy(now)
                   and not (self.verifier is not None and self.verifier.is_bad(r.file, start))]
        if len(legs_of) < 2:
            return None
        align = self._align[span.file]
        total = sum(r.weight for r in legs_of)
        bounds = [0]
        for replica in legs_of[:-1]:
            step = int(span.length * replica.weight / total) // align * align
            bounds.append(min(span.length, bounds[-1] + step))
        bounds.append(span.length)
        legs = [(r, lo, hi) for r, lo, hi in zip(legs_of, bounds[:-1], bounds[1:], strict=True) if hi > lo]
        self.stripes += 1
        results = await asyncio.gather(
            *(self._one(r, span.offset + lo, hi - lo, buf[lo:hi], ticket) for r, lo, hi in legs),
            return_exceptions=True,
        )
        got = 0
        for (replica, lo, hi), result in zip(legs, results, strict=True):
            if isinstance(result, BaseException):
                if not isinstance(result, StoreError):
                    raise result
                self._failed(replica)
                self.stripe_redos += 1
                return None
            got += result[0]
            if result[0] < hi - lo:  # the file ends inside this leg: later legs must be empty
                break
        if got < span.head + span.need or got != sum(
                r[0] for r in results if isinstance(r, tuple)):
            self.stripe_redos += 1
            return None
        return got

    async def map(self, key: Hashable, file: int, offset: int, length: int,
                  ticket: Ticket) -> tuple[memoryview, int, bool]:
        """A zero-copy backend's resident view of the bytes, from the first replica that
        serves them; returns the view, the backend file to unmap later, and whether the page
        cache held every byte."""
        zero_copy = self.zero_copy
        if zero_copy is None:
            raise InvariantError("map() on a backend that cannot map")

        verifier = self.verifier

        async def attempt(replica: Replica) -> tuple[memoryview, int, bool]:
            async with self._slot(replica, ticket, length):
                view, cached = await backends.map_tiered(zero_copy, replica.file, offset, length)
            self._count(replica, length, ticket)
            if verifier is not None:
                try:  # hashing the mapped bytes touches every page of them
                    await verifier.check(key, replica.file, file, offset, view)
                except BaseException:
                    del view
                    zero_copy.unmap(replica.file, offset, length)
                    raise
            return view, replica.file, cached

        return await self._failover(key, file, offset, attempt)

    def _order(self, key: Hashable, file: int, offset: int) -> list[Replica]:
        """The router's order for ``key``, with the replicas whose last read of the extent at
        ``offset`` did not match the manifest moved last."""
        order = self.router.order(key, file)
        verifier = self.verifier
        if verifier is None or not verifier.bad or len(order) == 1:
            return order
        return sorted(order, key=lambda r: verifier.is_bad(r.file, offset))  # stable

    async def _failover(self, key: Hashable, file: int, offset: int,
                        attempt: Callable[[Replica], Awaitable[T]]) -> T:
        """``attempt`` on each replica of ``file`` in routing order until one succeeds;
        the last replica's error when none does (``offset``: the extent's, for the order)."""
        last: StoreError | None = None
        for tries, replica in enumerate(self._order(key, file, offset)):
            if tries:
                self.retries += 1
                if isinstance(last, ChecksumError) and self.verifier is not None:
                    self.verifier.retries += 1
            try:
                result = await attempt(replica)
            except StoreError as exc:
                self._failed(replica)
                last = exc
                continue
            self.router.succeeded(replica)
            self.failovers += tries > 0
            return result
        if last is None:
            raise InvariantError("a read failed over without an error")
        raise last

    async def _take_slot(self, replica: Replica, ticket: Ticket, nbytes: int) -> bool:
        """Wait for a slot in the replica's drive queue, counted as pending on the replica while
        it waits and in flight on the drive once held; whether the slot is speculative.  Every
        slot taken is given back with :meth:`_give_slot`.  Two plain methods rather than an
        async context manager: that costs a generator and two coroutines a read (5 % of the
        event loop's time on 36 KiB misses, sampled with py-spy)."""
        rep = self.per_replica[self._root_of[replica.file]]
        rep.pending += 1
        try:
            speculative = await self.queues[replica.device].acquire(ticket, nbytes)
        except BaseException:
            rep.pending -= 1
            raise
        self.devices[replica.device].in_flight += 1
        return speculative

    def _give_slot(self, replica: Replica, speculative: bool, nbytes: int) -> None:
        self.devices[replica.device].in_flight -= 1
        self.queues[replica.device].release(speculative, nbytes)
        self.per_replica[self._root_of[replica.file]].pending -= 1

    @contextlib.asynccontextmanager
    async def _slot(self, replica: Replica, ticket: Ticket, nbytes: int) -> AsyncIterator[None]:
        """:meth:`_take_slot` and :meth:`_give_slot` around a block (the less frequent users:
        mapping, hints)."""
        speculative = await self._take_slot(replica, ticket, nbytes)
        try:
            yield
        finally:
            self._give_slot(replica, speculative, nbytes)

    async def hint(self, key: Hashable, file: int, offset: int, length: int) -> bool:
        """``posix_fadvise(WILLNEED)`` the bytes on the routed replica, in the ``HINT`` class:
        the kernel starts reading them into the page cache; nothing is owned or counted against
        the budget.  False when it could not be given (the file is gone, for instance)."""
        replica = self.router.order(key, file)[0]
        try:
            async with self._slot(replica, Ticket(HINT), length):
                await asyncio.to_thread(_fadvise_willneed, replica.path, offset, length)
        except OSError:
            return False
        self.hints += 1
        return True

    async def _one(self, replica: Replica, offset: int, length: int, buf: memoryview,
                   ticket: Ticket) -> tuple[int, bool]:
        # The backend gets a memoryview of its own, released once the read returned or raised:
        # a worker thread that still holds it for a moment (``concurrent.futures`` dropped a
        # work item's arguments only after it published the result, measured: a few loads in
        # a hundred; ``backends/_workers.py`` drops them first, a wrapper or another backend
        # may not) then holds a dead view, not an export of the slab, so the slab's export
        # check (``_slab.Slab.exported``) sees only the views an engine keeps.
        handed = buf[:]
        try:
            speculative = await self._take_slot(replica, ticket, length)
            try:
                got, cached = await self._read_tiered(replica.file, offset, length, handed)
            finally:
                self._give_slot(replica, speculative, length)
        finally:
            _let_go(handed)
        self._count(replica, got, ticket)
        return got, cached

    def _count(self, replica: Replica, nbytes: int, ticket: Ticket) -> None:
        dev = self.devices[replica.device]
        dev.reads += 1
        dev.bytes += nbytes
        rep = self.per_replica[self._root_of[replica.file]]
        rep.reads += 1
        rep.bytes += nbytes
        self.bytes_read += nbytes
        if ticket.prefetch:
            self.migration_bytes += nbytes

    def _failed(self, replica: Replica) -> None:
        self.devices[replica.device].errors += 1
        self.per_replica[self._root_of[replica.file]].errors += 1
        self.router.failed(replica)

    def drive_usage(self) -> dict[str, tuple[float, int]]:
        """Per drive: seconds with a read in flight, and bytes read, since the store opened."""
        return {name: (queue.busy_seconds(), self.devices[name].bytes)
                for name, queue in self.queues.items()}

    @property
    def queue_waits(self) -> int:
        """Reads that waited for a slot in their drive's queue."""
        return sum(q.waited for q in self.queues.values())
