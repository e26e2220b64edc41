"""LFU: evict the least frequently requested expert, the least recently requested among equals.

Why it exists: MoE routing is skewed (some experts of a layer are routed far more often than
others), which is what frequency captures and recency misses; LFU is the classic baseline for
that, next to LRU.  It is byte-agnostic: every expert counts the same, whatever its size.

Frequency is a key's requests over the whole run (*perfect* LFU, ``history=True``, the
registry's ``lfu``): the count survives eviction.  Keeping it is cheap here, because the keys
are the checkpoint's experts (layers x experts, a few thousand), not an open-ended stream.
``history=False`` is the *in-cache* LFU of libCacheSim (a key enters with frequency 1, gains
1 per hit while resident and forgets it on eviction); on the real traces it is far worse
(docs/tried-and-dropped.md, negative results) and it is kept to check this code against libCacheSim's
``LFU``, which it matches hit for hit.

Ties are broken by recency: among keys of the lowest frequency, the least recently requested
goes first.  A key inserted without a request (a prefetch) enters with frequency 1.

Structure: one ``OrderedDict`` per frequency (LRU order inside, oldest first) and the sorted
list of frequencies in use, so a request costs O(1) plus a bisect over the few distinct
frequencies, and ``victims`` walks buckets lowest first.

Invariants (:meth:`LFUPolicy.check`): every resident key is in exactly one bucket, the one of
its frequency (with history: ``max(1, requests seen)``); no bucket is empty; the frequency
list is sorted, distinct and names exactly the buckets.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import ClassVar

from iosched._errors import InvariantError, require

from .._policy import Capability, Key


class LFUPolicy:
    name: ClassVar[str] = "lfu"
    capabilities: ClassVar[Capability] = Capability.NONE

    def __init__(self, *, history: bool = True) -> None:
        self.history = history
        self._count: dict[Key, int] = {}  # history: requests of every key seen so far
        self._freq: dict[Key, int] = {}  # resident keys -> their bucket
        self._buckets: dict[int, OrderedDict[Key, None]] = {}
        self._freqs: list[int] = []  # sorted keys of _buckets

    def frequency(self, key: Key) -> int:
        """The frequency ``key`` has (resident) or would enter with (not resident)."""
        f = self._freq.get(key)
        if f is not None:
            return f
        return max(1, self._count.get(key, 0)) if self.history else 1

    def on_request(self, key: Key, nbytes: int, hit: bool) -> None:
        count = 0
        if self.history:
            count = self._count[key] = self._count.get(key, 0) + 1
        f = self._freq.get(key)
        if f is None:  # a miss: on_insert follows if admitted
            return
        self._unlink(key, f)
        self._link(key, max(1, count) if self.history else f + 1)

    def admit(self, key: Key, nbytes: int, victims: Sequence[Key] = ()) -> bool:
        return True

    def on_insert(self, key: Key, nbytes: int) -> None:
        if key in self._freq:
            raise InvariantError(f"LFU: insert of {key!r}, which is already resident")
        self._link(key, self.frequency(key))

    def on_remove(self, key: Key) -> None:
        self._unlink(key, self._freq[key])

    def victims(self) -> Iterator[Key]:
        for f in self._freqs:
            yield from self._buckets[f]

    def check(self, keys: set[Key]) -> None:
        require(set(self._freq) == keys, "LFU frequencies do not track the resident set")
        require(self._freqs == sorted(set(self._freqs)), "LFU frequency list is not sorted")
        require(set(self._freqs) == set(self._buckets), "LFU frequency list != buckets")
        seen = 0
        for f, bucket in self._buckets.items():
            if not bucket:
                raise InvariantError(f"LFU bucket {f} is empty")
            if f < 1:
                raise InvariantError(f"LFU bucket {f} below 1")
            for key in bucket:
                if self._freq.get(key) != f:
                    raise InvariantError(f"LFU: {key!r} is in bucket {f}, not its own")
                if self.history:
                    if f != max(1, self._count.get(key, 0)):
                        raise InvariantError(f"LFU: {key!r} is in bucket {f} but was requested "
                                             f"{self._count.get(key, 0)} times")
            seen += len(bucket)
        require(seen == len(self._freq), "LFU: a key is in two buckets or none")

    # -- internals -----------------------------------------------------------------------

    def _link(self, key: Key, f: int) -> None:
        self._freq[key] = f
        bucket = self._buckets.get(f)
        if bucket is None:
            bucket = self._buckets[f] = OrderedDict()
            bisect.insort(self._freqs, f)
        bucket[key] = None  # newest at the end: least recently requested first in a bucket

    def _unlink(self, key: Key, f: int) -> None:
        del self._freq[key]
        bucket = self._buckets[f]
        del bucket[key]
        if not bucket:
            del self._buckets[f]
            self._freqs.pop(bisect.bisect_left(self._freqs, f))
