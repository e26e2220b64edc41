"""``moe``: hit density priced per request, with its own prefetch, on the structure of MoE routing.

Why a policy of its own: a token visits every MoE layer once, in a fixed order, so the next
request for an expert of layer ``l`` can only come at ``l``'s next visit, and the layer just
served is the one visited last again. LRU evicts precisely the layer that comes next, LFU
ignores both the cycle and the fact that recently routed experts come back (see
docs/residency.md). This policy ranks resident experts by *hit density*, the hits an expert's
bytes are expected to buy per unit of time they are held (LHD, Beckmann et al., NSDI 2018),
with four MoE-specific parts:

1. **Reuse from the run itself.** The probability of an expert being routed within the next
   ``h`` visits of its layer comes from an online hazard table over (age, count) classes
   (``residency/_hazard.py``); ``h``, the horizon, is the mean age at which the table evicts
   (measured, an exponential average over the last ~100 evictions), started at the budget in
   token cycles.
2. **The layer cycle.** An expert of the layer ``d`` visits ahead waits ``d`` layer steps
   before its first chance of a hit, then a whole cycle of ``L`` steps per further visit:
   density = ``P(hit within h) x cost / ((d + L x E[idle visits]) x bytes)``. Evicting the
   lowest density over all layers at once gives every layer the bytes whose marginal density
   is equal: the water-filling of the budget over layers, re-planned at every batch.
3. **Prefetch of the next layer.** After each batch (one layer of one token) the driver asks
   :meth:`MoEPolicy.end_batch`, which predicts the next layer's experts from the cross-layer
   co-activation of this token's picks (``residency/_cooc.py``) and proposes the ``k`` best.
   The driver loads them speculatively within its bytes-moved budget; the table asks
   :meth:`MoEPolicy.admit_prefetch`, which refuses unless the candidate's density beats every
   victim's (the eviction guard). A prefetched expert keeps its candidate density until the
   visit it was fetched for has passed (a minimum age, so the next batch's misses cannot
   evict it first); the store publishes it only when its read succeeded.  The co-activation
   is learned from every token's picks, a prompt's included when the engine passes its
   router's rows (:meth:`MoEPolicy.on_routing`, ``ExpertStore.observe_routing``).
4. **The routing context.** The prediction for the next layer, over its layer's mean, lifts
   or lowers each of that layer's experts' class hit probability by a factor measured on the
   run (``residency/alternatives/_lift.py``): which experts the text is routing toward now, as far as the
   measurements say that predicts their reuse.

``cost`` is the felt wait of the layer's misses (:meth:`MoEPolicy.on_wait`, measured by the
store: the time the engine spent awaiting ``acquire``, not the read's service time), relative
to the mean; without measurements (the replay) every miss costs the same, so the density
counts hits, the replay's metric.

Demand misses are always admitted: an admission filter measured no gain on the bundled traces
(docs/tried-and-dropped.md, negative results), and a demand miss's bytes are held while the engine
computes on it anyway.

Nothing here is fitted to a trace: ``k``, ``L`` and the expert sizes come from the model's
shape (:class:`~iosched.residency._policy.ModelShape`), the hazard and co-activation are learned on the
run, the horizon is measured; the remaining constants (bins, priors, the ~100-eviction
average) are structural and say so where they are defined.

Invariants (:meth:`check`): the resident mask is exactly the table's admitted keys; only
resident experts carry a pending (prefetch) density; the batch in progress is a layer's
distinct experts; ages are never negative; the hazard table holds no more uses than exposures.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import ClassVar

import numpy as np
import numpy.typing as npt

from iosched._errors import StoreError, require

from .. import _history
from .._cooc import CoActivation
from .._hazard import AGE_MAX, HazardTable, age_bin, count_bin
from .._policy import (
    BatchAware,
    BudgetAware,
    Capability,
    HistoryKeeper,
    Key,
    LookaheadAware,
    ModelShape,
    PrefetchGuard,
    RoutingAware,
    ShapeAware,
    WaitCostAware,
)
from ._lift import ContextLift, lift_bin

F64 = npt.NDArray[np.float64]

HORIZON_MEMORY = 100
"""Evictions the horizon average spans (decay 1 - 1/100): long enough to smooth single
evictions, short enough to follow a budget that grows between turns."""


class MoEPolicy(BudgetAware, ShapeAware, BatchAware, PrefetchGuard, WaitCostAware, RoutingAware,
                HistoryKeeper, LookaheadAware):
    name: ClassVar[str] = "moe"
    capabilities: ClassVar[Capability] = (
        Capability.BUDGET | Capability.SHAPE | Capability.BATCHES | Capability.PREFETCH_GUARD
        | Capability.WAIT_COST | Capability.ROUTING | Capability.HISTORY | Capability.LOOKAHEAD)

    def __init__(self, shape: ModelShape | None = None, prefetch_width: int | None = None) -> None:
        """``prefetch_width``: experts proposed per batch at most; ``None`` is ``k``, one
        batch's worth (per token, at most one token cycle of bytes, spread evenly over the
        layers: the churn limit); 0 turns prefetching off (an eviction-only policy)."""
        if prefetch_width is not None and (isinstance(prefetch_width, bool)
                                           or not isinstance(prefetch_width, int) or prefetch_width < 0):
            raise StoreError(f"policy 'moe': prefetch_width must be an integer >= 0, got {prefetch_width!r}")
        self._width_setting = prefetch_width
        self._shape: ModelShape | None = None
        self._budget: int | None = None
        self._where: dict[Key, tuple[int, int]] = {}
        if shape is not None:
            self.set_shape(shape)

    # ------------------------------------------------------------------ set-up hooks

    def set_budget(self, budget_bytes: int) -> None:
        self._budget = budget_bytes

    def set_shape(self, shape: ModelShape) -> None:
        if self._shape is not None:
            if shape != self._shape:
                raise StoreError(f"policy 'moe': set_shape with another shape ({shape}) than before")
            return
        if not shape.layers or shape.n_expert <= 0 or shape.experts_per_token <= 0:
            raise StoreError(f"policy 'moe': empty model shape {shape}")
        self._shape = shape
        self._layers = tuple(shape.layers)
        self._pos = {layer: i for i, layer in enumerate(self._layers)}
        self._L = L = len(self._layers)
        self._E = E = shape.n_expert
        self._k = shape.experts_per_token
        self._width = self._k if self._width_setting is None else self._width_setting
        self._size = np.array([[float(shape.expert_bytes[layer])] * E for layer in self._layers])
        self._count = np.zeros((L, E))
        self._cb = count_bin(self._count)
        """``count_bin(_count)`` but for the rows of ``_cb_dirty`` (counts changed since),
        brought up to date by :meth:`_fresh_rows`: the class terms of the next layer (the
        lift) are recomputed as often as the visited layer's, and its counts have not changed."""
        self._cb_dirty: set[int] = set()
        self._last = np.full((L, E), -AGE_MAX, dtype=np.int64)
        self._visits = np.zeros(L, dtype=np.int64)
        self._resident = np.zeros((L, E), dtype=bool)
        self._in_batch = np.zeros((L, E), dtype=bool)
        self._pending = np.full((L, E), np.nan)
        self._wait_sum = np.zeros(L)
        self._wait_n = np.zeros(L)
        self._hazard = HazardTable()
        self._coact = CoActivation(L, E)
        self._lift = ContextLift(L, E)
        self._lam: F64 | None = None
        """The hazard table's per-visit use probabilities, as of the last rebuild."""
        self._lift_observed: list[tuple[F64, npt.NDArray[np.int64], F64, npt.NDArray[np.bool_]]] = []
        """Per token visit: the stale prediction (binned in ``_learn``), ages, counts, routed."""
        self._pins = _history.Pins(L, E)
        self._batch_pos = -1
        self._batch: list[int] = []
        self._batch_set: set[int] = set()
        self._prev: tuple[int, list[int]] | None = None
        self._prev_routed = False
        self._proposed: set[tuple[int, int]] = set()
        self._expected: dict[int, F64] = {}
        """Layer position -> the engine's estimate for its next batch (``on_expect``)."""
        """Experts proposed for the next layer and not requested since: an insert of one is a
        prefetch, guarded until its visit."""
        self._horizon = float("nan")
        self._num = np.zeros((L, E))
        self._ext = np.zeros((L, E))
        self._cost = np.ones(L)
        self._arange_L = np.arange(L)
        self._next_key: tuple[int, int] | None = None
        self._version = 0
        self._order_head: list[tuple[float, int]] = []
        self._order_rest: tuple[F64, npt.NDArray[np.int64], npt.NDArray[np.intp]] | None = None
        """The ranking's values and experts, and the positions past the sorted head."""
        self._small_pairs: list[tuple[float, int]] = []
        self._small_key: tuple[int, tuple[int, int] | None] | None = None
        self._order_version = -1
        self._order_cursor = -1
        """The cursor the order was ranked for (distances count from it): an order ranked
        between batches (``prepare``, or a prefetch's victims) is stale once the next batch
        moves the cursor, even though no density changed."""
        self._stamp = 0
        self._order_stamp = np.zeros(L * E, dtype=np.int64)
        """``_stamp`` where an expert was in the last ranking (cheaper than a clear and a set)."""
        self._pending_of: dict[int, float] = {}
        """The experts carrying a pending density (flat index: density), mirroring
        ``_pending``: the ranking writes these few instead of a ``where`` over all."""
        self._row_of = np.repeat(np.arange(L), E)
        self._row_bounds = np.array([[p * E, (p + 1) * E] for p in range(L)], dtype=np.int64)
        self._dist = np.array([self._distance(c) for c in range(L)])
        """``_distance(cursor)`` for every cursor."""
        self._num_flat, self._ext_flat, self._size_flat = self._num.ravel(), self._ext.ravel(), self._size.ravel()
        self._deferred: tuple[int, int] | None = None
        """A ``prepare`` not done yet, ``(version, cursor)``: done by :meth:`_settle` before
        the first call that reads the order or changes what it ranks (exactly as if done
        when asked), dropped unread once the version moves on."""
        self._held = 0
        """Bytes of the resident experts (as inserted): ``prepare`` defers its sort while
        the next batch's misses fit beside them."""
        self._held_of: dict[int, int] = {}
        self._rows_all = False
        self._rows_dirty: set[int] = set()
        """Layer positions (or, ``_rows_all``, every one) whose class terms (``_num``,
        ``_ext``) are out of date: computed by :meth:`_fresh_rows` when first read."""
        self._appended: list[int] = []
        self._next_value: F64 | None = None
        self._batches_since_rebuild = 0
        self._observed: list[tuple[npt.NDArray[np.int64], F64, npt.NDArray[np.bool_]]] = []
        self._paired: list[tuple[int, list[int], list[int]]] = []
        self._paired_rows: list[tuple[int, npt.NDArray[np.int64], npt.NDArray[np.int64]]] = []
        self._prediction: tuple[int, list[int], F64 | None] | None = None
        """The last :meth:`_predict_next` (cursor, the picks list it read, the result, never
        written to): ``end_batch`` proposes from it and the next walk's densities read it
        again.  Dropped by whatever changes its inputs: a batch's end (counts, the picks),
        :meth:`_learn` (the co-activation), a loaded history."""
        self._rows: tuple[int, npt.NDArray[np.int64]] | None = None
        """The last multi-token routing observed (layer position, rows), to pair with the
        next layer's rows of the same tokens."""
        self._routed_pos = -1
        """Position whose coming (or current) batch was learned row by row from the router's
        output: its batch pairs nothing more at its end (no token counted twice)."""
        self._rebuild()

    # ------------------------------------------------------------------ the Policy protocol

    def on_request(self, key: Key, nbytes: int, hit: bool) -> None:
        where = self._where.get(key)
        pos, e = where if where is not None else self._locate(key)
        if pos != self._batch_pos or e in self._batch_set:
            self._end_batch()
            self._batch_pos = pos
        self._batch.append(e)
        self._batch_set.add(e)
        self._in_batch[pos, e] = True
        if self._proposed:
            self._proposed.discard((pos, e))
        if self._size[pos, e] != nbytes:
            self._settle()  # a deferred ranking reads the size it was asked with
            self._size[pos, e] = nbytes

    def admit(self, key: Key, nbytes: int, victims: Sequence[Key] = ()) -> bool:
        return True

    def admit_prefetch(self, key: Key, nbytes: int, victims: Sequence[Key] = ()) -> bool:
        """The eviction guard: load ``key`` ahead of demand only if its density (with its
        predicted chance of being routed at the next visit) beats that of every expert it
        would displace.  Measured alternative, dropped: comparing hit probabilities within
        the horizon instead of densities lost 0.5-2.9 points at 0.5-2 TD (docs/tried-and-dropped.md)."""
        if not victims:
            return True
        self._refresh()
        worst = max(self._value(*self._locate(v)) for v in victims)
        return self._value(*self._locate(key)) > worst

    def on_insert(self, key: Key, nbytes: int) -> None:
        self._settle()
        pos, e = self._locate(key)
        self._resident[pos, e] = True
        self._size[pos, e] = nbytes
        flat = pos * self._E + e
        if (pos, e) in self._proposed:  # a speculative load: guarded until its visit passes
            self._refresh()
            value = self._value(pos, e)
            self._pending[pos, e] = value
            if value == value:
                self._pending_of[flat] = value
            else:
                self._pending_of.pop(flat, None)
        self._held += nbytes - self._held_of.get(flat, 0)
        self._held_of[flat] = nbytes
        if self._order_stamp[flat] == self._stamp:
            self._version += 1  # back in after an eviction: its old rank is stale
        else:
            self._appended.append(flat)  # this batch's miss, or a prefetch (merged from the small list)

    def on_remove(self, key: Key) -> None:
        self._settle()
        pos, e = self._locate(key)
        flat = pos * self._E + e
        self._held -= self._held_of.pop(flat, 0)
        self._resident[pos, e] = False
        self._pending[pos, e] = np.nan
        self._pending_of.pop(flat, None)
        age = max(1, int(self._visits[pos] - self._last[pos, e]))
        self._horizon += (min(age, AGE_MAX) - self._horizon) / HORIZON_MEMORY

    def victims(self) -> Iterator[Key]:
        """Resident experts, lowest density first; the batch in progress (and, while a decode
        batch is filling, the rest of its layer) last.

        Cost: the order of every layer but the next is sorted once per batch (densities
        change when the cursor moves) and kept; the next layer's few resident experts, whose
        densities change with each pick, are sorted on each call and merged in.  Experts
        evicted since are skipped; experts inserted since (this batch's misses, prefetches
        of the next layer) come from the small list or at the end.
        """
        self._settle()
        self._refresh()
        if self._order_version != self._version or self._order_cursor != self._cursor():
            self._sort_victims(self._cursor())
        E, layers = self._E, self._layers
        resident = self._resident.ravel()
        small = self._next_layer_order()
        filling = 0 < len(self._batch) < self._k
        in_batch = self._in_batch.ravel()
        pinned = self._pins.pinned.ravel()
        batch_pos = self._batch_pos
        seen: set[int] = set()
        tail: list[int] = []
        ranked = itertools.chain((i for _, i in heapq.merge(self._ranked_others(), small)),
                                 self._appended)
        for i in ranked:
            if i in seen or not resident[i]:
                continue
            seen.add(i)
            if in_batch[i] or (filling and i // E == batch_pos) or pinned[i]:
                tail.append(i)  # the batch in progress (and, while it fills, its layer), pins: last
                continue
            yield (layers[i // E], i % E)
        for i in tail:
            if resident[i]:
                yield (layers[i // E], i % E)

    def _next_layer_order(self) -> list[tuple[float, int]]:
        """The next layer's resident experts as (density, flat index), ascending; cached
        until the prediction or the other layers' order changes.  A prefetch that comes in
        meanwhile is walked after the cached ones (``_appended``): it beat what it displaced,
        so it ranks high anyway."""
        key = (self._order_version, self._next_key)
        if key != self._small_key:
            self._rank_next_layer(self._cursor(), self._next_value, key)
        return self._small_pairs

    def _rank_next_layer(self, cursor: int, predicted: F64 | None,
                         key: tuple[int, tuple[int, int] | None]) -> None:
        """Rank the resident experts of the layer after ``cursor`` (by ``predicted`` density,
        else by class) for :meth:`_next_layer_order`, cached under ``key``."""
        E = self._E
        nxt = (cursor + 1) % self._L
        self._fresh_rows()
        if predicted is not None:
            vals = predicted
        else:
            vals = self._num[nxt] * self._cost[nxt] / ((1.0 + self._ext[nxt]) * self._size[nxt])
        pend = self._pending[nxt]
        vals = np.where(np.isnan(pend), vals, pend)
        idx = np.flatnonzero(self._resident[nxt])
        order = idx[np.argsort(vals[idx], kind="stable")]
        self._small_pairs = list(zip(vals[order].tolist(), (order + nxt * E).tolist(), strict=True))
        self._small_key = key

    def prepare(self) -> None:
        """Between batches (the store calls it while the engine computes): rank the victims
        for the coming batch, the next layer's, so that its first miss does not pay for the
        sort on the engine's critical path.  The layer visited next is the cursor's successor
        (every token visits the layers in order); if another comes, ``victims`` re-ranks.

        While the coming batch's ``k`` misses fit beside the held bytes it will likely evict
        nothing, so the ranking is deferred (:meth:`_settle` does it before the first walk
        or change of what it ranks, on the same state, so the order is the one ranking now
        would give): an all-hit batch then pays nothing for it (``iosched hitpath``: the
        batch-end work fell from ~190 to ~40 us, docs/tried-and-dropped.md, "Cutting the
        default's CPU")."""
        if self._shape is None or self._batch:
            return
        cursor = (self._cursor() + 1) % self._L
        if (self._budget is not None and self._held
                + self._k * self._shape.expert_bytes[self._layers[cursor]] <= self._budget):
            # the coming batch's misses fit beside what is held: it will likely evict
            # nothing, so rank only if something asks (exactly what ranking now would give)
            self._deferred = (self._version, cursor)
            return
        self._deferred = None
        self._prepare(cursor)

    def _settle(self) -> None:
        """Do the deferred ``prepare`` (if any, and still current) before anything reads the
        order or changes what it ranks: the resident set, a size, a pending density.  Every
        other change bumps the version, after which the deferred ranking is never read."""
        deferred = self._deferred
        if deferred is not None:
            self._deferred = None
            if deferred[0] == self._version:
                self._prepare(deferred[1])

    def _prepare(self, cursor: int) -> None:
        if self._order_version != self._version or self._order_cursor != cursor:
            self._sort_victims(cursor)
        # and the layer after it, as victims() will see it once the batch has begun: while a
        # batch is in progress nothing is predicted (see _refresh), so it ranks by class
        key = (self._order_version, (cursor, -1))
        if key != self._small_key:
            self._rank_next_layer(cursor, None, key)

    def _sort_victims(self, cursor: int) -> None:
        """Rank the resident experts of every layer but the next by density (see victims):
        the ``HEAD`` lowest sorted now, the rest only if a walk gets past them (rare: a miss
        needs one victim, a batch's prefetches a few), since a full sort of thousands of
        experts per batch cost more than the rest of the policy together (measured in the
        demo: 150 us per sort, 35 sorts per token).

        Runs twice per batch when the budget is smaller than the working set (the prefetch
        guard's walk, then ``prepare``'s), so it is written for few numpy calls (~1 us each,
        on a few hundred experts): the next layer cut out of the sorted resident indices by
        two bisections, distances from a table per cursor, pending densities written over
        the few experts that carry one, the rest's values kept unsliced until a walk needs
        them.  The array ``argpartition`` sees is the same as ever (resident experts in flat
        order), so its tie order, and every decision, is unchanged."""
        E = self._E
        nxt = (cursor + 1) % self._L
        self._fresh_rows()
        idx = np.flatnonzero(self._resident)
        lo, hi = idx.searchsorted(self._row_bounds[nxt]).tolist()
        if lo < hi:
            idx = np.concatenate((idx[:lo], idx[hi:]))
        rows = self._row_of[idx]
        vals = (self._num_flat[idx] * self._cost[rows]
                / ((self._dist[cursor][rows] + self._ext_flat[idx]) * self._size_flat[idx]))
        if self._pending_of:
            flats = [f for f in self._pending_of if f // E != nxt]
            if flats:
                vals[idx.searchsorted(flats)] = [self._pending_of[f] for f in flats]
        n = idx.size
        head = min(n, 4 * self._k + 8)
        if head < n:
            part = np.argpartition(vals, head - 1)
            first = part[:head]
            first = first[vals[first].argsort(kind="stable")]
            self._order_rest = (vals, idx, part[head:])
        else:
            first = vals.argsort(kind="stable")
            self._order_rest = None
        self._order_head = list(zip(vals[first].tolist(), idx[first].tolist(), strict=True))
        self._stamp += 1
        self._order_stamp[idx] = self._stamp
        self._appended = []
        self._order_version = self._version
        self._order_cursor = cursor

    def _ranked_others(self) -> Iterator[tuple[float, int]]:
        """The sorted head, then (sorted on first need) the rest: every value in the rest is
        at least the head's largest, so the chain stays in order."""
        yield from self._order_head
        if self._order_rest is not None:
            vals, idx, rest = self._order_rest
            vals, idx = vals[rest], idx[rest]
            order = np.argsort(vals, kind="stable")
            yield from zip(vals[order].tolist(), idx[order].tolist(), strict=True)

    def on_wait(self, key: Key, seconds: float) -> None:
        pos, _ = self._locate(key)
        if math.isfinite(seconds) and seconds >= 0:
            self._wait_sum[pos] += seconds
            self._wait_n[pos] += 1  # folded into the costs once per token cycle (_rebuild)

    def end_batch(self) -> list[Key]:
        """The batch of requests just made (one layer of one token) is complete: learn from
        it, and return the next layer's experts worth loading ahead, best first."""
        if self._shape is None or self._batch_pos < 0:
            return []
        nxt = (self._batch_pos + 1) % self._L
        self._end_batch()
        scores = self._predict_next()  # None for a prefill batch of many tokens, among others
        if scores is None:
            return []
        self._lift.predict(nxt, scores)
        self._update_rows(nxt)
        out: list[Key] = []
        chance = self._k / self._E  # an expert drawn at random: a guess no better is not made
        score, resident, width = scores.tolist(), self._resident[nxt], self._width
        for j in np.argsort(-scores, kind="stable").tolist():
            if score[j] <= chance or len(out) >= width:
                break
            if not resident[j]:
                self._proposed.add((nxt, j))
                out.append((self._layers[nxt], j))
        return out

    def on_expect(self, layer: int, probabilities: npt.NDArray[np.float64]) -> None:
        """The engine's estimate for ``layer``'s next batch (``ExpertStore.expect``): it takes
        the place of the co-activation prediction for that layer until its batch has passed,
        in the densities the guard and the victim order compare and in the proposals (an
        engine that applies the next layer's router to the hidden state predicts better than
        co-activation: Colibri, 71.6-73.6 % recall of the top-8)."""
        if self._shape is None:
            return
        pos = self._pos.get(layer)
        if pos is None or probabilities.shape != (self._E,):
            return
        self._expected[pos] = probabilities
        # what the store loads on it is guarded until its visit, as the policy's own proposals
        chance = self._k / self._E
        self._proposed.update((pos, int(e)) for e in np.flatnonzero(probabilities > chance).tolist())
        self._next_key = None  # the next layer's cached densities may be stale now
        self._version += 1

    def on_routing(self, layer: int, rows: npt.NDArray[np.int64]) -> None:
        """The router's output for a batch of several tokens at ``layer``: row ``t`` holds the
        experts token ``t`` routed (in slot order, padded with -1).  Pairs each row with the
        same token's row at the previous layer, when that layer's routing came just before
        with as many rows (never the first layer's with the last's: those are other tokens,
        of a previous prompt or chunk); learned with the cycle's other observations (``_learn``).

        Why: a batch of many tokens (a prompt) reaches the policy as the union of its experts,
        which says nothing about which experts go together; its rows do, and they are all the
        co-activation evidence there is before the first decode token.  Measured with the
        bundled traces' prompts (docs/tried-and-dropped.md): 8 TD decode hits
        93.7 -> 94.9 (qwen) and 92.6 -> 93.5 (gemma).  A single row is ignored: its batch, at
        most ``k`` keys, is paired at its end already."""
        if self._shape is None or rows.ndim != 2 or rows.shape[0] <= 1:
            return
        pos = self._pos.get(layer)
        if pos is None:
            raise StoreError(f"policy 'moe': routing for layer {layer}, not a MoE layer of this "
                             f"model (layers {self._layers[0]}..{self._layers[-1]})")
        if rows.size and (int(rows.max()) >= self._E or int(rows.min()) < -1):
            raise StoreError(f"policy 'moe': routing for layer {layer} names an expert outside "
                             f"0..{self._E - 1}")
        prev = self._rows
        # the layer before, of the same tokens: never across the wrap (the first layer's rows
        # follow the last layer's of *other* tokens, a previous prompt or chunk)
        if pos > 0 and prev is not None and prev[0] == pos - 1 and prev[1].shape[0] == rows.shape[0]:
            self._paired_rows.append((prev[0], prev[1], rows))
        self._rows = (pos, rows)
        self._routed_pos = pos

    # ------------------------------------------------------------------ usage history

    @property
    def pinned_experts(self) -> int:
        return int(self._pins.pinned.sum()) if self._shape is not None else 0

    def history(self) -> dict[str, npt.NDArray[np.generic]]:
        """What this run learned (with any history loaded before), for :func:`_history.save`."""
        if self._shape is None:
            raise StoreError("policy 'moe' has no shape, hence no history")
        self._fresh_rows()  # before _learn changes the lift's calibration under them
        self._learn()
        coact = self._coact.counts
        return {
            "layers": np.array(self._layers, dtype=np.int64), "n_expert": np.array(self._E),
            "k": np.array(self._k), "count": self._count, "visits": self._pins.visits + self._visits,
            "hazard_used": self._hazard.used, "hazard_exposed": self._hazard.exposed,
            "pairs": coact if coact is not None else np.zeros((0,), dtype=np.float32),
            "picks": self._coact.picks,
        }

    def load_history(self, arrays: Mapping[str, npt.NDArray[np.generic]], source: str) -> None:
        """Seed the policy with a saved history, decayed by half (``residency/_history.py``);
        a ``StoreError`` naming ``source`` and the field when it does not fit this model."""
        if self._shape is None:
            raise StoreError("policy 'moe' needs its shape before a history")
        L, E = self._L, self._E
        _history.require_fits(arrays, source, {
            "layers": (L,), "count": (L, E), "visits": (L,), "hazard_used": self._hazard.used.shape,
            "hazard_exposed": self._hazard.exposed.shape, "picks": (L, E)}, self._layers, E, self._k)
        d = _history.HISTORY_DECAY
        self._prediction = None
        count = np.asarray(arrays["count"], dtype=np.float64)
        self._count += d * count
        self._cb, self._cb_dirty = count_bin(self._count), set()
        self._pins.visits += d * np.asarray(arrays["visits"], dtype=np.float64)
        self._hazard.used += d * np.asarray(arrays["hazard_used"], dtype=np.float64)
        self._hazard.exposed += d * np.asarray(arrays["hazard_exposed"], dtype=np.float64)
        self._coact.seed(arrays, d)
        self._rebuild()

    def hand_over(self) -> tuple[list[tuple[Key, int]], list[int], CoActivation, F64, dict[Key, int]]:
        """What a successor policy needs to go on where this one stops (``residency/alternatives/earned.py``
        switches to ``coact``): the resident experts, least recently routed first (ties in
        flat order; a prefetch never routed: first), each with its layer's visit count at
        that routing; each layer position's visits so far; the co-activation table (shared,
        not copied); each layer's pick counts plus one pseudo-pick, ``float [L, E]``; and
        each resident expert's bytes.
        The batch in progress, if any, is closed first: its experts count as routed.  After
        this the policy must not be fed again."""
        if self._shape is None:
            raise StoreError("policy 'moe' has no shape: nothing to hand over")
        self._end_batch()
        self._learn()  # the cycle's deferred pairs into the shared table
        idx = np.flatnonzero(self._resident)
        rows = self._row_of[idx]
        last = self._last.ravel()[idx]
        order = np.argsort(last * self._L + rows, kind="stable")
        E, layers = self._E, self._layers
        flats = idx[order].tolist()
        keys: list[Key] = [(layers[i // E], i % E) for i in flats]
        resident: list[tuple[Key, int]] = [(key, int(v)) for key, v in zip(keys, last[order].tolist(), strict=True)]
        sizes: dict[Key, int] = {key: int(self._size_flat[i]) for key, i in zip(keys, flats, strict=True)}
        visits: list[int] = self._visits.tolist()
        return resident, visits, self._coact, self._count + 1.0, sizes

    def check(self, keys: set[Key]) -> None:
        require(self._shape is not None or not keys, "unshaped moe policy holds keys")
        if self._shape is None:
            return
        mine = {(self._layers[i // self._E], i % self._E) for i in np.flatnonzero(self._resident).tolist()}
        require(mine == keys, "moe policy's resident mask does not track the table")
        require(np.all(np.isnan(self._pending[~self._resident])), "pending density on a non-resident expert")
        require(self._pending_of == {int(f): float(self._pending.ravel()[f])
                                     for f in np.flatnonzero(~np.isnan(self._pending))},
                "pending densities out of step with their dict")
        fresh = np.ones(self._L, dtype=bool)
        fresh[sorted(self._cb_dirty)] = False
        require(np.array_equal(self._cb[fresh], count_bin(self._count[fresh])), "count bins out of step")
        require(len(set(self._batch)) == len(self._batch), "a batch holds an expert twice")
        require(int(self._in_batch.sum()) == len(self._batch), "batch mask out of step")
        require(np.all(self._visits[:, None] >= self._last), "negative age")
        require(np.all(self._hazard.used <= self._hazard.exposed + 0.01), "more uses than exposures")
        self._lift.check()

    # ------------------------------------------------------------------ internals

    def _locate(self, key: Key) -> tuple[int, int]:
        """``(layer position, expert)`` of a key; a dict hit on the hot path."""
        got = self._where.get(key) if self._shape is not None else None
        return got if got is not None else self._locate_new(key)

    def _locate_new(self, key: Key) -> tuple[int, int]:
        if self._shape is None:
            raise StoreError("policy 'moe' needs the model's shape before its first request: "
                             "call set_shape(ModelShape(...)) (the store and iosched replay do)")
        if not (isinstance(key, tuple) and len(key) == 2 and key[0] in self._pos):
            raise StoreError(f"policy 'moe': key {key!r} is not a (layer, expert) of this model "
                             f"(layers {self._layers[0]}..{self._layers[-1]})")
        layer, expert = key
        if isinstance(expert, bool) or not isinstance(expert, int) or not 0 <= expert < self._E:
            raise StoreError(f"policy 'moe': key {key!r}: expert out of range 0..{self._E - 1}")
        where = (self._pos[layer], expert)
        self._where[key] = where
        return where

    def _end_batch(self) -> None:
        """Learn from the batch in progress (if any) and start none."""
        pos, picks = self._batch_pos, self._batch
        self._prediction = None
        if pos < 0 or not picks:
            self._batch_pos, self._batch = -1, []
            self._batch_set.clear()
            return
        # Learning is deferred to the token cycle's end (_rebuild), where one bincount takes a
        # whole cycle's observations: the density tables it feeds are rebuilt only there, so
        # the outcome is the same and a batch costs a copy instead of two bincounts.
        # The lift bins too (one lift_bin over the cycle's stale predictions, not one per batch).
        visits = int(self._visits[pos])
        last, count = self._last[pos], self._count[pos]
        ages, counts = visits - last, count.copy()
        routed = self._in_batch[pos].copy()
        self._observed.append((ages, counts, routed))
        stale = self._lift.stale_probs(pos) if len(picks) <= self._k else None
        if stale is not None:  # a token's visit: calibrates the lift (in _learn)
            self._lift_observed.append((stale, ages, counts, routed))
        self._visits[pos] = visits + 1
        chosen = np.array(picks)
        count[chosen] += 1.0  # distinct picks (a repeat ends the batch): as a fancy +=
        self._cb_dirty.add(pos)
        last[chosen] = visits + 1
        prev = self._prev
        from_rows = self._routed_pos == pos  # learned row by row (on_routing): not again here
        if from_rows:
            self._routed_pos = -1
        elif (prev is not None and prev[0] == (pos - 1) % self._L and not self._prev_routed
                and len(prev[1]) <= self._k and len(picks) <= self._k):
            self._paired.append((prev[0], prev[1], picks))
        # (picks is the batch's own list, never appended to again: a new batch gets a new one)
        self._prev, self._prev_routed = (pos, picks), from_rows
        self._in_batch[pos] = False
        self._pending[pos] = np.nan  # the visit prefetches were made for has passed
        self._expected.pop(pos, None)  # and so has the one the engine's estimate was for
        if self._pending_of:
            E = self._E
            self._pending_of = {f: v for f, v in self._pending_of.items() if f // E != pos}
        if self._proposed:
            self._proposed = {(p, j) for (p, j) in self._proposed if p != pos}
        self._batches_since_rebuild += 1
        if self._batches_since_rebuild >= self._L:  # once per token cycle
            self._rebuild()
        else:
            self._update_rows(pos)  # only this layer's ages and counts changed
        self._batch_pos, self._batch = pos, []
        self._batch_set.clear()
        self._version += 1  # the cursor moved: every layer's distance changed

    def _rebuild(self) -> None:
        """New density tables from the hazard table (once per token cycle), and every
        expert's class terms with them."""
        if not math.isfinite(self._horizon):
            td = self._shape.token_cycle_bytes if self._shape is not None else 0
            self._horizon = max(1.0, (self._budget or 0) / td) if td else 1.0
        self._learn()
        self._phit, self._extra = self._hazard.density(round(self._horizon))
        self._lam = self._hazard.hazard()
        self._batches_since_rebuild = 0
        self._set_cost()
        self._pins.update(self._count, self._visits, self._size, self._budget)
        self._update_rows(slice(None))

    def _learn(self) -> None:
        """Fold the cycle's deferred observations into the hazard and co-activation tables."""
        self._prediction = None
        if self._observed:
            ages, counts, routed = zip(*self._observed, strict=True)
            self._hazard.observe(np.concatenate(ages), np.concatenate(counts), np.concatenate(routed))
            self._observed = []
        if self._paired:
            self._coact.learn_many(self._paired)
            self._paired = []
        if self._lift_observed and self._lam is not None:
            stale, ages, counts, routed = zip(*self._lift_observed, strict=True)
            expected = self._lam[age_bin(np.concatenate(ages)), count_bin(np.concatenate(counts))]
            bins = lift_bin(np.stack(stale)).ravel()  # row by row, as stale_bins would
            self._lift.observe(bins, expected, np.concatenate(routed))
        self._lift_observed = []
        for pos, rows, next_rows in self._paired_rows:
            self._coact.learn_rows(pos, rows, next_rows)
        self._paired_rows = []

    def _update_rows(self, rows: int | slice) -> None:
        """The class terms of the experts of ``rows`` (one position, or ``slice(None)``: all)
        are out of date: marked here, computed by :meth:`_fresh_rows` when first read.

        Why lazily: a batch changes its own layer's terms and the next layer's (the lift),
        and most batches end with nobody reading either (all hits: nothing is ranked).  Exact:
        the terms are a function of the ages, counts, lift bins and density tables, and
        every change to those marks the rows it touches (``_learn`` from :meth:`history`
        first computes what is marked), so a row computed late equals the row computed at
        the mark."""
        if isinstance(rows, slice):
            self._rows_all = True
            self._rows_dirty.clear()
        elif not self._rows_all:
            self._rows_dirty.add(rows)
        self._version += 1

    def _fresh_rows(self) -> None:
        """Compute the class terms marked stale (see :meth:`_update_rows`): ``_num`` =
        P(hit within the horizon), ``_ext`` = L x expected idle visits; the density divides
        them by distance and size.  Element by element, so a row's terms are the same
        whether computed alone or with others."""
        rows: int | slice | npt.NDArray[np.int64]
        if self._rows_all:
            rows = slice(None)
        elif len(self._rows_dirty) == 1:
            rows = next(iter(self._rows_dirty))
        elif self._rows_dirty:
            rows = np.array(sorted(self._rows_dirty), dtype=np.int64)
        else:
            return
        self._rows_all = False
        self._rows_dirty.clear()
        if self._cb_dirty:
            stale = sorted(self._cb_dirty)
            self._cb_dirty.clear()
            self._cb[stale] = count_bin(self._count[stale])
        age = np.minimum(self._visits[rows, None] - self._last[rows], AGE_MAX - 1)
        cb = self._cb[rows]
        self._num[rows] = np.minimum(1.0, self._phit[age, cb] * self._lift.factor(rows))
        self._ext[rows] = self._L * self._extra[age, cb]

    def _set_cost(self) -> None:
        """Per-layer miss cost relative to the mean felt wait (1 everywhere until measured);
        a layer with few measurements is pulled toward the mean by one pseudo-miss."""
        n = float(self._wait_n.sum())
        mean = float(self._wait_sum.sum()) / n if n else 0.0
        if mean > 0.0:
            self._cost = (self._wait_sum + mean) / (self._wait_n + 1.0) / mean
        self._version += 1

    def _distance(self, cursor: int) -> F64:
        """Layer steps from ``cursor`` to each layer's next visit: 1 for the next layer, L for
        the cursor's own."""
        out: F64 = ((self._arange_L - cursor - 1) % self._L + 1).astype(np.float64)
        return out

    def _refresh(self) -> None:
        """Bring the next layer's densities up to date: by its predicted probability of
        being routed at its coming visit, given this token's picks so far (once per pick)."""
        # Only a complete batch predicts (during a batch the next layer ranks by class, one
        # step away: measured, predicting from partial picks changed no eviction's outcome
        # and cost a prediction per pick).
        nxt_key = (self._cursor(), -1 if self._batch else len(self._picks()))
        if self._next_key != nxt_key:
            self._next_key = nxt_key
            self._next_value = self._predicted_values()

    def _value(self, pos: int, e: int) -> float:
        """Density of one expert (after :meth:`_refresh`): a prefetched one not yet used keeps
        the density it was loaded with; the next layer's by prediction; else by class."""
        pending = float(self._pending[pos, e])
        if pending == pending:
            return pending
        if self._rows_all or self._rows_dirty:
            self._fresh_rows()
        cur = self._cursor()
        if self._next_value is not None and pos == (cur + 1) % self._L:
            return float(self._next_value[e])
        d = (pos - cur - 1) % self._L + 1
        return float(self._num[pos, e] * self._cost[pos]
                     / ((d + self._ext[pos, e]) * self._size[pos, e]))

    def _cursor(self) -> int:
        """Position of the batch in progress, or of the last one when none is."""
        if self._batch_pos >= 0:
            return self._batch_pos
        return self._prev[0] if self._prev is not None else self._L - 1

    def _picks(self) -> list[int]:
        """This token's picks at the cursor: the batch in progress, or the one just ended."""
        if self._batch:
            return self._batch
        if self._prev is not None and self._prev[0] == self._cursor():
            return self._prev[1]
        return []

    def _predict_next(self) -> F64 | None:
        """Probability of each expert of the next layer being routed at its coming visit,
        from this token's picks at the cursor; ``None`` for a prefill-like batch, a batch in
        progress, or before anything was learned."""
        if self._batch:
            return None
        picks = self._picks()
        if not picks or len(picks) > self._k:
            return None
        cursor = self._cursor()
        nxt = (cursor + 1) % self._L
        expected = self._expected.get(nxt)
        if expected is not None:  # the engine's own lookahead (it sees the hidden state)
            return expected
        cached = self._prediction
        if cached is not None and cached[0] == cursor and cached[1] is picks:
            return cached[2]
        counts = self._count[nxt] + 1.0  # one pseudo-pick each: an unseen expert is possible
        out = self._coact.predict(cursor, picks, self._k, counts / np.add.reduce(counts))
        self._prediction = (cursor, picks, out)
        return out

    def _predicted_values(self) -> F64 | None:
        """Density of the next layer's experts: routed at the next visit (one layer step
        away) with the predicted probability, else as any expert of their class."""
        pi = self._predict_next()
        if pi is None:
            return None
        nxt = (self._cursor() + 1) % self._L
        self._fresh_rows()
        phit = pi + (1.0 - pi) * self._num[nxt]
        out: F64 = phit * self._cost[nxt] / ((1.0 + (1.0 - pi) * self._ext[nxt]) * self._size[nxt])
        return out
