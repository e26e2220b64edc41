"""Belady's MIN: the offline reference, evicting the resident expert needed farthest in future.

Why it exists: an online policy is judged by how much of the gap between LRU and this
reference it closes.  It is *offline*: it must be built with the whole request sequence, so
the store cannot run it and the policy registry does not list it; ``iosched replay`` builds it
from the trace (``--policy belady``).

How it follows the sequence: the driver calls :meth:`BeladyPolicy.on_request` once per
request, in order, so the policy keeps a cursor into the precomputed sequence and asserts that
every request is the one it expects (a replay that skipped, repeated or reordered a request
would otherwise produce a plausible, wrong number).  At request ``i`` of key ``k`` the key's
*next use* becomes the index of the following request of ``k`` (``NEVER`` when there is none).

Eviction order (:meth:`BeladyPolicy.victims`): keys never requested again first, then by next
use, farthest first.  A max-heap keyed by next use with lazy deletion: a hit pushes a fresh
entry and leaves the old one behind; an entry is *live* while its key is resident and its next
use is still the key's current one.  Entries that ``victims`` pops are parked and pushed back
before any other call, so the driver may stop iterating anywhere (the protocol allows it) and
nothing is lost.  Each request costs O(log n); stale entries are compacted away when they
outnumber the live ones.

Admission: every miss is admitted (``admit`` is always true).  "OPT with bypass" (do not cache
an item whose next use is farther than every resident's) cannot do better through the
:class:`~iosched.residency.ResidencyTable`: the store holds even a transient (not admitted) expert's
bytes within the budget while it loads and is computed on, so the table evicts the same
victims either way, and bypass would only leave the freed bytes empty where admission keeps
an item that is evicted first when the bytes are needed.  ``bypass_budget=`` exists to measure
exactly that (docs/tried-and-dropped.md, negative results); it bypasses only a miss that does not
fit beside the resident keys within ``bypass_budget``.

Sizes: experts differ in size between layers (by up to ~20% in the bundled traces); with
unequal sizes farthest-next-use is the classic Belady rule, not a proven optimum (the sized
problem is NP-hard), so "offline optimum" means "this rule with perfect knowledge".

Invariants (:meth:`BeladyPolicy.check`): the resident set is exactly the driver's; every
resident key has exactly one live heap entry carrying its current next use; the cursor never
passes the end of the sequence.
"""

from __future__ import annotations

import heapq
import sys
from collections.abc import Iterator, Sequence
from typing import ClassVar

from iosched._errors import InvariantError, require

from .._policy import Capability, Key

NEVER = sys.maxsize
"""Next use of a key that is not requested again."""


def next_uses(keys: Sequence[Key]) -> list[int]:
    """For each position ``i``, the index of the next request of ``keys[i]`` (``NEVER`` if none)."""
    out = [NEVER] * len(keys)
    last: dict[Key, int] = {}
    for i in range(len(keys) - 1, -1, -1):
        key = keys[i]
        out[i] = last.get(key, NEVER)
        last[key] = i
    return out


