"""Residency: which experts stay in RAM (``iosched.residency``).

``ResidencyTable`` is the lease-aware driver with the strict byte budget; policies (one a
file) decide admission and eviction order, and declare their optional abilities
(:class:`Capability`, bound once by :func:`bind` into :class:`Hooks`).  ``make_policy(name)``
builds one by name.  This module's names are the package's interface: the core and the
tools import them from here, never from its private modules.

The rooms: the interface (``_policy``), the driver (``_table``), the registry and the
baseline (``lru``) here; the default policy, by parts, in ``default/``
(docs/default-policy.md); the alternatives kept for comparison in ``alternatives/``
(``coact``, ``moe``, ``earned``, ``lfu``, ``lrfu``, ``wtinylfu``, ``belady``, ``sketch``); the
models of MoE routing both share (``_cooc``, ``_hazard``, ``_history``) here.  Beyond these
names, the public modules of those packages are the interface too; the ``_``-prefixed
modules are imported from inside their own package only, and ``default`` imports nothing of
``alternatives``: contracts that ``lint-imports`` checks (docs/design.md, "Import rules").
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
    PolicyState,
    PrefetchGuard,
    RoutingAware,
    ShapeAware,
    StateReporting,
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
    "PolicyState",
    "PrefetchGuard",
    "ResidencyTable",
    "RoutingAware",
    "ShapeAware",
    "StateReporting",
    "WaitCostAware",
    "bind",
    "load_history_file",
    "make_policy",
    "save_history_file",
]
