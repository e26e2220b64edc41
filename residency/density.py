"""``density``: ``coact``'s prefetch, with an eviction that ranks by hit density, an LRU
shadow that can overrule it, and a cost verdict that retires it to LRU's order or, above one
token cycle, to S3-FIFO's queues.

Why: with the engine computing on what is at hand (``acquire_as_ready``) the felt wait left
is the reads that outlast the compute of a layer's hits, and fewer misses is what shortens
it; ``coact``'s prefetch found little to take there (docs/residency-notebook.md, "Compute on
what is at hand").  LRU evicts by age alone.  On MoE routing an expert's chance of being
routed again depends on its age *and* on how often it was routed before, and the next chance
of any expert comes only at its layer's next visit.  ``moe`` (``residency/moe.py``) ranks by
that, but with a per-request cost and a context lift that made it slower than ``lru`` on two
cores; this policy keeps the ranking and nothing else, computed when a victim is needed:

- **Reuse from the run** (``residency/_hazard.py``'s :class:`HazardTable`): at every decode
  visit of a layer each of its experts adds an exposure to its (age, count) class and a use
  when routed; a prompt's router rows (``on_routing``) count as visits too.  The exposures of
  a token are added at its end, in one ``bincount`` (its visits' ages are kept per batch).
- **Density** (LHD, Beckmann et al., NSDI 2018, with the layer cycle, weighed by the time a
  miss costs): an expert of the layer ``d`` visits ahead (``d = L`` for the layer in
  progress) is worth ``P(routed within h visits) x (bytes + B0) / ((d + L x E[unused
  visits]) x bytes)``; victims go lowest density first.  ``bytes + B0`` is the time its miss
  would cost, a request's latency plus its transfer, in bytes at the drive's bandwidth
  (:data:`MISS_FIXED_BYTES`), so the density is the critical-path time a held byte saves:
  LHD's per-object density (``/ bytes``) for experts far smaller than ``B0``, size-neutral
  (bytes saved per byte held) for experts far larger.  The horizon ``h`` is the budget in
  token cycles (at least 1): under LRU an expert stays about that many visits of its layer,
  so it is the span over which holding it can pay (an offline model of the as-ready layer,
  session 29: a horizon of 4 at one token cycle lost 2-4 points of hits on the synthetic
  traces against LRU, one of 1 lost 0-1).
- **The LRU shadow** (keys and sizes only, the store's semantics: a batch's hits first, then
  its misses evicting the oldest): every request runs through it too.  From the
  :data:`MIN_TOKENS`-th decode token on, when this policy's misses (plus its used prefetches,
  which would have been misses) exceed the shadow's by more than :data:`GUARD_SIGMAS` times
  the shadow's Poisson noise (its square root), the eviction is LRU's for good and the
  density state is dropped: on a trace whose reuse is recency alone the ranking cannot lose
  more than that margin.  A one-way switch, as ``earned``'s: after it nothing feeds the
  density, so it could not be judged again.
- **Where the work runs.**  A batch's visit (ages, counts, the shadow) and the ranking for
  the next layer run at the batch's end (``end_batch``, ``prepare``), which the store
  schedules while the engine computes; the next layer's misses then take their victims from
  that ranking (its :data:`RANK_FIRST` lowest sorted, the rest only if taken).  Where the
  batch-end work did not run (an engine computing on the loop without an await) the next
  batch's first request does the visit and its first miss the ranking.  Measured on the
  critical path (qwen, 1500 MB/s, 5 ms a layer, 4 TD, 32 tokens, the same hits and felt
  wait each time): ranked at every miss, ``default`` ran at 0.967x ``lru``; once a batch, at
  its first miss, 0.989x; with the visit and the ranking at the batch end, 1.012x
  (docs/residency-notebook.md, session 29).  Above one token cycle of budget a ranking
  serves several batches (:data:`RERANK_MAX`); the experts routed since it was made are
  offered after it, by their fresh densities.
- **What it costs** (the cost verdict, :meth:`_judge_cost`).  The visits and the rankings are
  Python and numpy on the event loop: ~160 us a layer in a real run where the engine's compute
  swept the caches before them (qwen, 1 TD, compute in a thread, session 44: the ranking
  102-114 us, the visit 48 us).  Where the reads cost the engine almost nothing (small experts,
  or reads the page cache serves while it computes) no eviction order can save that much:
  ``iosched demo`` (36 KiB experts from the page cache, 4 TD) ran ``default`` at 0.84x ``lru``,
  its visits and rankings 46 ms over 15 decode tokens against 18 ms of felt wait in all
  (docs/demo.md, session 44).  So the policy times its own work on the store's clock
  (``set_clock``) and the store tells it the engine's felt wait so far, less its own batch-end
  work that ran inside it (``set_felt_wait``).  From the :data:`COST_VERDICT_FROM`-th decode
  token on, the verdict prices what the ranking's lead could have saved: the misses it had
  fewer than the LRU shadow, plus :data:`GUARD_SIGMAS` of the shadow's Poisson noise (the lead
  at its likely best), each at this policy's mean felt wait a miss, never more than all of the
  felt wait LRU would have had (session 44's bound, the most any eviction order could save).
  When the ranking has cost more than that, and more than :data:`MATERIAL_SHARE` of the
  decode's time, it retires for good: to LRU's order at one token cycle, to S3-FIFO's queues
  above (``residency/_s3fifo.py``: from two cycles up they keep most of the ranking's hits at
  LRU's cost; at one they lose to LRU).  Since the drives serve a layer's reads one after
  another (``inflight_bytes``, ``iosched/_scheduler.py``) a miss costs the engine 0.07-0.25 ms
  of felt wait at 2.25 MiB, and in paired real runs the ranking kept ran 0.957-0.979x ``lru``
  at qwen 1 TD and 0.978-0.994x at 4 TD (session 46); retired to S3-FIFO at tokens 3-11,
  ``default`` ran at medians of 1.000 and 1.009x ``lru`` at qwen and gemma 4 TD, retired to LRU
  at token 16, 0.983 and 0.984x at 1 TD (three paired rounds each; docs/benchmarks.md, session
  47); retired, with LRU's own hooks (``coact``'s ``_hand_over``), 0.996 and 1.006x at 4 TD,
  0.989 and 0.991x at 1 TD (six rounds), its first 16 tokens (the ranking on trial) at
  0.927-1.017x, the rest at 0.980-1.030x (session 48).  Priced only at one token cycle, with the
  bound above it (session 46), the ranking stayed at 4 TD.  Where CPU is free (the
  critical-path replay's ``--cpu free``) it never fires, so the same inputs still give the
  same numbers.
- **Where it cannot matter** (a budget that holds the whole model: nothing is ever evicted)
  the eviction is LRU's from the start and nothing is learned, so a resident ``acquire``
  costs what ``coact``'s does.

Everything else (the next-layer prefetch, its guard, its trial) is ``coact``'s: a subclass.
``coact``'s LRU order is kept beside the ranking: its guard reads it (a fresh victim is never
displaced by a guess), the eviction falls back to it, and S3-FIFO's queues start from it.

Constants: :data:`GUARD_SIGMAS` and :data:`MIN_TOKENS` are statistical (a 2-sigma rule on
miss counts; three tokens as ``coact``'s trial); the cost verdict gives the lead the same
2 sigma and waits as many tokens (:data:`COST_VERDICT_FROM`); :data:`MATERIAL_SHARE` is
measured (a switch's own cost); the bins and the prior are ``_hazard.py``'s.  Nothing is
fitted to a trace.

Invariants (:meth:`check`): ``coact``'s, plus: the resident mask is exactly the table's
keys; the Python lists of last routings and counts equal their arrays; no expert's last
routing is after its layer's visits; the shadow holds no more bytes
than the budget; once S3-FIFO evicts, its queues' (``_s3fifo.py``).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import ClassVar, TypeVar

import numpy as np
import numpy.typing as npt

from iosched._errors import require

from ._hazard import AGE_MAX, COUNT_BIN_OF, HazardTable, count_bin
from ._policy import Capability, FeltWaitAware, Key, ModelShape
from ._s3fifo import S3Fifo
from .coact import CoactPolicy

_T = TypeVar("_T")

GUARD_SIGMAS = 2.0
"""The shadow's misses plus this many of their standard deviations (Poisson: the square root)
is what this policy's misses may reach before the eviction turns to LRU's: a density that
loses by less is noise, one that loses by more is losing (about 2.3 % of the looks of an
eviction as good as LRU's cross it by chance, one-sided)."""

RANK_FIRST = 32
"""Victims sorted at first (the rest only when taken): more than a layer's misses and the next
layer's prefetches take (``2 k`` = 12 at the bundled traces' ``k`` of 6; 16 at an 8-expert
model), so a batch sorts 32 of its ~300-1200 resident experts, not all."""

RERANK_MAX = 4
"""The most batches one ranking serves (at a budget of 4 token cycles and more).  A ranking
serves ``min(horizon, RERANK_MAX)`` batches: at one token cycle every batch ranks afresh, at two
every other, at four and more every fourth; the experts routed since it was made are offered
after it, by their fresh densities.  Measured with the hit-rate replay (eviction only, whole
traces, qwen, gemma and three synthetic traces, session 32): ranking every 2 batches at 2 TD
and every 4 at 4 and 8 TD gave the decode hits of ranking every batch within 0.1 point; every 4
at 2 TD lost up to 0.6, every 2 at 1 TD up to 1.2, every 8 at 4 TD up to 0.3.  Each ranking
is ~15 numpy calls on the event loop, and in real runs beside a compute thread those cost 2-5
times their own CPU (docs/residency-notebook.md, session 31)."""

REFRESH_SETTLED = 16
REFRESH_EVERY = 4
"""The density tables follow the hazard table at every decode token's end for the first
:data:`REFRESH_SETTLED` tokens, then at every :data:`REFRESH_EVERY`-th: by then each class
holds the exposures of 16 visits of every layer, and a token adds about 1/17 more, so the
tables barely move between refreshes (and the exposures are still counted every token).
Measured with the hit-rate replay, eviction only (5 traces, 0.5-8 TD, session 32): decode
hits within 0.1 point of refreshing every token."""

MISS_FIXED_BYTES = 256 << 10
"""``B0``: a miss's fixed cost (the request's latency) in bytes at the drive's bandwidth, the
size at which an expert's read is half latency, half transfer.  An NVMe read's ~80 us at
3 GB/s is 240 KB; this project's virtio disk paced to 400 MB/s, with a depth-1 latency of
385-454 us (``iosched topology --probe``, docs/benchmarks.md), 154-182 KB.  The policy is not
told the drive, and the order barely depends on the value where experts are MiBs: the
hit-rate replay (eviction only, 7 traces whose layers have two expert sizes, as a GGUF
Q4_K_M's mix, 0.5-8 TD, session 36) moved the same bytes within 0.5 % with ``B0`` = 0 and
256 KiB, and -2.1 to +0.8 % of what ``/ bytes`` alone (``B0`` = inf) moved, fewer in 25 of
35 cells; with it the ranking moved fewer bytes than the best online libCacheSim policy in
35 of 35 cells (34 before: ``s3`` at 8 TD, 1.006x S3FIFO's).
Where every layer's experts have the same size the factor is a constant and left out."""

MATERIAL_SHARE = 0.01
"""The cost verdict retires the ranking only when it cost more than this share of the decode's
time so far: a ranking that costs less cannot slow the engine by more, and a switch of eviction
order mid-run has a cost of its own (the evicted experts the new order would have kept come
back as misses).  Measured on the critical path's qwen, 500 MB/s, 1 ms a layer, 4 TD cell,
where the ranking cost 0.5 % of the time and trailed the LRU shadow within its noise: retired
at token 26 it ran 0.965x (to LRU) and 0.969x ``lru`` (to S3-FIFO), kept 0.983x (session 47).
Where it retires in the real runs it cost 2-4 % (qwen and gemma, 1 and 4 TD, 2.25 MiB)."""

MIN_TOKENS = 3
"""Decode tokens before the guard may decide: the fewest over which a count of misses
differs by more than the routing's noise (``coact``'s trial waits as many pairs)."""

COST_VERDICT_FROM = MIN_TOKENS
"""Decode tokens before the cost verdict may decide, at every budget: as many as the shadow's
verdict waits.  The verdict prices the ranking's lead at its likely best (plus
:data:`GUARD_SIGMAS` of the shadow's noise), wide over a few tokens, so an early look errs
toward keeping the ranking.  Until session 47 it waited :data:`REFRESH_SETTLED` tokens (the
density tables' settling): in the paired real runs at 4 TD it retired the ranking at token 16
every time, and from token 3 it does so at tokens 3-11, 1.001-1.005x ``lru`` against
0.995-1.000x (qwen and gemma, 2.25 MiB experts, two rounds).  At one token cycle it kept
waiting 16 tokens until session 49 (session 47 had gemma 1 TD at 0.965-0.968x retired at token
3, against 0.985-0.991x at token 16, but from rounds an hour apart, not paired).  Paired, eight
rounds, arms rotated, beside a second ``lru`` (qwen and gemma, 1 TD, 2.25 MiB, O_DIRECT,
compute in a thread, session 49): from token 3 it retired at tokens 5-6 (qwen) and 3-6 (gemma),
medians 0.998 and 0.994x ``lru`` against 0.993 and 0.998x at token 16 and the second ``lru``'s
1.000 and 0.997x; qwen's first 16 tokens 101 ms above ``lru``'s against 152 (medians), gemma's
+6 against -7 ms (its ranking leads by 5 % of the misses there, which is worth about what it
costs: a wash).  One rule at every budget (docs/residency-notebook.md, session 49)."""

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]


