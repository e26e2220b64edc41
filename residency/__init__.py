"""Residency: which experts stay in RAM (``iosched.residency``).

``ResidencyTable`` is the lease-aware driver with the strict byte budget; policies (one a
file) decide admission and eviction order, and declare their optional abilities
(:class:`Capability`, bound once by :func:`bind` into :class:`Hooks`).  ``make_policy(name)``
builds one by name.  This module's names are the package's interface: the core and the
tools import them from here, never from its private modules.

Beyond these names, the package's public modules (``belady``, ``earned``, ``lfu``, ``lru``,
``lrfu``, ``moe``, ``registry``, ``sketch``, ``wtinylfu``) are its interface too; the
``_``-prefixed modules are
imported from inside the package only, a contract that ``lint-imports`` checks
(docs/design.md, "Import rules").
"""

from __future__ import annotations

from ._history import load as load_history_file
from ._history import save as save_history_file
from ._policy import (
    BatchAware,
    BudgetAware,
    Capability,
    CostAware,
    FeltWaitAware,
    HistoryKeeper,
    Hooks,
    Key,
    LookaheadAware,
    ModelShape,
    Policy,
    PrefetchGuard,
    RoutingAware,
    ShapeAware,
    WaitCostAware,
    bind,
)
from ._table import Entry, EntryState, ResidencyTable
from .lru import LRUPolicy
from .registry import POLICIES, make_policy

__all__ = [
    "POLICIES",
    "BatchAware",
    "BudgetAware",
    "Capability",
    "CostAware",
    "Entry",
    "EntryState",
    "FeltWaitAware",
    "HistoryKeeper",
    "LookaheadAware",
    "Hooks",
    "Key",
    "LRUPolicy",
    "ModelShape",
    "Policy",
    "PrefetchGuard",
    "ResidencyTable",
    "RoutingAware",
    "ShapeAware",
    "WaitCostAware",
    "bind",
    "load_history_file",
    "make_policy",
    "save_history_file",
]
