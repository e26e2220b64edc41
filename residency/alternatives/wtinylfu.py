"""W-TinyLFU: a small LRU window, a segmented main region, and frequency-based admission.

Why it exists: MoE routing is skewed and cyclic.  Below one token cycle of budget LRU evicts
exactly the layer that comes next; a frequency filter keeps a stable set of hot experts
resident and serves the cold misses transiently instead of letting them flush the hot ones.
This is Caffeine's policy (Einziger, Friedman, Manes: "TinyLFU: A Highly Efficient Cache
Admission Policy"), mapped onto :class:`iosched.residency.ResidencyTable`'s interface, byte-weighted
and lease-aware.

Segments (all LRU ``OrderedDict``\\ s, oldest first, byte totals kept):

* *window*: admitted misses enter here; holds up to ``window_fraction`` (Caffeine's 1 %) of
  the capacity in bytes; its overflow (oldest first) moves to probation's MRU end;
* *probation*: main-region entries requested once since they left the window (or demoted);
* *protected*: main-region entries hit while in probation; at most ``protected_fraction``
  (Caffeine's 80 %) of the main region (capacity less the window); its overflow (oldest
  first) is demoted to probation's MRU end.

The capacity is what the table lets admitted entries use, given by the optional
``set_budget`` hook the table calls at construction (``budget_bytes - transient_bytes``);
without it (a policy driven by hand) the capacity is the peak of the bytes the policy has
held.

Frequency: a :class:`~iosched.residency.alternatives.sketch.CountMinSketch` incremented on every request, aged
(halved) every ``10 x`` the capacity in items (Caffeine's sample size); the capacity in items
is the capacity in bytes over the mean size of the experts seen, or the peak resident count,
whichever is larger.  The sketch's width follows the distinct keys seen (at least twice as
many counters per row); when it grows the sketch is rebuilt and every seen key's estimate is
carried over, so no history is lost.

How Caffeine maps onto this table.  Caffeine admits every miss into the window and runs the
filter when the window's oldest entry (the *candidate*) would push the main region over:
candidate and probation's oldest (the *victim*) duel, and the one with the lower frequency
is dropped.  Here the table asks the policy ``admit(key, nbytes, victims)`` *for the missed
key*, with the evictable keys it would drop (taken in :meth:`WTinyLFUPolicy.victims` order:
probation oldest first, then protected, then window, Caffeine's victim order; leased,
pinned and loading entries are skipped by the table, so they are never victims).  So the duel
happens at the door: the missed key is the candidate, the victims its opponents.  It is
admitted when no eviction is needed, or when its estimate beats every victim's
(``candidate > max(victims)``: the hysteresis is the strict inequality, ties reject, as in
Caffeine), or, as in Caffeine's guard against hash flooding, with probability ``jitter``
(1/128) when its estimate is at least 6 (a seeded ``random.Random``, so runs repeat).  A
rejected miss becomes the table's transient entry (its bounded slot) and never enters a
segment.  The window therefore keeps Caffeine's role of a recency buffer in front of
probation, not of a shelter from the filter; adaptive window sizing (Caffeine's hill
climber) is not implemented.

Invariants (:meth:`WTinyLFUPolicy.check`): the three segments are disjoint and their union is
exactly the table's non-transient keys; each segment's byte total is the sum of its entries;
the window is within its cap and protected within its cap (both re-established after every
insert and promotion).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from itertools import chain
from typing import ClassVar

from iosched._errors import InvariantError, require

from .._policy import BudgetAware, Capability, Key
from .sketch import CountMinSketch, next_power_of_two

WINDOW, PROBATION, PROTECTED = 0, 1, 2
ADMIT_HASHDOS_THRESHOLD = 6
"""Caffeine's: a candidate this frequent may win a lost duel at random (``jitter``)."""


