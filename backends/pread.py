"""``pread``: positional reads from a bounded thread pool, through the page cache.

The portable baseline: ``os.preadv`` releases the GIL for the whole read, so N threads keep
N reads in flight, and it needs nothing from the kernel beyond POSIX.  The pool size is the
backend's queue depth (setting ``pread_threads``).
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar, Sequence

from iosched._errors import ReadError

from ._base import Caps
from ._util import run_to_completion


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
            raise ReadError(
                f"{path}: read of {length} bytes at offset {offset} failed: {exc.strerror or exc}"
            ) from exc
        if n == 0:
            break
        done += n
    return done


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
    name: ClassVar[str] = "pread"
    caps: ClassVar[Caps] = Caps.NONE

    def __init__(self, threads: int) -> None:
        self._threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._fds: list[int] = []
        self._paths: list[str] = []

    def open(self, paths: Sequence[str]) -> None:
        self._fds = open_all(paths, 0)
        self._paths = list(paths)
        self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix=f"iosched-{self.name}")

    def alignment(self, file: int) -> int:
        return 1

    def _read_sync(self, file: int, offset: int, length: int, buf: memoryview) -> int:
        return pread_into(self._fds[file], offset, length, buf, self._paths[file])

    async def read(self, file: int, offset: int, length: int, buf: memoryview) -> int:
        assert self._pool is not None, "backend used before open()"
        fut = asyncio.get_running_loop().run_in_executor(
            self._pool, self._read_sync, file, offset, length, buf
        )
        return await run_to_completion(fut)

    def info(self) -> dict[str, Any]:
        return {"threads": self._threads}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()
