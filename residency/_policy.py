"""The policy interface: what a residency policy decides, and nothing else.

After libCacheSim and Caffeine's simulator: a policy sees requests and membership changes
and answers two questions, *admit this?* and *who goes first?*.  The driver
(:class:`residency.ResidencyTable`) owns bytes, leases, statistics and the budget, and skips
victims it may not evict (leased, loading).  The store and the replay tool drive the very
same policy objects through that table, so there is no second copy of any policy.

Keys are opaque hashables, ``(layer, expert)`` in practice.  Call order for one key:
``on_request`` for every request, then on a miss ``admit``; if admitted ``on_insert``, later
``on_remove`` exactly once (eviction, failed load, or close).
"""

from __future__ import annotations

from typing import ClassVar, Hashable, Iterator, Protocol

Key = Hashable


class Policy(Protocol):
    name: ClassVar[str]

    def on_request(self, key: Key, nbytes: int, hit: bool) -> None:
        """A request for ``key``; ``hit`` when it was resident or loading at that moment."""

    def admit(self, key: Key, nbytes: int) -> bool:
        """Whether a missed ``key`` may enter the resident set (else it is served transiently)."""

    def on_insert(self, key: Key, nbytes: int) -> None:
        """``key`` entered the resident set (its bytes are reserved from now on)."""

    def on_remove(self, key: Key) -> None:
        """``key`` left the resident set."""

    def victims(self) -> Iterator[Key]:
        """Resident keys in the order they should be evicted; the driver stops early and
        skips keys it may not evict, and does not change membership while iterating."""

    def check(self, keys: set[Key]) -> None:
        """Raise ``AssertionError`` unless the policy's own state is consistent and tracks
        exactly ``keys`` (the driver's resident set)."""