class BeladyPolicy:
    """Farthest-next-use eviction over a request sequence known in advance.

    ``keys`` is the full request sequence in replay order; the driver must then call
    :meth:`on_request` for exactly these keys, in this order.
    """

    name: ClassVar[str] = "belady"
    capabilities: ClassVar[Capability] = Capability.NONE
    """Not ``REJECTS`` even with bypass: a bypassed miss takes the victims an admitted one
    would (its bytes are held while it is computed on), as in a table without a slot."""

    def __init__(self, keys: Sequence[Key], *, bypass_budget: int | None = None) -> None:
        self._keys: list[Key] = list(keys)
        self._next: list[int] = next_uses(self._keys)
        self._cursor = 0
        self.bypass_budget = bypass_budget
        """When set, "OPT with bypass": a miss that does not fit beside the resident keys in
        this many bytes is refused if its next use is farther than every resident key's (or
        never).  See the module docstring: through the table this cannot beat admitting it."""
        self._resident_bytes = 0
        self._sizes: dict[Key, int] = {}
        self._current: dict[Key, int] = {}  # key -> next use as of its latest request
        self._resident: set[Key] = set()
        # Max-heap by next use: entries (-next_use, tie, key); ``tie`` (insertion counter)
        # orders never-again keys (equal NEVER) by age and keeps keys out of comparisons.
        self._heap: list[tuple[int, int, Key]] = []
        self._parked: list[tuple[int, int, Key]] = []
        self._tie = 0

    # -- the sequence --------------------------------------------------------------------

    @property
    def cursor(self) -> int:
        """Requests seen so far."""
        return self._cursor

    @property
    def finished(self) -> bool:
        """Whether every request of the sequence has been seen."""
        return self._cursor == len(self._keys)

    def next_use(self, key: Key) -> int:
        """Index of ``key``'s next request as of the latest request seen (``NEVER`` if none)."""
        return self._current.get(key, NEVER)

    # -- the policy protocol -------------------------------------------------------------

    def on_request(self, key: Key, nbytes: int, hit: bool) -> None:
        self._unpark()
        i = self._cursor
        if i >= len(self._keys):
            raise InvariantError(f"request {i} for {key!r} past the end of the "
                                 f"{len(self._keys)}-request sequence Belady was built with")
        expected = self._keys[i]
        if expected != key:
            raise InvariantError(f"request {i} is {key!r}, but the sequence Belady was built "
                                 f"with has {expected!r} there")
        self._cursor = i + 1
        nxt = self._next[i]
        self._current[key] = nxt
        if key in self._resident:
            self._push(key, nxt)  # the old entry goes stale: its next use is no longer current

    def admit(self, key: Key, nbytes: int, victims: Sequence[Key] = ()) -> bool:
        if self.bypass_budget is None or self._resident_bytes + nbytes <= self.bypass_budget:
            return True  # plain Belady, or it fits without evicting anything
        self._unpark()
        mine = self.next_use(key)
        top = self._top()
        return mine != NEVER and (top is None or top >= mine)

    def on_insert(self, key: Key, nbytes: int) -> None:
        self._unpark()
        self._resident.add(key)
        self._sizes[key] = nbytes
        self._resident_bytes += nbytes
        self._push(key, self.next_use(key))
        self._maybe_compact()

    def on_remove(self, key: Key) -> None:
        self._unpark()
        self._resident.remove(key)  # its heap entries go stale
        self._resident_bytes -= self._sizes.pop(key)
        self._maybe_compact()

    def victims(self) -> Iterator[Key]:
        self._unpark()
        return self._victims()

    def check(self, keys: set[Key]) -> None:
        self._unpark()
        require(self._resident == keys, "Belady's resident set does not track the driver's")
        require(set(self._sizes) == keys and self._resident_bytes == sum(self._sizes.values()),
                "Belady's resident bytes do not add up")
        require(0 <= self._cursor <= len(self._keys), "Belady's cursor is out of the sequence")
        live: dict[Key, int] = {}
        for neg, _, key in self._heap:
            if self._live(key, -neg):
                live[key] = live.get(key, 0) + 1
        require(set(live) == keys, "a resident key has no live heap entry")
        require(all(n == 1 for n in live.values()), "a resident key has two live heap entries")
        # A key's next use is updated at each of its requests, so it is never one already seen.
        require(all(self._current.get(k, NEVER) >= self._cursor for k in keys),
                "a resident key's next use lies in the past")

    # -- internals -----------------------------------------------------------------------

    def _live(self, key: Key, nxt: int) -> bool:
        return key in self._resident and self._current.get(key, NEVER) == nxt

    def _push(self, key: Key, nxt: int) -> None:
        self._tie += 1
        heapq.heappush(self._heap, (-nxt, self._tie, key))

    def _top(self) -> int | None:
        """The farthest next use among resident keys (dropping stale entries on the way)."""
        heap = self._heap
        while heap:
            neg, _, key = heap[0]
            if self._live(key, -neg):
                return -neg
            heapq.heappop(heap)
        return None

    def _victims(self) -> Iterator[Key]:
        heap = self._heap
        while heap:
            entry = heapq.heappop(heap)
            neg, _, key = entry
            if self._live(key, -neg):
                self._parked.append(entry)  # back into the heap before any other call
                yield key

    def _unpark(self) -> None:
        if self._parked:
            for entry in self._parked:
                heapq.heappush(self._heap, entry)
            self._parked.clear()

    def _maybe_compact(self) -> None:
        if len(self._heap) > 4 * len(self._resident) + 64:
            self._heap = [e for e in self._heap if self._live(e[2], -e[0])]
            heapq.heapify(self._heap)
