"""The hand-written arm: what an engine's author writes instead of iosched.

Why it exists: a policy that beats LRU inside iosched has not yet paid for itself; the
question an engine's author asks is whether iosched beats the 40 lines they would write
themselves.  :class:`HandwrittenLRU` is those lines: an ``OrderedDict`` LRU of each expert's
bytes under the same ``budget_bytes``, filled by a ``ThreadPoolExecutor`` of 8 threads running
``os.pread`` over the expert's extents (from :func:`iosched.load_index`, the same index the store
reads), views built over the bytes with :meth:`iosched.ExpertView.over` (the same typed tensors
the store hands out, so the compute is the same).  ``drop_behind``: the arm gets no more memory
than its budget where the store reads with ``O_DIRECT`` (with the store on buffered ``pread``
both keep the page cache).  So it starts with the files dropped from the page cache, reads with
readahead off (``POSIX_FADV_RANDOM``) and drops each read's whole pages once read
(``POSIX_FADV_DONTNEED``).  Each of the three is needed: the kernel's readahead (8 MiB on this
VM's disk) brings pages past the range, which a drop of the range leaves cached, and ``DONTNEED``
keeps a range's partial end pages.  Without them a qwen run at 162 MiB of budget (576 KiB
experts, 48 tokens) left 510 MiB of the checkpoint cached, served to later misses as page-cache
hits outside the budget; with them, none (``tests/test_compute.py`` checks it).  Readahead off
costs the arm nothing it is allowed: a read is the expert's range, and whatever readahead adds
past it would be dropped unread.  Eight threads: a common size for a pread pool, and the
engine the project's goals are stated against.

:class:`HandwrittenEngineStore` adds what the shared engine loop (``tools/demo.py``
``drive_engine``) calls, so the arm runs the very loop and compute the iosched arms run.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

from iosched import CheckpointIndex, ExpertKey, ExpertView, RequestTally

THREADS = 8
PAGE = mmap.PAGESIZE


class HandwrittenLRU:
    """An LRU of experts' bytes under ``budget_bytes``, read by ``threads`` threads of pread."""

    def __init__(self, index: CheckpointIndex, budget_bytes: int, threads: int = THREADS,
                 drop_behind: bool = False) -> None:
        self.index, self.budget, self.drop_behind = index, budget_bytes, drop_behind
        self.cache: OrderedDict[ExpertKey, ExpertView] = OrderedDict()
        self.used = self.requests = self.hits = self.bytes_read = 0
        self.wait_s = 0.0
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="pread")
        self.fds = [os.open(path, os.O_RDONLY) for path in index.files]
        if drop_behind:  # nothing cached to start with (the index's header reads), no readahead
            for fd in self.fds:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)

    def _read(self, key: ExpertKey) -> ExpertView:
        layout = self.index.experts[key]
        parts = []
        for e in layout.extents:
            parts.append(os.pread(self.fds[e.file], e.length, e.offset))
            if self.drop_behind:  # whole pages: DONTNEED keeps a range's partial end pages
                start, end = e.offset // PAGE * PAGE, -(-(e.offset + e.length) // PAGE) * PAGE
                os.posix_fadvise(self.fds[e.file], start, end - start, os.POSIX_FADV_DONTNEED)
        return ExpertView.over(layout, memoryview(b"".join(parts)))

    async def get_many(self, keys: list[ExpertKey]) -> list[ExpertView]:
        """The views of ``keys``, reading the missing ones concurrently; LRU order updated."""
        missing = [k for k in keys if k not in self.cache]
        self.requests += len(keys)
        self.hits += len(keys) - len(missing)
        if missing:
            t0, loop = time.perf_counter(), asyncio.get_running_loop()
            views = await asyncio.gather(*(loop.run_in_executor(self.pool, self._read, k) for k in missing))
            self.wait_s += time.perf_counter() - t0
            for key, view in zip(missing, views, strict=True):
                self.cache[key] = view
                self.used += view.data.nbytes
                self.bytes_read += view.data.nbytes
        for key in keys:
            self.cache.move_to_end(key)
        busy = set(keys)
        while self.used > self.budget:  # evict the least recent, never this batch's own
            victim = next((k for k in self.cache if k not in busy), None)
            if victim is None:
                break
            self.used -= self.cache.pop(victim).data.nbytes
        return [self.cache[k] for k in keys]

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        for fd in self.fds:
            os.close(fd)


class HandwrittenEngineStore(HandwrittenLRU):
    """:class:`HandwrittenLRU` with the calls ``drive_engine`` makes on a store (no-ops where
    a hand-written cache has nothing to do: token boundaries, turns, router rows)."""

    @asynccontextmanager
    async def acquire_many(self, keys: Iterable[ExpertKey]) -> AsyncIterator[list[ExpertView]]:
        yield await self.get_many(list(keys))

    @property
    def request_tally(self) -> RequestTally:
        return RequestTally(requests=self.requests, hits=self.hits,
                            misses=self.requests - self.hits, single_flight_joins=0,
                            felt_wait_s=self.wait_s)

    def token_boundary(self) -> None:
        pass

    def end_turn(self) -> int:
        return self.budget

    async def settle(self) -> None:
        pass  # its reads are the engine's own awaits: nothing runs behind them

    def observe_routing(self, layer: int, experts: Any) -> None:
        pass

    def expect(self, layer: int, probabilities: Any) -> int:
        return 0  # a hand-written LRU has no lookahead

    def stats(self) -> dict[str, Any]:
        return {"felt_wait_s": self.wait_s, "bytes_read": self.bytes_read, "hits": self.hits,
                "misses": self.requests - self.hits, "requests": self.requests,
                "single_flight_joins": 0, "resident_bytes": self.used, "budget_bytes": self.budget,
                "loading": 0, "evictions": None, "backend": f"pread x{THREADS} (hand-written)"}
