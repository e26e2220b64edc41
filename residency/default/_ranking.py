"""The density ranking: victims by hit density, learned from the run (after LHD, Beckmann et
al., NSDI 2018, with the layer cycle).

On MoE routing an expert's chance of being routed again depends on its age *and* on how
often it was routed before, and its next chance comes only at its layer's next visit. So:

- **Reuse from the run** (``residency/_hazard.py``): at every decode visit of a layer each of
  its experts adds an exposure to its (age, count) class and a use when routed; a prompt's
  router rows count as visits too. A token's exposures are added at its end, in one bincount.
- **Density**: an expert of the layer ``d`` visits ahead (``d = L`` for the layer in
  progress) is worth ``P(routed within h visits) x (bytes + B0) / ((d + L x E[unused visits])
  x bytes)``, lowest first. ``bytes + B0`` is what its miss would cost (a request's latency
  plus its transfer, in bytes at the drive's bandwidth: :data:`MISS_FIXED_BYTES`), so the
  density is the critical-path time a held byte saves. The horizon ``h`` is the budget in
  token cycles (at least 1): about the visits an expert stays under LRU.
- **When the work runs**: a batch's visit and the ranking for the next layer run at the
  batch's end (while the engine computes); a ranking serves ``min(h, RERANK_MAX)`` batches,
  the experts routed or inserted since offered after it by their fresh densities.

Invariants (:meth:`DensityRanking.check`): the resident mask is exactly the resident set; the
Python lists of last routings and counts equal their arrays; no expert's last routing is
after its layer's visits.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import numpy.typing as npt

from iosched._errors import require

from .._hazard import AGE_MAX, COUNT_BIN_OF, HazardTable, count_bin
from .._policy import Key
from ._meter import CostMeter
from ._walk import LayerWalk

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]

RANK_FIRST = 32
"""Victims sorted at first (the rest only when taken): more than a layer's misses and the next
layer's prefetches take (``2 k``), so a batch sorts 32 of its ~300-1200 resident experts."""

RERANK_MAX = 4
"""The most batches one ranking serves. Hit-rate replay, 5 traces: ranking every 2 batches at
2 TD and every 4 from 4 TD kept the decode hits of ranking every batch within 0.1 point."""

REFRESH_SETTLED = 16
REFRESH_EVERY = 4
"""The density tables follow the hazard table at every decode token for the first 16 tokens,
then every 4th (hit-rate replay, 5 traces, 0.5-8 TD: decode hits within 0.1 point)."""

MISS_FIXED_BYTES = 256 << 10
"""``B0``: a miss's fixed cost in bytes at the drive's bandwidth (an NVMe read's ~80 us at
3 GB/s is 240 KB). Where every layer's experts have the same size the factor is a constant
and left out; with two sizes a layer it moved the same bytes as ``B0`` = 0 within 0.5 %."""

_CBIN_OFFSETS: list[int] = (COUNT_BIN_OF * AGE_MAX).tolist()
"""``count_bin(c) x AGE_MAX`` for the counts a run reaches (a lookup, not a numpy call)."""


def _cbin_offset(count: int) -> int:
    if count < len(_CBIN_OFFSETS):
        return _CBIN_OFFSETS[count]
    return int(count_bin(np.array([count], dtype=np.float64))[0]) * AGE_MAX


