"""The pread backend on real files, with faults injected around the real system call."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from backends.pread import PreadBackend
from iosched import ReadError

pytestmark = pytest.mark.asyncio


@pytest.fixture
def data_file(tmp_path: Path) -> tuple[Path, bytes]:
    payload = os.urandom(256 * 1024 + 123)
    path = tmp_path / "blob.bin"
    path.write_bytes(payload)
    return path, payload


async def _read(backend: PreadBackend, offset: int, length: int) -> bytes:
    buf = bytearray(length)
    await backend.read(0, offset, length, memoryview(buf))
    return bytes(buf)


async def test_unaligned_reads_are_byte_exact(data_file: tuple[Path, bytes]) -> None:
    path, payload = data_file
    backend = PreadBackend(threads=2)
    backend.open([str(path)])
    try:
        for offset, length in [(0, 1), (1, 4095), (4095, 4097), (12345, 100000), (len(payload) - 7, 7)]:
            assert await _read(backend, offset, length) == payload[offset:offset + length]
    finally:
        backend.close()


async def test_short_reads_and_eintr_are_retried(
    data_file: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real preadv, made to return at most 1000 bytes a call and to fail with EINTR
    every third call: the backend must still deliver every byte."""
    path, payload = data_file
    real = os.preadv
    calls = 0

    def flaky(fd: int, buffers: list[Any], offset: int) -> int:
        nonlocal calls
        calls += 1
        if calls % 3 == 0:
            raise InterruptedError(4, "Interrupted system call")
        return real(fd, [memoryview(buffers[0])[:1000]], offset)

    monkeypatch.setattr(os, "preadv", flaky)
    backend = PreadBackend(threads=2)
    backend.open([str(path)])
    try:
        assert await _read(backend, 777, 50_000) == payload[777:50_777]
        assert calls > 60
    finally:
        backend.close()


async def test_read_past_eof_names_the_file(data_file: tuple[Path, bytes]) -> None:
    path, payload = data_file
    backend = PreadBackend(threads=2)
    backend.open([str(path)])
    try:
        with pytest.raises(ReadError, match=r"blob\.bin: short read"):
            await _read(backend, len(payload) - 10, 20)
    finally:
        backend.close()


async def test_io_error_names_the_file(tmp_path: Path) -> None:
    folder = tmp_path / "dir"
    folder.mkdir()
    backend = PreadBackend(threads=1)
    with pytest.raises(ReadError, match="missing.bin"):
        backend.open([str(tmp_path / "missing.bin")])
    backend = PreadBackend(threads=1)
    backend.open([str(folder)])  # a directory opens read-only but cannot be read
    try:
        with pytest.raises(ReadError, match=r"dir: read of 10 bytes"):
            await _read(backend, 0, 10)
    finally:
        backend.close()


async def test_cancelled_read_finishes_before_returning(data_file: tuple[Path, bytes]) -> None:
    """A cancelled caller must not get control back while the thread still writes its buffer."""
    path, payload = data_file
    backend = PreadBackend(threads=1)
    backend.open([str(path)])
    try:
        buf = bytearray(len(payload))
        task = asyncio.ensure_future(backend.read(0, 0, len(payload), memoryview(buf)))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # The read ran to completion before the cancellation was delivered.
        assert bytes(buf) == payload
    finally:
        backend.close()
