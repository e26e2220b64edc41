"""``pread``: positional reads from a bounded thread pool.

The portable baseline: ``os.preadv`` releases the GIL for the whole read, so N threads keep
N reads in flight, and it needs nothing from the kernel beyond POSIX.  The pool size is the
backend's queue depth (setting ``pread_threads``).
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from typing import ClassVar, Sequence

from iosched._errors import ReadError

from ._base import Caps
from ._util import run_to_completion


def pread_full(fd: int, offset: int, length: int, buf: memoryview, path: str) -> None:
    """Read exactly ``length`` bytes at ``offset`` into ``buf``, looping on short reads and EINTR."""
    done = 0
    while done < length:
        try:
            n = os.preadv(fd, [buf[done:length]], offset + done)
        except InterruptedError:  # PEP 475 retries EINTR already; kept for signal handlers that raise
            continue
        except OSError as exc:
            raise ReadError(
                f"{path}: read of {length} bytes at offset {offset} failed: {exc.strerror or exc}"
            ) from exc
        if n == 0:
            raise ReadError(
                f"{path}: short read: {done} of {length} bytes at offset {offset} "
                f"(file ends at {offset + done}; was it truncated?)"
            )
        done += n


class PreadBackend:
    name: ClassVar[str] = "pread"
    caps: ClassVar[Caps] = Caps.NONE

    def __init__(self, threads: int) -> None:
        self._threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._fds: list[int] = []
        self._paths: list[str] = []

    def open(self, paths: Sequence[str]) -> None:
        self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="iosched-pread")
        for path in paths:
            try:
                self._fds.append(os.open(path, os.O_RDONLY | os.O_CLOEXEC))
            except OSError as exc:
                self.close()
                raise ReadError(f"{path}: cannot open: {exc.strerror or exc}") from exc
            self._paths.append(path)

    async def read(self, file: int, offset: int, length: int, buf: memoryview) -> None:
        assert self._pool is not None, "backend used before open()"
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(
            self._pool, pread_full, self._fds[file], offset, length, buf, self._paths[file]
        )
        await run_to_completion(fut)

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
