"""Page-aligned read buffers, recycled, but never while a view of one is still referenced.

Why a pool: a fresh anonymous mapping costs an ``mmap`` call and one page fault per 4 KiB on
first write (about 750 faults for a 3 MiB expert); experts of one model come in a handful of
sizes, so the buffer an eviction frees is usually the size the next load needs (the same
after page rounding, or with O_DIRECT a block or two apart: :func:`reuse_slack`).  Before the
pool really recycled under a full budget (:attr:`SlabPool.spares`), iosched's cold misses
waited 1.35-1.8x as long as 8 hand-written ``pread`` threads (``iosched bench-readpath``).

Why ``mmap.mmap(-1, n)``: anonymous mappings are page-aligned, which O_DIRECT needs, and they
go back to the kernel on ``close`` instead of lingering in the allocator's heap.

Invariant kept with the store's help: the pool holds idle buffers only while they fit in the
budget's headroom (``resident + idle <= budget``, each buffer counted at its page-rounded
size), so the buffers' total memory stays within the byte budget plus page rounding.  The
one exception is the :attr:`SlabPool.spares`: evicted experts' slabs, held only until the end
of the event-loop step in which the loads they made room for take them.

**No stale view** (``docs/design.md``, "Slabs and views"): a slab is recycled only when no
buffer of its mapping is exported any more (:meth:`Slab.exported`).  An engine that keeps
``view.data``, a ``view.tensors[...]`` array, a slice of one, or anything numpy or
``memoryview`` derives from them past its lease holds such an export; when its expert leaves
the store the slab is *retired* (:class:`RetiredSlabs`): set aside, never handed to another
load while that reference lives, and taken back (recycled or closed) once it died.  Retired
slabs are memory the engine keeps, not resident experts: they are outside the byte budget, so
no acquire ever waits for memory that its own caller's variable holds (``retired_bytes``
reports them).
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import logging
import mmap
import weakref
from collections import defaultdict, deque

from iosched._errors import InvariantError

PAGE = mmap.PAGESIZE
REUSE_SLACK_MIN = 64 << 10
REUSE_SLACK_SHIFT = 6


def reuse_slack(capacity: int) -> int:
    """How much larger than ``capacity`` an idle slab may be and still be taken: 64 KiB or
    1/64 of the size, whichever is more (16 blocks of 4 KiB, more than O_DIRECT's rounding of a
    few extents adds; at most 1.6 % of a large slab held beyond what its expert needs), and
    always less than ``capacity`` itself, so that room for one slab plus the slack never
    holds two."""
    return min(capacity - 1, max(REUSE_SLACK_MIN, capacity >> REUSE_SLACK_SHIFT))


def serves(capacity: int, slab_capacity: int) -> bool:
    """Whether a slab of ``slab_capacity`` bytes may serve a load that needs ``capacity``
    (page-rounded): at least that, and at most :func:`reuse_slack` more."""
    return capacity <= slab_capacity <= capacity + reuse_slack(capacity)


log = logging.getLogger("iosched")


def round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


HUGE_PAGE = 2 << 20
"""x86-64's and arm64's (4 KiB base pages) transparent huge page: the PMD size."""

_PRIVATE = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
_MADV_HUGEPAGE: int | None = getattr(mmap, "MADV_HUGEPAGE", None)


def _address(mm: mmap.mmap) -> int:
    """Where ``mm`` is mapped (the ``ctypes`` object that tells is dropped at once, so that it
    holds no export of the mapping)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(mm))


