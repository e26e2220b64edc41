"""``mmap``: read-only mappings of whole shards; an expert's view points into the mapping.

Why: on a page-cache-friendly drive (SATA SSD, a warm file) the cheapest read is none at all:
the engine reads the page cache through the mapping, with no copy into a buffer of ours.

A load is a *pre-touch*, so the expert is resident before its lease starts and the engine
never takes a major fault inside its compute: ``madvise(MADV_POPULATE_READ)`` (Linux 5.14)
faults the range in from a worker thread, through ``ctypes`` so the GIL is released while the
kernel reads; where the kernel lacks it, ``MADV_WILLNEED`` and then one byte touched per page.
Eviction gives the pages back: ``MADV_PAGEOUT`` (Linux 5.4) where the kernel has it, else
``MADV_DONTNEED``; only whole pages inside the expert are advised, never a neighbour's.

A shard that shrinks under the store must not kill the process with SIGBUS: the file's size
is checked (``fstat``) right before each pre-touch, and a range past the end is a
:class:`ReadError`.  What this cannot cover, and ``docs/backends.md`` says: a file truncated
*while* a pre-touch or the engine's compute reads it still raises SIGBUS, as with any mmap.

Page-cache tier (``map_tiered``): a pre-touch that needed no device I/O took no *major* page
fault.  The worker thread's ``ru_majflt`` (``getrusage(RUSAGE_THREAD)``, two system calls,
about a microsecond whatever the range) is read before and after it; any major fault means
some page came from the drive.  A page another read has in flight counts as major too (the
fault waits for the I/O), so the answer errs towards "drive".  Copies (``read_tiered``, for
experts of several extents) are probed as ``pread`` probes them.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import resource
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from iosched._errors import InvariantError, ReadError

from ._base import Caps
from ._workers import Workers
from .pread import PageCacheProbe, open_all

PAGE = mmap.PAGESIZE
MADV_PAGEOUT = 21  # linux/mman.h; Python's mmap module lacks it
MADV_POPULATE_READ = 22

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.madvise.restype = ctypes.c_int


_RUSAGE_THREAD: int | None = getattr(resource, "RUSAGE_THREAD", None)


def _major_faults() -> int:
    """This thread's major page faults so far (-1 where the count is per process only)."""
    if _RUSAGE_THREAD is None:
        return -1
    return resource.getrusage(_RUSAGE_THREAD).ru_majflt


def _madvise(address: int, length: int, advice: int) -> int:
    """``madvise`` through ctypes (which drops the GIL for the call); 0 or the errno."""
    if _libc.madvise(address, length, advice) == 0:
        return 0
    return ctypes.get_errno()


