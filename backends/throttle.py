"""``ThrottledBackend``: a real backend slowed to a set bandwidth for some of its files.

Why: tests and benchmarks of replica routing need one fast and one slow drive, and a
development machine has one disk.  Each throttled path prefix gets a token bucket (bytes per
second, burst of one second's worth by default); a read waits until the bucket holds its bytes,
then the inner backend does the real read.  The bytes are always real; only their pace is set.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ._base import Backend, read_tiered, undelivered_counter


class _Bucket:
    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = rate, burst
        self.tokens, self.stamp = burst, time.monotonic()
        self.lock = asyncio.Lock()

    async def take(self, n: int) -> None:
        async with self.lock:  # FIFO: reads are paced in arrival order
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
            self.tokens -= n
            if self.tokens < 0:
                await asyncio.sleep(-self.tokens / self.rate)


class ThrottledBackend:
    """Wraps ``inner``; reads of paths under a prefix in ``rates`` (bytes/s) are paced."""

    def __init__(self, inner: Backend, rates: Mapping[str, float], burst_s: float = 0.05) -> None:
        self.inner = inner
        self.undelivered = undelivered_counter(inner)  # forwarded, looked up once
        self.name = inner.name  # mirrors the wrapped backend
        self.caps = inner.caps
        self._rates = dict(rates)
        self._burst_s = burst_s
        self._buckets: list[_Bucket | None] = []

    def open(self, paths: Sequence[str]) -> None:
        self.inner.open(paths)
        shared: dict[str, _Bucket] = {}
        for path in paths:
            prefix = next((p for p in self._rates if path.startswith(p)), None)
            if prefix is not None and prefix not in shared:
                rate = self._rates[prefix]
                shared[prefix] = _Bucket(rate, rate * self._burst_s)
            self._buckets.append(shared.get(prefix) if prefix is not None else None)

    def alignment(self, file: int) -> int:
        return self.inner.alignment(file)

    async def read_tiered(self, file: int, offset: int, length: int, buf: memoryview) -> tuple[int, bool]:
        bucket = self._buckets[file]
        if bucket is not None:
            await bucket.take(length)
        return await read_tiered(self.inner, file, offset, length, buf)

    async def read(self, file: int, offset: int, length: int, buf: memoryview) -> int:
        return (await self.read_tiered(file, offset, length, buf))[0]

    def info(self) -> dict[str, Any]:
        return {**self.inner.info(), "throttled": dict(self._rates)}

    def close(self) -> None:
        self.inner.close()


__all__ = ["ThrottledBackend"]
