"""Residency: which experts stay in RAM.

``ResidencyTable`` is the lease-aware driver with the strict byte budget; policies (one a
file) decide admission and eviction order.  ``make_policy(name)`` builds one by name.
"""

from __future__ import annotations

from typing import Callable

from iosched._errors import StoreError

from ._policy import Key, Policy
from ._table import Entry, EntryState, ResidencyTable
from .lru import LRUPolicy

__all__ = ["Entry", "EntryState", "Key", "LRUPolicy", "Policy", "ResidencyTable", "make_policy", "POLICIES"]

POLICIES: dict[str, Callable[[], Policy]] = {
    "lru": LRUPolicy,
    # "default" is the best policy the project has; until issue #5 lands that is LRU.
    "default": LRUPolicy,
}


def make_policy(name: str) -> Policy:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise StoreError(f"unknown policy {name!r}; choose one of {', '.join(sorted(POLICIES))}") from None
    return factory()
