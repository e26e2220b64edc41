"""Policies by name: what ``ExpertStore.open(policy=...)`` and ``iosched replay --policy`` accept."""

from __future__ import annotations

from collections.abc import Callable

from iosched._errors import StoreError

from ._policy import Policy
from .coact import CoactPolicy
from .density import DensityPolicy
from .earned import EarnedPolicy
from .lfu import LFUPolicy
from .lrfu import LRFUPolicy
from .lru import LRUPolicy
from .moe import MoEPolicy
from .wtinylfu import WTinyLFUPolicy

POLICIES: dict[str, Callable[[], Policy]] = {
    "lru": LRUPolicy,
    # "default" is the policy that measured best where the engine feels it (docs/residency.md):
    # density's eviction (below), which retires to LRU's order, or above one token cycle to
    # S3-FIFO's queues (residency/_s3fifo.py), where its Python costs the engine more than its
    # lead saves, plus coact's next-layer prefetch, turned off when it slows the engine.  It
    # needs the model's shape (set_shape), which the store and iosched replay give it.
    "default": DensityPolicy,
    "coact": CoactPolicy,
    # coact's prefetch, eviction by learned hit density under an LRU shadow that can overrule
    # it (residency/density.py)
    "density": DensityPolicy,
    # the MoE-aware hit-density policy, with its co-activation prefetch (residency/moe.py)
    "moe": MoEPolicy,
    # moe while its measured gain in felt wait exceeds its measured cost, then coact
    # (residency/earned.py): for engines whose compute leaves the drive idle (a GPU's)
    "earned": EarnedPolicy,
    # LFU with LRU tie-break; request counts survive eviction ("perfect" LFU, residency/lfu.py).
    "lfu": LFUPolicy,
    # a decaying routing rate per byte, the engine's lookahead (residency/lrfu.py)
    "lrfu": LRFUPolicy,
    # W-TinyLFU: window + probation/protected, count-min admission (residency/wtinylfu.py).
    # It rejects misses: give its table a transient slot (tools/replay.py does).
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
