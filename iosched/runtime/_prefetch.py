"""Prefetch: loads started ahead of demand, and the ledger of what became of them.

:class:`PrefetchLedger` follows every entry a prefetch loaded: it stays *unused* until an
acquire leases it (``prefetch_used``) or it leaves the table unleased (``prefetch_wasted``;
``prefetch_failed`` when its load failed), so ``issued == used + wasted + failed + unused``
until ``close()``; entries still unused at close are neither.  The hit path pays one test of
the ledger's emptiness for it.

:class:`Prefetcher` issues prefetches: the engine's own (``ExpertStore.prefetch``) and the
policy's.  After an ``acquire_many`` holds its leases (the engine computes on that layer
now), the policy's batch-end work is scheduled for the engine's next await: learning,
predicting the next layer, issuing what it proposes and ranking the next batch's victims
(``prepare``) cost ~60 µs per batch of hits on the 2-core VM (``iosched hitpath``, more when
the batch's misses evict: docs/tried-and-dropped.md, "Cutting the default's CPU"), and the
engine should be computing meanwhile.  If the next batch begins first, the work is skipped: the policy closes that
batch itself, and prefetches for the layer already requested would come too late.

An engine computing on the loop (``acquire_as_ready``) gives the loop its felt waits only,
and work queued at the group's entry would run first in the next one, ahead of the read
results that finished while the engine computed (the engine resumed ~200 µs late in 28 % of
qwen's batches at one token cycle).  So when the engine's wait has a result on its way and
the engine will wait again in that group (``EngineWait.engine_resumes_first``), the work lets
it resume first, a turn of the loop at a time (:data:`PUT_OFF_TURNS_MAX`), and runs in a
later wait of the group.  docs/benchmarks.md, "Letting a result on its way through before the
batch-end work": held time 77 -> 71 ms over 32 tokens, tokens/s within noise (most held cases
are a group's last wait, where the work cannot be put off without being skipped).

What a prefetch may use: within the per-token byte budget (``token_budget_bytes``), the
bytes the drives' idle time can absorb (``iosched/runtime/_pacing.py``, when pacing is on), and only
reservations the policy's eviction guard accepts (``ResidencyTable.reserve_speculative_many``).
"""

from __future__ import annotations

import asyncio
import ctypes
import sys
import time
from collections.abc import Callable, Hashable, Mapping
from typing import Protocol, cast

import numpy as np
import numpy.typing as npt

from iosched._layout import ExpertKey, ExpertLayout
from iosched.residency import Entry, Hooks, ResidencyTable

from ._pacing import IdlePacer
from ._room import Lifecycle
from ._stats import RequestCounts


