"""Read backends, one a file, behind the protocol in ``_base``.

``create(name)`` builds a backend by name; ``available()`` says which can run here and, for
those that cannot, why; ``resolve(name)`` turns ``auto`` into a name, with the reason.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from iosched._errors import BackendUnavailable
from iosched._settings import get as setting

from ._base import (
    Backend,
    Caps,
    TieredBackend,
    ZeroCopyBackend,
    map_tiered,
    read_tiered,
    tiered_reader,
    undelivered_counter,
)

__all__ = ["Backend", "Caps", "NAMES", "TieredBackend", "ZeroCopyBackend", "available", "cached_share",
           "choose_auto", "create", "map_tiered", "read_tiered", "resolve", "tiered_reader",
           "undelivered_counter"]

NAMES = ("pread", "odirect", "mmap", "uring")


def _uring_reason() -> str | None:
    from .uring import probe

    return probe()


def available() -> dict[str, str | None]:
    """Each backend name mapped to ``None`` when it can run here, else the reason it cannot."""
    return {"pread": None, "odirect": None, "mmap": None, "uring": _uring_reason()}


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _accepts_direct(path: str) -> bool:
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC))
    except OSError:
        return False
    return True


WARM_SHARE = 0.5
"""The share of a larger-than-half-memory checkpoint the page cache must already hold for
``auto`` to read it buffered: then most misses are memory copies, which no O_DIRECT read
matches (``iosched bench-readpath --passes 2``: re-reads the page cache served cost the
buffered arms a fraction of a drive read, docs/benchmarks.md), and drive reads with readahead
were on par with O_DIRECT on the development VM's pass 1."""


def cached_share(paths: Sequence[str]) -> float | None:
    """The share of the files' pages the page cache holds now, or ``None`` if it cannot tell.

    ``mincore(2)`` over a private mapping of each file, which is never touched: no I/O and
    no readahead (``preadv2(RWF_NOWAIT)``, the per-read probe of ``pread``, would start
    readahead at every page it samples), one system call per file."""
    import ctypes
    import mmap

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        mincore = libc.mincore
    except (OSError, AttributeError):
        return None
    page = mmap.PAGESIZE
    cached = pages = 0
    for path in paths:
        try:
            size = os.path.getsize(path)
            if size == 0:
                continue
            with open(path, "rb") as f:
                mm = mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError):
            return None
        try:
            n = (size + page - 1) // page
            vec = (ctypes.c_ubyte * n)()
            anchor = ctypes.c_char.from_buffer(mm)
            try:
                if mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vec) != 0:
                    return None
            finally:
                del anchor
            cached += sum(b & 1 for b in bytes(vec))
            pages += n
        finally:
            mm.close()
    return cached / pages if pages else None


def choose_auto(paths: Sequence[str]) -> tuple[str, str]:
    """What ``auto`` picks for a checkpoint made of ``paths``, and the reason in words.

    The rule and the measurements behind it are in ``docs/backends.md``:

    1. a checkpoint that fits in half the available memory is read through the page cache with
       ``pread``: re-reads of evicted experts then cost a memory copy, not a device read;
    2. a larger one (the case iosched exists for) is read with O_DIRECT, so no expert is held
       twice (page cache and slab): ``uring`` where io_uring works (0.95x fio's io_uring at
       4 MiB, qd 8), else ``odirect``;
    3. a filesystem that refuses O_DIRECT gets ``pread``;
    4. a larger checkpoint of which the page cache already holds at least ``WARM_SHARE`` (a
       warm start: :func:`cached_share`) is read with ``pread`` too: those misses are memory
       copies.
    """
    total = sum(os.path.getsize(p) for p in paths)
    available = _mem_available()
    if not paths or not all(_accepts_direct(p) for p in paths):
        return "pread", "auto: the filesystem refuses O_DIRECT, so buffered pread"
    if available and total <= available // 2:
        return "pread", (f"auto: the checkpoint ({total / 1e9:.1f} GB) fits in half the available "
                         f"memory ({available / 1e9:.1f} GB), so the page cache serves re-reads: pread")
    share = cached_share(paths)
    if share is not None and share >= WARM_SHARE:
        return "pread", (f"auto: the checkpoint ({total / 1e9:.1f} GB) exceeds half the available memory "
                         f"({available / 1e9:.1f} GB), but the page cache holds {100 * share:.0f} % of it "
                         f"(mincore), so buffered reads serve those misses from memory: pread")
    reason = _uring_reason()
    if reason is None:
        return "uring", (f"auto: the checkpoint ({total / 1e9:.1f} GB) exceeds half the available memory "
                         f"({available / 1e9:.1f} GB): O_DIRECT through io_uring")
    return "odirect", (f"auto: the checkpoint ({total / 1e9:.1f} GB) exceeds half the available memory "
                       f"({available / 1e9:.1f} GB): O_DIRECT; io_uring is unavailable: {reason}")


def resolve(name: str, paths: Sequence[str] = ()) -> tuple[str, str | None]:
    """The backend ``name`` stands for, and why ``auto`` chose it (``None`` when asked by name)."""
    if name == "auto":
        return choose_auto(paths)
    if name not in NAMES:
        raise BackendUnavailable(f"unknown backend {name!r}; choose one of auto, {', '.join(NAMES)}")
    reason = available()[name]
    if reason is not None:
        raise BackendUnavailable(f"backend {name!r} is unavailable here: {reason}")
    return name, None


def create(name: str) -> Backend:
    """A new, unopened backend; ``name`` must be one :func:`resolve` accepts (not ``auto``)."""
    threads = int(setting("pread_threads"))
    if name == "pread":
        from .pread import PreadBackend

        return PreadBackend(threads, int(setting("pread_inline_max")))
    if name == "odirect":
        from .odirect import ODirectBackend

        return ODirectBackend(threads)
    if name == "mmap":
        from .mmap import MmapBackend

        return MmapBackend(threads)
    if name == "uring":
        reason = _uring_reason()
        if reason is not None:
            raise BackendUnavailable(f"backend 'uring' is unavailable here: {reason}")
        from .uring import UringBackend

        return UringBackend(direct=True)
    raise BackendUnavailable(f"unknown backend {name!r}; choose one of {', '.join(NAMES)}")
