"""Residency: which experts stay in RAM.

``ResidencyTable`` is the lease-aware driver with the strict byte budget; policies (one a
file) decide admission and eviction order.  ``make_policy(name)`` builds one by name.

What the core and the tools use of this package is named here (``__all__``) or is a public
module of it (``belady``, ``history``, ``lfu``, ``lru``, ``moe``, ``registry``, ``sketch``,
``wtinylfu``); the ``_``-prefixed modules are imported from inside the package only, a
contract that ``lint-imports`` checks (docs/design.md, "Import rules").
"""

from __future__ import annotations

from ._policy import Key, ModelShape, Policy
from ._table import Entry, EntryState, ResidencyTable
from .lru import LRUPolicy
from .registry import POLICIES, make_policy

__all__ = ["Entry", "EntryState", "Key", "LRUPolicy", "ModelShape", "POLICIES", "Policy", "ResidencyTable",
           "make_policy"]