class MmapBackend:
    name: ClassVar[str] = "mmap"
    caps: ClassVar[Caps] = Caps.ZERO_COPY

    def __init__(self, threads: int) -> None:
        self._threads = threads
        self._pool: Workers | None = None
        self._fds: list[int] = []
        self._paths: list[str] = []
        self._maps: list[mmap.mmap | None] = []
        self._bases: list[int] = []
        self.populate_read = True
        self.pageout = True
        self.pretouched_bytes = 0
        self.released_bytes = 0
        self._probe = PageCacheProbe()

    def open(self, paths: Sequence[str]) -> None:
        self._fds = open_all(paths, 0)
        self._paths = list(paths)
        self._probe.open(paths)
        for fd, path in zip(self._fds, self._paths, strict=True):
            size = os.fstat(fd).st_size
            if size == 0:
                self._maps.append(None)
                self._bases.append(0)
                continue
            try:
                mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
            except OSError as exc:
                self.close()
                raise ReadError(f"{path}: cannot map: {exc.strerror or exc}") from exc
            self._maps.append(mm)
            self._bases.append(int(np.frombuffer(mm, dtype=np.uint8).ctypes.data))
        self._pool = Workers(self._threads, "iosched-mmap")

    def alignment(self, file: int) -> int:
        return 1

    async def read_tiered(self, file: int, offset: int, length: int, buf: memoryview) -> tuple[int, bool]:
        """A copy out of the file (for experts made of several extents, which need one buffer)."""
        if self._pool is None:
            raise InvariantError("backend used before open()")
        return await self._pool.run(self._probe.read, self._fds[file], file, offset, length, buf)

    async def read(self, file: int, offset: int, length: int, buf: memoryview) -> int:
        return (await self.read_tiered(file, offset, length, buf))[0]

    async def map_tiered(self, file: int, offset: int, length: int) -> tuple[memoryview, bool]:
        if self._pool is None:
            raise InvariantError("backend used before open()")
        cached = await self._pool.run(self._pretouch_counted, file, offset, length)
        mm = self._maps[file]
        if mm is None:
            raise InvariantError(f"file {file} is not mapped")
        return memoryview(mm)[offset:offset + length].toreadonly(), cached

    async def map(self, file: int, offset: int, length: int) -> memoryview:
        return (await self.map_tiered(file, offset, length))[0]

    def _pretouch_counted(self, file: int, offset: int, length: int) -> bool:
        """Pre-touch; ``True`` when it took no major fault (every page was cached)."""
        before = _major_faults()
        self._pretouch(file, offset, length)
        return before >= 0 and _major_faults() == before

    def _pretouch(self, file: int, offset: int, length: int) -> None:
        path, mm = self._paths[file], self._maps[file]
        size = os.fstat(self._fds[file]).st_size
        mapped = len(mm) if mm is not None else 0
        if offset + length > min(size, mapped):
            raise ReadError(
                f"{path}: {length} bytes at offset {offset} lie past the end of the file "
                f"({size} bytes now, {mapped} mapped); was it truncated?"
            )
        start = offset - offset % PAGE
        address, span = self._bases[file] + start, offset + length - start
        if self.populate_read:
            err = _madvise(address, span, MADV_POPULATE_READ)
            if err == 0:
                self.pretouched_bytes += length
                return
            if err not in (errno.EINVAL, errno.ENOSYS):
                raise ReadError(f"{path}: pre-touch of {length} bytes at offset {offset} failed: "
                                f"{os.strerror(err)}")
            self.populate_read = False  # an older kernel: touch by hand from now on
        _madvise(address, span, mmap.MADV_WILLNEED)
        if mm is None:
            raise InvariantError(f"file {file} is not mapped")
        pages = np.frombuffer(mm, dtype=np.uint8, count=span, offset=start)[::PAGE]
        int(pages.sum())  # one byte a page: each fault is served before the lease starts
        self.pretouched_bytes += length

    def unmap(self, file: int, offset: int, length: int) -> None:
        """Give the pages back from a worker: ``MADV_PAGEOUT`` reclaims them synchronously in
        the calling thread (about 1 ms for 4 MiB, measured by ``iosched bench --backend mmap``),
        which must not be the engine's event loop."""
        if self._pool is not None:
            self._pool.submit(self._release, file, offset, length)

    def _release(self, file: int, offset: int, length: int) -> None:
        first = -(-offset // PAGE) * PAGE
        last = (offset + length) // PAGE * PAGE
        if last <= first:
            return
        address = self._bases[file] + first
        if self.pageout and _madvise(address, last - first, MADV_PAGEOUT) == 0:
            self.released_bytes += last - first
            return
        self.pageout = False
        _madvise(address, last - first, mmap.MADV_DONTNEED)
        self.released_bytes += last - first

    def undelivered(self) -> int:
        return 0 if self._pool is None else self._pool.undelivered()

    def info(self) -> dict[str, Any]:
        return {
            "threads": self._threads,
            "populate_read": self.populate_read,
            "pageout": self.pageout,
            "pretouched_bytes": self.pretouched_bytes,
            "released_bytes": self.released_bytes,
            **self._probe.info(),
            "page_cache_probe_map": "ru_majflt" if _RUSAGE_THREAD is not None else "none",
        }

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        for mm in self._maps:
            if mm is not None:
                try:
                    mm.close()
                except BufferError:
                    pass  # an engine still holds a view; unmapped when it is collected
        self._maps.clear()
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()
