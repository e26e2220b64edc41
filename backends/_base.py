"""The backend contract, after fio's ioengine: a small protocol, capabilities as flags.

A backend only moves bytes: it opens the checkpoint's files and fills a caller's buffer with
one extent.  Everything else (which buffer, per-device counters, timing, retries, budgets,
single-flight) is the core's, so a backend is a short file and every backend is held to the
same conformance suite (``tests/test_backend_conformance.py``).

Contract of :meth:`Backend.read`:

* fills ``buf[:length]`` with the file's bytes ``[offset, offset + length)`` or raises
  :class:`iosched.ReadError` naming the file (a short read past the end of file included);
* never touches ``buf`` after it returns or raises, also when the awaiting task is cancelled:
  a backend that hands the read to a thread or a ring waits for it to finish before
  propagating the cancellation, so the core may recycle the buffer at once.
"""

from __future__ import annotations

import enum
from typing import ClassVar, Protocol, Sequence


class Caps(enum.Flag):
    """What a backend can do; the core reads these instead of checking backend names."""

    NONE = 0
    DIRECT = enum.auto()
    """Bypasses the page cache (O_DIRECT): buffers and offsets must be block-aligned."""
    NATIVE_ASYNC = enum.auto()
    """Completions arrive on the event loop without a thread per read (io_uring)."""
    ZERO_COPY = enum.auto()
    """Views point into the backend's own memory (mmap) rather than a slab."""


class Backend(Protocol):
    name: ClassVar[str]
    caps: ClassVar[Caps]

    def open(self, paths: Sequence[str]) -> None:
        """Open every file the store will read; file ``i`` of later reads is ``paths[i]``."""

    async def read(self, file: int, offset: int, length: int, buf: memoryview) -> None:
        """Fill ``buf[:length]`` with ``length`` bytes of file ``file`` at ``offset``."""

    def close(self) -> None:
        """Release descriptors and workers; called once, with no read in flight."""
