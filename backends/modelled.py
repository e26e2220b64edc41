"""``modelled``: a drive model in place of a backend, for runs on virtual time only.

It reads nothing.  A read of ``n`` bytes completes, on the running loop's clock, when the
drive it targets has moved them: each drive is a :class:`DriveModel` (bandwidth, per-request
latency); the store's own per-device queues still decide how many reads are in flight.  The
buffer is left as it was (a simulation computes on a model, not on the bytes), and the count
is the real one: up to the file's end, so the store's short-read checks still hold.  It
exists for ``iosched replay --simulate --critical-path`` (``tools/critical_path.py``), which
runs the real store on :class:`iosched.clock.VirtualTimeLoop`; on a real loop it would merely
sleep.  :func:`iosched.backends.create` does not build it by name: a store gets it as an
object, so it is never picked by ``auto`` or by a setting.

The drive model: a request first waits out its latency (seek, command, flash read), which
overlaps with other requests in flight, then its bytes pass through the drive's one transfer
pipe at ``bandwidth`` after the bytes of every request ahead of it:

    done = max(now + latency, pipe_free) + n / bandwidth;   pipe_free = done

So one read alone costs ``latency + n / bandwidth``, and at queue depth the drive moves
``bandwidth`` bytes a second: the two numbers ``iosched topology --probe`` measures (its
depth-1 latency, its depth-``qd`` MB/s).

With ``burst`` > 0 the model is a rate limit in front of a faster drive instead (a cloud
volume's provisioned throughput, or ``iosched replay --throttle-mbps``'s token bucket): a
read may start once the bytes before it have been paced at ``bandwidth``, less ``burst``
seconds of credit, and then takes ``latency`` (the drive's own read time):

    paced = max(paced, now) + n / bandwidth;   done = max(now, paced - burst) + latency

Queue depth itself is the store's (``queue_depth=``), as on a real drive.  Invariants: the
pipe never carries two requests' bytes at once, and no read completes before ``now +
latency + n / bandwidth`` (with a burst: before ``now + latency``, nor before its bytes were
paced, less the credit).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from iosched._errors import ReadError, StoreError

from ._base import Caps


@dataclass
class DriveModel:
    """One drive: ``bandwidth`` bytes/s through its transfer pipe, ``latency`` s per request;
    with ``burst`` > 0, a rate limit instead (module docstring)."""

    bandwidth: float
    latency: float
    burst: float = 0.0
    pipe_free: float = field(default=0.0, repr=False)
    reads: int = field(default=0, repr=False)
    bytes: int = field(default=0, repr=False)
    busy_s: float = field(default=0.0, repr=False)

    def __post_init__(self) -> None:
        if not (self.bandwidth > 0 and self.bandwidth < float("inf")):
            raise StoreError(f"drive model: bandwidth must be a positive number of bytes/s, got {self.bandwidth!r}")
        if not (0 <= self.latency < float("inf")):
            raise StoreError(f"drive model: latency must be a number of seconds >= 0, got {self.latency!r}")
        if not (0 <= self.burst < float("inf")):
            raise StoreError(f"drive model: burst must be a number of seconds >= 0, got {self.burst!r}")

    def schedule(self, nbytes: int, now: float) -> float:
        """The completion time of a read of ``nbytes`` issued at ``now``; books the pipe."""
        transfer = nbytes / self.bandwidth
        if self.burst > 0:  # a token bucket (GCRA): paced, then the drive's own read
            self.pipe_free = max(self.pipe_free, now) + transfer
            self.reads += 1
            self.bytes += nbytes
            self.busy_s += transfer
            return max(now, self.pipe_free - self.burst) + self.latency
        start = max(now + self.latency, self.pipe_free)
        self.pipe_free = start + transfer
        self.reads += 1
        self.bytes += nbytes
        self.busy_s += transfer
        return self.pipe_free

    def describe(self) -> dict[str, Any]:
        return {"bandwidth_mb_s": self.bandwidth / 1e6, "latency_us": self.latency * 1e6, "burst_ms": self.burst * 1e3,
                "reads": self.reads, "bytes": self.bytes, "transfer_s": self.busy_s}


class ModelledBackend:
    """Backend protocol over :class:`DriveModel` drives (module docstring)."""

    name: ClassVar[str] = "modelled"

    def __init__(self, drive: DriveModel, drives: Mapping[str, DriveModel] | None = None,
                 cpu_per_read: float = 0.0) -> None:
        """``drive``: the model of every file's drive; ``drives``: models by path prefix (a
        mirror's root, say), the longest matching prefix winning, ``drive`` for the rest.
        ``cpu_per_read``: seconds of the event loop's thread a real backend spends on each
        read beyond what this one does (handing it to a thread and taking its completion
        back); charged to a :class:`iosched.clock.VirtualTimeLoop` when the read completes."""
        if not 0 <= cpu_per_read < float("inf"):
            raise StoreError(f"modelled backend: cpu_per_read must be seconds >= 0, got {cpu_per_read!r}")
        self.drive = drive
        self.cpu_per_read = cpu_per_read
        self._by_prefix = sorted((drives or {}).items(), key=lambda kv: -len(kv[0]))
        self._files: list[tuple[str, int, DriveModel]] = []

    @property
    def caps(self) -> Caps:
        return Caps.NONE

    def open(self, paths: Sequence[str]) -> None:
        files = []
        for path in paths:
            try:
                size = os.path.getsize(path)
            except OSError as exc:
                raise ReadError(f"{path}: cannot open: {exc.strerror or exc}") from exc
            model = next((m for prefix, m in self._by_prefix if path.startswith(prefix)), self.drive)
            files.append((path, size, model))
        self._files = files

    def alignment(self, file: int) -> int:
        return 1

    async def read(self, file: int, offset: int, length: int, buf: memoryview) -> int:
        path, size, model = self._files[file]
        count = max(0, min(length, size - offset))
        loop = asyncio.get_running_loop()
        now = loop.time()
        done = model.schedule(count, now)
        await asyncio.sleep(done - now)
        if self.cpu_per_read:
            advance = getattr(loop, "advance", None)
            if advance is not None:
                advance(self.cpu_per_read)
        return count

    def info(self) -> dict[str, Any]:
        models = {id(m): m for _, _, m in self._files} or {id(self.drive): self.drive}
        return {"modelled": True, "drives": [m.describe() for m in models.values()]}

    def close(self) -> None:
        self._files = []
