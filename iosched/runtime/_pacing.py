"""Prefetch pacing: the policy's prefetches get only the bytes the drives could have moved
while they were idle.

Why: a prefetch competes with demand reads for the drive.  When the drive is the bottleneck
(misses keep it busy all token long) every speculative byte delays a demand byte, and a
prefetch that is right one time in five costs five reads to save one: measured on the
development VM with 2.25 MiB experts (docs/tried-and-dropped.md, real-I/O replay), prefetching one
token cycle per token raised the felt wait per token by 20-42 % although it doubled the hit
rate.  When the drive idles while the engine computes, the same prefetches are free.  So the
allowance is measured, not set: between two batch ends, each drive's idle time times the
bandwidth it showed while busy is what it could have read for free, and that is what the
next batch's proposals may use.  Bandwidth is an exponential average over intervals with at
least one read (decay 1/8, about one token's worth of a 48-layer model's batches at the
minimum); before any read it is unknown and nothing is allowed.

The scheduler (``_scheduler.py``) keeps the other half of the promise: a speculative read
starts only on a drive with no demand read in flight or queued.
"""

from __future__ import annotations

from collections.abc import Callable

from . import _clock

BANDWIDTH_MEMORY = 8
"""Intervals the bandwidth average spans (decay 1 - 1/8)."""


class IdlePacer:
    """Bytes of speculative reads the drives could absorb, from their measured idle time."""

    def __init__(self, usage: Callable[[], dict[str, tuple[float, int]]]) -> None:
        self._usage = usage
        self._mark = _clock.now()
        self._last = usage()
        self._bandwidth: dict[str, float] = {}
        self.allowance = 0
        """Bytes the policy may still prefetch before the next interval ends."""
        self.granted_bytes = 0
        self.refused = 0

    def interval_done(self) -> int:
        """Close the interval since the last call (a batch end): the new allowance."""
        now = _clock.now()
        usage = self._usage()
        dt = now - self._mark
        spare = 0.0
        for drive, (busy, nbytes) in usage.items():
            busy0, bytes0 = self._last.get(drive, (0.0, 0))
            dbusy, dbytes = busy - busy0, nbytes - bytes0
            if dbusy > 0 and dbytes > 0:
                rate = dbytes / dbusy
                old = self._bandwidth.get(drive)
                self._bandwidth[drive] = rate if old is None else old + (rate - old) / BANDWIDTH_MEMORY
            bandwidth = self._bandwidth.get(drive, 0.0)
            spare += max(0.0, dt - dbusy) * bandwidth
        self._mark, self._last = now, usage
        self.allowance = int(spare)
        return self.allowance

    def take(self, nbytes: int) -> bool:
        """Whether a prefetch of ``nbytes`` fits the allowance (and, if so, spend it)."""
        if nbytes > self.allowance:
            self.refused += 1
            return False
        self.allowance -= nbytes
        self.granted_bytes += nbytes
        return True

    def refund(self, nbytes: int) -> None:
        """Give back what :meth:`take` granted to a prefetch that did not start (the policy's
        eviction guard refused it, or no room could be made): it read nothing."""
        self.allowance += nbytes
        self.granted_bytes -= nbytes
