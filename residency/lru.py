"""Plain LRU: evict the least recently requested expert.

The baseline every other policy is measured against, and what the default keeps alone once
its ranking and its prefetch retired.  On MoE decode it is the worst sane choice below one
token cycle of budget (it evicts exactly the layer that comes next).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import ClassVar

from iosched._errors import require

from ._policy import Capability, Key


class LRUPolicy:
    name: ClassVar[str] = "lru"
    capabilities: ClassVar[Capability] = Capability.NONE

    def __init__(self, order: OrderedDict[Key, int] | None = None) -> None:
        """``order``: resident keys, least recently requested first, each with its bytes,
        taken over (not copied): how the default, alone with LRU's order, keeps only that
        (``residency/default/_default.py``)."""
        self._order: OrderedDict[Key, int] = OrderedDict() if order is None else order

    def on_request(self, key: Key, nbytes: int, hit: bool) -> None:
        if hit and key in self._order:
            self._order.move_to_end(key)

    def admit(self, key: Key, nbytes: int, victims: Sequence[Key] = ()) -> bool:
        return True

    def on_insert(self, key: Key, nbytes: int) -> None:
        self._order[key] = nbytes
        self._order.move_to_end(key)

    def on_remove(self, key: Key) -> None:
        del self._order[key]

    def victims(self) -> Iterator[Key]:
        return iter(self._order)

    def check(self, keys: set[Key]) -> None:
        require(set(self._order) == keys, "LRU order does not track the resident set")
