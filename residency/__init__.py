"""Residency: which experts stay in RAM.

``ResidencyTable`` is the lease-aware driver with the strict byte budget; policies (one a
file) decide admission and eviction order.  ``make_policy(name)`` builds one by name.
"""

from __future__ import annotations

from ._policy import Key, Policy
from ._table import Entry, EntryState, ResidencyTable
from .lru import LRUPolicy
from .registry import POLICIES, make_policy

__all__ = ["Entry", "EntryState", "Key", "LRUPolicy", "Policy", "ResidencyTable", "make_policy", "POLICIES"]
