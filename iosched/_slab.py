"""Page-aligned read buffers, recycled.

Why a pool: a fresh anonymous mapping costs an ``mmap`` call and one page fault per 4 KiB on
first write (about 750 faults for a 3 MiB expert); experts of one model come in a handful of
sizes, so the buffer an eviction frees is usually the exact size the next load needs.

Why ``mmap.mmap(-1, n)``: anonymous mappings are page-aligned, which O_DIRECT needs, and they
go back to the kernel on ``close`` instead of lingering in the allocator's heap.

Invariant kept with the store's help: the pool holds idle buffers only while they fit in the
budget's headroom (``resident + idle <= budget``, each buffer counted at its page-rounded
size), so the buffers' total memory stays within the byte budget plus page rounding.
"""

from __future__ import annotations

import mmap
from collections import defaultdict

PAGE = mmap.PAGESIZE


def round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


class Slab:
    """One page-aligned buffer of ``capacity`` bytes."""

    __slots__ = ("capacity", "mm")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.mm = mmap.mmap(-1, capacity)

    def close(self) -> None:
        try:
            self.mm.close()
        except BufferError:
            # A caller still holds a numpy view past its lease; the mapping is freed when
            # that view is garbage-collected.
            pass


class SlabPool:
    def __init__(self) -> None:
        self._idle: dict[int, list[Slab]] = defaultdict(list)
        self.idle_bytes = 0
        self.allocated = 0
        """Slabs created over the pool's life (a reuse rate is 1 - allocated / takes)."""
        self.takes = 0
        self.gives = 0
        """Slabs given back; ``takes - gives`` are held by loads and resident experts."""

    def take(self, nbytes: int) -> Slab:
        capacity = round_up(max(nbytes, 1), PAGE)
        self.takes += 1
        free = self._idle.get(capacity)
        if free:
            self.idle_bytes -= capacity
            return free.pop()
        self.allocated += 1
        return Slab(capacity)

    def give(self, slab: Slab, max_idle_bytes: int) -> None:
        """Return a slab; it is kept for reuse only if the idle total stays within ``max_idle_bytes``."""
        self.gives += 1
        if self.idle_bytes + slab.capacity <= max_idle_bytes:
            self._idle[slab.capacity].append(slab)
            self.idle_bytes += slab.capacity
        else:
            slab.close()

    def trim(self, max_idle_bytes: int) -> None:
        """Close idle slabs, largest first, until the idle total is within ``max_idle_bytes``."""
        for capacity in sorted(self._idle, reverse=True):
            free = self._idle[capacity]
            while free and self.idle_bytes > max_idle_bytes:
                free.pop().close()
                self.idle_bytes -= capacity
        if self.idle_bytes > max_idle_bytes:  # pragma: no cover - arithmetic guard
            raise AssertionError("slab pool trim left too many idle bytes")

    def close(self) -> None:
        self.trim(0)
