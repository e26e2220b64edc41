"""``Slab`` (iosched/runtime/_slab.py): page-aligned read buffers, and huge pages under the large ones."""

from __future__ import annotations

import mmap
import sys
from pathlib import Path

import numpy as np
import pytest

from iosched.runtime._slab import HUGE_PAGE, PAGE, Slab, _address

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def address(buf: memoryview) -> int:
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


def smaps_of(start: int) -> dict[str, str]:
    """This process's ``/proc/self/smaps`` fields of the mapping that begins at ``start``."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            inside = int(head.split("-")[0], 16) == start
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


@pytest.mark.parametrize("capacity", [PAGE, 3 * PAGE, HUGE_PAGE - PAGE])
def test_a_slab_below_a_huge_page_is_the_mapping_itself(capacity: int) -> None:
    slab = Slab(capacity, huge=True)
    assert slab.base == 0 and len(slab.mm) == capacity
    buf = slab.buffer()
    assert len(buf) == capacity and address(buf) % PAGE == 0
    del buf
    slab.close()


@pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"),
                    reason="huge pages are asked for with Linux's madvise(MADV_HUGEPAGE) only")
@pytest.mark.parametrize("capacity", [HUGE_PAGE, 2359296, 5 * HUGE_PAGE // 2, 9 << 20])
def test_a_large_slabs_buffer_starts_on_a_huge_page_and_the_mapping_ends_with_it(capacity: int) -> None:
    """The buffer is ``capacity`` bytes from a 2 MiB boundary, the mapping ends where the
    buffer ends (no huge page can reach past it), and the buffer's whole 2 MiB pieces are
    the part advised (the kernel splits the mapping there: its own line in smaps)."""
    slab = Slab(capacity, huge=True)
    buf = slab.buffer()
    start = address(buf)
    assert len(buf) == capacity and start % HUGE_PAGE == 0
    assert len(slab.mm) == slab.base + capacity
    buf[::PAGE] = b"\1" * len(range(0, capacity, PAGE))  # written through: the buffer is the mapping's
    assert slab.mm[slab.base] == 1 and slab.mm[slab.base + capacity - PAGE] == 1
    advised = smaps_of(start)
    assert advised, "the advised part is a mapping of its own from the buffer's start"
    assert "hg" in advised["VmFlags"].split()
    size_kb = int(advised["Size"].split()[0])
    assert size_kb * 1024 == capacity // HUGE_PAGE * HUGE_PAGE
    if THP.exists() and "[never]" not in THP.read_text():
        assert advised.get("THPeligible") == "1"
    del buf, advised
    slab.close()


def test_exported_sees_the_buffers_views_of_a_large_slab_too() -> None:
    """:meth:`Slab.exported` over the whole mapping: a view of the buffer (offset by
    ``base``) counts while it lives, and not after."""
    slab = Slab(2359296, huge=True)
    assert not slab.exported()
    view = np.frombuffer(slab.buffer()[PAGE:].toreadonly(), dtype=np.uint8)
    assert slab.exported()
    del view
    assert not slab.exported()
    slab.close()


def test_the_ctypes_address_probe_leaves_no_export() -> None:
    slab = Slab(3 * HUGE_PAGE, huge=True)
    assert _address(slab.mm) % PAGE == 0  # what Slab asks once, in __init__
    assert not slab.exported()
    slab.close()


def test_without_huge_a_large_slab_is_the_mapping_itself() -> None:
    """Buffered reads (``huge`` off, the pool's default): no boundary, no advice."""
    slab = Slab(5 * HUGE_PAGE // 2)
    assert slab.base == 0 and len(slab.mm) == 5 * HUGE_PAGE // 2
    slab.close()


@pytest.mark.parametrize(("backend", "huge"), [("odirect", True), ("pread", False)])
def test_the_store_puts_huge_pages_under_direct_reads_only(st_checkpoint: Path, backend: str, huge: bool) -> None:
    """The store's pool asks for huge pages where the backend reads O_DIRECT."""
    import asyncio

    from iosched import ExpertStore

    async def main() -> None:
        async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 24, backend=backend) as store:
            assert store._loader.pool.huge_pages is huge

    asyncio.run(main())
