"""The backend contract, after fio's ioengine: a small protocol, capabilities as flags.

A backend only moves bytes: it opens the checkpoint's files and fills a caller's buffer.
Everything else (which buffer, alignment padding, per-device counters, timing, short-read
checks, retries, budgets, single-flight) is the core's, so a backend is a short file and
every backend is held to one conformance suite (``tests/test_backend_conformance.py``).

Contract of :meth:`Backend.read`:

* reads up to ``length`` bytes of file ``file`` at ``offset`` into ``buf[:length]`` and
  returns how many it read: fewer than ``length`` only when the file ends first (0 at or past
  the end).  The core, which knows how many bytes it needed, turns a short count into a
  :class:`iosched.ReadError`;
* raises :class:`iosched.ReadError` naming the file for any I/O error;
* for a backend with :attr:`Caps.DIRECT`, the core passes ``offset``, ``length`` and the
  address of ``buf`` as multiples of :meth:`Backend.alignment` (the device's logical block
  size), and ``buf`` is a slice of a page-aligned slab;
* never touches ``buf`` after it returns or raises, also when the awaiting task is cancelled:
  a backend that hands the read to a thread or a ring waits for it to finish before
  propagating the cancellation, so the core may recycle the buffer at once.

A :attr:`Caps.ZERO_COPY` backend also implements :class:`ZeroCopyBackend`: the core asks it
for a resident view of its own memory instead of a read into a slab.

A backend that hands completions to the event loop through a queue (a worker thread's post,
an io_uring CQE) may also have ``undelivered()``: the reads that finished whose awaiting
coroutine has not resumed yet.  The core looks it up once with :func:`undelivered_counter`
(``0`` for a backend without it) and lets those results through before batch-end work that
can wait (``iosched/runtime/_prefetch.py``); wrappers forward it.

A backend that can tell whether a read was served from the page cache also has
``read_tiered`` (and, zero-copy, ``map_tiered``), see :class:`TieredBackend`; the core calls
them through :func:`read_tiered` and :func:`map_tiered`, which answer ``False`` ("it may have
gone to the drive") for a backend without them, so wrappers and plain backends stay valid.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, cast


class Caps(enum.Flag):
    """What a backend can do; the core reads these instead of checking backend names."""

    NONE = 0
    DIRECT = enum.auto()
    """Bypasses the page cache (O_DIRECT): the core aligns offsets, lengths and buffers."""
    NATIVE_ASYNC = enum.auto()
    """Completions arrive on the event loop without a thread per read (io_uring)."""
    ZERO_COPY = enum.auto()
    """Views point into the backend's own memory (mmap) rather than a slab."""
    TURN_BATCHED = enum.auto()
    """The reads started in one turn of the event loop reach the device together, at the next
    turn (one ``io_uring_enter`` for all of them, scheduled with ``call_soon``): an engine that
    computes on the loop right after starting reads must let the loop turn once more first."""


class Backend(Protocol):
    @property
    def name(self) -> str:
        """The backend's name (``pread``, ``odirect``, ``mmap``, ``uring``)."""

    @property
    def caps(self) -> Caps:
        """What it can do."""

    def open(self, paths: Sequence[str]) -> None:
        """Open every file the store will read; file ``i`` of later calls is ``paths[i]``.
        Raises :class:`iosched.ReadError` naming a file that cannot be opened."""

    def alignment(self, file: int) -> int:
        """The granularity the core must align reads of ``file`` to (1 when it need not)."""

    async def read(self, file: int, offset: int, length: int, buf: memoryview) -> int:
        """Read up to ``length`` bytes at ``offset`` into ``buf``; fewer only at end of file."""

    def info(self) -> dict[str, Any]:
        """Backend-specific facts for ``stats()["backend_info"]`` (fallbacks, reasons, ring size)."""

    def close(self) -> None:
        """Release descriptors, rings and workers; called once, with no read in flight."""


class ZeroCopyBackend(Backend, Protocol):
    async def map(self, file: int, offset: int, length: int) -> memoryview:
        """A read-only view of the file's bytes ``[offset, offset + length)`` in the backend's
        own memory, made resident before it returns; :class:`iosched.ReadError` if the file
        is shorter than that now."""

    def unmap(self, file: int, offset: int, length: int) -> None:
        """The core no longer needs those bytes resident: give the pages back."""


class TieredBackend(Backend, Protocol):
    async def read_tiered(self, file: int, offset: int, length: int, buf: memoryview) -> tuple[int, bool]:
        """:meth:`Backend.read`, and whether the page cache held every byte it returned:
        ``True`` only when the kernel showed it (no byte needed device I/O); ``False`` for a
        read that went to the device or that the backend cannot tell about, so a drive read
        is never counted as a page-cache one."""


class TieredZeroCopyBackend(ZeroCopyBackend, Protocol):
    async def map_tiered(self, file: int, offset: int, length: int) -> tuple[memoryview, bool]:
        """:meth:`ZeroCopyBackend.map`, and whether making the range resident needed no
        device I/O (same meaning of ``True`` and ``False`` as ``read_tiered``)."""


def tiered_reader(backend: Backend) -> Callable[[int, int, int, memoryview], Awaitable[tuple[int, bool]]]:
    """``backend.read_tiered`` where it has one, else a reader answering
    ``(backend.read(...), False)``: looked up once by a caller that reads often (the core's
    read path), where a lookup and a coroutine of :func:`read_tiered` per read show."""
    tiered = getattr(backend, "read_tiered", None)
    if tiered is not None:
        return cast(TieredBackend, backend).read_tiered

    async def untiered(file: int, offset: int, length: int, buf: memoryview) -> tuple[int, bool]:
        return await backend.read(file, offset, length, buf), False

    return untiered


def undelivered_counter(backend: Backend) -> Callable[[], int]:
    """``backend.undelivered`` where it has one, else a counter that always answers ``0``."""
    counter: Callable[[], int] | None = getattr(backend, "undelivered", None)
    return counter if counter is not None else _none_undelivered


def _none_undelivered() -> int:
    return 0


async def read_tiered(backend: Backend, file: int, offset: int, length: int,
                      buf: memoryview) -> tuple[int, bool]:
    """``backend.read_tiered`` where it has one, else ``(backend.read(...), False)``."""
    return await tiered_reader(backend)(file, offset, length, buf)


async def map_tiered(backend: ZeroCopyBackend, file: int, offset: int, length: int) -> tuple[memoryview, bool]:
    """``backend.map_tiered`` where it has one, else ``(backend.map(...), False)``."""
    tiered = getattr(backend, "map_tiered", None)
    if tiered is None:
        return await backend.map(file, offset, length), False
    return await cast(TieredZeroCopyBackend, backend).map_tiered(file, offset, length)
