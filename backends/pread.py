"""``pread``: positional reads from a bounded thread pool, through the page cache.

The portable baseline: ``os.preadv`` releases the GIL for the whole read, so N threads keep
N reads in flight, and it needs nothing from the kernel beyond POSIX.  The pool size is the
backend's queue depth (setting ``pread_threads``).

Page-cache tier (``read_tiered``): each read first tries ``preadv2(RWF_NOWAIT)``, which the
kernel serves only from cached, up-to-date pages, stopping (short count, or EAGAIN) at the
first page it would have to wait for; the rest is then read normally.  A read that came back
whole from the first try needed no device I/O.  It is the read itself, not an extra probe:
a cached read costs the same system call as before, an uncached one one more (which starts the
readahead the blocking read would start anyway); measured in ``docs/telemetry.md``.

``RWF_NOWAIT`` alone is not enough: it starts readahead on a miss, and a fast drive can finish
it inside the call, so a drive read came back whole (``_cachestat``).  Where ``cachestat(2)``
runs, it gates the try: a range with a page not cached is read plainly and is a drive read.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from typing import Any, ClassVar

from iosched._errors import InvariantError, ReadError

from ._base import Caps
from ._cachestat import CacheStat
from ._workers import Workers

_RWF_NOWAIT: int | None = getattr(os, "RWF_NOWAIT", None)


def _read_error(path: str, length: int, offset: int, exc: OSError) -> ReadError:
    return ReadError(f"{path}: read of {length} bytes at offset {offset} failed: {exc.strerror or exc}")


def pread_into(fd: int, offset: int, length: int, buf: memoryview, path: str) -> int:
    """Read up to ``length`` bytes at ``offset``, looping on short reads and EINTR; stops
    early only at end of file.  Returns the count."""
    done = 0
    while done < length:
        try:
            n = os.preadv(fd, [buf[done:length]], offset + done)
        except InterruptedError:  # PEP 475 retries EINTR already; kept for handlers that raise
            continue
        except OSError as exc:
            raise _read_error(path, length, offset, exc) from exc
        if n == 0:
            break
        done += n
    return done


class PageCacheProbe:
    """Buffered reads that also say whether the page cache served them (``RWF_NOWAIT`` first).

    Per file, until the filesystem refuses ``RWF_NOWAIT`` (EOPNOTSUPP: no ``FMODE_NOWAIT``);
    from then on that file's reads are plain and answer ``False`` (counted as drive reads),
    and ``info()`` names the file.  Invariant: ``True`` only when ``cachestat(2)`` (where it
    runs) saw every page cached before the read and ``RWF_NOWAIT`` then returned them all."""

    def __init__(self) -> None:
        self._paths: list[str] = []
        self._nowait: list[bool] = []
        self.refused: dict[str, str] = {}
        self._stat = CacheStat()

    def open(self, paths: Sequence[str]) -> None:
        self._paths = list(paths)
        self._nowait = [_RWF_NOWAIT is not None] * len(paths)

    def read(self, fd: int, file: int, offset: int, length: int, buf: memoryview) -> tuple[int, bool]:
        """``pread_into``, and ``True`` when every byte came from cached pages."""
        path = self._paths[file]
        if not self._nowait[file] or _RWF_NOWAIT is None:
            return pread_into(fd, offset, length, buf, path), False
        if self._stat.cached(fd, offset, length) is False:  # RWF_NOWAIT's readahead could hide it
            return pread_into(fd, offset, length, buf, path), False
        try:
            first = os.preadv(fd, [buf[:length]], offset, _RWF_NOWAIT)
        except (BlockingIOError, InterruptedError):  # EAGAIN: the first page is not cached
            first = 0
        except OSError as exc:
            if exc.errno != errno.EOPNOTSUPP:
                raise _read_error(path, length, offset, exc) from exc
            self._nowait[file] = False
            self.refused[path] = "the filesystem refuses RWF_NOWAIT (EOPNOTSUPP)"
            return pread_into(fd, offset, length, buf, path), False
        if first >= length:
            return first, True
        rest = pread_into(fd, offset + first, length - first, buf[first:], path)
        return first + rest, rest == 0  # nothing left to read: the file ended in cached pages

    def read_cached(self, fd: int, file: int, offset: int, length: int, buf: memoryview) -> int | None:
        """The read, when the page cache holds all of it (``cachestat(2)`` says so where it
        runs, and ``RWF_NOWAIT`` returns every byte); ``None`` otherwise, having waited for
        no I/O (what it may have copied is read again by :meth:`read`)."""
        if not self._nowait[file] or _RWF_NOWAIT is None or self._stat.cached(fd, offset, length) is False:
            return None
        try:
            done = os.preadv(fd, [buf[:length]], offset, _RWF_NOWAIT)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as exc:
            if exc.errno != errno.EOPNOTSUPP:
                raise _read_error(self._paths[file], length, offset, exc) from exc
            return None  # read() meets the refusal again and records it
        return done if done >= length else None

    def info(self) -> dict[str, Any]:
        if _RWF_NOWAIT is None:
            probe = "none"
        elif self._stat.available:
            probe = "cachestat+preadv2(RWF_NOWAIT)"
        else:
            probe = "preadv2(RWF_NOWAIT)"
        return {"page_cache_probe": probe, "page_cache_probe_refused": dict(self.refused),
                "page_cache_probe_cachestat": self._stat.reason or "yes"}


def open_all(paths: Sequence[str], flags: int) -> list[int]:
    """Open every path with ``flags``; on failure close what was opened and raise ReadError."""
    fds: list[int] = []
    for path in paths:
        try:
            fds.append(os.open(path, flags | os.O_RDONLY | os.O_CLOEXEC))
        except OSError as exc:
            for fd in fds:
                os.close(fd)
            raise ReadError(f"{path}: cannot open: {exc.strerror or exc}") from exc
    return fds


class PreadBackend:
    """Reads in a pool of ``threads``; a read of at most ``inline_max`` bytes that the page
    cache holds whole is copied on the caller's thread instead (:meth:`read_tiered`)."""

    name: ClassVar[str] = "pread"
    caps: ClassVar[Caps] = Caps.NONE

    def __init__(self, threads: int, inline_max: int = 0) -> None:
        self._threads = threads
        self._inline_max = inline_max
        self.inline_reads = 0
        """Reads the page cache served on the caller's thread, without the pool."""
        self._pool: Workers | None = None
        self._fds: list[int] = []
        self._paths: list[str] = []
        self._probe = PageCacheProbe()

    def open(self, paths: Sequence[str]) -> None:
        self._fds = open_all(paths, 0)
        self._paths = list(paths)
        self._probe.open(paths)
        self._pool = Workers(self._threads, f"iosched-{self.name}")

    def alignment(self, file: int) -> int:
        return 1

    def _read_sync(self, file: int, offset: int, length: int, buf: memoryview) -> tuple[int, bool]:
        return self._probe.read(self._fds[file], file, offset, length, buf)

    async def read_tiered(self, file: int, offset: int, length: int, buf: memoryview) -> tuple[int, bool]:
        """The read in the pool; first, if it is small (``inline_max``, setting
        ``pread_inline_max``), on this thread when the page cache holds all of it.

        Why: a worker's round trip costs more than such a copy.  ``RWF_NOWAIT`` exists for
        this (a server tries the cached read inline and hands the rest to threads), and it
        never waits for the device.  docs/benchmarks.md, "small cached reads copied inline": a
        cached 36 KiB ``preadv2(RWF_NOWAIT)`` takes 6.3 us, 256 KiB 24 us, against 51 us for an
        empty call through a one-thread pool and back to the loop."""
        if self._pool is None:
            raise InvariantError("backend used before open()")
        if length <= self._inline_max:
            done = self._probe.read_cached(self._fds[file], file, offset, length, buf)
            if done is not None:
                self.inline_reads += 1
                return done, True
        return await self._pool.run(self._read_sync, file, offset, length, buf)

    async def read(self, file: int, offset: int, length: int, buf: memoryview) -> int:
        return (await self.read_tiered(file, offset, length, buf))[0]

    def undelivered(self) -> int:
        return 0 if self._pool is None else self._pool.undelivered()

    def info(self) -> dict[str, Any]:
        return {"threads": self._threads, "inline_max_bytes": self._inline_max, "inline_reads": self.inline_reads,
                **self._probe.info()}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()
