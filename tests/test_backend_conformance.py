"""One conformance suite, run on every backend: conftest's four, and io_uring through the page
cache (``UringBackend(direct=False)``, which ``backends.create`` does not build).

Each test holds a backend to the contract in ``backends/_base.py`` on real files: byte-exact
reads at unaligned places (aligned by the caller as the core does), counts at and past the end
of file, short reads and EINTR, removal and truncation under a running store, cancellation
mid-read, the buffered fallback of the O_DIRECT backends, and what ``read_tiered`` says of the
page cache.  The store-level tests in ``test_store.py`` also run on every backend.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import mmap
import os
from pathlib import Path
from typing import Any

import pytest

from iosched import ExpertStore, ReadError, _settings, backends
from iosched.backends import Backend, Caps, ZeroCopyBackend, map_tiered, read_tiered
from iosched.backends.uring import UringBackend
from tests.conftest import EXPERTS, LAYERS, drop_page_cache, random_file, require_backend, warm_page_cache
from tests.test_store import expected_bytes

pytestmark = pytest.mark.asyncio

BUFFERED_URING = "uring-buffered"


@pytest.fixture(params=[*backends.NAMES, BUFFERED_URING])
def backend(request: pytest.FixtureRequest) -> str:
    """Each backend in turn (conftest's, and buffered io_uring); skipped with the reason where
    it cannot run."""
    name: str = request.param
    return require_backend(name, "uring" if name == BUFFERED_URING else None)


def create(name: str) -> Backend:
    return UringBackend(direct=False) if name == BUFFERED_URING else backends.create(name)

SIZE = (1 << 20) + 1234  # not a multiple of any block size: the tail is a partial block


@pytest.fixture
def blob(tmp_path: Path) -> tuple[str, bytes]:
    return random_file(tmp_path, SIZE)


def opened(name: str, path: str) -> Backend:
    be = create(name)
    be.open([path])
    return be


async def read_exact(be: Backend, offset: int, length: int) -> tuple[bytes, int]:
    """What the core does: align the read as the backend asks, read into a page-aligned slab,
    return the requested bytes and the count the backend reported."""
    align = be.alignment(0)
    start = offset - offset % align
    end = offset + length
    end += -end % align
    slab = mmap.mmap(-1, max(end - start, 1))
    got = await be.read(0, start, end - start, memoryview(slab)[:end - start])
    head = offset - start
    return bytes(slab[head:head + max(0, min(length, got - head))]), got


@pytest.mark.parametrize("offset,length", [
    (0, 1), (1, 511), (511, 2), (4095, 4097), (12345, 100_000), (1 << 19, 1 << 19),
    (SIZE - 1234, 1234), (SIZE - 7, 7),
])
async def test_byte_exact_at_unaligned_offsets(backend: str, blob: tuple[str, bytes], offset: int, length: int) -> None:
    path, payload = blob
    be = opened(backend, path)
    try:
        data, _ = await read_exact(be, offset, length)
        assert data == payload[offset:offset + length]
    finally:
        be.close()


async def test_counts_at_and_past_end_of_file(backend: str, blob: tuple[str, bytes]) -> None:
    path, payload = blob
    be = opened(backend, path)
    try:
        align = be.alignment(0)
        start = (SIZE - 5000) // align * align
        length = -(-(SIZE - start + 3000) // align) * align  # runs well past the end
        slab = mmap.mmap(-1, length)
        got = await be.read(0, start, length, memoryview(slab))
        assert got == SIZE - start
        assert bytes(slab[:got]) == payload[start:]
        at_end = SIZE // align * align + (align if SIZE % align else 0)
        assert await be.read(0, at_end, align, memoryview(mmap.mmap(-1, max(align, 4096)))[:align]) == 0
        if be.caps & Caps.DIRECT:  # the partial last block came through the buffered descriptor
            assert be.info()["tail_reads"] >= 1
    finally:
        be.close()


async def test_short_reads_and_eintr(backend: str, blob: tuple[str, bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    """The real preadv made to return at most one block a call and to fail with EINTR every
    third call: the thread-pool backends must still deliver every byte."""
    if backend.startswith("uring"):
        pytest.skip("uring reads do not go through os.preadv; its short-read resubmission is tested in test_uring.py")
    path, payload = blob
    real = os.preadv
    calls = 0

    def flaky(fd: int, buffers: list[Any], offset: int, flags: int = 0) -> int:
        nonlocal calls
        calls += 1
        if calls % 3 == 0:
            raise InterruptedError(errno.EINTR, "Interrupted system call")
        return real(fd, [memoryview(buffers[0])[:4096]], offset, flags)

    be = opened(backend, path)
    monkeypatch.setattr(os, "preadv", flaky)
    try:
        data, _ = await read_exact(be, 777, 50_000)
        assert data == payload[777:50_777]
    finally:
        monkeypatch.undo()
        be.close()


async def test_cancelled_read_finishes_before_control_returns(backend: str, blob: tuple[str, bytes]) -> None:
    path, payload = blob
    be = opened(backend, path)
    try:
        length = SIZE // 4096 * 4096
        slab = mmap.mmap(-1, length)
        task = asyncio.ensure_future(be.read(0, 0, length, memoryview(slab)))
        await asyncio.sleep(0)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        snapshot = bytes(slab)
        await asyncio.sleep(0.05)
        assert bytes(slab) == snapshot, "the buffer changed after read() gave control back"
    finally:
        be.close()


async def test_io_error_names_the_file(backend: str, tmp_path: Path) -> None:
    with pytest.raises(ReadError, match="nothing-here.bin"):
        create(backend).open([str(tmp_path / "nothing-here.bin")])
    folder = tmp_path / "a-directory"
    folder.mkdir()
    be = create(backend)
    with pytest.raises(ReadError, match="a-directory"):  # at open, or at the first read
        be.open([str(folder)])
        try:
            await read_exact(be, 0, 10)
        finally:
            be.close()


async def test_zero_copy_map_and_unmap(backend: str, blob: tuple[str, bytes]) -> None:
    be = opened(backend, blob[0])
    try:
        if not be.caps & Caps.ZERO_COPY:
            pytest.skip(f"{backend} is not a zero-copy backend")
        zc: ZeroCopyBackend = be  # type: ignore[assignment]
        view = await zc.map(0, 5000, 70_000)
        assert view.readonly and bytes(view) == blob[1][5000:75_000]
        zc.unmap(0, 5000, 70_000)
        assert bytes(view) == blob[1][5000:75_000], "bytes must survive giving the pages back"
        os.truncate(blob[0], 4096)
        with pytest.raises(ReadError, match=r"blob\.bin.*truncated"):
            await zc.map(0, 5000, 70_000)
    finally:
        be.close()


async def test_removed_file_keeps_serving(backend: str, st_copy: Path) -> None:
    """Unlinking a shard under a running store changes nothing: its descriptors stay valid."""
    async with await ExpertStore.open(st_copy, budget_bytes=1 << 20, backend=create(backend)) as store:
        truth = {k: expected_bytes(store.index, k) for k in [(0, 1), (LAYERS - 1, EXPERTS - 2)]}
        for path in store.index.files:
            os.unlink(path)
        for key, want in truth.items():
            async with store.acquire(key) as view:
                assert view.data.tobytes() == want


async def test_gguf_multi_extent_experts(backend: str, gguf_checkpoint: Path) -> None:
    """Three extents an expert: packed back to back after aligned reads (O_DIRECT), copied
    into a slab (mmap), or read exactly (buffered)."""
    async with await ExpertStore.open(gguf_checkpoint, budget_bytes=1 << 20, backend=create(backend)) as store:
        for key in [(0, 0), (1, EXPERTS // 2), (LAYERS - 1, EXPERTS - 1)]:
            async with store.acquire(key) as view:
                assert view.data.tobytes() == expected_bytes(store.index, key)
        store.check_invariants()


async def test_direct_falls_back_when_refused(backend: str, blob: tuple[str, bytes],
                                             monkeypatch: pytest.MonkeyPatch,
                                             caplog: pytest.LogCaptureFixture) -> None:
    """A filesystem that refuses O_DIRECT (EINVAL at open) is read buffered: counted, logged once."""
    if not create(backend).caps & Caps.DIRECT:
        pytest.skip(f"{backend} does not read with O_DIRECT")
    path, payload = blob
    real_open = os.open

    def refusing(p: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(p, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing)
    caplog.set_level(logging.WARNING, logger="iosched.backends")
    be = opened(backend, path)
    monkeypatch.undo()
    try:
        assert be.alignment(0) == 1
        data, _ = await read_exact(be, 3, 10_000)
        assert data == payload[3:10_003]
        assert path in be.info()["buffered_fallbacks"]
        assert sum("O_DIRECT" in r.getMessage() for r in caplog.records) == 1
    finally:
        be.close()


async def test_page_cache_tier(backend: str, blob: tuple[str, bytes]) -> None:
    """``read_tiered`` never calls a read of dropped pages cached; of a warm file it does so
    exactly for the buffered backends that probe (``info()["page_cache_probe"]``); a partly
    cached range is a drive read; a read ending at end of file in cached pages is cached."""
    path, payload = blob
    be = opened(backend, path)
    try:
        probes = not be.caps & Caps.DIRECT and be.info()["page_cache_probe"] != "none"
        slab = mmap.mmap(-1, 1 << 20)
        half = 256 << 10
        drop_page_cache(path)
        assert await read_tiered(be, 0, 0, 2 * half, memoryview(slab)[:2 * half]) == (2 * half, False)
        assert bytes(slab[:2 * half]) == payload[:2 * half]
        warm_page_cache(path)
        drop_page_cache(path, 3 * half, half)  # [2 half, 3 half) cached, [3 half, 4 half) not
        assert await read_tiered(be, 0, 2 * half, 2 * half, memoryview(slab)[:2 * half]) == (2 * half, False)
        assert bytes(slab[:2 * half]) == payload[2 * half:4 * half]
        assert await read_tiered(be, 0, 2 * half, half, memoryview(slab)[:half]) == (half, probes)
        if not be.caps & Caps.DIRECT:
            warm_page_cache(path)  # the read runs past the end: what there is, is cached
            assert await read_tiered(be, 0, SIZE - 100, 4096, memoryview(slab)[:4096]) == (100, probes)
        if be.caps & Caps.ZERO_COPY:
            zc: ZeroCopyBackend = be  # type: ignore[assignment]
            drop_page_cache(path)
            view, cached = await map_tiered(zc, 0, 5000, 70_000)
            assert bytes(view) == payload[5000:75_000] and not cached
            warm_page_cache(path)
            view, cached = await map_tiered(zc, 0, 600_000, 70_000)  # a range never mapped
            assert bytes(view) == payload[600_000:670_000] and cached == probes
    finally:
        be.close()


async def test_info_is_a_dict(backend: str, blob: tuple[str, bytes]) -> None:
    be = opened(backend, blob[0])
    try:
        assert isinstance(be.info(), dict)
    finally:
        be.close()


async def test_a_finished_read_counts_as_undelivered_until_its_coroutine_resumes(
        backend: str, blob: tuple[str, bytes]) -> None:
    """``undelivered()`` (``backends/_base.py``): a read that finished while the loop was held
    (an engine computing on it) counts until its awaiting coroutine resumes; the core lets such
    results through before batch-end work (``iosched/runtime/_prefetch.py``)."""
    import time

    path, payload = blob
    with _settings.override(pread_inline_max=0):  # a cached read would be copied inline, no thread
        be = opened(backend, path)
    undelivered = backends.undelivered_counter(be)
    try:
        assert undelivered() == 0
        slab = mmap.mmap(-1, 1 << 16)
        task = asyncio.ensure_future(be.read(0, 0, 1 << 16, memoryview(slab)))
        for _ in range(3):  # the read reaches its thread (or the ring's next submission)
            await asyncio.sleep(0)
        deadline = time.monotonic() + 10
        while undelivered() == 0:  # the loop held, as an engine computing on it holds it
            assert time.monotonic() < deadline, "the finished read never counted"
            time.sleep(0.001)
        assert not task.done()
        assert undelivered() == 1
        assert await task == 1 << 16 and bytes(slab) == payload[:1 << 16]
        assert undelivered() == 0
    finally:
        be.close()


@pytest.mark.parametrize("inline_max", [0, 1 << 16])
async def test_pread_copies_a_small_cached_read_on_the_loop_and_hands_the_rest_to_threads(
        blob: tuple[str, bytes], inline_max: int) -> None:
    """``pread_inline_max``: a read of at most that many bytes that the page cache holds whole
    is copied on the calling thread (``RWF_NOWAIT``), said to be cached; a larger one, or one
    the page cache does not hold, goes to the worker threads; 0 sends every read there."""
    path, payload = blob
    with _settings.override(pread_inline_max=inline_max):
        be = opened("pread", path)
    try:
        warm_page_cache(path)
        got, cached = await read_tiered(be, 0, 0, 4096, memoryview(bytearray(4096)))
        assert (got, cached) == (4096, True)
        assert be.info()["inline_reads"] == (1 if inline_max else 0)
        slab = mmap.mmap(-1, 1 << 17)
        got, cached = await read_tiered(be, 0, 8192, 1 << 17, memoryview(slab))  # larger: a worker's
        assert (got, cached) == (1 << 17, True) and bytes(slab) == payload[8192:8192 + (1 << 17)]
        assert be.info()["inline_reads"] == (1 if inline_max else 0)
        drop_page_cache(path)
        small = bytearray(4096)
        got, cached = await read_tiered(be, 0, 1 << 19, 4096, memoryview(small))  # not cached: a worker's
        assert got == 4096 and bytes(small) == payload[1 << 19:(1 << 19) + 4096]
        assert be.info()["inline_reads"] == (1 if inline_max else 0)
        assert be.info()["inline_max_bytes"] == inline_max
    finally:
        be.close()
