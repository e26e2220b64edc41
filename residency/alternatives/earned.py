"""``earned``: ``moe`` while it earns its cost, then ``coact``.

Why: the objective is the engine's tokens per second. ``moe`` (``residency/alternatives/moe.py``) makes
better decisions than LRU: more hits, prefetches that land in the drive's idle time. But its
Python runs on the engine's critical path. On a 2-core VM, with real numpy
compute and 576 KiB experts, it cost more than its extra hits saved in every cell measured:
0.58-0.88x ``lru``'s tokens/s (docs/benchmarks.md, "Real reads and real compute"). On the
critical-path replay with compute elsewhere it reached 1.00-1.14x (docs/residency.md). Which
of the two an engine sees depends on its machine, its compute and its drive. So this policy
does not guess: it measures both sides, online, and keeps ``moe`` only while it pays.

**What it measures**, on decode batches (at most ``k`` keys of one layer; a prompt's batches
are not counted):

- *Cost*: the time spent inside ``moe``'s hooks, on the store's clock (``set_clock``); the
  shadow's own bookkeeping (an ordered-dict move per request) is counted with it.
  That is real time in a store. In the critical-path replay it is virtual time, so under
  ``--cpu free`` it is zero there.
- *Gain*: the misses an LRU of the same budget would have had, less the requests that
  waited, priced at the felt wait per waiting request. The LRU is a *shadow*: keys and sizes
  only, run on the same requests. A batch's felt wait is the longest wait of its requests
  (``on_wait``; its misses load in parallel, so their waits overlap).

Once a token (:data:`WINDOW_TOKENS`), from the :data:`MIN_WINDOWS`-th on, the sums since the
first counted batch are compared. If the saving does not exceed the cost, the policy switches
for good to ``coact`` (``residency/alternatives/coact.py``): LRU's eviction at LRU's cost per request, plus
a next-layer prefetch that never displaces an expert its layer's last visit routed. It goes on
from ``moe``'s state (``MoEPolicy.hand_over``): the LRU order from ``moe``'s last-use stamps of
what is resident, its visit counts, its co-activation table. ``cost_verdict`` (in
``stats()["policy_verdict"]``) says when the switch happened and on what numbers.

Why ``coact`` and not plain ``lru`` after the switch: on the critical path (compute elsewhere,
docs/residency.md, "`coact`") ``coact`` was never below ``lru`` by more than the CPU
measurement's noise and gained up to a few percent where two or more token cycles are held,
and it costs a few microseconds a request.

The cost counts all of ``moe``'s hook time, the batch-end work that runs while the engine
computes included. That is right where the engine's compute shares the cores and the GIL
with the store (with compute in a thread on the 2-core VM, ``moe`` doubled the compute's
time), and too much where that work would have been free (a GPU engine): there the rule
errs toward ``coact``.

Why a one-way switch: after it, ``moe``'s state is no longer fed (its co-activation table is
``coact``'s now), so it could not be judged again without paying its cost again. An engine
whose conditions change opens a new store.

Without a clock (the hit-rate replay, ``iosched replay --simulate``) nothing is measured and
nothing switches: the policy is ``moe``, decision for decision.

Constants: :data:`WINDOW_TOKENS` is structural; :data:`MIN_WINDOWS` was measured (see it).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import ClassVar

import numpy as np
import numpy.typing as npt

from .._policy import (
    BatchAware,
    BudgetAware,
    Capability,
    CostAware,
    HistoryKeeper,
    Key,
    LookaheadAware,
    ModelShape,
    PrefetchGuard,
    RoutingAware,
    ShapeAware,
    WaitCostAware,
)
from .coact import CoactPolicy
from .moe import MoEPolicy

WINDOW_TOKENS = 1
"""Decode tokens (``L`` decode batches) per window: the balance is judged once a token."""

MIN_WINDOWS = 2
"""Windows (tokens) before the first judgement. Judged from the 2nd token it ran at 0.80-1.00x
``lru`` with real reads and 0.96-1.14x on the critical path; judged from the 3rd and 8th it
kept more of ``moe``'s wins on the critical path but ran ``moe`` for up to 8 tokens in the real
runs (docs/tried-and-dropped.md)."""


class EarnedPolicy(BudgetAware, ShapeAware, BatchAware, PrefetchGuard, WaitCostAware, RoutingAware,
                   HistoryKeeper, LookaheadAware, CostAware):
    name: ClassVar[str] = "earned"
    capabilities: ClassVar[Capability] = MoEPolicy.capabilities | Capability.COST

    def __init__(self, shape: ModelShape | None = None, prefetch_width: int | None = None) -> None:
        self._moe = MoEPolicy(None, prefetch_width)
        self._after: CoactPolicy | None = None
        """``coact``, once switched (``None``: ``moe`` decides)."""
        self._width = prefetch_width
        self._now: Callable[[], float] | None = None
        self._shape: ModelShape | None = None
        self._budget: int | None = None
        self._verdict: str | None = None
        self._shadow: OrderedDict[Key, int] = OrderedDict()
        self._shadow_bytes = 0
        self._batch_layer: object = None
        self._batch_keys: set[Key] = set()
        self._batch_shadow_misses = self._batch_misses = self._batch_waits = 0
        self._batch_missed: set[Key] = set()
        self._batch_joined = False
        self._batch_felt_s = self._cost_s = 0.0
        """The batch in progress: its shadow's misses and its own (requests that found their
        expert neither resident nor loading), its requests that waited (misses and joins),
        whether a request joined a load in flight (a prefetch not finished), its felt wait,
        and the time taken since the last batch ended."""
        self._batches = self._shadow_misses = self._misses = self._priced_misses = self._waits = 0
        self._felt_s = self._priced_felt_s = self._spent_s = 0.0
        """The decode batches counted so far, and their sums; *priced*: the batches with a miss
        and no join, whose felt wait is their misses' alone."""
        self.windows = 0
        """Windows judged so far."""
        self._window = 0
        if shape is not None:
            self.set_shape(shape)

    # ------------------------------------------------------------------ set-up hooks

    def set_clock(self, now: Callable[[], float]) -> None:
        self._now = now

    @property
    def cost_verdict(self) -> str | None:
        """When and why ``moe`` was left, then what ``coact``'s trial of its prefetch found."""
        after = self._after.cost_verdict if self._after is not None else None
        return self._verdict if after is None else f"{self._verdict}; then {after}"

    @property
    def switched(self) -> bool:
        """Whether the policy decides as ``coact`` now."""
        return self._after is not None

    def set_budget(self, budget_bytes: int) -> None:
        self._budget = budget_bytes
        self._moe.set_budget(budget_bytes)
        self._trim_shadow()

    def set_shape(self, shape: ModelShape) -> None:
        self._moe.set_shape(shape)
        self._shape = shape
        self._window = WINDOW_TOKENS * len(shape.layers)

    # ------------------------------------------------------------------ the Policy protocol

    def on_request(self, key: Key, nbytes: int, hit: bool) -> None:
        after = self._after
        if after is not None:
            after.on_request(key, nbytes, hit)
            return
        now = self._now
        if now is None:
            self._moe.on_request(key, nbytes, hit)
            return
        t0 = now()
        layer = key[0] if isinstance(key, tuple) and key else None
        if layer != self._batch_layer or key in self._batch_keys:
            self._batch_ended()
            if self._after is not None:  # judged at that batch's end: this request is coact's
                self._after.on_request(key, nbytes, hit)
                return
            self._batch_layer = layer
        self._batch_keys.add(key)
        self._moe.on_request(key, nbytes, hit)
        if not hit:
            self._batch_misses += 1
            self._batch_missed.add(key)
        shadow = self._shadow
        if key in shadow:
            shadow.move_to_end(key)
        else:
            self._batch_shadow_misses += 1
            shadow[key] = nbytes
            self._shadow_bytes += nbytes
            self._trim_shadow()
        self._cost_s += now() - t0

    def _trim_shadow(self) -> None:
        budget = self._budget
        if budget is None:
            return
        shadow = self._shadow
        while self._shadow_bytes > budget and shadow:
            _, n = shadow.popitem(last=False)
            self._shadow_bytes -= n

    def _batch_ended(self) -> None:
        """The batch in progress ended (the next request is of another layer, or repeats a
        key): a decode batch (at most ``k`` keys) counts toward the window, with the cost and
        waits since the last batch ended; a prompt's batch does not (the engine's prefill is
        not what tokens/s measures, and its cold misses are alike for both policies)."""
        n = len(self._batch_keys)
        if n and self._shape is not None and n <= self._shape.experts_per_token:
            self._batches += 1
            self._shadow_misses += self._batch_shadow_misses
            self._misses += self._batch_misses
            self._waits += self._batch_waits
            self._felt_s += self._batch_felt_s
            if self._batch_misses and not self._batch_joined:
                self._priced_misses += self._batch_misses
                self._priced_felt_s += self._batch_felt_s
            self._spent_s += self._cost_s
            if self._batches % self._window == 0:
                self._judge()
        self._batch_keys = set()
        self._batch_shadow_misses = self._batch_misses = self._batch_waits = 0
        self._batch_missed = set()
        self._batch_joined = False
        self._batch_felt_s = self._cost_s = 0.0

    def _judge(self) -> None:
        """End of a window: compare the felt wait ``moe`` saved, since the first window,
        with the time it took."""
        self.windows += 1
        if self._priced_misses:
            per_miss = self._priced_felt_s / self._priced_misses
        elif self._misses:
            per_miss = self._felt_s / self._misses
        elif self._waits:
            # every request that waited joined a load in flight (moe's prefetches, late): the
            # shadow's misses are priced at those waits, or a moe whose prefetches all came
            # too late would never be judged (seen: 579 ms of felt wait a token, no miss)
            per_miss = self._felt_s / self._waits
        elif self._shadow_misses:
            return  # nothing missed that lru would have: a saving there is no price for yet
        else:
            per_miss = 0.0
        gain = self._shadow_misses * per_miss - self._felt_s
        cost = self._spent_s
        if self.windows >= MIN_WINDOWS and gain <= cost:
            self._verdict = (
                f"coact after {self._batches} decode batches: moe saved {gain * 1e3:.1f} ms of "
                f"felt wait ({self._misses} misses and {self._felt_s * 1e3:.1f} ms felt against an "
                f"lru shadow's {self._shadow_misses} misses at {per_miss * 1e3:.2f} ms each) and "
                f"took {cost * 1e3:.1f} ms")
            self._switch()

    def _switch(self) -> None:
        """From now on ``coact``, going on from ``moe``'s state: its LRU order over what is
        resident (oldest use first by ``moe``'s stamps), its visit counts, its co-activation
        table and pick counts (``MoEPolicy.hand_over``)."""
        after = CoactPolicy(self._width)
        if self._budget is not None:
            after.set_budget(self._budget)
        if self._now is not None:
            after.set_clock(self._now)
        if self._shape is not None:
            after.set_shape(self._shape)
            after.adopt(*self._moe.hand_over())
        self._after = after
        self._shadow.clear()

    def admit(self, key: Key, nbytes: int, victims: Sequence[Key] = ()) -> bool:
        return True

    def on_insert(self, key: Key, nbytes: int) -> None:
        if self._after is not None:
            self._after.on_insert(key, nbytes)
        else:
            self._timed(self._moe.on_insert, key, nbytes)

    def on_remove(self, key: Key) -> None:
        if self._after is not None:
            self._after.on_remove(key)
        else:
            self._timed(self._moe.on_remove, key)

    def victims(self) -> Iterator[Key]:
        if self._after is not None:
            return self._after.victims()
        if self._now is None:
            return self._moe.victims()
        return self._timed_victims(self._now)

    def _timed_victims(self, now: Callable[[], float]) -> Iterator[Key]:
        walk = self._moe.victims()
        while True:
            t0 = now()
            try:
                key = next(walk)
            except StopIteration:
                self._cost_s += now() - t0
                return
            self._cost_s += now() - t0
            yield key

    def _timed(self, hook: Callable[..., object], *args: object) -> object:
        now = self._now
        if now is None:
            return hook(*args)
        t0 = now()
        try:
            return hook(*args)
        finally:
            self._cost_s += now() - t0

    def check(self, keys: set[Key]) -> None:
        if self._after is not None:
            self._after.check(keys)
        else:
            self._moe.check(keys)

    # ------------------------------------------------------------------ the optional abilities

    def end_batch(self) -> list[Key] | None:
        if self._after is not None:
            return self._after.end_batch()
        now = self._now
        if now is None:
            return self._moe.end_batch()
        t0 = now()
        try:
            return self._moe.end_batch()
        finally:
            self._cost_s += now() - t0

    def prepare(self) -> None:
        if self._after is None:
            self._timed(self._moe.prepare)

    def admit_prefetch(self, key: Key, nbytes: int, victims: Sequence[Key] = ()) -> bool:
        if self._after is not None:
            return self._after.admit_prefetch(key, nbytes, victims)
        return bool(self._timed(self._moe.admit_prefetch, key, nbytes, victims))

    def on_wait(self, key: Key, seconds: float) -> None:
        if self._after is not None:
            return
        self._timed(self._moe.on_wait, key, seconds)
        if self._now is None or not (seconds >= 0 and seconds < float("inf")):
            return
        # the batch's felt wait is its longest request's (its loads overlap); every request
        # that waited is a miss the shadow is compared with
        self._batch_waits += 1
        if key not in self._batch_missed:
            self._batch_joined = True
        if seconds > self._batch_felt_s:
            self._batch_felt_s = seconds

    def on_routing(self, layer: int, rows: npt.NDArray[np.int64]) -> None:
        if self._after is None:
            self._timed(self._moe.on_routing, layer, rows)
        else:
            self._after.on_routing(layer, rows)

    def on_expect(self, layer: int, probabilities: npt.NDArray[np.float64]) -> None:
        if self._after is None:
            self._timed(self._moe.on_expect, layer, probabilities)
        else:
            self._after.on_expect(layer, probabilities)

    def history(self) -> dict[str, npt.NDArray[np.generic]]:
        """``moe``'s history: what it learned until the switch, if there was one (its
        co-activation table is ``coact``'s after it, and has gone on learning)."""
        return self._moe.history()

    def load_history(self, arrays: Mapping[str, npt.NDArray[np.generic]], source: str) -> None:
        self._moe.load_history(arrays, source)

    @property
    def pinned_experts(self) -> int:
        return 0 if self._after is not None else self._moe.pinned_experts


__all__ = ["MIN_WINDOWS", "WINDOW_TOKENS", "EarnedPolicy"]
