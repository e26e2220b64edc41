"""``odirect``: positional reads with O_DIRECT from a bounded thread pool.

Why: an engine that keeps experts in its own buffers gains nothing from the page cache but a
second copy of every expert and the kernel's memcpy; O_DIRECT moves the bytes from the device
straight into the store's slab.  The core rounds each read out to the device's logical block
size (from sysfs; 4096 when unknown) and points the view at the right offset inside the slab.

Each file has a direct descriptor and a buffered one.  The buffered one serves the part of a
read past the last whole block of the file (an O_DIRECT read there comes back short), and
every read of a file whose filesystem refuses O_DIRECT (tmpfs on old kernels, some FUSE),
which is counted in :meth:`info` and logged once, never silent.

Page-cache tier: an O_DIRECT read always goes to the device (``read_tiered`` answers
``False``); only a file read buffered for good is probed, as ``pread`` probes.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Sequence
from typing import Any, ClassVar

from iosched._errors import ReadError

from ._base import Caps
from ._direct import DirectFiles, DirectFilesOwner
from .pread import PreadBackend, pread_into

log = logging.getLogger("iosched.backends")


class ODirectBackend(DirectFilesOwner, PreadBackend):
    name: ClassVar[str] = "odirect"
    caps: ClassVar[Caps] = Caps.DIRECT

    def __init__(self, threads: int) -> None:
        super().__init__(threads)
        self._direct = DirectFiles(self.name)
        self.tail_reads = 0

    def open(self, paths: Sequence[str]) -> None:
        super().open(paths)  # the buffered descriptors
        self._open_direct(paths)

    def _read_sync(self, file: int, offset: int, length: int, buf: memoryview) -> tuple[int, bool]:
        fd, path, align = self._direct.fds[file], self._paths[file], self._direct.align[file]
        if fd is None:
            return self._probe.read(self._fds[file], file, offset, length, buf)
        done = 0
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
            self._direct.fall_back(file, "the filesystem refuses O_DIRECT reads (EINVAL)")
        if done < length:
            self.tail_reads += 1
            done += pread_into(self._fds[file], offset + done, length - done, buf[done:], path)
        return done, False

    def info(self) -> dict[str, Any]:
        return {
            **super().info(),
            **self._direct.info(),
            "tail_reads": self.tail_reads,
        }

    def close(self) -> None:
        self._direct.close()
        super().close()
