"""Whether the density ranking still earns its place: an LRU shadow that can overrule it, and a
cost verdict that retires it when its CPU costs the engine more than its lead saves.

- **The LRU shadow** (keys and sizes only, the store's semantics: a batch's hits first, then
  its misses evicting the oldest key outside the batch) runs every batch the ranking visits.
  From the :data:`MIN_TOKENS`-th decode token on, when the ranking's misses (plus its used
  prefetches, which would have been misses) exceed the shadow's by more than
  :data:`GUARD_SIGMAS` times the shadow's Poisson noise, LRU's order evicts from then on: on a
  trace whose reuse is recency alone the ranking cannot lose more than that margin.
- **The cost verdict** (from the :data:`COST_VERDICT_FROM`-th decode token): the ranking's CPU
  (``_meter.py``) against what its lead over the shadow could have saved, the lead at its
  likely best (plus :data:`GUARD_SIGMAS` of the shadow's noise) priced at the felt wait of a
  miss, never more than all the felt wait LRU would have had. When the ranking cost more than
  that, and more than :data:`MATERIAL_SHARE` of the decode's time, it retires: to LRU's order
  at one token cycle of budget, to S3-FIFO's queues above (where they keep most of the
  ranking's hits at LRU's cost; at one cycle they lose to LRU).

Both count from the first decode token (the prompt's misses are alike for every order).

Invariant: the shadow never holds more bytes than the budget.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from iosched._errors import require

GUARD_SIGMAS = 2.0
"""The shadow's misses plus this many Poisson standard deviations is what the ranking's may
reach (about 2.3 % of the looks of an order as good as LRU's cross it by chance)."""

MIN_TOKENS = 3
"""Decode tokens before the shadow may overrule: the fewest over which a count of misses
differs by more than the routing's noise."""

COST_VERDICT_FROM = MIN_TOKENS
"""Decode tokens before the cost verdict may decide (the lead's margin is wide over a few
tokens, so an early look errs toward keeping the ranking). Paired real runs, 1 and 4 TD
(docs/benchmarks.md, "The default against lru"): parity with ``lru`` from token 3."""

MATERIAL_SHARE = 0.01
"""The verdict retires the ranking only when it cost more than this share of the decode's
time: a switch of order has a cost of its own (what the new order would have kept comes back
as misses). Critical path, qwen 500 MB/s, 1 ms a layer, 4 TD: a ranking at 0.5 % of the time
retired ran 0.965x ``lru``, kept 0.983x."""


@dataclass(frozen=True)
class Retirement:
    """The judge's conclusion: the ranking retires to ``eviction`` (``lru`` or ``s3fifo``)."""

    eviction: str
    why: str


class RankingJudge:
    """The LRU shadow and the ranking's two verdicts."""

    def __init__(self, budget: int | None) -> None:
        self.budget = budget
        self.felt: Callable[[], float] | None = None
        """The engine's felt wait so far (the store's, ``set_felt_wait``)."""
        self._shadow: OrderedDict[int, int] = OrderedDict()
        """Flat indices (position x E + expert), oldest use first, and their bytes."""
        self._held = 0
        self.shadow_misses = 0
        self.misses = 0
        """Demand misses of the policy, and (:attr:`used`) its used prefetches, since the start."""
        self.used = 0
        self._mark = (0.0, 0.0, 0.0, 0, 0)
        """At the first decode token's end: the clock, the felt wait, the ranking's CPU and both
        miss counts (the cost verdict weighs the decode's, not the prompt's)."""

    def shadow_batch(self, base: int, batch: list[int], nbytes: int) -> None:
        """The batch through the shadow (``base``: its position x E): its hits first, then its
        misses, each evicting the oldest key outside the batch."""
        shadow = self._shadow
        missed = []
        for e in batch:
            flat = base + e
            if flat in shadow:
                shadow.move_to_end(flat)
            else:
                missed.append(flat)
        if not missed:
            return
        self.shadow_misses += len(missed)
        budget, held = self.budget, self._held
        inside = {base + e for e in batch}
        for flat in missed:
            if budget is not None:
                while held + nbytes > budget and shadow:
                    victim: int | None = next(iter(shadow))  # the oldest, unless the batch is all it holds
                    if victim in inside:
                        victim = next((k for k in shadow if k not in inside), None)
                    if victim is None:
                        break
                    held -= shadow.pop(victim)
                if held + nbytes > budget:
                    continue  # no room beside the batch: served transiently, as the table does
            shadow[flat] = nbytes
            held += nbytes
        self._held = held

    def token_end(self, decoded: int, now: Callable[[], float] | None, spent_s: float,
                  horizon: int) -> Retirement | None:
        """The ``decoded``-th decode token ended: the shadow's look, then the cost verdict
        (``spent_s``: the ranking's CPU so far; ``horizon``: the budget in token cycles)."""
        mine, theirs = self.misses + self.used, self.shadow_misses
        if decoded == 1 and self.felt is not None:
            self._mark = (now() if now is not None else 0.0, self.felt(), spent_s, mine, theirs)
        if decoded < MIN_TOKENS:
            return None
        if mine > theirs + GUARD_SIGMAS * math.sqrt(max(theirs, 1)):
            return Retirement("lru", f"lru after {decoded} decode tokens: density missed {mine} (with its used "
                                     f"prefetches) against the LRU shadow's {theirs}")
        if self.felt is None or decoded < COST_VERDICT_FROM:
            return None
        return self._judge_cost(self.felt, now, spent_s, decoded, mine, theirs, horizon)

    def _judge_cost(self, felt: Callable[[], float], now: Callable[[], float] | None, spent_s: float,
                    decoded: int, mine: int, theirs: int, horizon: int) -> Retirement | None:
        t0, felt0, cost0, mine0, theirs0 = self._mark
        waited, spent, mine, theirs = felt() - felt0, spent_s - cost0, mine - mine0, theirs - theirs0
        elapsed = now() - t0 if now is not None else 0.0
        if mine <= 0 or spent <= MATERIAL_SHARE * elapsed:
            return None
        per_miss = waited / mine
        lead = theirs - mine
        at_most = min(theirs, max(0.0, lead + GUARD_SIGMAS * math.sqrt(max(theirs, 1)))) * per_miss
        if at_most >= spent:
            return None
        why = (f"after {decoded} decode tokens: the ranking cost {1e3 * spent:.0f} ms "
               f"({100 * spent / max(elapsed, spent):.1f} % of the decode's time), "
               f"more than the {1e3 * at_most:.0f} ms of felt wait its lead could have saved "
               f"({lead} misses fewer than the LRU shadow's {theirs}, plus {GUARD_SIGMAS:g} sigma, "
               f"at {1e3 * per_miss:.2f} ms of felt wait a miss; since the first decode token)")
        return Retirement("lru", f"lru {why}") if horizon == 1 else Retirement("s3fifo", f"s3fifo {why}")

    def check(self) -> None:
        require(self.budget is None or self._held <= self.budget, "default: the LRU shadow holds more than the budget")