def _timer_slack_control() -> Callable[[int, int], int] | None:
    """``prctl(option, value)`` through libc, holding the GIL (``ctypes.PyDLL``: the call is
    1.5 us, and letting go of the GIL around it would hand it over at the wrong moment); ``None``
    where there is no ``prctl`` (not Linux). No library exposes ``PR_SET_TIMERSLACK`` (``os``
    has no ``prctl``), hence ``ctypes``."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.PyDLL(None).prctl
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]

    def prctl(option: int, value: int) -> int:
        return int(fn(option, value, 0, 0, 0))

    return prctl


_PR_SET_TIMERSLACK, _PR_GET_TIMERSLACK = 29, 30
_PRCTL = _timer_slack_control()

HANDOVER_SLACK_NS = 1
"""The calling thread's timer slack during a hand-over (:func:`release_gil`), then put back:
the kernel's default, 50 us, stretches a ``sleep(0)`` to 88-141 us on a 2-vCPU VM; at 1 ns it
takes 19-35 us with the three ``prctl`` calls, and the compute thread still gets the GIL
(docs/tried-and-dropped.md, "The hand-over's timer slack": 300 layers in 235-256 ms either way)."""


def release_gil() -> None:
    """Let the threads waiting for the GIL run, once a batch end, before the policy's work.

    Why: the batch-end work runs on the event loop while the engine computes in a thread, and
    that thread needs the GIL between its numpy calls.  A thread that asks for it waits until
    its holder lets go (CPython forces a switch only after ``sys.getswitchinterval()``, 5 ms),
    so one uninterrupted stretch of Python on the loop holds the compute up for its whole
    length (a thread of matvecs beside 300 us of Python every 2 ms: 10-13 % slower, 1 % when
    the Python lets go every 100 us).  Once suffices: it lets the compute thread start its layer
    before the pure-Python visit, and what follows is mostly numpy calls, of which those that
    release the GIL (sorts, loops over more than 500 elements) let the thread in anyway.  Only
    while the engine does not wait (``EngineWait.engine_waiting``): with the engine computing
    on the loop, a hand-over lets the readers' threads take the GIL first and delays waking the
    engine.  docs/tried-and-dropped.md, "The GIL, io_uring's submission turn": ``default``'s
    token time outside compute and felt wait 4-9 ms over ``lru``'s with it, 10-20 without.

    How: ``time.sleep(0)`` releases the GIL for one ``clock_nanosleep`` of zero, long enough
    for a waiting thread to take it (``os.sched_yield`` gives it back only after the other
    thread's switch interval); the thread's timer slack is set to :data:`HANDOVER_SLACK_NS`
    around it, or the kernel stretches the sleep to ~0.1 ms.  Where ``prctl`` is missing, the
    plain sleep."""
    prctl = _PRCTL
    slack = prctl(_PR_GET_TIMERSLACK, 0) if prctl is not None else 0
    if prctl is None or slack <= 0:  # no prctl, or the call failed: leave the slack alone
        time.sleep(0)
        return
    prctl(_PR_SET_TIMERSLACK, HANDOVER_SLACK_NS)
    try:
        time.sleep(0)
    finally:
        prctl(_PR_SET_TIMERSLACK, slack)


PUT_OFF_TURNS_MAX = 16
"""The most turns of the loop one batch end's work lets the engine resume first.  A result on
its way reaches the engine in four (the worker's post, the read's coroutine, the load's
future, ``asyncio.wait``'s callback), two more through a ``gather`` of a load's spans; several
results travel in the same turns.  Past this (results that keep arriving for other readers,
prefetches) the work runs anyway: each turn is a few microseconds, the work ~200."""


class EngineWait(Protocol):
    """What the prefetcher asks about the engine's wait, to place the policy's batch-end work
    (implemented by :class:`~iosched.runtime._felt.FeltWait`)."""

    def engine_waiting(self) -> bool:
        """Whether the engine waits for a load now: an acquire awaits one, or a thread of the
        engine's blocks for a group's batch."""

    def felt_so_far(self) -> float:
        """The engine's felt wait up to now, the wait in progress included."""

    def engine_resumes_first(self) -> bool:
        """Whether the engine's wait is about to end and it will wait again in this batch, so
        that the batch-end work is better run then."""


class PrefetchLedger:
    """What became of each entry a prefetch loaded."""

    __slots__ = ("unused", "used", "wasted", "failed", "_lifecycle")

    def __init__(self, lifecycle: Lifecycle) -> None:
        self.unused: dict[Hashable, Entry] = {}
        """Entries a prefetch started (loading or resident) that no acquire has leased yet."""
        self.used = self.wasted = self.failed = 0
        self._lifecycle = lifecycle

    def issued(self, entry: Entry) -> None:
        self.unused[entry.key] = entry

    def leased(self, entry: Entry) -> None:
        """The first lease of an entry a prefetch loaded: the prefetch was used."""
        if self.unused.get(entry.key) is entry:
            del self.unused[entry.key]
            self.used += 1

    def left(self, entry: Entry, failed: bool = False) -> None:
        """``entry`` left the table: if a prefetch loaded it and nobody leased it, the prefetch
        was wasted (or failed)."""
        if self.unused.get(entry.key) is entry:
            del self.unused[entry.key]
            if failed:
                self.failed += 1
            elif not self._lifecycle.closed:
                self.wasted += 1


class Prefetcher:
    """Issues the engine's and the policy's prefetches within their budgets."""

    def __init__(self, table: ResidencyTable, layouts: Mapping[ExpertKey, ExpertLayout],
                 start_load: Callable[[Entry, ExpertLayout], object], ledger: PrefetchLedger,
                 counts: RequestCounts, lifecycle: Lifecycle, engine: EngineWait, *,
                 token_budget_bytes: int | None, pacer: IdlePacer | None) -> None:
        """``start_load(entry, layout)`` starts a prefetch-priority load of a reserved entry;
        ``engine`` says how the engine waits (the batch-end work runs around its waits)."""
        self._table = table
        self._hooks: Hooks = table.hooks
        self._layouts = layouts
        self._start_load = start_load
        self._ledger = ledger
        self._counts = counts
        self._lifecycle = lifecycle
        self._engine = engine
        self.token_budget_bytes = token_budget_bytes
        self.pacer = pacer
        self.proposing = self._hooks.end_batch is not None
        """Whether the policy has batch-end work (and may propose prefetches)."""
        self._batch_end_at: int | None = None
        """``requests`` when the last ``acquire_many`` completed, until the policy was told."""
        self._turns_put_off = 0
        """Turns of the loop the batch-end work in view was put off (:data:`PUT_OFF_TURNS_MAX`)."""
        self.put_off = 0
        """Batch ends whose work let the engine resume first, at least one turn."""
        self._speculative_bytes = 0
        """Bytes prefetch started since the last token boundary."""
        self.issued = self.dropped = 0
        self.refused = self.refused_bytes = 0
        self.policy_batches = 0
        """Batches after which the policy proposed prefetches."""
        self.work_in_felt_s = 0.0
        """Seconds of the policy's batch-end work that ran while the engine waited, inside its
        felt wait (an engine computing on the loop, or a compute thread blocked for its next
        batch): the felt wait the policy is told (``set_felt_wait``) leaves them out, as they
        are its own cost, not the reads'."""
        self.expected = self.expect_started = 0
        """Experts the engine's lookahead (``ExpertStore.expect``) proposed, and loads of them
        started."""

    def token_boundary(self) -> None:
        """The per-token prefetch byte budget starts over."""
        self._speculative_bytes = 0

    def issue(self, layouts: list[ExpertLayout]) -> list[ExpertKey]:
        """Start loads of the experts neither resident nor loading, within the token budget and
        the room the eviction guard allows; the keys whose loads started."""
        wanted: dict[ExpertKey, ExpertLayout] = {}
        planned = self._speculative_bytes
        budget = self.token_budget_bytes
        for layout in layouts:
            if self._table.get(layout.key) is not None or layout.key in wanted:
                continue  # resident, or loading: a demand read got there first
            if budget is not None and planned + layout.nbytes > budget:
                self.refused += 1
                self.refused_bytes += layout.nbytes
                continue
            planned += layout.nbytes
            wanted[layout.key] = layout
        entries = self._table.reserve_speculative_many([(k, lay.nbytes) for k, lay in wanted.items()])
        started: list[ExpertKey] = []
        for layout, entry in zip(wanted.values(), entries, strict=True):
            if entry is None:  # no room without a leased/pinned/loading victim, or the
                self.dropped += 1  # policy's eviction guard refused
                continue
            self._speculative_bytes += layout.nbytes
            self._start_load(entry, layout)
            self._ledger.issued(entry)
            started.append(layout.key)
        self.issued += len(started)
        return started

    def batch_done(self) -> None:
        """An ``acquire_many`` holds all its leases: schedule the policy's batch-end work for
        the engine's next await."""
        if (self.proposing or self.expected) and not self._lifecycle.closed:
            self._batch_end_at = self._counts.requests
            self._turns_put_off = 0
            asyncio.get_running_loop().call_soon(self._policy_batch_end)

    def _policy_batch_end(self) -> None:
        if self._lifecycle.closed or self._batch_end_at != self._counts.requests:
            return  # the next batch began first (see the module docstring)
        if self._turns_put_off < PUT_OFF_TURNS_MAX and self._engine.engine_resumes_first():
            # The engine computes on the loop and its felt wait began with a result already
            # on its way: run after it, at the engine's next wait (module docstring).
            if not self._turns_put_off:
                self.put_off += 1
            self._turns_put_off += 1
            asyncio.get_running_loop().call_soon(self._policy_batch_end)
            return
        self._batch_end_at = None
        if self.pacer is not None:
            self.pacer.interval_done()
        end_batch, prepare = self._hooks.end_batch, self._hooks.prepare
        if end_batch is None or not self.proposing:
            return
        waiting = self._engine.engine_waiting()
        if not waiting:  # (release_gil: why, why once, and why not then)
            release_gil()  # the engine's compute thread, just handed its layer, goes first
        # the felt wait, for a policy that reads it only
        felt = self._engine.felt_so_far if self._hooks.set_felt_wait is not None else None
        felt_before = felt() if felt is not None else 0.0
        try:
            wanted = end_batch()
            if wanted is None:  # the policy has no batch-end work any more: stop scheduling it
                self.proposing = False
                return
            if wanted:
                self.policy_batches += 1
                self._proposed(wanted)
            if prepare is not None:
                prepare()
        finally:  # the part of the work the engine waited through (all of it on the loop)
            if felt is not None:
                self.work_in_felt_s += felt() - felt_before

    def expect(self, layer: int, probabilities: npt.NDArray[np.float64], min_probability: float) -> list[ExpertKey]:
        """The engine's lookahead for ``layer``: its experts of at least ``min_probability``,
        likeliest first, issued as the policy's proposals are (the pacer's allowance, the
        token budget, the eviction guard); the keys whose loads started.  From the first
        one on, the pacer's intervals close at every batch end, also under a policy with no
        batch-end work of its own (``lru`` pays nothing for this until an engine calls it)."""
        likely = np.flatnonzero(probabilities >= min_probability)
        if not likely.size:
            return []
        order = likely[np.argsort(-probabilities[likely], kind="stable")]
        keys: list[Hashable] = [(layer, e) for e in order.tolist()]
        if not keys:
            return []
        self.expected += len(keys)
        if self._hooks.admit_prefetch is None:
            # a policy without an eviction guard (lru) cannot say what an estimate may displace,
            # and displacing its oldest entries evicts the next layers' (measured: lru with a
            # 0.7-recall lookahead ran at 0.44-0.63x its tokens/s): free bytes only
            table = self._table
            free = min(table.budget_bytes - table.used_bytes, table.main_bytes - table.admitted_bytes)
            fitting: list[Hashable] = []
            for key in keys:
                layout = self._layouts.get(cast("ExpertKey", key))
                if layout is not None and layout.nbytes <= free and table.get(layout.key) is None:
                    fitting.append(key)
                    free -= layout.nbytes
            keys = fitting
        started = self._proposed(keys)
        self.expect_started += len(started)
        return started

    def _proposed(self, keys: list[Hashable]) -> list[ExpertKey]:
        # (a key of the policy's shape that the checkpoint lacks is skipped, and so is an expert
        # larger than the region admitted entries may use: it could never be reserved)
        room = self._table.main_bytes
        layouts = [layout for key in cast("list[ExpertKey]", keys)
                   if (layout := self._layouts.get(key)) is not None and layout.nbytes <= room]
        pacer = self.pacer
        if pacer is None:
            return self.issue(layouts)
        # Only what the drives' idle time can absorb (iosched/runtime/_pacing.py); what the guard then
        # refuses read nothing and goes back to the allowance.
        charged: list[ExpertLayout] = []
        for layout in layouts:
            if self._table.get(layout.key) is not None:
                continue  # resident or loading: costs nothing, and issue() skips it
            if not pacer.take(layout.nbytes):
                break
            charged.append(layout)
        started = self.issue(charged)
        done = set(started)
        for layout in charged:
            if layout.key not in done:
                pacer.refund(layout.nbytes)
        return started

    def close_last_batch(self) -> None:
        """At ``close()``: a batch that ended with the policy not yet told is told now (its
        proposals are not loaded: the store is closing)."""
        if self._batch_end_at == self._counts.requests and self._hooks.end_batch is not None and self.proposing:
            self._batch_end_at = None
            self._hooks.end_batch()
