"""Cross-layer co-activation: which experts of the next layer follow this layer's picks.

Why: one token's picks in layer ``l`` predict its picks in layer ``l + 1`` far better than
popularity does (on the bundled traces, the top-k by co-occurrence with the current picks name
50.8 % / 49.2 % of the next layer's experts, top-k by frequency 35.2 % / 36.8 %; measured in
docs/tried-and-dropped.md). That is what lets a prefetch issued while layer ``l`` computes land
before layer ``l + 1`` asks.

``counts[p, i, j]`` is how often expert ``j`` of the layer after position ``p`` was routed in
the same token as expert ``i`` of layer ``p``, and ``picks[p, i]`` how often ``i`` was a pick
whose next layer was learned; both learned online from decode-like batches (at most ``k``
experts, so a prefill batch of many tokens does not pair experts of different tokens) and,
when the engine passes the router's output (``ExpertStore.observe_routing``), from every
token of a batch of many, row by row (:meth:`learn_rows`): a prompt's tokens are routing
evidence like a decode token's, and before the first decode token they are all there is.
:meth:`predict` estimates each next-layer expert's probability of being routed as the mean,
over this token's picks ``i``, of ``P(j | i)``, each shrunk toward the next layer's popularity
by one pseudo-observation: ``(counts[p, i, j] + k x popularity(j)) / (picks[p, i] + 1)``.
Measured online on the bundled traces (top-k precision / log loss per expert and batch):
the plain sum of rows 50.3 % / 2.88 (qwen) and 49.1 % / 2.97 (gemma), the mean of
conditionals 55.4 / 2.65 and 53.8 / 2.73, with the shrinkage 54.2 / 2.35 and 52.5 / 2.40;
popularity alone 34.9 / 3.01 and 36.9 / 3.01. The shrunk one is the best calibrated, and the
policy weighs its probabilities against resident experts, so calibration is what counts.

Memory is ``layers x experts x experts`` float32 (3 MiB for 48 x 128); above
:data:`MAX_CELLS` cells the table is not kept and :meth:`predict` answers nothing (the policy
then prefetches nothing, which is always safe).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

F64 = npt.NDArray[np.float64]

MAX_CELLS = 1 << 24
"""64 MiB of float32: room for 256 layers of 128 experts, or 64 of 256."""


class CoActivation:
    def __init__(self, n_layers: int, n_expert: int) -> None:
        self.n_layers = n_layers
        self.n_expert = n_expert
        cells = n_layers * n_expert * n_expert
        self.counts: npt.NDArray[np.float32] | None = (
            np.zeros((n_layers, n_expert, n_expert), dtype=np.float32) if cells <= MAX_CELLS else None)
        self.picks = np.zeros((n_layers, n_expert))

    def learn_many(self, pairs: Sequence[tuple[int, Sequence[int], Sequence[int]]]) -> None:
        """Tokens that routed ``picks`` at layer position ``pos`` and ``next_picks`` at the
        next, one ``(pos, picks, next_picks)`` each (one scatter-add for them all)."""
        if self.counts is None or not pairs:
            return
        groups: dict[tuple[int, int], list[tuple[int, Sequence[int], Sequence[int]]]] = {}
        for pair in pairs:
            groups.setdefault((len(pair[1]), len(pair[2])), []).append(pair)
        for (n_picks, n_next), group in groups.items():
            if not n_picks or not n_next:
                continue
            self.learn_arrays(
                np.fromiter([p for p, _, _ in group], dtype=np.intp, count=len(group)),
                np.array([picks for _, picks, _ in group], dtype=np.intp).reshape(len(group), n_picks),
                np.array([nxt for _, _, nxt in group], dtype=np.intp).reshape(len(group), n_next))

    def learn_arrays(self, pos: npt.NDArray[np.intp], rows: npt.NDArray[np.intp],
                     next_rows: npt.NDArray[np.intp]) -> None:
        """Pair ``i`` is a token's picks ``rows[i]`` at layer position ``pos[i]`` and its picks
        ``next_rows[i]`` at the next position; one scatter-add for them all."""
        if self.counts is None or not pos.size:
            return
        # Flat cell numbers into the tables (C-contiguous, so reshape is a view): the same
        # cells, each += 1 as often as a three-index add.at of the nested loops would add it,
        # and the order of equal increments changes no sum.  (``np.add.at`` measured faster
        # than a fancy-indexed += for a token's 1,692 cells, numpy 2.4: 5 against 8 µs.)
        E = self.n_expert
        first = pos[:, None] * E + rows
        np.add.at(self.counts.reshape(-1), (first[:, :, None] * E + next_rows[:, None, :]).ravel(),
                  np.float32(1.0))
        np.add.at(self.picks.reshape(-1), first.ravel(), 1.0)

    def seed(self, arrays: Mapping[str, npt.NDArray[np.generic]], decay: float) -> None:
        """Add a saved history's table (its ``pairs`` and ``picks``), times ``decay``; a history
        saved without the table (too large to keep, :data:`MAX_CELLS`) seeds nothing."""
        pairs = arrays.get("pairs")
        if self.counts is not None and pairs is not None and pairs.shape == self.counts.shape:
            self.counts += np.float32(decay) * pairs.astype(np.float32)
            self.picks += decay * np.asarray(arrays["picks"], dtype=np.float64)

    def learn_rows(self, pos: int, rows: npt.NDArray[np.int64], next_rows: npt.NDArray[np.int64]) -> None:
        """Row ``t`` of ``rows`` (the experts token ``t`` routed at layer position ``pos``,
        padded with -1) pairs with row ``t`` of ``next_rows`` (its experts at the next
        layer): one scatter-add for a whole prompt, however long."""
        if self.counts is None or rows.shape[0] != next_rows.shape[0] or not rows.size:
            return
        a = np.broadcast_to(rows[:, :, None], (rows.shape[0], rows.shape[1], next_rows.shape[1]))
        b = np.broadcast_to(next_rows[:, None, :], a.shape)
        ok = (a >= 0) & (b >= 0)
        E = self.n_expert
        self.counts[pos] += np.bincount(a[ok] * E + b[ok], minlength=E * E).reshape(E, E).astype(np.float32)
        picked = rows[(next_rows >= 0).any(axis=1)]
        self.picks[pos] += np.bincount(picked[picked >= 0], minlength=E)

    def predict(self, pos: int, picks: Sequence[int], k: int, popularity: F64) -> F64 | None:
        """Probabilities of the next layer's experts being routed given this token's ``picks``
        at ``pos``; ``popularity`` is the next layer's distribution of picks (sums to 1).
        ``None`` when no transition from ``pos`` was learned yet."""
        if self.counts is None or not picks:
            return None
        idx = np.array(picks, dtype=np.intp)
        seen = self.picks[pos].take(idx)
        if not seen.any():
            return None  # nothing learned from ``pos`` for these picks yet
        # mean_i (counts[i, j] + k pop[j]) / (seen[i] + 1) is one weighted sum of the rows plus
        # the popularity term, (counts[rows]^T w)[j] + k pop[j] sum(w) over n with
        # w = 1 / (seen + 1): one matrix-vector product instead of three picks x experts
        # temporaries (7 against 11 us for 8 picks of 128 experts, numpy 2.4)
        w = np.reciprocal(seen + 1.0)
        total = float(np.add.reduce(w))
        out: F64 = np.dot(self.counts[pos].take(idx, axis=0).T, w)
        out += (k * total) * popularity
        out *= 1.0 / len(idx)
        np.minimum(out, 1.0, out=out)
        return out
