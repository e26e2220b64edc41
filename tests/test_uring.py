"""What only the io_uring backend has, on real files and FIFOs: the probe and its reasons,
batching and the CQ's semaphore, short-read resubmission, cancellation that waits for the
kernel's CQE, the EINVAL of a misaligned O_DIRECT read, bytearrays and read-only buffers, and
one ring per event loop.

What every backend must do (byte-exact reads, counts at and past the end of file, cancellation
mid-read, errors naming the file, removed files, the buffered fallback when O_DIRECT is refused)
is in ``test_backend_conformance.py``, which runs on ``uring`` and on buffered ``uring`` too."""

from __future__ import annotations

import asyncio
import errno
import mmap
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from iosched import BackendUnavailable
from iosched.backends import Caps, uring
from iosched.backends.uring import BufferedUringBackend, UringBackend, probe
from tests.conftest import random_file

_REASON = probe()
pytestmark = [
    pytest.mark.asyncio,
    pytest.mark.skipif(_REASON is not None, reason=f"io_uring is unavailable here: {_REASON}"),
]

SIZE = 5 * 4096 + 333  # not a multiple of any block size


@pytest.fixture
def blob(tmp_path: Path) -> tuple[str, bytes]:
    return random_file(tmp_path, SIZE)


@pytest.fixture(params=[True, False], ids=["direct", "buffered"])
def direct(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


def opened(path: str, direct: bool = True, **kwargs: Any) -> UringBackend:
    be = UringBackend(direct=direct, **kwargs)
    be.open([path])
    return be


@pytest.fixture
def fifo(tmp_path: Path) -> Iterator[tuple[str, int]]:
    """A FIFO and a write end: a read of it stays in flight until the test writes."""
    path = tmp_path / "pipe"
    os.mkfifo(path)
    wfd = os.open(path, os.O_RDWR)  # never blocks on Linux; lets the reader open at once
    yield str(path), wfd
    os.close(wfd)


async def test_probe_says_io_uring_works_here() -> None:
    with open("/proc/sys/kernel/io_uring_disabled") as f:
        if f.read().strip() != "0":
            pytest.skip("kernel.io_uring_disabled is set on this machine")
    assert probe() is None


async def test_probe_reasons_when_io_uring_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a seccomp filter or kernel.io_uring_disabled looks like: EPERM from the setup."""
    L = uring._liburing()

    def refused(*args: Any) -> int:
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(L, "io_uring_queue_init", refused)
    reason = uring._probe_here()
    assert reason is not None and "Operation not permitted" in reason and "kernel.io_uring_disabled = " in reason
    monkeypatch.setitem(sys.modules, "liburing", None)  # import liburing now raises ImportError
    assert "cannot be imported" in str(uring._probe_here())


async def test_ring_setup_failure_is_backend_unavailable(blob: tuple[str, bytes],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(*args: Any) -> int:
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(uring._liburing(), "io_uring_queue_init", refused)
    be = opened(blob[0], direct=False)
    try:
        with pytest.raises(BackendUnavailable, match="io_uring_disabled"):
            await be.read(0, 0, 10, memoryview(bytearray(10)))
    finally:
        be.close()


async def test_probe_survives_a_crashing_binding(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A liburing build that dies with SIGILL at import: the probe process dies, not us."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nkill -ILL $$\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))
    assert "SIGILL" in str(probe.__wrapped__())


async def test_caps_and_classes() -> None:
    assert (type(UringBackend()) is UringBackend
            and UringBackend.caps == Caps.NATIVE_ASYNC | Caps.DIRECT | Caps.TURN_BATCHED)
    buffered = UringBackend(direct=False)
    assert type(buffered) is BufferedUringBackend and buffered.caps == Caps.NATIVE_ASYNC | Caps.TURN_BATCHED
    assert UringBackend.name == BufferedUringBackend.name == "uring"


async def test_reads_into_a_bytearray(blob: tuple[str, bytes]) -> None:
    """The binding takes any writable buffer, not only the core's mmap slabs (buffered: a
    bytearray is not aligned for O_DIRECT)."""
    path, payload = blob
    be = opened(path, direct=False)
    try:
        buf = bytearray(10_000)
        assert await be.read(0, 777, 10_000, memoryview(buf)) == 10_000
        assert bytes(buf) == payload[777:10_777]
    finally:
        be.close()


async def test_many_concurrent_reads_are_exact_and_batched(blob: tuple[str, bytes], direct: bool) -> None:
    path, payload = blob
    be = opened(path, direct, entries=32)  # 200 reads > the CQ's 64: the semaphore queues them
    try:
        slab = mmap.mmap(-1, 200 * 4096)
        view = memoryview(slab)
        spots = [(i, (i * 512) % (SIZE - 4096) // 512 * 512) for i in range(200)]
        counts = await asyncio.gather(*(be.read(0, off, 4096, view[i * 4096:(i + 1) * 4096]) for i, off in spots))
        assert counts == [4096] * 200
        for i, off in spots:
            assert bytes(view[i * 4096:(i + 1) * 4096]) == payload[off:off + 4096]
        info = be.info()
        assert info["submissions"] >= 200 and info["batches"] < 200 // 4, info
        assert info["rings"] == 1
        view.release()
    finally:
        be.close()


async def test_short_reads_are_resubmitted(fifo: tuple[str, int]) -> None:
    """A FIFO hands out what has been written: the first CQE is short, not at end of file,
    and the backend must resubmit for the rest."""
    path, wfd = fifo
    be = opened(path, direct=False)
    try:
        buf = bytearray(300)
        os.write(wfd, b"a" * 100)
        task = asyncio.ensure_future(be.read(0, 0, 300, memoryview(buf)))
        for _ in range(200):
            await asyncio.sleep(0.005)
            if be.info()["resubmits"]:
                break
        assert not task.done() and be.info()["resubmits"] >= 1
        os.write(wfd, b"b" * 200)
        assert await task == 300 and bytes(buf) == b"a" * 100 + b"b" * 200
    finally:
        be.close()


async def test_cancelled_read_waits_for_its_completion(fifo: tuple[str, int]) -> None:
    """The kernel owns the buffer until the CQE: cancelling the awaiting task must not give
    control back before it, however long that takes."""
    path, wfd = fifo
    be = opened(path, direct=False)
    try:
        buf = bytearray(5)
        task = asyncio.ensure_future(be.read(0, 0, 5, memoryview(buf)))
        await asyncio.sleep(0.05)  # submitted, blocked in the kernel on the empty FIFO
        task.cancel()
        await asyncio.sleep(0.05)
        task.cancel()  # a second cancellation changes nothing either
        await asyncio.sleep(0.05)
        assert not task.done(), "read() returned while its SQE was still in flight"
        os.write(wfd, b"hello")
        with pytest.raises(asyncio.CancelledError):
            await task
        assert bytes(buf) == b"hello"  # the kernel's write landed before control came back
    finally:
        be.close()


async def test_o_direct_refused_at_read_falls_back(blob: tuple[str, bytes]) -> None:
    """A misaligned buffer gets EINVAL from the kernel on the O_DIRECT fd: the file is then
    read buffered, byte-exact, and the fallback is recorded."""
    path, payload = blob
    be = opened(path)
    try:
        buf = bytearray(4096 + 1)
        assert await be.read(0, 0, 4096, memoryview(buf)[1:]) == 4096
        assert bytes(buf[1:]) == payload[:4096]
        assert "EINVAL" in be.info()["buffered_fallbacks"][path]
    finally:
        be.close()


async def test_read_only_buffer_is_refused_before_submission(blob: tuple[str, bytes]) -> None:
    be = opened(blob[0], direct=False)
    try:
        with pytest.raises(TypeError, match="read-only"):
            await be.read(0, 0, 10, memoryview(b"0123456789"))
        assert be.info()["submissions"] == 0
    finally:
        be.close()


async def test_one_ring_per_event_loop_and_close_releases_them(blob: tuple[str, bytes]) -> None:
    path, payload = blob
    be = opened(path, direct=False)
    buf = bytearray(100)
    assert await be.read(0, 0, 100, memoryview(buf)) == 100
    other = bytearray(100)
    thread = threading.Thread(target=lambda: asyncio.run(be.read(0, 100, 100, memoryview(other))))
    thread.start()
    thread.join()
    assert bytes(buf) + bytes(other) == payload[:200]
    assert be.info()["rings"] == 2  # one for this loop, one for the (now closed) thread's loop
    efds = [ring.efd for ring in be._rings.values()]
    be.close()
    assert be.info()["rings"] == 0
    for efd in efds:
        with pytest.raises(OSError):
            os.fstat(efd)
