"""``cachestat(2)``: how many of a file range's pages the page cache holds, without I/O.

Why it exists: ``preadv2(RWF_NOWAIT)`` alone cannot tell a cached read from a drive read.
``RWF_NOWAIT`` sets ``IOCB_NOWAIT``, not ``IOCB_NOIO``, so on a miss the kernel still starts
readahead before it gives up, and a fast drive can finish that I/O while the call is still
looking: the read then comes back whole and looks cached (on a virtio disk, 2 of 40 reads of
512 KiB right after ``POSIX_FADV_DONTNEED`` came back whole from ``RWF_NOWAIT``).
``cachestat(2)`` (Linux 6.5) counts the range's cached pages and never reads.

No library exposes it (``os`` has no ``cachestat`` up to Python 3.13), hence the ``ctypes``
call.  Cost: about 6 µs a call through ``ctypes``, in the backend's worker thread, against the
hundreds of µs of the 0.5 MiB read it gates.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
import sys
from typing import Any

# cachestat's number in the generic system-call table, which x86_64 and arm64 share
# (include/uapi/asm-generic/unistd.h, arch/x86/entry/syscalls/syscall_64.tbl: 451).
_SYS_CACHESTAT = 451
_MACHINES = {"x86_64", "amd64", "aarch64", "arm64"}
PAGE = mmap.PAGESIZE


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in
                ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


class CacheStat:
    """``cached(fd, offset, length)``: ``True`` when every page of the range (up to the end of
    the file) is in the page cache, ``False`` when one is not, ``None`` when the kernel cannot
    tell (no ``cachestat``: then ``available`` is ``False`` and ``reason`` says why)."""

    def __init__(self) -> None:
        self.available = False
        self.reason = ""
        self._syscall: Any = None
        if not sys.platform.startswith("linux") or platform.machine().lower() not in _MACHINES:
            self.reason = f"cachestat(2) is Linux x86_64/arm64 only (here {sys.platform} {platform.machine()})"
            return
        try:
            self._syscall = ctypes.CDLL(None, use_errno=True).syscall
        except (OSError, AttributeError) as exc:
            self.reason = f"libc's syscall() is not reachable: {exc}"
            return
        probe, _ = self._call(-1, 0, 0)  # EBADF where the call exists, ENOSYS where it does not
        if probe == errno.EBADF:
            self.available = True
        else:
            self.reason = f"cachestat(2) answered {errno.errorcode.get(probe, probe)} (Linux < 6.5?)"

    def _call(self, fd: int, offset: int, length: int) -> tuple[int, int]:
        """``(0, cached pages)``, or ``(errno, 0)``.  Safe from several threads at once."""
        out, rng = _Stat(), _Range(offset, length)
        rc = self._syscall(ctypes.c_long(_SYS_CACHESTAT), ctypes.c_int(fd), ctypes.byref(rng),
                           ctypes.byref(out), ctypes.c_uint(0))
        return (0, int(out.nr_cache)) if rc == 0 else (ctypes.get_errno(), 0)

    def cached(self, fd: int, offset: int, length: int) -> bool | None:
        if not self.available or length <= 0:
            return None
        err, pages = self._call(fd, offset, length)
        if err:
            return None
        first, last = offset // PAGE, (offset + length - 1) // PAGE
        if pages >= last - first + 1:
            return True
        size = os.fstat(fd).st_size  # pages past the end of the file are never cached
        if offset >= size:
            return True
        return pages >= min(last, (size - 1) // PAGE) - first + 1
