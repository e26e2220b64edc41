"""The resident experts in order of use, each stamped with its layer's visit count at that use.

It is LRU's eviction order, and it tells a *fresh* expert (routed at its layer's last visit)
from a *stale* one: the prefetch's guard never displaces a fresh one for a guess. A prefetch
enters at the oldest end (``guess``): used at its layer's batch, it moves to the newest end
like any hit; unused, it is the first victim, so a wrong guess costs one expert's bytes for
one layer step and displaces nothing else.

Invariants (:meth:`UseOrder.check`): the order holds exactly the resident keys; ``held`` is
the sum of their bytes; ``resident_in`` counts them per layer position; no stamp is after its
layer's visits.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from iosched._errors import require

from .._policy import Key
from ._walk import LayerWalk


class UseOrder:
    """Resident keys, least recently used first, with their stamps and bytes."""

    def __init__(self, walk: LayerWalk) -> None:
        self._walk = walk
        self.stamps: OrderedDict[Key, int] = OrderedDict()
        """Key -> its layer's visit count at its last use (or insertion)."""
        self.nbytes: dict[Key, int] = {}
        self.held = 0
        self.resident_in = [0] * walk.L
        """Per layer position: how many of its experts are resident."""

    def insert(self, key: Key, p: int, nbytes: int, guess: bool) -> None:
        self.stamps[key] = self._walk.visits[p]
        if guess:
            self.stamps.move_to_end(key, last=False)  # first to go if unused
        self.resident_in[p] += 1
        self.nbytes[key] = nbytes
        self.held += nbytes

    def remove(self, key: Key, p: int) -> int:
        """``key`` left; its stamp."""
        stamp = self.stamps.pop(key)
        self.held -= self.nbytes.pop(key)
        self.resident_in[p] -= 1
        return stamp

    def fresh(self, key: Key) -> bool:
        """Whether ``key`` was used at its layer's last visit."""
        walk = self._walk
        return self.stamps[key] >= walk.visits[walk.pos[key[0]]]  # type: ignore[index]

    def victims(self) -> Iterator[Key]:
        return iter(self.stamps)

    def hand_over(self) -> OrderedDict[Key, int]:
        """The order for ``LRUPolicy``'s own hooks, taken over (not copied): its values each
        key's bytes from here; the stamps, bytes and counts are not kept until
        :meth:`take_back`."""
        order = self.stamps
        for key in order:
            order[key] = self.nbytes[key]  # (an existing key keeps its place)
        self.nbytes, self.held = {}, 0
        return order

    def take_back(self) -> None:
        """The order back from ``LRUPolicy``'s hooks (its values bytes): every resident key
        counts as used at its layer's last visit (fresh, so that no guess displaces it)."""
        self.nbytes = dict(self.stamps)
        self.held = sum(self.nbytes.values())
        walk, resident_in = self._walk, [0] * self._walk.L
        for key in self.stamps:
            p = walk.position_of(key)
            resident_in[p] += 1
            self.stamps[key] = walk.visits[p]
        self.resident_in = resident_in

    def check(self, keys: set[Key]) -> None:
        require(set(self.stamps) == keys, "default: the use order does not track the resident set")
        require(set(self.nbytes) == keys and self.held == sum(self.nbytes.values()),
                "default: the held bytes do not track the resident set")
        per_layer = [0] * self._walk.L
        for key, stamp in self.stamps.items():
            p = self._walk.position_of(key)
            per_layer[p] += 1
            require(stamp <= self._walk.visits[p], f"default: {key!r} was used after its layer's last visit")
        require(per_layer == self.resident_in, "default: the per-layer resident counts are off")
