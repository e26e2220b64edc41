"""``cachestat(2)`` and the page-cache tier it gates (``backends/_cachestat.py``).

``preadv2(RWF_NOWAIT)`` starts readahead on a miss, and a fast disk (a virtio disk, say) can
finish it inside the call: a read of a dropped range can come back whole (2 in 40 can), and
``read_tiered`` must not call such a drive read cached.  These tests hold the kernel's answer to what
``mincore`` says, and the tier to "a dropped range is never cached", many times over."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from iosched.backends._cachestat import PAGE, CacheStat
from iosched.backends.pread import PageCacheProbe
from tests.conftest import cached_pages, drop_page_cache, random_file, warm_page_cache

SIZE = (2 << 20) + 777  # a partial last page


@pytest.fixture
def stat() -> CacheStat:
    cs = CacheStat()
    if not cs.available:
        pytest.skip(f"no cachestat(2) here: {cs.reason}")
    return cs


def test_cachestat_agrees_with_mincore(tmp_path: Path, stat: CacheStat) -> None:
    path, _ = random_file(tmp_path, SIZE)
    fd = os.open(path, os.O_RDONLY)
    try:
        warm_page_cache(path)
        assert cached_pages(path) == (SIZE + PAGE - 1) // PAGE
        assert stat.cached(fd, 0, SIZE) is True
        assert stat.cached(fd, SIZE - 100, 4096) is True  # runs past the end: what there is, is cached
        assert stat.cached(fd, SIZE + PAGE, 4096) is True  # wholly past the end: nothing to read
        drop_page_cache(path)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead past what is read
        os.preadv(fd, [bytearray(1 << 20)], 0)
        if cached_pages(path, 0, 1 << 20) != (1 << 20) // PAGE or cached_pages(path, 1 << 20, 0):
            pytest.skip("the kernel read ahead despite POSIX_FADV_RANDOM: no half-cached file to test")
        assert stat.cached(fd, 0, 1 << 20) is True
        assert stat.cached(fd, 0, (1 << 20) + 1) is False
        assert stat.cached(fd, (1 << 20) - 1, 2) is False
        assert stat.cached(fd, (1 << 20) - PAGE, PAGE) is True
        drop_page_cache(path)
        assert stat.cached(fd, 0, SIZE) is False
        assert stat.cached(fd, 0, 0) is None  # an empty range says nothing
    finally:
        os.close(fd)
    assert stat.cached(fd, 0, 4096) is None  # a closed descriptor: the kernel cannot tell


def test_a_dropped_range_is_never_called_cached(tmp_path: Path) -> None:
    """40 drops, each followed by the probe's read of 512 KiB: every one is a drive read with
    the right bytes.  The race it guards against is timing-bound: a raw drop-then-``RWF_NOWAIT``
    loop saw 0-2 whole reads in 40 per run here, the probe without the gate 0 in 200 in one
    such run, so this test cannot fail reliably without the gate; with it, it must never."""
    path, payload = random_file(tmp_path, SIZE)
    probe = PageCacheProbe()
    probe.open([path])
    if probe.info()["page_cache_probe"] == "none":
        pytest.skip("this Python has no os.RWF_NOWAIT: the probe never calls a read cached")
    fd = os.open(path, os.O_RDONLY)
    buf = memoryview(bytearray(512 << 10))
    try:
        for i in range(40):
            off = (i % 3) * PAGE * 7
            drop_page_cache(path)
            assert probe.read(fd, 0, off, len(buf), buf) == (len(buf), False), f"read {i} at {off}"
            assert bytes(buf) == payload[off:off + len(buf)]
        # read 39 (at 0) left its pages cached: the same range again is a page-cache read
        assert probe.read(fd, 0, 0, len(buf), buf) == (len(buf), True)
    finally:
        os.close(fd)