class Slab:
    """One page-aligned buffer of ``capacity`` bytes, ``mm[base:base + capacity]``.

    **Huge pages under direct reads** (Linux; ``huge``, which the pool sets for a backend that
    reads O_DIRECT): a slab of 2 MiB or more is a private anonymous mapping whose buffer starts
    on a 2 MiB boundary, its whole 2 MiB pieces advised ``MADV_HUGEPAGE``.  An O_DIRECT read
    into 4 KiB pages hands the block layer one segment per page that is not physically next to
    the one before (a virtio disk takes at most 254 a request,
    ``/sys/block/*/queue/max_segments``), so a 2.25 MiB expert read into a shared mapping of
    4 KiB pages (``mmap.mmap(-1, n)``'s default) becomes several requests, and how many
    depends on where the kernel happened to put the pages: persistent for a slab's life,
    different from one run to the next.  docs/benchmarks.md, "Huge pages under the slabs"
    (2.25 MiB O_DIRECT reads, 8 threads): shared 4 KiB pages 916 MB/s, private 1,030, private
    with huge pages 1,716.
    Without a boundary inside it a mapping holds no huge page, hence the start moved to one:
    the mapping is made ``2 MiB - 4 KiB`` longer, then shrunk to end where the buffer ends,
    so the head before ``base`` is never touched (no memory) and no huge page reaches past the
    buffer (a tail shorter than 2 MiB stays in 4 KiB pages): the memory is the capacity's,
    as before.  The kernel may still hand out 4 KiB pages (``transparent_hugepage`` set to
    ``never``, or no 2 MiB of free contiguous memory): then it is the private mapping's speed.
    Not under buffered reads: there the page cache fills memory, a fresh slab's huge page then
    costs the kernel a compaction, and the reads lost (``iosched bench-readpath --sizes 9M
    --backends pread``, 6 alternated rounds: 1,740 -> 1,449 MB/s, CPU a group 32 -> 40 ms);
    they get private 4 KiB pages.
    """

    __slots__ = ("base", "capacity", "mm")

    def __init__(self, capacity: int, huge: bool = False) -> None:
        self.capacity = capacity
        self.base = 0
        if not huge or capacity < HUGE_PAGE or _MADV_HUGEPAGE is None or not _PRIVATE:
            self.mm = mmap.mmap(-1, capacity, flags=_PRIVATE) if _PRIVATE else mmap.mmap(-1, capacity)
            return
        mm = mmap.mmap(-1, capacity + HUGE_PAGE - PAGE, flags=_PRIVATE)
        self.base = base = -_address(mm) % HUGE_PAGE
        try:
            mm.resize(base + capacity)  # the tail past the buffer unmapped (mremap shrinks in place)
            mm.madvise(_MADV_HUGEPAGE, base, capacity // HUGE_PAGE * HUGE_PAGE)
        except (OSError, SystemError, ValueError):
            pass  # no mremap or no madvise here: a buffer of 4 KiB pages still
        self.mm = mm

    def buffer(self) -> memoryview:
        """The buffer, ``capacity`` bytes (a memoryview: an export while it lives)."""
        return memoryview(self.mm)[self.base:self.base + self.capacity]

    def exported(self) -> bool:
        """Whether any buffer of the mapping is still exported: a ``memoryview`` of it, held
        directly or by a numpy array (the views, and whatever an engine derived from them).

        Python has no public export count.  ``mmap.resize`` refuses with ``BufferError``
        exactly while exports exist (CPython's ``is_resizeable`` checks them first), and a
        resize to the same size is otherwise a no-op (``mremap`` to the same length returns
        the same address, contents untouched).  Measured on the development VM: 0.4 µs when
        not exported (one system call), 0.3 µs when exported (no system call).  It is exact
        for every Python-level reference; a raw address (``arr.ctypes.data``) is none.
        Where ``mremap`` is missing (not Linux) the resize raises ``SystemError`` after the
        export check passed: not exported.
        """
        try:
            self.mm.resize(len(self.mm))
        except BufferError:
            return True
        except (OSError, SystemError):
            return False
        return False

    def close(self) -> None:
        try:
            self.mm.close()
        except BufferError:
            # Still exported: the mapping is freed when its last view is garbage-collected.
            pass


class _Retired:
    """One retired slab: what it held (for the warning) and when (the pool's bytes taken)."""

    __slots__ = ("slab", "owner", "taken_at")

    def __init__(self, slab: Slab, owner: object, taken_at: int) -> None:
        self.slab = slab
        self.owner = owner
        self.taken_at = taken_at


class RetiredSlabs:
    """Slabs whose views outlived their lease: set aside until the last reference dies.

    A retired slab is *watched* through its ``view.data`` array: every array and memoryview
    the store hands out or numpy derives from them holds that array (its base chain), so a
    ``weakref.finalize`` on it fires when the last of them dies.  The finalizer runs in
    whatever thread drops that reference (or runs the garbage collector), possibly in the
    middle of the event loop's own code, so it only appends a ticket to a ``deque`` (atomic:
    no lock a finalizer could deadlock on, never the event loop).  :meth:`reclaim`, on the
    store's side, then re-checks each fired slab with :meth:`Slab.exported` (the truth; the
    finalizer fires before the array lets go of its buffer, and a memoryview sliced from an
    array's ``.base`` holds the mapping without the array) and hands back those free now.
    A slab still exported after its finalizer fired, or retired with no array to watch, is
    *lingering*: re-checked at every :meth:`reclaim` (only an engine that digs through
    ``.base`` gets there).  The finalizer holds a ticket, never the slab nor the store.

    ``slabs == released + len(parked) + len(lingering)``; ``bytes`` sums the ones held now.
    """

    __slots__ = ("slabs", "released", "bytes", "warned", "_parked", "_lingering", "_fired", "_tickets")

    def __init__(self) -> None:
        self.slabs = 0
        """Slabs retired so far (monotonic)."""
        self.released = 0
        """Retired slabs handed back since (recycled, closed, or let go at ``close()``)."""
        self.bytes = 0
        """Page-rounded bytes of the retired slabs held now (a gauge)."""
        self.warned = False
        self._parked: dict[int, _Retired] = {}
        self._lingering: list[_Retired] = []
        self._fired: deque[int] = deque()
        """Tickets of parked slabs whose watched array died (appended by finalizers)."""
        self._tickets = itertools.count()

    def __len__(self) -> int:
        return len(self._parked) + len(self._lingering)

    def retire(self, slab: Slab, owner: object, watch: object | None, taken_at: int) -> None:
        """Set ``slab`` (which held ``owner``'s views) aside until ``watch`` (its live
        ``view.data``, or ``None`` when that died already) and every export are gone."""
        record = _Retired(slab, owner, taken_at)
        self.slabs += 1
        self.bytes += slab.capacity
        if watch is None:
            self._lingering.append(record)
            return
        ticket = next(self._tickets)
        self._parked[ticket] = record
        weakref.finalize(watch, self._fired.append, ticket).atexit = False

    def reclaim(self, room: int | None = None, horizon: int = 0) -> list[Slab]:
        """The retired slabs nothing exports any more, no longer counted here.

        ``room`` (``None``: no limit): hand back free slabs only while their capacity sums to
        at most ``room``; a free one beyond it stays retired (still counted in ``bytes``, as it
        was a moment ago) for a later call, if it was retired when the pool's bytes taken were
        past ``horizon``, else it is handed back too (and the caller closes it)."""
        fired = self._fired
        while fired:
            record = self._parked.pop(fired.popleft(), None)
            if record is not None:
                self._lingering.append(record)
        if not self._lingering:
            return []
        free: list[Slab] = []
        held: list[_Retired] = []
        for record in self._lingering:
            if record.slab.exported():
                held.append(record)
            elif room is not None and record.slab.capacity > room and record.taken_at > horizon:
                held.append(record)  # free, kept for a later take (SlabPool.reclaim)
            else:
                if room is not None:
                    room -= record.slab.capacity
                free.append(record.slab)
                self.released += 1
                self.bytes -= record.slab.capacity
        self._lingering = held
        return free

    def oldest(self) -> _Retired | None:
        """The retired slab watched longest, if any (a published expert's whose ``view.data``
        still lives; they are kept in retirement order)."""
        return next(iter(self._parked.values()), None)

    def let_go(self) -> None:
        """``close()``: hold none any more.  What an engine still references is freed by
        Python with the last reference (the mapping lives as long as a memoryview of it)."""
        self.released += len(self)
        self.bytes = 0
        self._parked.clear()
        self._lingering.clear()
        self._fired.clear()


class SlabPool:
    def __init__(self, huge_pages: bool = False) -> None:
        self.huge_pages = huge_pages
        """Whether new slabs of 2 MiB and more go on huge pages (:class:`Slab`): for a backend
        that reads O_DIRECT."""
        self._idle: dict[int, list[Slab]] = defaultdict(list)
        self.idle_bytes = 0
        self.allocated = 0
        """Slabs created over the pool's life (a reuse rate is 1 - allocated / takes)."""
        self.takes = 0
        self.taken_bytes = 0
        """Capacity handed out by :meth:`take`, summed: the clock retired slabs are aged by."""
        self.gives = 0
        """Slabs given back (recycled, closed or retired); ``takes - gives`` are held by loads
        and resident experts."""
        self.retired = RetiredSlabs()
        self.spares: list[Slab] = []
        """Slabs evictions freed that did not fit the idle headroom (by their own page or block
        rounding), handed to the loads the same event-loop step starts (:meth:`take`), else
        closed at the end of that step: never idle, never held past the step.  A list, not one
        slab: a batch of prefetches (``reserve_speculative_many``) evicts several victims
        before its loads start, and with a single spare all but one of their slabs were closed
        and as many fresh ones mapped (111 of 137 prefetch loads in a paired real run, qwen,
        2.25 MiB experts, 4 TD: page faults, zeroing and an munmap's TLB flush on every core
        each).  Their bytes are the evicted experts', which the loads about to start take, so
        the pool still holds no more than the budget past the step."""

    def take(self, nbytes: int) -> Slab:
        """An idle slab of at least ``nbytes`` (page-rounded), else a new one.

        An idle slab up to :func:`reuse_slack` larger is taken too: O_DIRECT rounds each expert's
        reads out to whole blocks from wherever its bytes start, so experts of one size need
        slabs one or two blocks apart, and an exact-size match missed half the recycling (a
        fresh ``mmap`` costs its page faults and the kernel's zeroing on the first read into
        it, and its ``munmap`` a TLB flush on every core: measured with ``iosched
        bench-readpath``, docs/benchmarks.md)."""
        capacity = round_up(max(nbytes, 1), PAGE)
        self.takes += 1
        spares = self.spares
        for i, spare in enumerate(spares):
            if serves(capacity, spare.capacity):
                del spares[i]
                self.taken_bytes += spare.capacity
                return spare
        free = self._idle.get(capacity)
        if not free:
            fits = [c for c, slabs in self._idle.items() if slabs and serves(capacity, c)]  # the exact size has none
            free = self._idle[min(fits)] if fits else None
        if free:
            slab = free.pop()
            self.idle_bytes -= slab.capacity
            self.taken_bytes += slab.capacity
            return slab
        self.taken_bytes += capacity
        self.allocated += 1
        return Slab(capacity, self.huge_pages)

    def give_back(self, slab: Slab, max_idle_bytes: int, owner: object = None, watch: object | None = None,
                  budget_bytes: int = 0, hand_over: bool = False) -> None:
        """Return a slab: recycled (kept idle if the idle total stays within ``max_idle_bytes``,
        else closed) when nothing exports it, else retired until nothing does.

        ``owner`` is the published expert whose views the slab held (``None`` for a failed
        load's slab, which an exception's traceback may still reference for a while) and
        ``watch`` its ``view.data`` array if something still references it; ``budget_bytes``
        dates the warning about views kept for long (:meth:`_warn_if_kept`).

        ``hand_over`` (an eviction, whose reservation's load takes a slab in the same step): a
        free slab that does not fit ``max_idle_bytes`` becomes one of the :attr:`spares`
        instead of being closed.  Why: the table counts an expert at its bytes, its slab holds them page-
        (O_DIRECT: block-) rounded, so with the budget full the slab an eviction freed never
        fitted the headroom, was closed, and every miss mapped a fresh one: its page faults,
        the kernel's zeroing and munmap's TLB flush were most of the gap to a hand-written
        pread engine (docs/benchmarks.md, "Read path against 8 pread threads")."""
        self.gives += 1
        # The slab given back first, then the retired ones: the other way round, a retired
        # slab freed meanwhile took the idle room and this one (which the load about to start
        # would reuse just as well) was closed, so a retired slab freed was worth nothing.
        if watch is not None or slab.exported():
            self.retired.retire(slab, owner, watch, self.taken_bytes)
        elif hand_over and self.idle_bytes + slab.capacity > max_idle_bytes:
            self._hand_over(slab)
        else:
            self._keep(slab, max_idle_bytes)
        self.reclaim(max_idle_bytes, 2 * budget_bytes)
        if owner is not None and len(self.retired) and not self.retired.warned:
            self._warn_if_kept(budget_bytes)

    def _warn_if_kept(self, budget_bytes: int) -> None:
        """Warn once when a retired slab is still referenced after the store loaded more than
        ``budget_bytes`` since: a whole turnover of the budget, so not the loop variable
        (``async with ... as view`` keeps ``view`` bound until the next one) that retires a
        slab for one acquire in perfectly normal engine code, but a view kept on purpose."""
        oldest = self.retired.oldest()
        if oldest is None or self.taken_bytes - oldest.taken_at <= budget_bytes:
            return
        self.retired.warned = True
        log.warning(
            "a view of expert %r is still referenced long after its lease ended (the store loaded "
            "%d bytes since, more than its %d-byte budget): its %d-byte buffer is retired, never "
            "reused while that reference lives, and outside budget_bytes; copy what you keep past "
            "a lease. stats()['retired_bytes'] is what is held so; this is said once per store.",
            oldest.owner, self.taken_bytes - oldest.taken_at, budget_bytes, oldest.slab.capacity)

    def _hand_over(self, slab: Slab) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            slab.close()
            return
        self.spares.append(slab)
        loop.call_soon(self._spare_unused, slab)

    def _spare_unused(self, slab: Slab) -> None:
        """The step that made ``slab`` a spare ended: close it unless a load took it."""
        spares = self.spares
        for i, spare in enumerate(spares):
            if spare is slab:
                del spares[i]
                slab.close()
                return

    def fits(self, nbytes: int) -> bool:
        """Whether :meth:`take` of ``nbytes`` would reuse a spare or an idle slab."""
        capacity = round_up(max(nbytes, 1), PAGE)
        if any(serves(capacity, spare.capacity) for spare in self.spares):
            return True
        return any(slabs and serves(capacity, c) for c, slabs in self._idle.items())

    def reclaim(self, max_idle_bytes: int, keep_for: int = 0) -> None:
        """Take back the retired slabs whose last reference died (kept idle within
        ``max_idle_bytes``, else closed).

        ``keep_for`` > 0: a free retired slab that does not fit in the idle limit now stays
        retired until the pool has taken ``keep_for`` more bytes since it was retired, so a
        later load reuses it.  Why: an engine's loop variable (``async with
        store.acquire_many(keys) as views``) holds the previous batch while the next one
        evicts it, so a whole batch of slabs is retired at once and comes back free at once,
        when the budget has room for one of them; closed there, every later miss of that
        batch mapped a fresh slab (page faults, zeroing, munmap's TLB flush: measured with
        ``iosched bench-readpath``).  Held so, they are memory the engine's views held a
        moment ago and ``retired_bytes`` still reports; the store keeps them for two turnovers of
        the budget (``2 * budget_bytes``: retired while one batch loads, wanted by the next; one
        turnover was too short by the slabs' page rounding and closed half of them)."""
        if len(self.retired):
            room = None if keep_for <= 0 else max(0, max_idle_bytes - self.idle_bytes)
            for slab in self.retired.reclaim(room, self.taken_bytes - keep_for):
                self._keep(slab, max_idle_bytes)

    def _keep(self, slab: Slab, max_idle_bytes: int) -> None:
        if self.idle_bytes + slab.capacity <= max_idle_bytes:
            self._idle[slab.capacity].append(slab)
            self.idle_bytes += slab.capacity
        else:
            slab.close()

    def trim(self, max_idle_bytes: int) -> None:
        """Close idle slabs, largest first, until the idle total is within ``max_idle_bytes``."""
        for capacity in sorted(self._idle, reverse=True):
            free = self._idle[capacity]
            while free and self.idle_bytes > max_idle_bytes:
                free.pop().close()
                self.idle_bytes -= capacity
        if self.idle_bytes > max_idle_bytes:  # an arithmetic guard
            raise InvariantError("slab pool trim left too many idle bytes")

    def idle_exported(self) -> int:
        """Idle slabs something still exports: 0 unless a bug recycled a slab in use
        (``ExpertStore.check_invariants``)."""
        return sum(1 for free in self._idle.values() for slab in free if slab.exported())

    def close(self) -> None:
        self.trim(0)
        for spare in self.spares:
            spare.close()
        self.spares.clear()
        self.retired.let_go()
