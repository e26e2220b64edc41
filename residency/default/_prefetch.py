"""The next-layer prefetch: at a decode batch's end, the next layer's likeliest experts, loaded
while the engine computes, under a guard that makes a guess pay for its victim.

- **Prediction**: the next layer's experts scored by the cross-layer co-activation of this
  token's picks (``residency/_cooc.py``, shrunk toward the layer's popularity), corrected by
  the measured precision (:attr:`NextLayerPrefetch.calibration`). The ``width`` likeliest
  that are not resident and beat chance (``k / E``) are proposed.
- **The guard** (:meth:`NextLayerPrefetch.admit`): into free bytes, any proposal. Over victims
  only when every victim is stale (its layer's last visit did not route it) and the guess's
  probability exceeds the measured probability that an evicted stale expert is asked for at
  its layer's next visit (:attr:`NextLayerPrefetch.stale_reuse`). A fresh victim is never
  displaced by a guess: at a batch's end LRU's oldest fresh experts are the next layer's
  own, routed one token ago (critical path, qwen, 1 TD: displacing them ran 0.966x ``lru``
  against 0.984x without a prefetch).
- **The engine's lookahead** (``ExpertStore.expect``): its probabilities stand in for the
  prediction until that layer's batch begins.
- **Learning**: a token's decode batches are kept; at its end one array of its picks gives
  the pairs and the counts, one scatter-add each; a prompt's router rows are learned row by
  row, so the first decode token already predicts.

Invariants (:meth:`NextLayerPrefetch.check`): the estimates are probabilities; stale victims
are remembered only while a guess may be admitted.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

from iosched._errors import StoreError, require

from .. import _history
from .._cooc import CoActivation
from .._policy import Key
from ._order import UseOrder
from ._walk import LayerWalk

REUSE_MEMORY = 100
"""Evictions the stale victims' reuse estimate spans (decay 1 - 1/100): long enough to smooth
single evictions, short enough to follow a budget that grows."""


class NextLayerPrefetch:
    """What the prefetch learned and proposed, and its guard's estimates."""

    def __init__(self, walk: LayerWalk, order: UseOrder) -> None:
        self._walk, self._order = walk, order
        L, E = walk.L, walk.E
        self.coact = CoActivation(L, E)
        self.popular = np.ones((L, E))
        """Per layer position and expert: its picks, plus one pseudo-pick."""
        self.picked: list[tuple[int, list[int]] | None] = []
        """This token's decode batches so far (``None``: a prompt's batch between them)."""
        self.tail: tuple[int, list[int]] | None = None
        """The last batch learned, when learned mid-token (``history``): the next pairs with it."""
        self.rows: tuple[int, npt.NDArray[np.int64]] | None = None
        """The last router rows seen (``on_routing``): the next layer's pair with them."""
        self.proposed: dict[Key, tuple[float, float]] = {}
        """The last batch end's proposals: their calibrated and raw probabilities."""
        self.admitting: Key | None = None
        """A guess admitted and about to be inserted (at the order's oldest end)."""
        self.expected: dict[int, npt.NDArray[np.float64]] = {}
        """The engine's lookahead per layer position, until its batch begins."""
        self.ghosts: OrderedDict[Key, int] = OrderedDict()
        """Evicted stale keys, and their layer's visit count when they left."""
        self._evicted = 1.0
        self._reused = walk.k / E if E else 0.0
        """Stale evictions, and those asked for at their layer's next visit (decayed; one
        pseudo-eviction, reused at chance)."""
        self.guesses: dict[Key, float | None] = {}
        """Prefetches admitted and not yet used or evicted, with their raw probability
        (``None``: the engine's, which the calibration leaves out)."""
        self._guessed_p = self._guessed_used = 0.0
        """Of the prefetches resolved (used, or evicted unused): the sum of their raw
        probabilities and how many were used."""

    @property
    def stale_reuse(self) -> float:
        """The measured probability that an evicted stale expert is asked for at its layer's
        next visit."""
        return self._reused / self._evicted

    @property
    def calibration(self) -> float:
        """Used prefetches per unit of predicted probability, over the resolved ones (one
        pseudo-observation at 1.0 before any)."""
        return (self._guessed_used + 1.0) / (self._guessed_p + 1.0)

    # ------------------------------------------------------------------ what the requests say

    def used(self, key: Key) -> None:
        """A guess was used (its key hit)."""
        guess = self.guesses.pop(key)
        if guess is not None:
            self._guessed_p += guess
            self._guessed_used += 1.0

    def missed(self, key: Key, p: int) -> None:
        """A miss on ``key``: a stale victim asked for at its layer's next visit counts."""
        left = self.ghosts.pop(key, None)
        if left is not None and self._walk.visits[p] - left <= 1:
            self._reused += 1.0

    def resolve(self, key: Key) -> None:
        """``key`` left the resident set: a guess still unused resolves as wasted."""
        guess = self.guesses.pop(key, None) if self.guesses else None
        if guess is not None:
            self._guessed_p += guess

    def evicted_stale(self, key: Key, p: int) -> None:
        """A stale ``key`` was evicted: remembered, to measure what evicting one costs."""
        ghosts = self.ghosts
        ghosts[key] = self._walk.visits[p]
        if len(ghosts) > max(len(self._order.stamps), 1):
            ghosts.popitem(last=False)
        decay = 1.0 - 1.0 / REUSE_MEMORY
        self._evicted = self._evicted * decay + 1.0
        self._reused *= decay

    def forget(self) -> None:
        """No guess will be weighed or proposed from here (the prefetch is off for good)."""
        self.ghosts.clear()
        self.proposed.clear()

    def retire(self) -> None:
        """Nothing is learned, weighed or resolved from here (LRU's order alone is kept): the
        token's picks and rows dropped, and a guess still resident forgotten."""
        self.forget()
        self.forget_picks()
        self.rows = None
        self.guesses.clear()

    # ------------------------------------------------------------------ learning

    def note_batch(self, pos: int, batch: list[int], decode: bool) -> None:
        """A batch closed: a decode batch joins this token's picks; a prompt's batch leaves a
        ``None`` there, so that its union pairs with nothing."""
        if decode:
            self.picked.append((pos, batch))
        elif batch:
            self.tail = None
            if self.picked and self.picked[-1] is not None:
                self.picked.append(None)

    def learn(self) -> None:
        """The token's pairs (neighbouring decode batches at neighbouring positions) into the
        co-activation table and its picks into the popularity counts, one scatter-add each."""
        seq, tail = self.picked, self.tail
        if not seq:
            return
        walk = self._walk
        self.picked = []
        # mid-token (``history``), the last batch is kept to pair with the next one
        self.tail = seq[-1] if seq[-1] is not None and seq[-1][0] != walk.L - 1 else None
        E, k, coact = walk.E, walk.k, self.coact
        if tail is not None:
            seq = [tail, *seq]
        new = slice(int(tail is not None), None)
        batches = [b for b in seq if b is not None]
        if len(batches) == len(seq) and all(len(b[1]) == k for b in batches):
            # the usual token: k picks at each layer, one array for the pairs and the counts
            picks = np.array([b[1] for b in batches], dtype=np.intp)
            pos = np.fromiter([b[0] for b in batches], dtype=np.intp, count=len(batches))
            ok = pos[1:] == pos[:-1] + 1
            coact.learn_arrays(pos[:-1][ok], picks[:-1][ok], picks[1:][ok])
            np.add.at(self.popular.reshape(-1), (pos[new, None] * E + picks[new]).ravel(), 1.0)
            return
        coact.learn_many([(a[0], a[1], b[1]) for a, b in itertools.pairwise(seq)
                          if a is not None and b is not None and b[0] == a[0] + 1])
        flat = [b[0] * E + e for b in seq[new] if b is not None for e in b[1]]
        if flat:
            np.add.at(self.popular.reshape(-1), flat, 1.0)

    def forget_picks(self) -> None:
        """The token's picks dropped unlearned (no prefetch will read the co-activation)."""
        self.picked, self.tail = [], None

    def learn_rows(self, pos: int, rows: npt.NDArray[np.int64]) -> None:
        """A prompt's router rows at position ``pos`` (validated): each token's picks pair
        with its picks at the layer before (never across the wrap, whose rows are other
        tokens')."""
        prev = self.rows
        if pos > 0 and prev is not None and prev[0] == pos - 1 and prev[1].shape[0] == rows.shape[0]:
            self.coact.learn_rows(pos - 1, prev[1], rows)
        picked = rows[rows >= 0]
        self.popular[pos] += np.bincount(picked, minlength=self._walk.E)
        self.rows = (pos, rows)

    # ------------------------------------------------------------------ proposing and admitting

    def propose(self, pos: int, batch: list[int], width: int, budget: int | None) -> list[Key]:
        """The next layer's likeliest experts that are not resident, best first, at most
        ``width``; none where no proposal could be admitted and pay (:meth:`_could_admit`)."""
        walk = self._walk
        nxt = pos + 1 if pos + 1 < walk.L else 0
        if not self._could_admit(nxt, width, budget):
            return []
        popular = self.popular[nxt]
        scores = self.coact.predict(pos, batch, walk.k, popular / np.add.reduce(popular))
        if scores is None:
            return []
        chance = walk.k / walk.E
        layer, stamps = walk.layers[nxt], self._order.stamps
        scale = self.calibration
        out: list[Key] = []
        top = np.argpartition(-scores, min(2 * width, walk.E - 1))[:2 * width]
        for j in top[np.argsort(-scores[top], kind="stable")].tolist():
            raw = float(scores[j])
            s = min(1.0, raw * scale)
            if s <= chance or len(out) >= width:
                break
            key = (layer, j)
            if key not in stamps:
                self.proposed[key] = (s, raw)
                out.append(key)
        return out

    def _could_admit(self, nxt: int, width: int, budget: int | None) -> bool:
        """Whether a proposal for position ``nxt`` could be admitted and pay: its last visit
        missed (else what it routes is resident), one of its experts is not resident, and
        there are free bytes for it or LRU's oldest expert is stale."""
        order, walk = self._order, self._walk
        if order.resident_in[nxt] >= walk.E or not walk.missed[nxt]:
            return False
        if budget is None or order.held + walk.expert_bytes[nxt] <= budget:
            return True
        return any(not order.fresh(key) for key in itertools.islice(order.stamps, width))

    def admit(self, key: Key, victims: Sequence[Key]) -> bool:
        """The guard (module docstring): whether a guess of ``key`` may displace ``victims``."""
        proposed = self.proposed.get(key)
        if proposed is None:
            proposed = self._engine_guess(key)
        if proposed is None:
            return not victims  # nobody's estimate: free bytes only
        if victims:
            if any(self._order.fresh(v) for v in victims):
                return False  # a fresh victim: never displaced by a guess
            if proposed[0] <= self.stale_reuse:
                return False
        self.admitting = key
        self.guesses[key] = proposed[1] if key in self.proposed else None
        return True

    def _engine_guess(self, key: Key) -> tuple[float, float] | None:
        if not self.expected or not isinstance(key, tuple) or len(key) != 2:
            return None
        walk = self._walk
        pos = walk.pos.get(key[0])
        expected = self.expected.get(pos) if pos is not None else None
        if expected is None or type(key[1]) is not int or not 0 <= key[1] < walk.E:
            return None
        p = float(expected[key[1]])
        return (p, p)

    # ------------------------------------------------------------------ usage history

    def history(self) -> dict[str, npt.NDArray[np.generic]]:
        """What the run learned, in ``moe``'s file format (``residency/_history.py``) less its
        hazard table: the shape, the picks per expert, the visits, the co-activation pairs."""
        walk, counts = self._walk, self.coact.counts
        return {
            "layers": np.array(walk.layers, dtype=np.int64), "n_expert": np.array(walk.E),
            "k": np.array(walk.k), "count": self.popular - 1.0,
            "visits": np.array(walk.visits, dtype=np.float64),
            "pairs": counts if counts is not None else np.zeros((0,), dtype=np.float32),
            "picks": self.coact.picks,
        }

    def load_history(self, arrays: Mapping[str, npt.NDArray[np.generic]], source: str) -> None:
        """Seed the co-activation table and the popularity from a saved history, decayed by
        half; a ``StoreError`` naming ``source`` and the field when it does not fit."""
        walk = self._walk
        _history.require_fits(arrays, source, {"layers": (walk.L,), "count": (walk.L, walk.E),
                                               "picks": (walk.L, walk.E)}, walk.layers, walk.E, walk.k)
        d = _history.HISTORY_DECAY
        self.popular += d * np.asarray(arrays["count"], dtype=np.float64)
        self.coact.seed(arrays, d)

    def check(self, guessing: bool) -> None:
        require(0.0 <= self.stale_reuse <= 1.0, "default: the stale reuse is not a probability")
        require(self.calibration > 0.0, "default: the calibration is not positive")
        require(guessing or not self.ghosts, "default: stale victims remembered with no guess to weigh")


def check_routing(owner: str, layer: int, pos: int | None, rows: npt.NDArray[np.int64], n_expert: int,
                  layers: Sequence[int]) -> int:
    """``layer``'s position; a ``StoreError`` naming ``owner`` when ``rows`` are not routing of a
    MoE layer of the model."""
    if pos is None:
        raise StoreError(f"policy '{owner}': routing for layer {layer}, not a MoE layer of "
                         f"this model (layers {layers[0]}..{layers[-1]})")
    if rows.ndim == 2 and rows.shape[0] > 1 and rows.size and (int(rows.max()) >= n_expert or int(rows.min()) < -1):
        raise StoreError(f"policy '{owner}': routing for layer {layer} names an expert "
                         f"outside 0..{n_expert - 1}")
    return pos