class WTinyLFUPolicy(BudgetAware):
    name: ClassVar[str] = "wtinylfu"
    capabilities: ClassVar[Capability] = Capability.BUDGET | Capability.REJECTS

    def __init__(self, *, window_fraction: float = 0.01, protected_fraction: float = 0.8,
                 jitter: float = 1 / 128, seed: int = 0) -> None:
        if not 0.0 <= window_fraction < 1.0 or not 0.0 <= protected_fraction <= 1.0:
            raise ValueError("window_fraction must be in [0, 1) and protected_fraction in [0, 1]")
        self.window_fraction = window_fraction
        self.protected_fraction = protected_fraction
        self.jitter = jitter
        self._rng = random.Random(seed)
        self._budget: int | None = None
        self._peak_bytes = 0
        self._peak_count = 0
        self._segs: tuple[OrderedDict[Key, int], OrderedDict[Key, int], OrderedDict[Key, int]] = (
            OrderedDict(), OrderedDict(), OrderedDict())
        self._bytes = [0, 0, 0]
        self._where: dict[Key, int] = {}
        self._seen: set[Key] = set()
        self._seen_bytes = 0
        self.sketch = CountMinSketch(256)
        self._resize_sample()

    # -- sizing --------------------------------------------------------------------------

    def set_budget(self, budget_bytes: int) -> None:
        """The bytes admitted entries may use (the table calls this at construction)."""
        self._budget = budget_bytes
        self._resize_sample()

    @property
    def capacity(self) -> int:
        return self._budget if self._budget is not None else self._peak_bytes

    @property
    def window_cap(self) -> int:
        return int(self.window_fraction * self.capacity)

    @property
    def protected_cap(self) -> int:
        return int(self.protected_fraction * (self.capacity - self.window_cap))

    def _resize_sample(self) -> None:
        items = self._peak_count
        if self._seen and self._budget is not None:
            mean = self._seen_bytes / len(self._seen)
            if mean > 0:
                items = max(items, int(self._budget / mean))
        self.sketch.sample_size = 10 * max(items, 16)

    def _grow_sketch(self) -> None:
        old = self.sketch
        new = CountMinSketch(next_power_of_two(4 * len(self._seen)), sample_size=old.sample_size)
        new.additions, new.resets = old.additions, old.resets
        for key in self._seen:  # carry every estimate over: no history is lost
            est = old.estimate(key)
            if est:
                idx = new.indexes(key)
                new.table[idx] = max(int(new.table[idx].max()), est)
        self.sketch = new

    def frequency(self, key: Key) -> int:
        return self.sketch.estimate(key)

    def segment(self, key: Key) -> str | None:
        """``"window"``, ``"probation"``, ``"protected"``, or ``None`` when not resident."""
        where = self._where.get(key)
        return None if where is None else ("window", "probation", "protected")[where]

    def segment_bytes(self) -> tuple[int, int, int]:
        return self._bytes[0], self._bytes[1], self._bytes[2]

    # -- the policy protocol -------------------------------------------------------------

    def on_request(self, key: Key, nbytes: int, hit: bool) -> None:
        if key not in self._seen:
            self._seen.add(key)
            self._seen_bytes += nbytes
            if 2 * len(self._seen) > self.sketch.width:
                self._grow_sketch()
            if len(self._seen) & (len(self._seen) - 1) == 0:  # now and then: mean size moved
                self._resize_sample()
        self.sketch.increment(key)
        where = self._where.get(key)
        if where is None:
            return
        if where == PROBATION:
            self._move(key, PROBATION, PROTECTED)
            self._rebalance_protected()
        else:
            self._segs[where].move_to_end(key)

    def admit(self, key: Key, nbytes: int, victims: Sequence[Key] = ()) -> bool:
        if not victims:
            return True
        candidate = self.sketch.estimate(key)
        victim = max(self.sketch.estimate(v) for v in victims)
        if candidate > victim:
            return True
        return candidate >= ADMIT_HASHDOS_THRESHOLD and self._rng.random() < self.jitter

    def on_insert(self, key: Key, nbytes: int) -> None:
        if key in self._where:
            raise InvariantError(f"W-TinyLFU: insert of {key!r}, which is already resident")
        self._where[key] = WINDOW
        self._segs[WINDOW][key] = nbytes
        self._bytes[WINDOW] += nbytes
        held = sum(self._bytes)
        if held > self._peak_bytes:
            self._peak_bytes = held
        if len(self._where) > self._peak_count:
            self._peak_count = len(self._where)
            if self._budget is None:
                self._resize_sample()
        cap = self.window_cap
        window = self._segs[WINDOW]
        while self._bytes[WINDOW] > cap and window:
            self._move(next(iter(window)), WINDOW, PROBATION)

    def on_remove(self, key: Key) -> None:
        where = self._where.pop(key)
        self._bytes[where] -= self._segs[where].pop(key)

    def victims(self) -> Iterator[Key]:
        return chain(self._segs[PROBATION], self._segs[PROTECTED], self._segs[WINDOW])

    def check(self, keys: set[Key]) -> None:
        require(set(self._where) == keys, "W-TinyLFU segments do not track the resident set")
        total = 0
        for seg_id, seg in enumerate(self._segs):
            if not all(self._where.get(k) == seg_id for k in seg):
                raise InvariantError(f"W-TinyLFU: a key in segment {seg_id} is recorded elsewhere")
            if self._bytes[seg_id] != sum(seg.values()):
                raise InvariantError(f"W-TinyLFU: segment {seg_id}'s bytes do not add up")
            total += len(seg)
        require(total == len(self._where), "W-TinyLFU: a key is in two segments or none")
        require(self._bytes[WINDOW] <= self.window_cap, "W-TinyLFU window over its cap")
        require(self._bytes[PROTECTED] <= self.protected_cap, "W-TinyLFU protected over its cap")

    # -- internals -----------------------------------------------------------------------

    def _move(self, key: Key, src: int, dst: int) -> None:
        nbytes = self._segs[src].pop(key)
        self._bytes[src] -= nbytes
        self._segs[dst][key] = nbytes  # at the MRU end
        self._bytes[dst] += nbytes
        self._where[key] = dst

    def _rebalance_protected(self) -> None:
        cap = self.protected_cap
        protected = self._segs[PROTECTED]
        while self._bytes[PROTECTED] > cap and protected:
            self._move(next(iter(protected)), PROTECTED, PROBATION)
