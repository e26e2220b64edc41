"""Wrappers around a real backend, for tests that need to hold a read mid-flight.

Not a mock: every byte still comes from the real backend reading the real file.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, ClassVar

from iosched.backends import Caps
from iosched.backends.pread import PreadBackend


class GatedBackend:
    """A real ``pread`` backend whose reads wait for ``gate`` before they start."""

    name: ClassVar[str] = "pread"
    caps: ClassVar[Caps] = Caps.NONE

    def __init__(self) -> None:
        self.inner = PreadBackend(threads=4)
        self.gate = asyncio.Event()
        self.started = 0

    def open(self, paths: Sequence[str]) -> None:
        self.inner.open(paths)

    def alignment(self, file: int) -> int:
        return self.inner.alignment(file)

    async def read(self, file: int, offset: int, length: int, buf: memoryview) -> int:
        self.started += 1
        await self.gate.wait()
        return await self.inner.read(file, offset, length, buf)

    def info(self) -> dict[str, Any]:
        return self.inner.info()

    def close(self) -> None:
        self.inner.close()
