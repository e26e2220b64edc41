"""``odirect``: positional reads with O_DIRECT from a bounded thread pool.

Why: an engine that keeps experts in its own buffers gains nothing from the page cache but a
second copy of every expert and the kernel's memcpy; O_DIRECT moves the bytes from the device
straight into the store's slab.  The core rounds each read out to the device's logical block
size (from sysfs; 4096 when unknown) and points the view at the right offset inside the slab.

Each file has a direct descriptor and a buffered one.  The buffered one serves the part of a
read past the last whole block of the file (an O_DIRECT read there comes back short), and
every read of a file whose filesystem refuses O_DIRECT (tmpfs on old kernels, some FUSE),
which is counted in :meth:`info` and logged once, never silent.
"""

from __future__ import annotations

import errno
import logging
import os
from typing import Any, ClassVar, Sequence

from iosched._devices import logical_block_size
from iosched._errors import ReadError

from ._base import Caps
from .pread import PreadBackend, open_all, pread_into

log = logging.getLogger("iosched.backends")


class ODirectBackend(PreadBackend):
    name: ClassVar[str] = "odirect"
    caps: ClassVar[Caps] = Caps.DIRECT

    def __init__(self, threads: int) -> None:
        super().__init__(threads)
        self._direct: list[int | None] = []
        """Per file: the O_DIRECT descriptor, or None once the file is read buffered."""
        self._direct_fds: list[int] = []
        self._align: list[int] = []
        self.buffered_fallbacks: dict[str, str] = {}
        """File path -> why it is read buffered."""
        self.tail_reads = 0

    def open(self, paths: Sequence[str]) -> None:
        super().open(paths)  # the buffered descriptors
        for path in paths:
            try:
                fd: int | None = open_all([path], os.O_DIRECT)[0]
            except ReadError as exc:
                cause = exc.__cause__
                if not (isinstance(cause, OSError) and cause.errno == errno.EINVAL):
                    self.close()
                    raise
                fd = None
                self._fall_back(path, "the filesystem refuses O_DIRECT (open: EINVAL)")
            self._direct.append(fd)
            if fd is not None:
                self._direct_fds.append(fd)
            self._align.append(logical_block_size(path) if fd is not None else 1)

    def _fall_back(self, path: str, why: str) -> None:
        if path not in self.buffered_fallbacks:
            self.buffered_fallbacks[path] = why
            log.warning("odirect: %s: %s; reading it buffered", path, why)

    def alignment(self, file: int) -> int:
        return self._align[file]

    def _read_sync(self, file: int, offset: int, length: int, buf: memoryview) -> int:
        fd, path, align = self._direct[file], self._paths[file], self._align[file]
        done = 0
        if fd is not None:
            try:
                while done < length:
                    n = os.preadv(fd, [buf[done:length]], offset + done)
                    done += n
                    if n == 0 or n % align:
                        break  # the file ends inside this read
            except InterruptedError:
                pass  # finish buffered below
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise ReadError(
                        f"{path}: O_DIRECT read of {length} bytes at offset {offset} failed: "
                        f"{exc.strerror or exc}"
                    ) from exc
                self._direct[file] = None  # still closed by close(), through _direct_fds
                self._fall_back(path, "the filesystem refuses O_DIRECT reads (EINVAL)")
        if done < length:
            if fd is not None:
                self.tail_reads += 1
            done += pread_into(self._fds[file], offset + done, length - done, buf[done:], path)
        return done

    def info(self) -> dict[str, Any]:
        return {
            **super().info(),
            "block_sizes": sorted(set(self._align)),
            "buffered_fallbacks": dict(self.buffered_fallbacks),
            "tail_reads": self.tail_reads,
        }

    def close(self) -> None:
        for fd in self._direct_fds:
            os.close(fd)
        self._direct_fds.clear()
        self._direct.clear()
        super().close()
