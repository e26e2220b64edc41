"""Policies by name: what ``ExpertStore.open(policy=...)`` and ``iosched replay --policy`` accept."""

from __future__ import annotations

from collections.abc import Callable

from iosched._errors import StoreError

from ._policy import Policy
from .alternatives.coact import CoactPolicy
from .alternatives.earned import EarnedPolicy
from .alternatives.lfu import LFUPolicy
from .alternatives.lrfu import LRFUPolicy
from .alternatives.moe import MoEPolicy
from .alternatives.wtinylfu import WTinyLFUPolicy
from .default import DefaultPolicy
from .lru import LRUPolicy

POLICIES: dict[str, Callable[[], Policy]] = {
    # the default (docs/default-policy.md): the density ranking's eviction and the next-layer
    # prefetch, each kept while it pays, else LRU's order (or S3-FIFO's queues)
    "default": DefaultPolicy,
    # the name the default had while it was one policy among others: kept for old command lines
    "density": DefaultPolicy,
    "lru": LRUPolicy,
    # the alternatives kept for comparison (residency/alternatives/, docs/residency.md)
    "coact": CoactPolicy,
    "moe": MoEPolicy,
    "earned": EarnedPolicy,
    "lfu": LFUPolicy,
    "lrfu": LRFUPolicy,
    # rejects misses: give its table a transient slot (tools/replay.py does)
    "wtinylfu": WTinyLFUPolicy,
}


def make_policy(name: str, **options: object) -> Policy:
    """A fresh policy by name; ``options`` go to its constructor (``prefetch_width`` for
    ``moe``/``default``), and one it does not take is a ``StoreError`` naming it."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise StoreError(f"unknown policy {name!r}; choose one of {', '.join(sorted(POLICIES))}") from None
    try:
        return factory(**options)
    except TypeError:
        raise StoreError(f"policy {name!r} takes no option(s) {', '.join(sorted(options))}") from None
