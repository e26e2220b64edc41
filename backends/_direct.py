"""Per-file O_DIRECT descriptors, shared by the backends that read with O_DIRECT.

Each file gets a direct descriptor and its alignment (the device's logical block size).  A
filesystem that refuses O_DIRECT (EINVAL at open, or at a read) turns the file buffered for
good: its descriptor is dropped from use (still closed by :meth:`close`), its alignment
becomes 1, and the reason is recorded and logged once, never silent.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

from iosched._devices import logical_block_size
from iosched._errors import ReadError

from .pread import open_all

log = logging.getLogger("iosched.backends")


class DirectFiles:
    def __init__(self, backend: str) -> None:
        self._backend = backend
        self.fds: list[int | None] = []
        """Per file: the O_DIRECT descriptor, or None once the file is read buffered."""
        self.align: list[int] = []
        self._opened: list[int] = []
        self.fallbacks: dict[str, str] = {}
        """File path -> why it is read buffered."""
        self._paths: list[str] = []

    def open(self, paths: Sequence[str]) -> None:
        """Open a direct descriptor per path; EINVAL makes the file buffered, any other error
        raises :class:`ReadError` (the caller closes what it opened)."""
        self._paths = list(paths)
        for path in paths:
            fd: int | None = None
            try:
                fd = open_all([path], os.O_DIRECT)[0]
                self._opened.append(fd)
            except ReadError as exc:
                cause = exc.__cause__
                if not (isinstance(cause, OSError) and cause.errno == errno.EINVAL):
                    raise
                self._record(path, "the filesystem refuses O_DIRECT (open: EINVAL)")
            self.fds.append(fd)
            self.align.append(logical_block_size(path) if fd is not None else 1)

    def open_buffered(self, paths: Sequence[str]) -> None:
        """Every file buffered from the start (a backend asked not to use O_DIRECT)."""
        self._paths = list(paths)
        self.fds = [None] * len(paths)
        self.align = [1] * len(paths)

    def fall_back(self, file: int, why: str) -> None:
        """A read on the direct descriptor was refused: read the file buffered from now on."""
        self.fds[file] = None
        self._record(self._paths[file], why)

    def _record(self, path: str, why: str) -> None:
        if path not in self.fallbacks:
            self.fallbacks[path] = why
            log.warning("%s: %s: %s; reading it buffered", self._backend, path, why)

    def info(self) -> dict[str, Any]:
        return {"block_sizes": sorted(set(self.align)), "buffered_fallbacks": dict(self.fallbacks)}

    def close(self) -> None:
        for fd in self._opened:
            os.close(fd)
        self._opened.clear()
        self.fds.clear()


class DirectFilesOwner:
    """What a backend that reads through a :class:`DirectFiles` exposes of it (``odirect`` and
    ``uring`` alike): opening it (closing the backend if that fails), each file's alignment,
    and why a file is read buffered.  Listed first among the bases, so its ``alignment``
    overrides a buffered base's."""

    _direct: DirectFiles
    close: Callable[[], None]

    def _open_direct(self, paths: Sequence[str]) -> None:
        try:
            self._direct.open(paths)
        except ReadError:
            self.close()
            raise

    @property
    def buffered_fallbacks(self) -> dict[str, str]:
        """File path -> why it is read buffered."""
        return self._direct.fallbacks

    def alignment(self, file: int) -> int:
        return self._direct.align[file]