_CBIN_OFFSETS: list[int] = (COUNT_BIN_OF * AGE_MAX).tolist()
"""``count_bin(c) x AGE_MAX`` for the counts a run reaches (a lookup, not a numpy call)."""


def _cbin_offset(count: int) -> int:
    """``count``'s row offset in the class tables (``_cbin``)."""
    if count < len(_CBIN_OFFSETS):
        return _CBIN_OFFSETS[count]
    return int(count_bin(np.array([count], dtype=np.float64))[0]) * AGE_MAX


class DensityPolicy(CoactPolicy, FeltWaitAware):
    name: ClassVar[str] = "density"
    capabilities: ClassVar[Capability] = CoactPolicy.capabilities | Capability.FELT_WAIT

    def __init__(self, prefetch_width: int | None = None) -> None:
        super().__init__(prefetch_width)
        self._hz = HazardTable()
        self._dv: I64 = np.zeros(0, dtype=np.int64)
        """Per layer position: its visits as the density counts them (decode batches and a
        prompt's rows)."""
        self._last: I64 = np.zeros((0, 0), dtype=np.int64)
        """Per layer position and expert: the visit that last routed it (``-AGE_MAX``: never)."""
        self._count: F64 = np.zeros((0, 0))
        self._last_l: list[list[int]] = []
        self._count_l: list[list[int]] = []
        """``_last`` and ``_count`` as Python lists, kept equal to them: a decode visit reads
        and writes ``k`` of their entries, which scalar reads and writes do for less than the
        numpy calls of a vectorised visit after the compute swept the caches (hit-rate replay,
        gemma, 4 TD, a 48 MiB sweep between batches: 70 -> 52 us a visit, the LRU shadow's
        20 us included)."""
        self._res_bytes = bytearray()
        """Flat (position x E + expert): resident (1) or not (0); a Python-level read or write
        of one costs a third of a numpy scalar's, and the membership hooks do one each."""
        self._res: npt.NDArray[np.bool_] = np.zeros(0, dtype=bool)
        """The same bytes as a numpy view, for the ranking's vectorised reads."""
        self._pending: list[tuple[int, list[int], list[int], list[int]]] = []
        """This token's decode visits: position, experts, their last routing and count before."""
        self._phit_flat: F64 = np.zeros(0)
        """P(routed within the horizon) by class (count bin x AGE_MAX + age)."""
        self._extra_flat: F64 = np.zeros(0)
        """Layer steps held unused beyond the first chance, by class."""
        self._cbin: I64 = np.zeros((0, 0), dtype=np.int64)
        """Per layer position and expert: the count's bin (``count_bin(self._count)``) times
        :data:`AGE_MAX`, the offset of its row in the class tables (class = that + age)."""
        self._ahead: F64 = np.zeros((0, 0))
        """``[cur, p]``: layer steps from a batch at position ``cur`` to position ``p``'s next
        visit (``L`` for ``cur`` itself)."""
        self._cycle_bytes = 0
        """One token cycle's bytes (``ModelShape.token_cycle_bytes``): the horizon's unit and
        S3-FIFO's probation."""
        self._uniform = True
        """Every layer's experts have the same bytes: the density's size factor is left out
        (a constant: the order, which is all a ranking uses, stays)."""
        self._horizon = 1
        self._rerank = 1
        """Batches one ranking serves: ``min(horizon, RERANK_MAX)``."""
        self._layer_of: I64 = np.zeros(0, dtype=np.int64)
        self._held_per_step: F64 = np.zeros(0)
        """Per layer position: ``bytes / (bytes + B0)``, what a layer step of holding one of
        its experts costs per unit of miss time it saves (module docstring, "Density")."""
        self._pos_flat: I64 = np.zeros(0, dtype=np.int64)
        """Flat index -> layer position."""
        self._rows_seen: list[bool] = []
        self._lru = False
        """The eviction is LRU's (the budget holds the model, or the shadow overruled it)."""
        self._lru_reason: str | None = None
        self._overruled = False
        """Whether the shadow overruled the ranking (the verdict says so)."""
        self._s3: S3Fifo | None = None
        """The eviction's queues once the cost verdict retired the ranking above one token
        cycle (``residency/_s3fifo.py``); ``None`` while the ranking or LRU evicts."""
        self._shadow: OrderedDict[int, int] = OrderedDict()
        """The LRU shadow: flat indices, oldest use first, and their bytes."""
        self._shadow_held = 0
        self._shadow_misses = 0
        self._used = 0
        self._decoded = 0
        self._felt: Callable[[], float] | None = None
        """The engine's felt wait so far (the store's, ``set_felt_wait``): what the misses cost
        it, the most a better eviction could save (the cost verdict)."""
        self._cost_s = 0.0
        """Seconds on the store's clock this policy spent on what ``coact`` does not do: the
        visits (ages, counts, the shadow, the hazard table) and the rankings."""
        self._decode_mark = (0.0, 0.0, 0.0, 0, 0)
        """At the first decode token's end: the store's clock, the felt wait, :attr:`_cost_s`
        and both miss counts (the cost verdict weighs the decode's, not the prompt's)."""
        self._cur = 0
        self._epoch = 0
        """Batches closed (``_close_batch``): a ranking is valid for the epoch it was made for."""
        self._rank_epoch = -1
        self._rank_pos = -1
        self._applied = -1
        """The epoch whose batch's visit ``end_batch`` applied (``_close_batch`` then does not)."""
        self._rank_head: list[int] = []
        """The batch's ranking: flat indices of its :data:`RANK_FIRST` lowest densities, in order."""
        self._head_at = 0
        """Where the head's keys still to offer begin: those before left the resident set or
        joined :attr:`_since_rank` since the ranking, and stay out of it until the next."""
        self._rank_tail: tuple[F64, I64, I64 | list[int]] | None = None
        """The rest: unsorted until first needed, then in order."""
        self._since_rank: dict[int, None] = {}
        """Flat indices inserted, or (a ranking serving several batches) routed, since the
        ranking was made (an ordered set): offered after it, by their densities then, and
        not from it."""

    # ------------------------------------------------------------------ set-up

    def set_shape(self, shape: ModelShape) -> None:
        super().set_shape(shape)
        L, E = self._L, self._E
        self._cycle_bytes = shape.token_cycle_bytes
        self._dv = np.zeros(L, dtype=np.int64)
        self._last = np.full((L, E), -AGE_MAX, dtype=np.int64)
        self._count = np.zeros((L, E))
        self._cbin = np.zeros((L, E), dtype=np.int64)
        self._last_l = [[-AGE_MAX] * E for _ in range(L)]
        self._count_l = [[0] * E for _ in range(L)]
        self._res_bytes = bytearray(L * E)
        self._res = np.frombuffer(self._res_bytes, dtype=np.bool_)
        self._layer_of = np.array(self._layers, dtype=np.int64)
        sizes = np.array(self._expert_bytes, dtype=np.float64)
        self._held_per_step = sizes / (sizes + MISS_FIXED_BYTES)
        self._pos_flat = np.repeat(np.arange(L, dtype=np.int64), E)
        steps = np.arange(L)
        self._ahead = ((steps[None, :] - steps[:, None] - 1) % L + 1).astype(np.float64)
        self._uniform = len(set(self._expert_bytes)) <= 1
        self._rows_seen = [False] * L
        self._settle_budget()

    def set_budget(self, budget_bytes: int) -> None:
        super().set_budget(budget_bytes)
        self._settle_budget()

    def _settle_budget(self) -> None:
        """The horizon from the budget in token cycles; LRU's order where nothing is ever
        evicted (the budget holds every expert of the model)."""
        if not self._L or self._budget is None:
            return
        cycle = self._cycle_bytes
        self._horizon = max(1, min(AGE_MAX - 1, round(self._budget / cycle)))
        self._rerank = min(self._horizon, RERANK_MAX)
        self._refresh()
        if self._budget >= self._E * sum(self._expert_bytes) and (not self._lru or self._s3 is not None):
            self._to_lru("the budget holds every expert: nothing to rank", overruled=False)
        elif self._s3 is not None and self._horizon < 2:  # (S3-FIFO loses to LRU there: _s3fifo.py)
            self._to_lru(f"lru: the budget fell to {self._budget / cycle:.2f} token cycles, where "
                         f"S3-FIFO loses to LRU (it evicted from {self._decoded} decode tokens on)")

    def _refresh(self) -> None:
        phit, extra = self._hz.density(self._horizon)
        self._phit_flat = phit.T.ravel()  # by class = count bin x AGE_MAX + age
        self._extra_flat = (self._L * extra).T.ravel()  # in layer steps: L a further visit

    @property
    def eviction(self) -> str:
        """``density``, or ``lru`` or ``s3fifo`` and why (``stats()["policy_verdict"]`` carries it
        too)."""
        if not self._lru:
            return "density"
        return f"s3fifo ({self._lru_reason})" if self._s3 is not None else f"lru ({self._lru_reason})"

    @property
    def cost_verdict(self) -> str | None:
        verdict = super().cost_verdict
        if not self._overruled:
            return verdict
        return f"{verdict}; eviction: {self._lru_reason}" if verdict else f"eviction: {self._lru_reason}"

    def set_felt_wait(self, felt: Callable[[], float]) -> None:
        """The store's felt wait so far: with the clock (``set_clock``), the ranking's cost
        verdict (:meth:`_judge_cost`)."""
        self._felt = felt

    # ------------------------------------------------------------------ requests

    def _guess_used(self, key: Key) -> None:
        super()._guess_used(key)
        self._used += 1

    def _close_batch(self) -> bool:
        batch, pos = self._batch, self._batch_pos
        applied = self._applied == self._epoch
        decode = super()._close_batch()
        if not applied and not self._lru and batch:
            self._timed(self._visit, pos, batch, decode)  # the batch-end work did not run (module docstring)
        self._epoch += 1
        return decode

    def _timed(self, work: Callable[..., _T], *args: object) -> _T:
        """``work(*args)`` (a visit, a ranking, the order of the late keys), its time on the
        store's clock counted in :attr:`_cost_s`."""
        now = self._now
        if now is None:
            return work(*args)
        t0 = now()
        result = work(*args)
        self._cost_s += now() - t0
        return result

    def _visit(self, pos: int, batch: list[int], decode: bool) -> None:
        """A batch complete: its visit into the ages and counts, the LRU shadow, and at a
        decode token's last layer :meth:`_token_end`.  Run at the batch's end, while the
        engine computes (``end_batch``), or when the next batch begins if that did not run."""
        self._cur = pos
        self._shadow_batch(pos, batch)
        if decode:
            visit = int(self._dv[pos])
            last_l, count_l = self._last_l[pos], self._count_l[pos]
            row_last, row_count, row_cbin = self._last[pos], self._count[pos], self._cbin[pos]
            old_last = [last_l[e] for e in batch]
            old_count = [count_l[e] for e in batch]
            self._pending.append((pos, list(batch), old_last, old_count))
            if self._rerank > 1:  # routed since the ranking: its place there is stale
                base, since = pos * self._E, self._since_rank
                for e in batch:
                    since[base + e] = None
            for e, c in zip(batch, old_count, strict=True):  # scalar writes (see _last_l)
                c += 1
                last_l[e] = visit
                count_l[e] = c
                row_last[e] = visit
                row_count[e] = c
                row_cbin[e] = _cbin_offset(c)
            self._dv[pos] = visit + 1
            if pos == self._L - 1:
                self._token_end()
        elif self._rows_seen[pos]:
            self._rows_seen[pos] = False  # the prompt's rows were its visits
        else:  # a prompt without its rows: one visit routing what it asked for
            experts = np.array(batch, dtype=np.int64)
            self._last[pos, experts] = self._dv[pos]
            self._count[pos, experts] += 1.0
            self._cbin[pos, experts] = count_bin(self._count[pos, experts]) * AGE_MAX
            self._dv[pos] += 1
            self._mirror(pos)

    def _mirror(self, pos: int) -> None:
        """Position ``pos``'s row of ``_last`` and ``_count`` into their lists, after a
        vectorised update of it."""
        self._last_l[pos] = self._last[pos].tolist()
        self._count_l[pos] = self._count[pos].astype(np.int64).tolist()

    def _shadow_batch(self, pos: int, batch: list[int]) -> None:
        """The batch through the LRU shadow: its hits first, then its misses, each evicting
        the oldest key outside the batch (the store leases a batch's hits before its misses
        evict).  Keys are flat indices (position x E + expert): no tuple is made per request."""
        shadow, base = self._shadow, pos * self._E
        missed = []
        for e in batch:
            flat = base + e
            if flat in shadow:
                shadow.move_to_end(flat)
            else:
                missed.append(flat)
        if not missed:
            return
        self._shadow_misses += len(missed)
        nbytes, budget, held = self._expert_bytes[pos], self._budget, self._shadow_held
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
        self._shadow_held = held

    def _token_end(self) -> None:
        """A decode token's last layer: its visits' exposures into the hazard table (one
        bincount), the density tables refreshed, and the guard's look."""
        pending, self._pending = self._pending, []
        if pending:
            pos = np.fromiter((p for p, *_ in pending), dtype=np.intp, count=len(pending))
            last, count = self._last[pos], self._count[pos]
            routed = np.zeros(last.shape, dtype=bool)
            if len({len(experts) for _, experts, _, _ in pending}) == 1:  # the usual token: one array each
                rows = np.arange(len(pending))[:, None]
                experts2 = np.array([experts for _, experts, _, _ in pending])
                last[rows, experts2] = np.array([old for _, _, old, _ in pending])
                count[rows, experts2] = np.array([old for _, _, _, old in pending])
                routed[rows, experts2] = True
            else:
                for i, (_, experts, old_last, old_count) in enumerate(pending):
                    last[i, experts] = old_last
                    count[i, experts] = old_count
                    routed[i, experts] = True
            age = (self._dv[pos] - 2)[:, None] - last  # visits idle before this one: 0 = routed at the last
            self._hz.observe(age.ravel(), count.ravel(), routed.ravel())
            if self._decoded < REFRESH_SETTLED or self._decoded % REFRESH_EVERY == 0:
                self._refresh()
        self._decoded += 1
        mine = self._all_misses + self._used
        theirs = self._shadow_misses
        if self._decoded == 1 and self._felt is not None:  # the cost verdict counts from here
            self._decode_mark = (self._now() if self._now is not None else 0.0, self._felt(), self._cost_s,
                                 mine, theirs)
        if self._decoded >= MIN_TOKENS:
            if mine > theirs + GUARD_SIGMAS * math.sqrt(max(theirs, 1)):
                self._to_lru(f"lru after {self._decoded} decode tokens: density missed {mine} "
                             f"(with its used prefetches) against the LRU shadow's {theirs}")
            elif self._felt is not None and self._decoded >= COST_VERDICT_FROM:
                self._judge_cost(self._felt, mine, theirs)

    def _judge_cost(self, felt: Callable[[], float], mine: int, theirs: int) -> None:
        """The ranking's cost verdict: when the CPU this policy has spent beyond ``coact``'s
        (:attr:`_cost_s`) exceeds what its lead over the LRU shadow could have saved, plus
        :data:`GUARD_SIGMAS` of the shadow's noise, at this policy's mean felt wait a miss
        (never more than all of the felt wait LRU would have had), and exceeds
        :data:`MATERIAL_SHARE` of the decode's time, LRU's eviction for good at one token
        cycle, S3-FIFO's above (module docstring, "What it costs")."""
        t0, felt0, cost0, mine0, theirs0 = self._decode_mark
        waited, spent, mine, theirs = felt() - felt0, self._cost_s - cost0, mine - mine0, theirs - theirs0
        elapsed = self._now() - t0 if self._now is not None else 0.0
        if mine <= 0 or spent <= MATERIAL_SHARE * elapsed:
            return
        per_miss = waited / mine
        lead = theirs - mine
        at_most = min(theirs, max(0.0, lead + GUARD_SIGMAS * math.sqrt(max(theirs, 1)))) * per_miss
        if at_most < spent:
            why = (f"after {self._decoded} decode tokens: the ranking cost {1e3 * spent:.0f} ms "
                   f"({100 * spent / max(elapsed, spent):.1f} % of the decode's time), "
                   f"more than the {1e3 * at_most:.0f} ms of felt wait its lead could have saved "
                   f"({lead} misses fewer than the LRU shadow's {theirs}, plus {GUARD_SIGMAS:g} sigma, "
                   f"at {1e3 * per_miss:.2f} ms of felt wait a miss; since the first decode token)")
            if self._horizon == 1:
                self._to_lru(f"lru {why}")
            else:
                self._to_s3(f"s3fifo {why}")

    def _to_lru(self, reason: str, overruled: bool = True, s3: bool = False) -> None:
        """The ranking retires for good: LRU's order evicts from here, or with ``s3`` S3-FIFO's
        queues (:meth:`_to_s3`); where the prefetch is off too, ``coact`` retires.  To LRU's
        order while ``coact``'s trial runs, at one token cycle of budget or less the trial
        stops (``_stop_trial``: a guess could displace only fresh experts there), above it
        counts its admissions again (``_restart_admissions``)."""
        self._lru, self._lru_reason = True, reason
        self._overruled = overruled
        self._s3 = S3Fifo(self._cycle_bytes, ((key, self._bytes[key]) for key in self._order)) if s3 else None
        self._shadow.clear()
        self._shadow_held = 0
        self._pending = []
        if not s3:  # the guard's victims are LRU's from here: what it admitted before says nothing
            if self._budget is not None and self._budget <= self._cycle_bytes:
                self._stop_trial("the eviction became LRU's at one token cycle of budget or less, "
                                 "where a guess could displace only the next layer's fresh experts")
            else:
                self._restart_admissions("the eviction became LRU's")
        if (not self._retired and self._trial is None and not self.prefetching and not self._engine_seen
                and (self._verdict or not self._width)):
            super()._retire()  # the trial had turned the prefetch off (or it never ran): LRU alone from here

    def _to_s3(self, reason: str) -> None:
        """The ranking retired for its cost above one token cycle: S3-FIFO's queues evict from
        here (``residency/_s3fifo.py``), the resident keys starting in main, LRU's order."""
        self._to_lru(reason, s3=True)

    def _hand_over(self) -> None:
        """LRU's own hooks only where LRU's order evicts: S3-FIFO's queues need this policy's."""
        if self._s3 is None:
            super()._hand_over()

    def on_routing(self, layer: int, rows: npt.NDArray[np.int64]) -> None:
        """A prompt's router rows: ``coact``'s learning, and each row one visit of the
        layer for the hazard table."""
        super().on_routing(layer, rows)
        pos = self._pos.get(layer)
        if self._lru or pos is None or rows.ndim != 2:
            return
        last, count, E = self._last[pos], self._count[pos], self._E
        for row in rows:
            picked = row[row >= 0]
            routed = np.zeros(E, dtype=bool)
            routed[picked] = True
            self._hz.observe(self._dv[pos] - 1 - last, count, routed)
            last[routed] = self._dv[pos]
            count[routed] += 1.0
            self._dv[pos] += 1
        self._cbin[pos] = count_bin(count) * AGE_MAX
        self._mirror(pos)
        self._rows_seen[pos] = True
        self._refresh()

    # ------------------------------------------------------------------ membership

    def on_request(self, key: Key, nbytes: int, hit: bool) -> None:
        super().on_request(key, nbytes, hit)
        if hit and self._s3 is not None:
            self._s3.hit(key)

    def on_insert(self, key: Key, nbytes: int) -> None:
        guess = self._admitting == key
        super().on_insert(key, nbytes)
        if self._s3 is not None:
            self._s3.insert(key, nbytes, guess)
        if self._retired:  # (retired, the eviction is LRU's for good: no ranking reads the mask)
            return
        p, e = self._where[key]
        flat = p * self._E + e
        self._res_bytes[flat] = 1
        if not self._lru:
            self._since_rank[flat] = None
            if len(self._since_rank) > RANK_FIRST * self._rerank:
                self._rank_epoch = -1  # so many new: the next victims rank afresh
                self._since_rank = {}

    def on_remove(self, key: Key) -> None:
        super().on_remove(key)
        if self._s3 is not None:
            self._s3.remove(key)
        if not self._retired:
            p, e = self._where[key]
            self._res_bytes[p * self._E + e] = 0

    def _unretire(self) -> None:
        super()._unretire()
        self._res_bytes[:] = bytes(len(self._res_bytes))
        for key in self._order:
            p, e = self._locate(key)
            self._res_bytes[p * self._E + e] = 1

    def victims(self) -> Iterator[Key]:
        if self._s3 is not None:
            return self._s3.victims()  # (the keys it was given)
        if self._lru:
            return iter(self._order)
        return self._ranked()

    def _ranked(self) -> Iterator[Key]:
        """The resident experts, lowest density first, from the ranking that serves the batch
        in progress (made by :meth:`prepare` while the engine computed on the batch before, or
        here at its first eviction; above one token cycle, up to :data:`RERANK_MAX` - 1
        batches earlier), each once.  Keys that left since are skipped; keys that came
        since (the batch's own loads, once published and released; a prefetch) follow, by
        their own density: every resident key is offered, or a miss could wait for room that
        an unranked key holds."""
        cur = self._batch_pos if self._batch_pos >= 0 else self._cur
        if not self._ranking_serves(self._epoch, cur):
            self._timed(self._rank, cur, self._epoch)
        res, E, layer_of = self._res_bytes, self._E, self._layers
        late = self._since_rank  # offered last, by their fresh densities
        # (the head and the tail are disjoint parts of one ranking: nothing is offered twice)
        head, at = self._rank_head, self._head_at
        while at < len(head) and (not res[head[at]] or head[at] in late):
            at += 1  # gone (evicted) or offered late until the next ranking: for good
        self._head_at = at
        for flat in head[at:] if at else head:
            if res[flat] and flat not in late:
                p, e = divmod(flat, E)
                yield (layer_of[p], e)
        if self._rank_tail is not None:
            density, idx, tail = self._rank_tail
            if isinstance(tail, np.ndarray):  # sorted once, when first needed
                tail = idx[tail[np.argsort(density[tail], kind="stable")]].tolist()
                self._rank_tail = (density, idx, tail)
            for flat in tail:
                if res[flat] and flat not in late:
                    p, e = divmod(flat, E)
                    yield (layer_of[p], e)
        if late:
            for flat in self._timed(self._late_order, late, cur):
                p, e = divmod(flat, E)
                yield (layer_of[p], e)

    def _late_order(self, late: dict[int, None], cur: int) -> list[int]:
        """The keys of ``late`` still resident, lowest density first (for a batch at ``cur``)."""
        res = self._res_bytes
        fresh = np.array([f for f in late if res[f]], dtype=np.int64)
        return fresh[np.argsort(self._densities_of(fresh, cur), kind="stable")].tolist() if fresh.size else []

    def _rank(self, cur: int, epoch: int) -> None:
        """Rank the resident experts for a batch at position ``cur``: the :data:`RANK_FIRST`
        lowest densities sorted, the rest only when a batch takes more (it takes a few)."""
        self._rank_epoch, self._rank_pos = epoch, cur
        self._since_rank = {}
        density, idx = self._densities(cur)
        first = min(RANK_FIRST, idx.size)
        if first < idx.size:
            part = np.argpartition(density, first - 1)
            head, self._rank_tail = part[:first], (density, idx, part[first:])
        else:
            head, self._rank_tail = np.arange(idx.size), None
        self._rank_head = idx[head[np.argsort(density[head], kind="stable")]].tolist()
        self._head_at = 0

    def _ranking_serves(self, epoch: int, cur: int) -> bool:
        """Whether the ranking at hand may serve the batch of ``epoch`` at position ``cur``:
        made for it, or (``_rerank`` > 1) for one of the ``_rerank - 1`` batches before it."""
        age = epoch - self._rank_epoch
        if self._rank_epoch < 0 or age < 0:
            return False
        if self._rerank > 1:
            return age < self._rerank
        return age == 0 and self._rank_pos == cur

    def prepare(self) -> None:
        """Between batches, while the engine computes: the next position's ranking, so that
        its misses find their victims ranked (unless the ranking at hand still serves it:
        :data:`RERANK_MAX`)."""
        if not self._lru and self._L and self._batch_pos >= 0:
            nxt, epoch = (self._batch_pos + 1) % self._L, self._epoch + 1
            if not self._ranking_serves(epoch, nxt):
                self._timed(self._rank, nxt, epoch)

    def _densities(self, cur: int) -> tuple[F64, I64]:
        idx = np.flatnonzero(self._res)
        return self._densities_of(idx, cur), idx

    def _densities_of(self, idx: I64, cur: int) -> F64:
        """The densities of the experts at flat indices ``idx`` for a batch at position
        ``cur``: the module docstring's formula; where every layer's experts have the same
        size, without its size factor (:attr:`_uniform`: the same order)."""
        pos = self._pos_flat[idx]
        age = np.minimum((self._dv - 1)[pos] - self._last.reshape(-1)[idx], AGE_MAX - 1)
        cls = age + self._cbin.reshape(-1)[idx]
        ahead = self._ahead[cur][pos]  # visits of layers until its next chance; L for this one
        held = ahead + self._extra_flat[cls]  # layer steps it would hold its bytes for
        if not self._uniform:  # (where every size is the same, a constant: see _uniform)
            held *= self._held_per_step[pos]
        density: F64 = self._phit_flat[cls] / held
        return density

    def _retire(self) -> None:
        """The prefetch is off for good: ``coact`` then stops its bookkeeping, which the
        ranking needs, so only once the eviction is LRU's too."""
        if self._lru:
            super()._retire()
        else:
            self._proposed.clear()

    def end_batch(self) -> list[Key] | None:
        """The batch's visit (:meth:`_visit`, off the engine's path while it computes), then
        ``coact``'s proposals; none once the trial turned the prefetch off, but not ``None``:
        the store goes on calling this and :meth:`prepare` between batches."""
        batch, pos = self._batch, self._batch_pos
        if self._lru:
            return super().end_batch()
        if batch and len(batch) <= self._k and self._applied != self._epoch:
            self._applied = self._epoch
            self._timed(self._visit, pos, batch, True)
        if self._trial is None and not self._prefetching and not self._engine_seen:
            self._proposed.clear()
            return []
        return super().end_batch()

    def _learn(self) -> None:
        if not self._lru and self._trial is None and not self._prefetching and not self._engine_seen:
            self._picked, self._tail = [], None  # no prefetch will read the co-activation
            return
        super()._learn()

    def check(self, keys: set[Key]) -> None:
        super().check(keys)
        if not self._L:
            return
        if not self._retired:  # (retired, nothing reads the mask: on_insert)
            mask = np.zeros_like(self._res)
            for key in keys:
                p, e = self._where[key]
                mask[p * self._E + e] = True
            require(bool(np.array_equal(mask, self._res)), "density: the resident mask does not track the resident set")
        require(self._last.tolist() == self._last_l and self._count.astype(np.int64).tolist() == self._count_l,
                "density: the lists of last routings and counts differ from their arrays")
        require(bool((self._last <= self._dv[:, None]).all()),
                "density: an expert was routed after its layer's last visit")
        require(self._budget is None or self._shadow_held <= self._budget,
                "density: the LRU shadow holds more than the budget")
        if self._s3 is not None:
            self._s3.check(set(keys))


__all__ = ["COST_VERDICT_FROM", "GUARD_SIGMAS", "MATERIAL_SHARE", "MIN_TOKENS", "MISS_FIXED_BYTES", "DensityPolicy"]