class DensityRanking:
    """The ranking's state over one model: ages, counts, the hazard table, the resident mask
    and the ranking in use."""

    def __init__(self, walk: LayerWalk, horizon: int) -> None:
        self._walk = walk
        L, E = walk.L, walk.E
        self._L, self._E = L, E
        self._hz = HazardTable()
        self.dv: I64 = np.zeros(L, dtype=np.int64)
        """Per layer position: its visits as the density counts them (decode batches and a
        prompt's rows)."""
        self._last: I64 = np.full((L, E), -AGE_MAX, dtype=np.int64)
        """Per layer position and expert: the visit that last routed it (``-AGE_MAX``: never)."""
        self._count: F64 = np.zeros((L, E))
        self._cbin: I64 = np.zeros((L, E), dtype=np.int64)
        """``count_bin(_count) x AGE_MAX``: the offset of an expert's row in the class tables."""
        self._last_l: list[list[int]] = [[-AGE_MAX] * E for _ in range(L)]
        self._count_l: list[list[int]] = [[0] * E for _ in range(L)]
        """``_last`` and ``_count`` as Python lists, kept equal to them: a decode visit reads and
        writes ``k`` entries, which scalar list accesses do for less than numpy calls."""
        self.resident = bytearray(L * E)
        """Flat (position x E + expert): resident (1) or not (0)."""
        self._res: npt.NDArray[np.bool_] = np.frombuffer(self.resident, dtype=np.bool_)
        self._pending: list[tuple[int, list[int], list[int], list[int]]] = []
        """This token's decode visits: position, experts, their last routing and count before."""
        self._phit_flat: F64 = np.zeros(0)
        """P(routed within the horizon) by class (count bin x AGE_MAX + age)."""
        self._extra_flat: F64 = np.zeros(0)
        """Layer steps held unused beyond the first chance, by class."""
        steps = np.arange(L)
        self._ahead: F64 = ((steps[None, :] - steps[:, None] - 1) % L + 1).astype(np.float64)
        """``[cur, p]``: layer steps from a batch at ``cur`` to position ``p``'s next visit."""
        self._uniform = len(set(walk.expert_bytes)) <= 1
        """Every layer's experts have the same bytes: the size factor is a constant, left out."""
        sizes = np.array(walk.expert_bytes, dtype=np.float64)
        self._held_per_step: F64 = sizes / (sizes + MISS_FIXED_BYTES)
        self._pos_flat: I64 = np.repeat(np.arange(L, dtype=np.int64), E)
        self._rows_seen = [False] * L
        self.horizon = 1
        self._rerank = 1
        """Batches one ranking serves: ``min(horizon, RERANK_MAX)``."""
        self.cur = 0
        """The position of the batch last visited."""
        self.epoch = 0
        """Batches closed: a ranking is valid for the epoch it was made for."""
        self.applied = -1
        """The epoch whose batch's visit ran at its end (its close then does not run it)."""
        self._rank_epoch = -1
        self._rank_pos = -1
        self._rank_head: list[int] = []
        """The ranking's :data:`RANK_FIRST` lowest densities, flat indices, in order."""
        self._head_at = 0
        """Where the head's keys still to offer begin."""
        self._rank_tail: tuple[F64, I64, I64 | list[int]] | None = None
        """The rest: unsorted until first needed, then in order."""
        self._since_rank: dict[int, None] = {}
        """Flat indices inserted, or (a ranking serving several batches) routed, since the
        ranking was made: offered after it, by their densities then."""
        self.set_horizon(horizon)

    def set_horizon(self, horizon: int) -> None:
        """The budget in token cycles, rounded, at least 1 (below :data:`AGE_MAX`)."""
        self.horizon = horizon
        self._rerank = min(horizon, RERANK_MAX)
        self._refresh()

    def _refresh(self) -> None:
        phit, extra = self._hz.density(self.horizon)
        self._phit_flat = phit.T.ravel()  # by class = count bin x AGE_MAX + age
        self._extra_flat = (self._L * extra).T.ravel()  # in layer steps: L a further visit

    # ------------------------------------------------------------------ what the run routes

    def visit(self, pos: int, batch: list[int], decode: bool) -> bool:
        """A batch complete: its visit into the ages and counts; whether it ended a decode
        token (the caller then calls :meth:`token_end`)."""
        self.cur = pos
        if decode:
            visit = int(self.dv[pos])
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
            self.dv[pos] = visit + 1
            return pos == self._L - 1
        if self._rows_seen[pos]:
            self._rows_seen[pos] = False  # the prompt's rows were its visits
        else:  # a prompt without its rows: one visit routing what it asked for
            experts = np.array(batch, dtype=np.int64)
            self._last[pos, experts] = self.dv[pos]
            self._count[pos, experts] += 1.0
            self._cbin[pos, experts] = count_bin(self._count[pos, experts]) * AGE_MAX
            self.dv[pos] += 1
            self._mirror(pos)
        return False

    def token_end(self, decoded: int) -> None:
        """A decode token's last layer (``decoded`` tokens before it): its visits' exposures
        into the hazard table (one bincount), the density tables refreshed."""
        pending, self._pending = self._pending, []
        if not pending:
            return
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
        age = (self.dv[pos] - 2)[:, None] - last  # visits idle before the one just made
        self._hz.observe(age.ravel(), count.ravel(), routed.ravel())
        if decoded < REFRESH_SETTLED or decoded % REFRESH_EVERY == 0:
            self._refresh()

    def observe_rows(self, pos: int, rows: npt.NDArray[np.int64]) -> None:
        """A prompt's router rows at position ``pos``: each row one visit of the layer."""
        last, count, E = self._last[pos], self._count[pos], self._E
        for row in rows:
            picked = row[row >= 0]
            routed = np.zeros(E, dtype=bool)
            routed[picked] = True
            self._hz.observe(self.dv[pos] - 1 - last, count, routed)
            last[routed] = self.dv[pos]
            count[routed] += 1.0
            self.dv[pos] += 1
        self._cbin[pos] = count_bin(count) * AGE_MAX
        self._mirror(pos)
        self._rows_seen[pos] = True
        self._refresh()

    def _mirror(self, pos: int) -> None:
        """Position ``pos``'s row of ``_last`` and ``_count`` into their lists."""
        self._last_l[pos] = self._last[pos].tolist()
        self._count_l[pos] = self._count[pos].astype(np.int64).tolist()

    # ------------------------------------------------------------------ membership

    def inserted(self, flat: int) -> None:
        self.resident[flat] = 1
        self._since_rank[flat] = None
        if len(self._since_rank) > RANK_FIRST * self._rerank:
            self._rank_epoch = -1  # so many new: the next victims rank afresh
            self._since_rank = {}

    def removed(self, flat: int) -> None:
        self.resident[flat] = 0

    # ------------------------------------------------------------------ the ranking

    def victims(self, cur: int, meter: CostMeter) -> Iterator[Key]:
        """The resident experts, lowest density first, for a batch at ``cur``, each once:
        the ranking that serves it (made now if none does, timed by ``meter``), then the keys
        that came since, by their fresh densities: every resident key is offered, or a miss
        could wait for room that an unranked key holds."""
        if not self._serves(self.epoch, cur):
            meter.timed("rank", self._rank, cur, self.epoch)
        res, E, layer_of = self.resident, self._E, self._walk.layers
        late = self._since_rank
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
            for flat in meter.timed("late", self._late_order, late, cur):
                p, e = divmod(flat, E)
                yield (layer_of[p], e)

    def prepare(self, nxt: int, epoch: int, meter: CostMeter) -> None:
        """The ranking for the batch of ``epoch`` at ``nxt``, unless the one at hand serves it."""
        if not self._serves(epoch, nxt):
            meter.timed("rank", self._rank, nxt, epoch)

    def _late_order(self, late: dict[int, None], cur: int) -> list[int]:
        res = self.resident
        fresh = np.array([f for f in late if res[f]], dtype=np.int64)
        return fresh[np.argsort(self._densities_of(fresh, cur), kind="stable")].tolist() if fresh.size else []

    def _rank(self, cur: int, epoch: int) -> None:
        """The :data:`RANK_FIRST` lowest densities sorted, the rest only when a batch takes more."""
        self._rank_epoch, self._rank_pos = epoch, cur
        self._since_rank = {}
        idx = np.flatnonzero(self._res)
        density = self._densities_of(idx, cur)
        first = min(RANK_FIRST, idx.size)
        if first < idx.size:
            part = np.argpartition(density, first - 1)
            head, self._rank_tail = part[:first], (density, idx, part[first:])
        else:
            head, self._rank_tail = np.arange(idx.size), None
        self._rank_head = idx[head[np.argsort(density[head], kind="stable")]].tolist()
        self._head_at = 0

    def _serves(self, epoch: int, cur: int) -> bool:
        """Whether the ranking at hand may serve the batch of ``epoch`` at ``cur``."""
        age = epoch - self._rank_epoch
        if self._rank_epoch < 0 or age < 0:
            return False
        if self._rerank > 1:
            return age < self._rerank
        return age == 0 and self._rank_pos == cur

    def _densities_of(self, idx: I64, cur: int) -> F64:
        """The densities of the experts at flat indices ``idx`` for a batch at ``cur``."""
        pos = self._pos_flat[idx]
        age = np.minimum((self.dv - 1)[pos] - self._last.reshape(-1)[idx], AGE_MAX - 1)
        cls = age + self._cbin.reshape(-1)[idx]
        ahead = self._ahead[cur][pos]  # visits of layers until its next chance; L for this one
        held = ahead + self._extra_flat[cls]  # layer steps it would hold its bytes for
        if not self._uniform:
            held *= self._held_per_step[pos]
        density: F64 = self._phit_flat[cls] / held
        return density

    def check(self, keys: set[Key]) -> None:
        mask = np.zeros_like(self._res)
        for key in keys:
            p, e = self._walk.where[key]
            mask[p * self._E + e] = True
        require(bool(np.array_equal(mask, self._res)), "default: the resident mask does not track the resident set")
        require(self._last.tolist() == self._last_l and self._count.astype(np.int64).tolist() == self._count_l,
                "default: the lists of last routings and counts differ from their arrays")
        require(bool((self._last <= self.dv[:, None]).all()),
                "default: an expert was routed after its layer's last visit")
