"""``budget="auto"`` grows between turns while the measured benefit exceeds the measured cost.

``budget="auto"`` opens at ``auto_start_cycles`` whole token cycles (at most what fits, see
:func:`iosched.runtime._sizing.auto_budget`) and, at each decision point, adds the whole cycles whose
measured benefit exceeds their measured cost:

* **Benefit** (seconds of felt wait per cycle added): a *ghost list* remembers the experts the
  table evicted, each with the count of bytes evicted before it.  A demand miss on a ghost
  expert would have been a hit had the budget been larger by the bytes evicted since it left
  (its eviction depth, itself included); its felt wait is credited to the band
  ``(depth - 1) // TD``: band 0 is what one more cycle would have saved, band 1 a second one.
  The depth is exact for LRU's stack and an estimate for the other policies (a larger budget
  would have evicted other experts, not only fewer).  An acquire's felt wait is shared by the
  acquires waiting beside it (six misses awaited together for 2 ms cost the engine 2 ms), so a
  miss is credited its own wait divided by how many acquires were waiting when it began.
  The ghost holds at most the current budget's bytes, so one decision can at most double it.
* **Cost** (seconds per cycle added): the time the system's tasks stalled on memory during the
  epoch, Linux pressure-stall information (``/proc/pressure/memory``, "some" line, kernel 4.20+).
  Memory we take is memory the engine and the page cache lack; once the machine stalls on
  memory for as long as a cycle would save, growing is refused.  Where PSI cannot be read
  (``None`` in the decision) the cost is the hard ceiling alone.
* **Ceiling**: the budget never exceeds ``AUTO_FRACTION`` of (``MemAvailable`` + our own
  resident bytes) read at the decision, nor the cycles that hold every expert.  The memory we
  already hold counts as ours, so the ceiling is a fixed point (``B = f × (A + B)``), not a
  ratchet that takes half of what is left at every turn; an engine that allocated its KV
  cache since ``open`` lowers it.

The added cycles are the prefix ``j`` that maximises ``Σ_{i<j} (benefit[i] - cost)`` within
the ceiling (0 when no band pays for itself).  A decision is taken at ``end_turn()`` (the
engine knows its turns) and after every full turnover of the budget (bytes evicted since the
last decision >= budget), because an engine may never mark a turn and growing evicts nothing,
so it is safe mid-turn.  The budget never shrinks: a smaller one would have to evict what the
engine may hold leased.

Written here rather than taken from a library: the ghost is the classic "shadow cache"
(ARC's B lists, libCacheSim's miss-ratio-curve tools compute the whole curve offline), but
no maintained library sizes an asyncio byte budget from felt wait and PSI online.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

__all__ = ["BudgetGrowth", "GrowthDecision", "GrowthStats", "GrowthStep", "psi_memory_some_us"]

_PSI_MEMORY = "/proc/pressure/memory"


def psi_memory_some_us(path: str = _PSI_MEMORY) -> int | None:
    """Total microseconds some task stalled on memory since boot, or ``None`` if unreadable."""
    try:
        with open(path, encoding="ascii") as fh:
            for line in fh:
                if line.startswith("some "):
                    for field in line.split():
                        if field.startswith("total="):
                            return int(field[6:])
    except (OSError, ValueError):
        return None
    return None


@dataclass(frozen=True)
class GrowthDecision:
    """One decision of the growth rule, as ``stats()["budget_growth"]["last"]`` shows it."""

    reason: str
    """``"end_turn"`` or ``"turnover"``: what triggered the decision."""
    budget_before: int
    budget_after: int
    added_cycles: int
    benefit_s: tuple[float, ...]
    """Felt wait each further cycle would have saved during the epoch (band 0 first)."""
    cost_s: float | None
    """Memory-stall seconds of the epoch (PSI "some"); ``None`` where PSI is unreadable."""
    ceiling_cycles: int
    """The most whole cycles the budget may reach at this decision."""


@dataclass(frozen=True)
class GrowthStep:
    """One growth of the budget: what triggered it, and the budget after it."""

    reason: str
    budget_bytes: int


@dataclass(frozen=True)
class GrowthStats:
    """``stats()["budget_growth"]``: the decisions so far, the growths, the ghost list."""

    decisions: int
    grown_cycles: int
    ghost_hits: int
    ghost_bytes: int
    grown_to: tuple[GrowthStep, ...]
    last: GrowthDecision | None


class BudgetGrowth:
    """The ghost list, the benefit bands of the current epoch, and the decision rule.

    Invariant: ``ghost_bytes <= bound``, the budget at the last decision (or at open).  A
    ghost key leaves the ghost when a demand miss finds it or when it is evicted again (a
    prefetch may have reloaded it meanwhile: it was then not a miss, and credits nothing).
    """

    def __init__(self, td_bytes: int, budget_bytes: int, max_cycles: int,
                 stall_us: Callable[[], int | None] = psi_memory_some_us) -> None:
        self.td = td_bytes
        self._stall_us = stall_us
        """The memory-stall clock: PSI's "some" total, in microseconds (``None``: unreadable)."""
        self.max_cycles = max_cycles
        """Cycles that hold every expert of the checkpoint: room past them is never used."""
        self._bound = budget_bytes
        self._ghost: OrderedDict[Hashable, tuple[int, int]] = OrderedDict()
        """key -> (bytes evicted before it, its bytes), oldest first."""
        self.ghost_bytes = 0
        self._evicted = 0
        self._epoch_start = 0
        self._bands = [0.0] * self._n_bands()
        self._stall_mark: int | None = stall_us()
        self.decisions = 0
        self.grown_cycles = 0
        self.ghost_hits = 0
        self.last: GrowthDecision | None = None
        self.trajectory: list[tuple[str, int]] = []
        """(reason, budget after) of each decision that grew the budget, in order."""

    def _n_bands(self) -> int:
        return max(1, -(-self._bound // self.td))

    def evicted(self, key: Hashable, nbytes: int) -> bool:
        """The table evicted ``key``; ``True`` when the budget has turned over since the last
        decision (time for one)."""
        self._ghost.pop(key, None)
        self._ghost[key] = (self._evicted, nbytes)
        self.ghost_bytes += nbytes
        self._evicted += nbytes
        while self.ghost_bytes > self._bound and self._ghost:
            _, (_, old) = self._ghost.popitem(last=False)
            self.ghost_bytes -= old
        return self._evicted - self._epoch_start >= self._bound

    def missed(self, key: Hashable) -> int | None:
        """A demand miss on ``key``: the band its wait belongs to, or ``None`` when a larger
        budget within the ghost's reach would not have kept it.  Drops it from the ghost."""
        found = self._ghost.pop(key, None)
        if found is None:
            return None
        before, nbytes = found
        self.ghost_bytes -= nbytes
        band = (self._evicted - before - 1) // self.td
        if band >= len(self._bands):
            return None
        self.ghost_hits += 1
        return band

    def credit(self, band: int, wait_s: float) -> None:
        self._bands[band] += wait_s

    def decide(self, reason: str, budget: int, resident_bytes: int, mem_available: int,
               fraction: float) -> GrowthDecision:
        """Close the epoch: how many whole cycles to add to ``budget``; starts the next epoch."""
        stall = self._stall_us()
        cost = (None if stall is None or self._stall_mark is None
                else max(0, stall - self._stall_mark) / 1e6)
        self._stall_mark = stall
        ceiling = min(self.max_cycles, int(fraction * (mem_available + resident_bytes)) // self.td)
        room = max(0, ceiling - budget // self.td)
        best = gain = 0.0
        add = 0
        for i, benefit in enumerate(self._bands[:room]):
            gain += benefit - (cost or 0.0)
            if gain > best:
                best, add = gain, i + 1
        decision = GrowthDecision(reason, budget, budget + add * self.td, add,
                                  tuple(round(b, 6) for b in self._bands), cost, ceiling)
        self.decisions += 1
        self.grown_cycles += add
        self.last = decision
        if add:
            self.trajectory.append((reason, decision.budget_after))
        self._bound = decision.budget_after
        self._bands = [0.0] * self._n_bands()
        self._epoch_start = self._evicted
        return decision

    def snapshot(self) -> GrowthStats:
        """``stats()["budget_growth"]``, frozen."""
        return GrowthStats(self.decisions, self.grown_cycles, self.ghost_hits, self.ghost_bytes,
                           tuple(GrowthStep(r, b) for r, b in self.trajectory), self.last)
