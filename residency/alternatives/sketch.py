"""A count-min sketch with 4-bit saturating counters and periodic aging (TinyLFU's).

Why it exists: W-TinyLFU (``residency/alternatives/wtinylfu.py``) admits a missed expert only when it has
been requested more often, *recently*, than what it would displace.  The sketch estimates a
key's request frequency in constant space; aging (halving every counter after
``sample_size`` increments, Caffeine's "reset") makes the estimate a recent one, so an expert
that was hot in an earlier phase loses its claim.

Shape: ``depth`` (4) rows of ``width`` counters (a power of two) in one ``uint8`` numpy array;
counters saturate at 15, as Caffeine's 4-bit ones do (the array spends a byte on each: the
keys are a checkpoint's experts, a few thousand, so the memory is a few tens of KiB).  A key
increments one counter per row; its estimate is the minimum of those counters, which never
undercounts (until aging halves it) and overcounts only by collisions.

Hashing is deterministic across processes: ``(layer, expert)`` tuples of ints (the store's
keys) and plain ints are mixed explicitly (splitmix64) with a fixed seed per row; other keys
fall back to ``hash()``, which Python salts per process for ``str``/``bytes`` (such keys give
estimates that are still correct, only their collisions differ from run to run).

Aging: ``sample_size`` increments after the last reset, every counter is halved (a right
shift) and the increment count is halved too (Caffeine's ``reset``; Caffeine also subtracts
the odd counters' lost halves, a refinement skipped here).  The owner derives
``sample_size`` from the cache's capacity in items (Caffeine: 10 x the maximum size), not
from a trace.
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np
import numpy.typing as npt

MAX_COUNT = 15
"""Saturation value of a counter (4 bits' worth)."""

DEPTH = 4

_MASK64 = (1 << 64) - 1
_SEEDS = (0x97CB3127, 0xB492B66F, 0x9AE16A3B, 0xC3A5C85C)  # per-row seeds (Caffeine's)


def _mix64(z: int) -> int:
    """splitmix64's finaliser: a full-avalanche 64-bit mix."""
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def key_hash(key: Hashable) -> int:
    """A 64-bit hash of ``key``, deterministic across processes for ints and int tuples."""
    if isinstance(key, int):
        return _mix64(key & _MASK64)
    if isinstance(key, tuple) and all(isinstance(part, int) for part in key):
        h = 0x2545F4914F6CDD1D
        for part in key:
            h = _mix64(h ^ (part & _MASK64))
        return h
    return _mix64(hash(key) & _MASK64)


def next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class CountMinSketch:
    """``depth`` x ``width`` saturating counters; ``width`` is rounded up to a power of two."""

    def __init__(self, width: int, *, sample_size: int | None = None) -> None:
        if width < 1:
            raise ValueError(f"width must be positive, got {width}")
        self.width = next_power_of_two(width)
        self.depth = DEPTH
        self.table: npt.NDArray[np.uint8] = np.zeros(self.depth * self.width, dtype=np.uint8)
        self.sample_size = sample_size if sample_size is not None else 10 * self.width
        """Increments between two agings (halvings)."""
        self.additions = 0
        """Increments since the last aging (halved by it)."""
        self.resets = 0
        self._rows = np.arange(self.depth, dtype=np.int64) * self.width
        self._index_cache: dict[Hashable, npt.NDArray[np.int64]] = {}

    def indexes(self, key: Hashable) -> npt.NDArray[np.int64]:
        """The flat positions of ``key``'s counters, one per row (cached per key)."""
        idx = self._index_cache.get(key)
        if idx is None:
            h = key_hash(key)
            mask = self.width - 1
            cols = [_mix64(h ^ seed) & mask for seed in _SEEDS[: self.depth]]
            idx = self._rows + np.asarray(cols, dtype=np.int64)
            if len(self._index_cache) < 1 << 20:  # bounded: keys are experts in practice
                self._index_cache[key] = idx
        return idx

    def estimate(self, key: Hashable) -> int:
        """The key's (recent) frequency: never below the truth since the last aging, less
        halving; above it only by collisions; at most ``MAX_COUNT``."""
        return int(self.table[self.indexes(key)].min())

    def increment(self, key: Hashable) -> None:
        idx = self.indexes(key)
        t = self.table
        vals = t[idx]
        if vals.min() < MAX_COUNT:
            # Standard count-min: every row's counter, saturating at MAX_COUNT.  As in
            # Caffeine, only an increment that changed something counts towards aging.
            t[idx] = np.minimum(vals + 1, MAX_COUNT)
            self.additions += 1
            if self.additions >= self.sample_size:
                self.age()

    def age(self) -> None:
        """Halve every counter and the addition count (Caffeine's reset)."""
        self.table >>= 1
        self.additions //= 2
        self.resets += 1

    def clear(self) -> None:
        self.table[:] = 0
        self.additions = 0
