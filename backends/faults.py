"""``FaultyBackend``: a real backend that fails on purpose, for tests and ``iosched soak``.

Why a wrapper and not a mock: the bytes, descriptors, threads and rings stay the real
backend's, so what is tested is the core's handling of a failing drive, not a model of it.
A :class:`FaultPlan` says, per path prefix (one replica of a mirrored checkpoint, say), what
goes wrong and how often; a seeded RNG makes every run reproducible.  The faults:

* **EIO** (``eio_rate``): the read raises :class:`iosched.ReadError` naming the file, as a
  backend does for an I/O error; the inner backend is not called.
* **short read** (``short_rate``): the inner backend reads only the first half of the request
  (rounded down to the file's alignment) and that count is returned, exactly what a read that
  hits the end of a truncated file looks like to the core, which turns it into a ``ReadError``.
* **corruption** (``corrupt_rate``): the inner read (or mapping) succeeds and one byte of what
  it returned is flipped (XOR 0xFF), the byte in the middle of the bytes read: a bad cable, a
  DMA or RAM error, a drive returning stale data.  The middle byte lies inside the requested
  extent whenever the extent spans at least one alignment block (the reads the core pads for
  O_DIRECT add less than a block on each side).  A read cannot be corrupted in place in a
  read-only mapping, so a corrupted ``map`` returns a corrupted private copy of the bytes (the
  inner mapping stays, unmapped as usual).  Only ``verify="reads"`` can catch it.
* **latency spike** (``spike_rate``, ``spike_s``): an extra ``spike_s`` seconds before the read.
* **hang** (``hang``): a drive that stops answering.  Reads wait, before the inner read is
  called (so no buffer is touched and the wait is an ordinary cancellable ``await``), until the
  plan is changed with :meth:`FaultyBackend.set_plan` (they then read normally: the drive came
  back), or until ``hang_s`` seconds pass, after which they fail with EIO, as a real drive's
  command times out.  ``ExpertStore.close()`` waits for loads in flight, so a test that hangs
  a drive with no ``hang_s`` must lift the hang before closing.

Files truncated or replaced are real file operations, not faults of the wrapper:
:func:`truncate_file` and :func:`replace_file`.

``info()`` adds ``faults``: the plan and how many reads were seen and faults injected.
"""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, cast

from iosched._atomic import write_atomically
from iosched._errors import ReadError

from ._base import Backend, Caps, ZeroCopyBackend, map_tiered, read_tiered, undelivered_counter


@dataclass(frozen=True)
class Faults:
    """What goes wrong with reads of one path prefix; rates are per read, in [0, 1]."""

    eio_rate: float = 0.0
    short_rate: float = 0.0
    corrupt_rate: float = 0.0
    spike_rate: float = 0.0
    spike_s: float = 0.02
    hang: bool = False
    hang_s: float | None = None
    """With ``hang``: fail a hung read with EIO after this many seconds (``None``: wait until
    the plan changes)."""

    def __post_init__(self) -> None:
        for name in ("eio_rate", "short_rate", "spike_rate", "corrupt_rate"):
            rate = getattr(self, name)
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {rate!r}")
        if self.spike_s < 0 or (self.hang_s is not None and self.hang_s < 0):
            raise ValueError("spike_s and hang_s must not be negative")


@dataclass(frozen=True)
class FaultPlan:
    """Faults by path prefix (the longest matching prefix wins; paths matching none are
    healthy) and the RNG seed."""

    rules: Mapping[str, Faults] = field(default_factory=dict)
    seed: int = 0

    @classmethod
    def on(cls, prefix: str | os.PathLike[str], seed: int = 0, **faults: Any) -> FaultPlan:
        """One rule: ``FaultPlan.on(mirror, eio_rate=0.1)``."""
        return cls({os.fspath(prefix): Faults(**faults)}, seed)

    def faults_for(self, path: str) -> Faults | None:
        best: str | None = None
        for prefix in self.rules:
            if path.startswith(prefix) and (best is None or len(prefix) > len(best)):
                best = prefix
        return None if best is None else self.rules[best]

    def as_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "rules": {p: asdict(f) for p, f in self.rules.items()}}


COUNTERS = ("reads", "eio", "short", "spike", "hang", "hang_timeouts", "corrupt")


