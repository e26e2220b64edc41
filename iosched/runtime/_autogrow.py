"""``budget_bytes="auto"`` as the store runs it: when the growth rule is asked, and what it sees.

The rule itself (ghost list, benefit bands, memory-stall cost, ceiling) is
:class:`iosched.runtime._growth.BudgetGrowth`; this is its wiring into the store.  The acquire path
reports each demand miss (:meth:`AutoGrow.missed`) and credits its felt wait
(:meth:`AutoGrow.credit`); the table's evictions feed the ghost (:meth:`AutoGrow.evicted`);
a decision is taken at ``end_turn()`` and, because an engine may never mark turns, after
each full turnover of the budget, at the engine's next await.  A grown budget wakes the
acquires waiting for room.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Hashable

from iosched._errors import BudgetError
from iosched.residency import Entry, ResidencyTable

from . import _sizing
from ._growth import BudgetGrowth
from ._room import Lifecycle, Room
from ._slab import SlabPool

log = logging.getLogger("iosched")


class AutoGrow:
    """Drives one store's :class:`BudgetGrowth`."""

    def __init__(self, growth: BudgetGrowth, table: ResidencyTable, pool: SlabPool, room: Room,
                 lifecycle: Lifecycle) -> None:
        self.growth = growth
        self._table = table
        self._pool = pool
        self._room = room
        self._lifecycle = lifecycle
        self._due = False
        """A turnover decision is scheduled for the next await."""

    def missed(self, key: Hashable) -> int | None:
        return self.growth.missed(key)

    def credit(self, band: int, wait_s: float) -> None:
        self.growth.credit(band, wait_s)

    def evicted(self, entry: Entry) -> None:
        """The table evicted ``entry``: into the ghost; a full turnover schedules a decision."""
        if self.growth.evicted(entry.key, entry.nbytes) and not self._due:
            self._due = True  # the budget turned over: decide at the next await
            asyncio.get_running_loop().call_soon(self.grow, "turnover")

    def grow(self, reason: str) -> None:
        """Take a decision now (``reason``: ``"end_turn"`` or ``"turnover"``)."""
        self._due = False
        if self._lifecycle.closed:
            return
        try:
            available = _sizing.mem_available()
        except BudgetError as exc:  # /proc/meminfo went away: keep the budget
            log.warning("budget growth skipped: %s", exc)
            return
        table = self._table
        decision = self.growth.decide(reason, table.budget_bytes, table.used_bytes + self._pool.idle_bytes,
                                      available, _sizing.AUTO_FRACTION)
        if decision.added_cycles:
            table.grow(decision.budget_after)
            log.info("budget grew by %d token cycles to %d bytes (%s; felt wait per cycle %s s, "
                     "memory stall %s s)", decision.added_cycles, decision.budget_after, reason,
                     decision.benefit_s[:decision.added_cycles], decision.cost_s)
            self._room.wake()
