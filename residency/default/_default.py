"""``default``: the density ranking's eviction and the next-layer prefetch, each kept only while
it pays, in one state machine (docs/default-policy.md).

The parts, each in a module of its own: where the requests are in the model
(``_walk.py``), the order of use (``_order.py``), the density ranking (``_ranking.py``), the
LRU shadow and the cost verdict that judge it (``_judge.py``, timed by ``_meter.py``), S3-FIFO's
queues (``_s3fifo.py``), the next-layer prefetch (``_prefetch.py``) and its trial
(``_trial.py``). This module is the machine: it feeds the parts the store's events and makes
every change of state, each in one method:

- the eviction: ``density`` -> ``lru`` (the shadow overrules the ranking; its cost verdict at
  one token cycle of budget; a budget that holds every expert) or -> ``s3fifo`` (the cost
  verdict above one token cycle); ``s3fifo`` -> ``lru`` (a budget that fell below two token
  cycles, or grew to hold the model): :meth:`DefaultPolicy._evict_by`;
- the prefetch: on trial -> on or off for good (the trial's verdict; stopped off when the
  eviction turns to LRU's at one token cycle or less, where a guess could displace only the
  next layer's fresh experts): :meth:`DefaultPolicy._end_trial`;
- LRU alone: once the eviction is not the ranking's and the prefetch is off (and the engine
  passes no lookahead), nothing but LRU's order is kept: an ``LRUPolicy`` over the same
  order (with S3-FIFO's queues where they evict) takes the membership hooks, at LRU's cost
  per request (:meth:`DefaultPolicy._go_alone`); the engine's lookahead brings the
  bookkeeping back (:meth:`DefaultPolicy._come_back`).

:attr:`DefaultPolicy.state` says which state it is in, why, and since which decode token.
``coact`` (``alternatives/coact.py``) is this machine without the ranking.

Invariants (:meth:`DefaultPolicy.check`): each part's; LRU alone only when the eviction is not
the ranking's, the trial is over with the prefetch off and no lookahead was seen.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import ClassVar, Protocol

import numpy as np
import numpy.typing as npt

from iosched._errors import InvariantError, StoreError, require

from .._cooc import CoActivation
from .._hazard import AGE_MAX
from .._policy import (
    BatchAware,
    BudgetAware,
    Capability,
    CostAware,
    FeltWaitAware,
    HistoryKeeper,
    Key,
    LookaheadAware,
    ModelShape,
    PolicyState,
    PrefetchGuard,
    RoutingAware,
    ShapeAware,
    StateReporting,
)
from ..lru import LRUPolicy
from ._judge import RankingJudge
from ._meter import CostMeter
from ._order import UseOrder
from ._prefetch import NextLayerPrefetch, check_routing
from ._ranking import DensityRanking
from ._s3fifo import S3Fifo
from ._trial import PrefetchTrial
from ._walk import LayerWalk


class Eviction(enum.Enum):
    """Who orders the victims."""

    RANKING = "density"
    LRU = "lru"
    S3FIFO = "s3fifo"


class _Membership(Protocol):
    def on_request(self, key: Key, nbytes: int, hit: bool) -> None: ...
    def on_insert(self, key: Key, nbytes: int) -> None: ...
    def on_remove(self, key: Key) -> None: ...
    def victims(self) -> Iterator[Key]: ...


class _S3Alone:
    """LRU's order kept beside S3-FIFO's queues, which evict: the membership once the default
    is alone with S3-FIFO (the order is what the bookkeeping comes back to)."""

    def __init__(self, lru: LRUPolicy, s3: S3Fifo) -> None:
        self.lru, self.s3 = lru, s3

    def on_request(self, key: Key, nbytes: int, hit: bool) -> None:
        self.lru.on_request(key, nbytes, hit)
        if hit:
            self.s3.hit(key)

    def on_insert(self, key: Key, nbytes: int) -> None:
        self.lru.on_insert(key, nbytes)
        self.s3.insert(key, nbytes)

    def on_remove(self, key: Key) -> None:
        self.lru.on_remove(key)
        self.s3.remove(key)

    def victims(self) -> Iterator[Key]:
        return self.s3.victims()


class DefaultPolicy(BudgetAware, ShapeAware, BatchAware, PrefetchGuard, RoutingAware, CostAware,
                    FeltWaitAware, HistoryKeeper, LookaheadAware, StateReporting):
    name: ClassVar[str] = "default"
    capabilities: ClassVar[Capability] = (Capability.BUDGET | Capability.SHAPE | Capability.BATCHES
                                          | Capability.PREFETCH_GUARD | Capability.ROUTING
                                          | Capability.COST | Capability.FELT_WAIT
                                          | Capability.HISTORY | Capability.LOOKAHEAD | Capability.STATE)

    def __init__(self, prefetch_width: int | None = None, *, ranking: bool = True) -> None:
        """``prefetch_width``: experts proposed per batch at most; ``None`` is ``k``; 0 turns
        the prefetch off. ``ranking``: whether the density ranking evicts at first (without
        it LRU's order does, from the start: ``coact``)."""
        if prefetch_width is not None and (isinstance(prefetch_width, bool)
                                           or not isinstance(prefetch_width, int) or prefetch_width < 0):
            raise StoreError(f"policy '{self.name}': prefetch_width must be an integer >= 0, got {prefetch_width!r}")
        self._width_setting = prefetch_width
        self._width = 0
        self._walk = LayerWalk(self.name)
        self._order = UseOrder(self._walk)
        self._prefetch: NextLayerPrefetch | None = None
        self._ranking: DensityRanking | None = None
        self._judge: RankingJudge | None = None
        self._s3: S3Fifo | None = None
        self._trial: PrefetchTrial | None = None
        self._alone: _Membership | None = None
        """LRU's order alone (``LRUPolicy``, or ``_S3Alone``), or ``None`` while the default
        keeps its bookkeeping."""
        self._meter = CostMeter()
        self._felt: Callable[[], float] | None = None
        """The engine's felt wait so far (``set_felt_wait``), for the judge's cost verdict."""
        self._budget: int | None = None
        self._cycle_bytes = 0
        self._horizon = 1
        self._eviction = Eviction.RANKING if ranking else Eviction.LRU
        self._eviction_why = ""
        self._overruled = False
        """Whether the eviction left the ranking on a verdict (the cost verdict then says so)."""
        self._s3_since = 0
        self._prefetching = True
        """Whether the prefetch is on: for good after the trial, per token during it."""
        self._verdict: str | None = None
        self._engine_seen = False
        """Whether the engine ever passed its own lookahead (``on_expect``)."""
        self._decoded = 0
        self._counted = 0
        """Decode tokens seen, and the last layer's visit that counted the last one."""
        self._why = "the start"
        self._since = 0

    # ------------------------------------------------------------------ the state

    @property
    def state(self) -> PolicyState:
        """Which state the machine is in (``density eviction, prefetch on trial``, ...,
        ``lru alone``), why, and since which decode token."""
        if self._alone is not None:
            mode = f"{self._eviction.value} alone"
        else:
            prefetch = "on trial" if self._trial is not None else "on" if self.prefetching else "off"
            mode = f"{self._eviction.value} eviction, prefetch {prefetch}"
        return PolicyState(mode, self._why, self._since)

    @property
    def lru_alone(self) -> bool:
        """Whether only LRU's order is kept (with S3-FIFO's queues where they evict)."""
        return self._alone is not None

    @property
    def eviction(self) -> str:
        """``density``, or ``lru`` or ``s3fifo`` and why."""
        if self._eviction is Eviction.RANKING or not self._eviction_why:
            return self._eviction.value
        return f"{self._eviction.value} ({self._eviction_why})"

    @property
    def cost_verdict(self) -> str | None:
        verdict = self._verdict
        if not self._overruled:
            return verdict
        return f"{verdict}; eviction: {self._eviction_why}" if verdict else f"eviction: {self._eviction_why}"

    @property
    def prefetching(self) -> bool:
        """Whether the coming batch ends may propose prefetches."""
        return self._prefetching and bool(self._width)

    @property
    def _guessing(self) -> bool:
        """Whether a guess may still be admitted (else the stale victims' reuse, which only the
        guard reads, is not measured)."""
        return self._engine_seen or (bool(self._width) and (self._prefetching or self._trial is not None))

    def _changed(self, why: str) -> None:
        self._why, self._since = why, self._decoded

    # ------------------------------------------------------------------ the transitions

    def _evict_by(self, eviction: Eviction, why: str, overruled: bool = True) -> None:
        """The eviction leaves the ranking (or S3-FIFO) for ``eviction``, for good; the
        ranking's state is dropped. To LRU's order while the trial runs: at one token cycle
        of budget or less the trial stops (a guess could displace only fresh experts), above
        it counts its admissions afresh (they were over the ranking's victims)."""
        self._eviction, self._eviction_why, self._overruled = eviction, why, overruled
        self._changed(why)
        if eviction is Eviction.S3FIFO:
            order = self._order
            self._s3 = S3Fifo(self._cycle_bytes, ((key, order.nbytes[key]) for key in order.stamps))
            self._s3_since = self._decoded
        else:
            self._s3 = None
        self._ranking = self._judge = None
        if eviction is Eviction.LRU:
            if self._budget is not None and self._budget <= self._cycle_bytes:
                self._stop_trial("the eviction became LRU's at one token cycle of budget or less, "
                                 "where a guess could displace only the next layer's fresh experts")
            elif self._trial is not None:
                self._trial.restart_admissions("the eviction became LRU's")
        if isinstance(self._alone, _S3Alone) and self._s3 is None:
            self._alone = self._alone.lru  # alone with S3-FIFO, which LRU's order replaces
        else:
            self._alone_when_done()  # the prefetch may have been off already (or never ran)

    def _end_trial(self, on: bool, verdict: str) -> None:
        """The trial is over: the prefetch ``on`` or off for good, ``verdict`` says why; off,
        and without the engine's lookahead, no guess is weighed from here, and the machine is
        alone with LRU's order unless the ranking still evicts."""
        self._trial = None
        self._prefetching = on
        self._verdict = verdict
        self._changed(verdict)
        if on or self._engine_seen:
            return
        if self._prefetch is not None:
            self._prefetch.forget()
        if self._alone_when_done():
            self._verdict += "; LRU alone from here on"

    def _stop_trial(self, why: str) -> None:
        """The trial, if it runs, ends now with the prefetch off (``why``: what left the guard
        no victim it may displace), unless the engine passes its lookahead."""
        if self._trial is not None and not self._engine_seen:
            self._end_trial(False, f"prefetch off after {len(self._trial.pairs)} pairs of decode tokens: {why}")

    def _alone_when_done(self) -> bool:
        """LRU's order alone, once nothing else is left to run: the ranking does not evict, the
        prefetch is off for good (or never ran) and the engine passes no lookahead; whether it
        went alone now."""
        if (self._alone is None and self._eviction is not Eviction.RANKING and self._trial is None
                and not self.prefetching and not self._engine_seen and (self._verdict or not self._width)):
            self._go_alone()
            return True
        return False

    def _go_alone(self) -> None:
        """LRU's order (with S3-FIFO's queues where they evict) takes the membership hooks, over
        this very order, at LRU's cost per request. A guess still resident is forgotten (a policy
        alone resolves no guess)."""
        if self._prefetch is not None:
            self._prefetch.retire()
        self._walk.drop()
        lru = LRUPolicy(self._order.hand_over())
        self._alone = lru if self._s3 is None else _S3Alone(lru, self._s3)

    def _come_back(self) -> None:
        """The engine passes its lookahead after all: the bookkeeping LRU alone skipped comes
        back, each resident expert counting as used at its layer's last visit (fresh)."""
        self._alone = None
        self._order.take_back()

    # ------------------------------------------------------------------ set-up

    def set_budget(self, budget_bytes: int) -> None:
        self._budget = budget_bytes
        if self._judge is not None:
            self._judge.budget = budget_bytes
        self._settle_budget()

    def set_shape(self, shape: ModelShape) -> None:
        walk = self._walk = LayerWalk(self.name, shape)
        self._order = UseOrder(walk)
        self._prefetch = NextLayerPrefetch(walk, self._order)
        self._width = walk.k if self._width_setting is None else self._width_setting
        self._cycle_bytes = shape.token_cycle_bytes
        if self._eviction is Eviction.RANKING:
            self._ranking = DensityRanking(walk, self._horizon)
            self._judge = RankingJudge(self._budget)
            self._judge.felt = self._felt
        self._settle_budget()

    def _settle_budget(self) -> None:
        """The horizon from the budget in token cycles; LRU's order where nothing is ever
        evicted (the budget holds every expert of the model), or where S3-FIFO would lose."""
        walk, budget = self._walk, self._budget
        if not walk.L or budget is None:
            return
        cycle = self._cycle_bytes
        self._horizon = max(1, min(AGE_MAX - 1, round(budget / cycle)))
        if self._ranking is not None:
            self._ranking.set_horizon(self._horizon)
        if budget >= walk.E * sum(walk.expert_bytes) and self._eviction is not Eviction.LRU:
            self._evict_by(Eviction.LRU, "the budget holds every expert: nothing to rank", overruled=False)
        elif self._eviction is Eviction.S3FIFO and self._horizon < 2:
            self._evict_by(Eviction.LRU, f"lru: the budget fell to {budget / cycle:.2f} token cycles, where "
                                         f"S3-FIFO loses to LRU (it evicted from {self._s3_since} decode tokens on)")

    def set_clock(self, now: Callable[[], float]) -> None:
        """The store's clock: the ranking's work is timed and the prefetch's trial runs.
        Without one (the hit-rate replay) the prefetch is always on."""
        self._meter.now = now
        if self._width and self._verdict is None:
            self._trial = PrefetchTrial(now)

    def set_felt_wait(self, felt: Callable[[], float]) -> None:
        """The engine's felt wait so far: with the clock, the ranking's cost verdict."""
        self._felt = felt
        if self._judge is not None:
            self._judge.felt = felt

    def adopt(self, resident: Sequence[tuple[Key, int]], visits: Sequence[int], coactivation: CoActivation,
              popularity: npt.NDArray[np.float64], sizes: dict[Key, int]) -> None:
        """Go on from a predecessor's state (``MoEPolicy.hand_over``, for ``earned``): the
        resident keys least recently routed first, each with its layer's visit count at that
        routing; each layer's visits; the co-activation table (taken over); the pick counts
        per layer (with a pseudo-pick each); each resident key's bytes. After ``set_shape``."""
        prefetch, walk = self._prefetch, self._walk
        if prefetch is None:
            raise InvariantError(f"{self.name}: adopt before set_shape")
        require(len(visits) == walk.L and popularity.shape == (walk.L, walk.E)
                and (coactivation.n_layers, coactivation.n_expert) == (walk.L, walk.E),
                f"{self.name}: the state to adopt is of another shape")
        walk.visits = [int(v) for v in visits]
        order = self._order
        for key, used in resident:
            order.stamps[key] = int(used)
            order.nbytes[key] = sizes[key]
            order.resident_in[walk.position_of(key)] += 1
        order.held = sum(order.nbytes.values())
        prefetch.coact = coactivation
        prefetch.popular = np.array(popularity, dtype=np.float64)

    # ------------------------------------------------------------------ the membership hooks

    def on_request(self, key: Key, nbytes: int, hit: bool) -> None:
        # The hot path: a resident acquire costs this on every layer of every token.
        alone = self._alone
        if alone is not None:
            alone.on_request(key, nbytes, hit)
            return
        walk = self._walk
        where = walk.where.get(key)
        if where is None:
            where = walk.locate(key)
        p, expert = where
        if p != walk.batch_pos or expert in walk.batch:
            self._begin_batch(p)
            if self._alone is not None:  # the batch's close ended the trial: LRU's order alone
                self._alone.on_request(key, nbytes, hit)
                return
        walk.batch.append(expert)
        prefetch = self._prefetch
        if hit:
            stamps = self._order.stamps
            if key in stamps:
                stamps[key] = walk.visit_now
                stamps.move_to_end(key)
            if prefetch is not None and prefetch.guesses and key in prefetch.guesses:
                prefetch.used(key)
                if self._trial is not None:
                    self._trial.used += 1
                if self._judge is not None:
                    self._judge.used += 1
            if self._s3 is not None:
                self._s3.hit(key)
        else:
            if self._trial is not None:
                self._trial.misses += 1
            if self._judge is not None:
                self._judge.misses += 1
            walk.missed[p] = True
            if prefetch is not None and prefetch.ghosts:
                prefetch.missed(key, p)

    def admit(self, key: Key, nbytes: int, victims: Sequence[Key] = ()) -> bool:
        return True

    def on_insert(self, key: Key, nbytes: int) -> None:
        alone = self._alone
        if alone is not None:
            alone.on_insert(key, nbytes)
            return
        prefetch = self._prefetch
        guess = prefetch is not None and prefetch.admitting == key
        p = self._walk.position_of(key)
        self._order.insert(key, p, nbytes, guess)
        if guess and prefetch is not None:
            prefetch.admitting = None
        if self._s3 is not None:
            self._s3.insert(key, nbytes, guess)
        if self._ranking is not None:
            p, e = self._walk.where[key]
            self._ranking.inserted(p * self._walk.E + e)

    def on_remove(self, key: Key) -> None:
        alone = self._alone
        if alone is not None:
            alone.on_remove(key)
            return
        walk, prefetch = self._walk, self._prefetch
        p = walk.position_of(key)
        stamp = self._order.remove(key, p)
        if prefetch is not None:
            prefetch.resolve(key)
            prefetch.proposed.pop(key, None)
            if stamp < walk.visits[p] and self._guessing:
                prefetch.evicted_stale(key, p)
        if self._s3 is not None:
            self._s3.remove(key)
        if self._ranking is not None:
            self._ranking.removed(p * walk.E + walk.where[key][1])

    def victims(self) -> Iterator[Key]:
        alone = self._alone
        if alone is not None:
            return alone.victims()
        if self._s3 is not None:
            return self._s3.victims()
        ranking = self._ranking
        if ranking is not None:
            walk = self._walk
            return ranking.victims(walk.batch_pos if walk.batch_pos >= 0 else ranking.cur, self._meter)
        return self._order.victims()

    # ------------------------------------------------------------------ batches and tokens

    def _begin_batch(self, p: int) -> None:
        """A request at another layer position (or repeating an expert): the batch in progress
        closes and one at ``p`` begins; at the first layer a token begins (the trial's pairs)."""
        decode = self._close_batch()
        trial = self._trial
        if trial is not None:
            verdict = trial.batch_begins(decode, p == 0)
            if verdict is None:
                self._prefetching = trial.prefetching  # the arm of the token in progress
            else:
                self._end_trial(verdict.on, verdict.why)
        self._walk.begin(p)
        prefetch = self._prefetch
        if prefetch is not None and prefetch.expected:
            prefetch.expected.pop(p, None)

    def _close_batch(self) -> bool:
        """End the batch in progress (its learning, and its visit unless its end work ran);
        whether it was a decode batch."""
        walk, ranking = self._walk, self._ranking
        applied = ranking is not None and ranking.applied == ranking.epoch
        pos, batch, decode = walk.close()
        prefetch = self._prefetch
        if prefetch is not None:
            prefetch.note_batch(pos, batch, decode)
            if decode and pos == walk.L - 1:
                self._learn()
        if not decode and batch and self._trial is not None:
            self._trial.prompt = True
        if ranking is not None:
            if not applied and batch:
                self._meter.timed("visit", self._visit, pos, batch, decode)  # its end work did not run
            ranking.epoch += 1
        elif decode and pos == walk.L - 1:
            self._token_counted()
        return decode

    def _token_counted(self) -> None:
        """A decode token's last batch ended (counted once, whichever saw it first)."""
        visit = self._walk.visits[self._walk.L - 1]
        if visit != self._counted:
            self._counted = visit
            self._decoded += 1

    def _visit(self, pos: int, batch: list[int], decode: bool) -> None:
        """A batch complete, seen by the ranking and its judge; at a decode token's last layer
        the judge's look (:meth:`_token_end`)."""
        ranking, judge = self._ranking, self._judge
        if ranking is None or judge is None:
            return
        ranking.cur = pos
        judge.shadow_batch(pos * self._walk.E, batch, self._walk.expert_bytes[pos])
        if ranking.visit(pos, batch, decode):
            ranking.token_end(self._decoded)
            self._token_counted()
            retirement = judge.token_end(self._decoded, self._meter.now, self._meter.spent_s, self._horizon)
            if retirement is not None:
                self._evict_by(Eviction(retirement.eviction), retirement.why)

    def _learn(self) -> None:
        """The token's picks into the co-activation, unless no prefetch will read it (the
        ranking evicts and the prefetch is off for good)."""
        prefetch = self._prefetch
        if prefetch is None:
            return
        if (self._eviction is Eviction.RANKING and self._trial is None and not self._prefetching
                and not self._engine_seen):
            prefetch.forget_picks()
        else:
            prefetch.learn()

    def end_batch(self) -> list[Key] | None:
        """The batch just made is complete: the ranking's visit (off the engine's path while it
        computes), then the next layer's proposals; ``None`` once alone (the store then stops
        the batch-end work)."""
        if self._alone is not None:
            return None
        walk, ranking, prefetch = self._walk, self._ranking, self._prefetch
        batch, pos = walk.batch, walk.batch_pos
        if ranking is not None:
            if batch and len(batch) <= walk.k and ranking.applied != ranking.epoch:
                ranking.applied = ranking.epoch
                self._meter.timed("visit", self._visit, pos, batch, True)
            if self._trial is None and not self._prefetching and not self._engine_seen:
                if prefetch is not None:
                    prefetch.proposed.clear()
                return []
        if self._alone is not None:
            return None
        if not batch:
            return []
        if self._trial is not None:
            self._trial.batch_ended()
        if prefetch is None:
            return []
        if prefetch.proposed:
            prefetch.proposed.clear()
        if len(batch) > walk.k or not self.prefetching:
            return []
        return prefetch.propose(pos, batch, self._width, self._budget)

    def prepare(self) -> None:
        """Between batches, while the engine computes: the next position's ranking."""
        ranking, walk = self._ranking, self._walk
        if ranking is not None and walk.L and walk.batch_pos >= 0:
            ranking.prepare((walk.batch_pos + 1) % walk.L, ranking.epoch + 1, self._meter)

    # ------------------------------------------------------------------ the prefetch's guard

    def admit_prefetch(self, key: Key, nbytes: int, victims: Sequence[Key] = ()) -> bool:
        prefetch = self._prefetch
        if prefetch is None:
            return not victims
        admitted = prefetch.admit(key, victims)
        if admitted and self._trial is not None:
            self._trial.admitted += 1
        return admitted

    def on_expect(self, layer: int, probabilities: npt.NDArray[np.float64]) -> None:
        """The engine's estimate for ``layer``'s next batch (``ExpertStore.expect``), weighed by
        the guard (not calibrated: the engine's own) until that batch begins; alone with
        LRU's order, the bookkeeping comes back."""
        self._engine_seen = True
        if self._alone is not None:
            self._come_back()
        pos = self._walk.pos.get(layer)
        if pos is not None and probabilities.shape == (self._walk.E,) and self._prefetch is not None:
            self._prefetch.expected[pos] = probabilities

    def on_routing(self, layer: int, rows: npt.NDArray[np.int64]) -> None:
        """A prompt's router rows: the prefetch's learning, and each row a visit of the layer
        for the ranking."""
        prefetch, walk = self._prefetch, self._walk
        if prefetch is None:
            return
        pos = check_routing(self.name, layer, walk.pos.get(layer), rows, walk.E, walk.layers)
        if rows.ndim == 2 and rows.shape[0] > 1:
            prefetch.learn_rows(pos, rows)
        if self._ranking is not None and rows.ndim == 2:
            self._ranking.observe_rows(pos, rows)

    # ------------------------------------------------------------------ usage history

    @property
    def pinned_experts(self) -> int:
        """None: a history seeds the co-activation and the popularity, and pins nothing."""
        return 0

    def history(self) -> dict[str, npt.NDArray[np.generic]]:
        if self._prefetch is None:
            raise StoreError(f"policy '{self.name}' has no shape, hence no history")
        self._learn()
        return self._prefetch.history()

    def load_history(self, arrays: Mapping[str, npt.NDArray[np.generic]], source: str) -> None:
        if self._prefetch is None:
            raise StoreError(f"policy '{self.name}' needs its shape before a history")
        self._prefetch.load_history(arrays, source)

    def check(self, keys: set[Key]) -> None:
        alone = self._alone
        require(alone is None or (self._eviction is not Eviction.RANKING and self._trial is None
                                  and not self.prefetching and not self._engine_seen),
                f"{self.name}: alone with LRU's order while the ranking evicts, the prefetch runs or "
                f"the engine passes its lookahead")
        if isinstance(alone, _S3Alone):
            alone.lru.check(keys)
        elif isinstance(alone, LRUPolicy):
            alone.check(keys)
        else:
            self._order.check(keys)
        if self._ranking is not None and alone is None:
            self._ranking.check(keys)
        if self._judge is not None:
            self._judge.check()
        if self._s3 is not None:
            self._s3.check(set(keys))
        if self._prefetch is not None:
            self._prefetch.check(self._guessing)