class FaultyBackend:
    """Wraps ``inner`` (a real backend, opened through this wrapper); reads of paths matched
    by the plan fail as the plan says.  Change the plan at any time with :meth:`set_plan`."""

    def __init__(self, inner: Backend, faults: FaultPlan) -> None:
        self.inner = inner
        self.undelivered = undelivered_counter(inner)  # forwarded, looked up once
        self.name = inner.name  # mirrors the wrapped backend
        self.caps: Caps = inner.caps
        self._paths: list[str] = []
        self._plan = faults
        self._rng = random.Random(faults.seed)
        self._by_file: list[Faults | None] = []
        self._lifted = asyncio.Event()
        self.counts: dict[str, int] = {name: 0 for name in COUNTERS}

    @property
    def plan(self) -> FaultPlan:
        return self._plan

    def set_plan(self, plan: FaultPlan) -> None:
        """Replace the plan (the RNG keeps its state); reads hung under the old plan resume."""
        self._plan = plan
        self._by_file = [plan.faults_for(path) for path in self._paths]
        self._lifted.set()
        self._lifted = asyncio.Event()

    def open(self, paths: Sequence[str]) -> None:
        self.inner.open(paths)
        self._paths = list(paths)
        self._by_file = [self._plan.faults_for(path) for path in self._paths]

    def alignment(self, file: int) -> int:
        return self.inner.alignment(file)

    async def _before(self, file: int, offset: int, length: int) -> bool:
        """Apply the faults that precede a read; True when this read is to come back short."""
        self.counts["reads"] += 1
        faults = self._by_file[file]
        if faults is None:
            return False
        path = self._paths[file]
        rng = self._rng
        if faults.hang:
            self.counts["hang"] += 1
            lifted = self._lifted
            try:
                await asyncio.wait_for(lifted.wait(), faults.hang_s)
            except asyncio.TimeoutError:
                self.counts["hang_timeouts"] += 1
                raise ReadError(f"{path}: injected fault: the drive did not answer a read of {length} "
                                f"bytes at {offset} within {faults.hang_s} s (EIO)") from None
            faults = self._by_file[file]  # the plan changed while we waited
            if faults is None:
                return False
        if faults.spike_rate and rng.random() < faults.spike_rate:
            self.counts["spike"] += 1
            await asyncio.sleep(faults.spike_s)
        if faults.eio_rate and rng.random() < faults.eio_rate:
            self.counts["eio"] += 1
            raise ReadError(f"{path}: injected fault: EIO reading {length} bytes at {offset}")
        if faults.short_rate and rng.random() < faults.short_rate:
            self.counts["short"] += 1
            return True
        return False

    def _corrupts(self, file: int) -> bool:
        """Whether the read that just succeeded is to be corrupted (the RNG is drawn only for
        paths with a ``corrupt_rate``, so plans without one replay as before)."""
        faults = self._by_file[file]
        if faults is None or not faults.corrupt_rate or self._rng.random() >= faults.corrupt_rate:
            return False
        self.counts["corrupt"] += 1
        return True

    async def read_tiered(self, file: int, offset: int, length: int, buf: memoryview) -> tuple[int, bool]:
        """The inner read (and what it says of the page cache), after the plan's faults."""
        if await self._before(file, offset, length):
            align = max(1, self.inner.alignment(file))
            half = (length // 2) // align * align
            if half == 0:
                return 0, False
            return await read_tiered(self.inner, file, offset, half, buf[:half])
        got, cached = await read_tiered(self.inner, file, offset, length, buf)
        if got > 0 and self._corrupts(file):
            buf[got // 2] ^= 0xFF
        return got, cached

    async def read(self, file: int, offset: int, length: int, buf: memoryview) -> int:
        return (await self.read_tiered(file, offset, length, buf))[0]

    async def map_tiered(self, file: int, offset: int, length: int) -> tuple[memoryview, bool]:
        """For a zero-copy inner backend: the same faults; a short read is the ReadError a
        mapping of a truncated file gives."""
        if await self._before(file, offset, length):
            raise ReadError(f"{self._paths[file]}: injected fault: the file ends before "
                            f"{offset + length} (short read)")
        view, cached = await map_tiered(cast(ZeroCopyBackend, self.inner), file, offset, length)
        if length > 0 and self._corrupts(file):
            copy = bytearray(view)
            copy[length // 2] ^= 0xFF
            view = memoryview(copy).toreadonly()
        return view, cached

    async def map(self, file: int, offset: int, length: int) -> memoryview:
        return (await self.map_tiered(file, offset, length))[0]

    def unmap(self, file: int, offset: int, length: int) -> None:
        cast(ZeroCopyBackend, self.inner).unmap(file, offset, length)

    def info(self) -> dict[str, Any]:
        return {**self.inner.info(), "faults": {**self.counts, "plan": self._plan.as_dict()}}

    def close(self) -> None:
        self.inner.close()


def truncate_file(path: str | os.PathLike[str], size: int) -> None:
    """Cut (or extend with zeros) a real file to ``size`` bytes, in place (``os.truncate``):
    descriptors already open see the new size."""
    os.truncate(path, size)


def replace_file(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace a file by a new one holding ``data`` the way tools do it (write a temporary file
    in the same folder, fsync, rename over: :mod:`iosched._atomic`): descriptors already open
    keep the old file."""
    write_atomically(path, data, prefix=".replace-")


__all__ = ["COUNTERS", "FaultPlan", "Faults", "FaultyBackend", "replace_file", "truncate_file"]
