"""``coact``: LRU's eviction, plus a prefetch of the next layer that pays for its victim.

Why a policy of its own: ``moe`` (``residency/moe.py``) prefetches the next layer into the
drive's idle time *and* ranks every resident expert by hit density.  On a few cores the
ranking costs the engine more than its decisions save in the I/O-bound cases (about 0.75 ms
a layer of miss-path Python in the real runs, docs/benchmarks.md).  This policy keeps the
prefetch and nothing else, at LRU's cost per request:

- **Eviction** is LRU's: the oldest use goes first (an ``OrderedDict``).
- **Prediction.** At a decode batch's end (one layer of one token, at most ``k`` experts) the
  next layer's experts are scored by the cross-layer co-activation of this token's picks
  (``residency/_cooc.py``, the table ``moe`` learns, shrunk toward the layer's popularity)
  and the scores corrected by the measured precision (:attr:`calibration`).  The
  ``prefetch_width`` likeliest (``k`` by default) that are not resident and beat chance
  (``k / E``) are proposed.
- **The guard** (``admit_prefetch``).  Into free bytes, any proposal.  Over victims only when
  every victim is *stale* (its layer's last visit did not route it) and the proposal's
  probability exceeds the measured probability that a stale victim is asked for at its
  layer's next visit (:attr:`stale_reuse`: evicted stale keys are remembered, and a miss on
  one at the next visit counts).  A *fresh* victim is never displaced by a guess.  At a
  batch's end LRU's oldest fresh experts are the next layer's own, routed one token ago.
  Displacing them for a guess about the same layer measured worse than not prefetching at one
  token cycle of budget: 0.966x against 0.984x ``lru``'s tokens/s, critical path, qwen,
  3 GB/s, compute 1 ms a layer (docs/residency.md, "`coact`").
- **Where a prefetch goes in the order**: at the *oldest* end.  When its layer's batch comes,
  a used prefetch is a hit and moves to the newest end like any hit (the store leases a
  batch's hits before its misses evict), and an unused one is the first victim, so a wrong
  guess costs one expert's bytes for one layer step and displaces nothing else.
- **No work that cannot pay**: when the next layer's last visit found all it routed resident,
  or no bytes are free and LRU's oldest experts are fresh, no proposal is computed (at one
  token cycle that is most batches; with what the model routes resident, every one).
- **Learning**: a token's decode batches are kept in a list; at its end one array of its
  picks gives the pairs (its picks at a layer, at the next) and the counts, one scatter-add
  each (about 45 µs a token on 48 layers); a prompt's router rows (``on_routing``) are learned
  row by row, so the first decode token already predicts.

With compute on the event loop and no await in it, the store skips the batch-end work (the
next batch begins first, ``iosched/_prefetch.py``) and this policy is LRU plus a visit count
per request.

Constants: the stale victims' reuse memory (:data:`REUSE_MEMORY`) is structural, like
``moe``'s horizon; chance (``k / E``) comes from the shape.  Nothing is fitted to a trace.

Invariants (:meth:`check`): the order holds exactly the table's admitted keys with a last use
never after its layer's visits; the held bytes are theirs; the estimates are probabilities;
the membership hooks are LRU's own exactly when retired and handed over (:meth:`_hand_over`).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import ClassVar

import numpy as np
import numpy.typing as npt

from iosched._errors import StoreError, require

from . import _history
from ._cooc import CoActivation
from ._policy import (
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
)
from .lru import LRUPolicy

_LRU_HOOKS = ("on_request", "on_insert", "on_remove", "victims")
"""The membership hooks a retired policy hands to LRU's own (:meth:`CoactPolicy._hand_over`)."""

REUSE_MEMORY = 100
"""Evictions the stale victims' reuse estimate spans (decay 1 - 1/100), as ``moe``'s horizon:
long enough to smooth single evictions, short enough to follow a budget that grows."""

TRIAL_PAIRS = 8
"""Pairs of decode tokens (one with the prefetch, one without) the trial runs at most: 16
tokens, half of the benchmarks' 32, so that what the trial costs (up to 8 tokens without a
prefetch that pays) stays a few percent of a short run."""

MIN_TRIAL_PAIRS = 3
"""Pairs before the trial may keep the prefetch early, or find nothing to prefetch: the fewest
from which a standard error means anything."""

MIN_OFF_PAIRS = MIN_TRIAL_PAIRS
"""Pairs before the trial may turn the prefetch off early: as many as it takes to keep it
(:data:`MIN_TRIAL_PAIRS`).  From 2 pairs for a while (session 25): there "the mean above one
standard error" is "both pairs above zero", a sign test, chosen while the prefetch never paid
at 4 TD with compute in a thread, so that an early "off" cost nothing.  Once a batch of
prefetches reused the slabs its evictions freed (``iosched/_slab.py``), it paid there
(1.010-1.014x ``lru`` over the whole trace where kept), and the sign test turned it off in one
run of six on +0.8 ms a token (standard error 0.3 ms), the rest of that run at 0.999x
(docs/benchmarks.md, session 26).  Alternated with the rule from 3 pairs while the prefetch did
not pay, the rule from 2 read the same within the noise (0.982-0.994x against 0.990-1.001x)."""

T_975 = {2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365}
"""Student's t, 97.5th percentile, by degrees of freedom (pairs - 1): the trial's threshold in
standard errors, so that a prefetch that changes nothing is turned off (or kept early) by
chance in at most 2.5 % of the looks (a normal 2-sigma rule on 3 pairs would in 9 %)."""

OFF_SE = 1.0
"""Standard errors above zero from which the trial turns the prefetch off early: the burden of
proof is on the prefetch.  Off is ``lru``, the side that cannot lose to ``lru``; a prefetch
kept wrongly costs every token after, and one tried too long costs its trial tokens (the
paired real runs, 576 KiB experts, 4 TD, compute in a thread: the trial's first 16 tokens at
0.85-0.91x ``lru``'s time, its verdict "off" only from the median of 8 pairs, 2026-12-02).  A
prefetch that changes nothing is turned off early so in about 16 % of the looks; one that
saves is kept by the same t rule as before (:data:`T_975`)."""


class CoactPolicy(BudgetAware, ShapeAware, BatchAware, PrefetchGuard, RoutingAware, CostAware,
                  HistoryKeeper, LookaheadAware):
    name: ClassVar[str] = "coact"
    capabilities: ClassVar[Capability] = (Capability.BUDGET | Capability.SHAPE | Capability.BATCHES
                                          | Capability.PREFETCH_GUARD | Capability.ROUTING
                                          | Capability.COST | Capability.HISTORY
                                          | Capability.LOOKAHEAD)

    def __init__(self, prefetch_width: int | None = None) -> None:
        """``prefetch_width``: experts proposed per batch at most; ``None`` is ``k``; 0 turns
        prefetching off (then it decides exactly as ``lru``)."""
        if prefetch_width is not None and (isinstance(prefetch_width, bool)
                                           or not isinstance(prefetch_width, int) or prefetch_width < 0):
            raise StoreError(f"policy 'coact': prefetch_width must be an integer >= 0, got {prefetch_width!r}")
        self._width_setting = prefetch_width
        self._width = 0
        self._order: OrderedDict[Key, int] = OrderedDict()
        """Resident keys, oldest use first, and their layer's visit count at that use."""
        self._bytes: dict[Key, int] = {}
        self._held = 0
        self._resident_in: list[int] = []
        """Per layer position: how many of its experts are resident."""
        self._budget: int | None = None
        self._pos: dict[int, int] = {}
        self._where: dict[Key, tuple[int, int]] = {}
        """Keys validated so far: their layer position and expert."""
        self._missed: list[bool] = []
        """Per layer position: whether its last visit had a miss."""
        self._layers: tuple[int, ...] = ()
        self._L = self._E = self._k = 0
        self._expert_bytes: list[int] = []
        self._coact: CoActivation | None = None
        self._popular = np.zeros((0, 0))
        """Per layer position and expert: its picks, plus one pseudo-pick."""
        self._visits: list[int] = []
        """Per layer position: its visits begun so far."""
        self._batch_pos = -1
        self._batch: list[int] = []
        self._visit_now = 0
        """The visit count of the batch in progress (its layer's)."""
        self._picked: list[tuple[int, list[int]] | None] = []
        """This token's decode batches so far (``None``: a prompt's batch between them),
        learned at its end (:meth:`_learn`)."""
        self._tail: tuple[int, list[int]] | None = None
        """The last batch learned, when learned mid-token (``history``): the next pairs with it."""
        self._rows: tuple[int, npt.NDArray[np.int64]] | None = None
        self._proposed: dict[Key, tuple[float, float]] = {}
        """The last batch end's proposals: their calibrated and raw probabilities."""
        self._admitting: Key | None = None
        self._expected: dict[int, npt.NDArray[np.float64]] = {}
        """The engine's lookahead (``on_expect``) per layer position, until its batch begins."""
        self._ghosts: OrderedDict[Key, int] = OrderedDict()
        """Evicted stale keys, and their layer's visit count when they left."""
        self._evicted = 1.0
        self._reused = 0.0
        """Stale evictions, and those asked for at their layer's next visit (decayed; one
        pseudo-eviction, reused at chance, from ``set_shape``)."""
        self._guesses: dict[Key, float | None] = {}
        """Prefetches admitted and not yet used or evicted, with their raw probability
        (``None``: the engine's, which the calibration leaves out)."""
        self._guessed_p = self._guessed_used = 0.0
        """Of the prefetches resolved (used, or evicted unused): the sum of their raw
        probabilities and how many were used."""
        self._now: Callable[[], float] | None = None
        self._prefetching = True
        """Whether the prefetch is on: for good after the trial, per token during it."""
        self._trial: list[float] | None = None
        """While the trial runs: per pair of decode tokens, ``net`` (see :meth:`_token_done`)."""
        self._decode_tokens = 0
        self._token_start: float | None = None
        self._gap_start: float | None = None
        """When the last batch ended (its leases held), until the next batch's first request."""
        self._tok_gaps_s = 0.0
        self._tok_misses = self._tok_used = 0
        """The token in progress: its time between batches, misses and used prefetches."""
        self._tok_blind = False
        """Whether a decode batch of the token in progress closed without its batch-end work
        (an engine computing on the loop): its time between batches is then unknown."""
        self._all_misses = 0
        """Demand misses since the start, until retired (``density``'s guard reads it)."""
        self._tok_prompt = False
        """Whether a prompt batch (more than ``k`` experts) closed in the token in progress."""
        self._pair_on: tuple[float, float, int, int, bool] = (0.0, 0.0, 0, 0, False)
        self._pair_off: tuple[float, float, int, int, bool] = (0.0, 0.0, 0, 0, False)
        self._verdict: str | None = None
        self._trial_admitted = 0
        """Prefetches the guard admitted while the trial ran (since :attr:`_trial_restart`)."""
        self._trial_restart: tuple[int, str] | None = None
        """The trial's pairs when its count of admissions started again, and why
        (:meth:`_restart_admissions`); ``None`` if it never did."""
        self._engine_seen = False
        """Whether the engine ever passed its own lookahead (``on_expect``)."""
        self._retired = False
        """LRU alone from here on (:meth:`_retire`): the trial turned the prefetch off for
        good and no engine lookahead was seen."""

    # ------------------------------------------------------------------ set-up

    def set_budget(self, budget_bytes: int) -> None:
        self._budget = budget_bytes

    def set_clock(self, now: Callable[[], float]) -> None:
        """The store's clock: decode tokens are timed and the trial runs (see
        :meth:`_token_done`).  Without one (the hit-rate replay) the prefetch is always on."""
        self._now = now
        if self._width and self._verdict is None:
            self._trial = []

    @property
    def cost_verdict(self) -> str | None:
        return self._verdict

    @property
    def prefetching(self) -> bool:
        """Whether the coming batch ends may propose prefetches."""
        return self._prefetching and bool(self._width)

    @property
    def _guessing(self) -> bool:
        """Whether a guess may still be admitted: the prefetch is on or on trial, or the engine
        passes its lookahead.  Else the stale victims' reuse, which only the guard reads, is
        not measured (``density`` keeps its ranking after the prefetch is off)."""
        return self._engine_seen or (bool(self._width) and (self._prefetching or self._trial is not None))

    def set_shape(self, shape: ModelShape) -> None:
        self._layers = tuple(shape.layers)
        self._pos = {layer: i for i, layer in enumerate(self._layers)}
        self._L, self._E, self._k = len(self._layers), shape.n_expert, shape.experts_per_token
        self._expert_bytes = [shape.expert_bytes[layer] for layer in self._layers]
        self._coact = CoActivation(self._L, self._E)
        self._popular = np.ones((self._L, self._E))
        self._visits = [0] * self._L
        self._missed = [True] * self._L
        self._resident_in = [0] * self._L
        self._reused = self._k / self._E
        self._width = self._k if self._width_setting is None else self._width_setting

    def adopt(self, resident: Sequence[tuple[Key, int]], visits: Sequence[int],
              coactivation: CoActivation, popularity: npt.NDArray[np.float64],
              sizes: dict[Key, int]) -> None:
        """Go on from a predecessor's state (``MoEPolicy.hand_over``, when ``default`` stops
        paying for ``moe``): the resident keys least recently routed first, each with its
        layer's visit count at that routing; the visits of each layer position; the
        co-activation table (taken over, not copied); the pick counts per layer (with a
        pseudo-pick each); each resident key's bytes.  After ``set_shape``, before requests."""
        require(bool(self._pos), "coact: adopt before set_shape")
        require(len(visits) == self._L and popularity.shape == (self._L, self._E)
                and (coactivation.n_layers, coactivation.n_expert) == (self._L, self._E),
                "coact: the state to adopt is of another shape")
        self._visits = [int(v) for v in visits]
        self._order = OrderedDict((key, int(used)) for key, used in resident)
        self._bytes = {key: sizes[key] for key in self._order}
        self._held = sum(self._bytes.values())
        self._resident_in = [0] * self._L
        for key in self._order:
            self._resident_in[self._pos_of(key)] += 1
        self._coact = coactivation
        self._popular = np.array(popularity, dtype=np.float64)

    @property
    def stale_reuse(self) -> float:
        """The measured probability that an evicted stale expert (one its layer's last visit
        did not route) is asked for at its layer's next visit."""
        return self._reused / self._evicted

    @property
    def calibration(self) -> float:
        """Used prefetches per unit of predicted probability, over the resolved ones: corrects
        the co-activation's estimate for the experts it is asked about, those LRU does not
        hold.  One pseudo-observation at 1.0 before any was resolved."""
        return (self._guessed_used + 1.0) / (self._guessed_p + 1.0)

    def _position(self, key: Key) -> int:
        try:
            return self._pos[key[0]]  # type: ignore[index]
        except (KeyError, TypeError, IndexError):
            raise StoreError(f"policy 'coact': key {key!r} is not (layer, expert) of a MoE "
                             f"layer of the model's shape") from None

    def _expert(self, key: Key) -> int:
        expert = key[1] if isinstance(key, tuple) and len(key) == 2 else None
        if type(expert) is not int or not 0 <= expert < self._E:
            raise StoreError(f"policy 'coact': key {key!r} is not (layer, expert) with an expert "
                             f"in 0..{self._E - 1}")
        return expert

    # ------------------------------------------------------------------ the Policy protocol

    def _locate(self, key: Key) -> tuple[int, int]:
        """Validate ``key`` once: its layer position and expert, remembered."""
        if not self._pos:
            raise StoreError("policy 'coact' needs the model's shape (set_shape) before requests")
        where = (self._position(key), self._expert(key))
        self._where[key] = where
        return where

    def _pos_of(self, key: Key) -> int:
        where = self._where.get(key)
        return (where if where is not None else self._locate(key))[0]

    def on_request(self, key: Key, nbytes: int, hit: bool) -> None:
        # The hot path (a hit inside the batch in progress) is a few dict operations: a
        # resident acquire costs this on every layer of every token (``iosched hitpath``).
        if self._retired:  # LRU's own work, nothing else
            if hit and key in self._order:
                self._order.move_to_end(key)
            return
        where = self._where.get(key)
        if where is None:
            where = self._locate(key)
        p, expert = where
        batch = self._batch
        if p != self._batch_pos or expert in batch:
            self._begin_batch(p)
            batch = self._batch
        batch.append(expert)
        if hit:
            order = self._order
            if key in order:
                order[key] = self._visit_now
                order.move_to_end(key)
            if self._guesses and key in self._guesses:
                self._guess_used(key)
        else:
            self._tok_misses += 1
            self._all_misses += 1
            self._missed[p] = True
            left = self._ghosts.pop(key, None)
            if left is not None and self._visits[p] - left <= 1:
                self._reused += 1.0

    def _begin_batch(self, p: int) -> None:
        """A request at another layer position (or repeating an expert): the batch in
        progress ends and one at ``p`` begins."""
        decode = self._close_batch()
        now = self._now if self._trial is not None else None  # only the trial reads the time
        if now is not None:
            if self._gap_start is not None:
                self._tok_gaps_s += now() - self._gap_start
                self._gap_start = None
            elif decode:
                self._tok_blind = True  # its batch-end work did not run: see _token_done
            if p == 0:
                self._token_begins(decode)
        self._batch_pos = p
        self._visits[p] += 1
        self._visit_now = self._visits[p]
        self._missed[p] = False
        if self._expected:
            self._expected.pop(p, None)

    def _guess_used(self, key: Key) -> None:
        guess = self._guesses.pop(key)
        self._tok_used += 1
        if guess is not None:
            self._guessed_p += guess
            self._guessed_used += 1.0

    def _close_batch(self) -> bool:
        """End the batch in progress; whether it was a decode batch (at most ``k`` keys).  A
        decode batch joins this token's picks (:meth:`_learn` pairs neighbours); a prompt's
        batch leaves a ``None`` there, so that its union pairs with nothing."""
        batch, pos = self._batch, self._batch_pos
        decode = bool(batch) and len(batch) <= self._k
        if decode:
            self._picked.append((pos, batch))
            if pos == self._L - 1:
                self._learn()
        elif batch:
            self._tail = None
            self._tok_prompt = True
            if self._picked and self._picked[-1] is not None:
                self._picked.append(None)
        self._batch = []
        self._batch_pos = -1
        return decode

    def _token_begins(self, after_decode: bool) -> None:
        """The first layer's batch begins: the token before it (if a decode token) is judged
        by the trial, and this one's arm is set."""
        if self._now is None:
            return
        now = self._now()
        if after_decode and not self._tok_prompt and self._token_start is not None:
            # a decode token: every batch of it was.  A prompt's last batch may look like one:
            # engines compute the last layer for the rows they need logits of, and the qwen
            # trace's prompt routes 6 experts (k) there; counting that prompt as a decode
            # token gave the trial's first pair seconds of noise (+7.6 s), which decided it.
            self._token_done(now - self._token_start)
        self._tok_prompt = False
        self._token_start = now
        self._tok_gaps_s = 0.0
        self._tok_misses = self._tok_used = 0
        self._tok_blind = False
        if self._trial is not None:
            # ABBA: on, off, off, on, ... so that a drift in the drive's speed cancels
            self._prefetching = (self._decode_tokens % 4) in (0, 3)

    def _token_done(self, seconds: float) -> None:
        """A decode token took ``seconds`` (its first layer's request to the next token's).

        **The trial.**  A prefetch saves felt wait and costs time elsewhere: its reads take
        the drive from the demand reads, and on a few cores reader threads and the event loop
        take the GIL and the cores from a compute thread (``moe``'s prefetching doubled the
        compute's time, docs/benchmarks.md).  No accounting inside the store sees all of
        that; the token's time does.  So the tokens of the first :data:`TRIAL_PAIRS` pairs
        alternate (ABBA) between prefetching and not, and each pair gives

            net = (token time, with) - (without)
                  - (misses with + used prefetches with - misses without) x price,

        the price of a miss being the token's time outside compute (outside the time between
        batches) per miss, measured on the token without.  The last term takes out what the
        routing alone changes between the two tokens: without the prefetch, the token with
        would have missed its misses plus its used prefetches.  If the mean ``net`` is above
        zero by more than :data:`OFF_SE` standard error (from :data:`MIN_OFF_PAIRS` pairs on)
        the prefetch is off for good, which leaves ``lru``; below zero by more than
        :data:`T_975` standard errors, on for good.  After :data:`TRIAL_PAIRS` pairs without
        so clear an answer, off: a prefetch whose saving the trial cannot tell from noise
        reads more bytes for nothing it can show (until session 37 the median pair decided
        there, on if not above zero: over the whole qwen trace at 4 TD, compute in a thread,
        the AMD EPYC VM, it kept the prefetch in 2 rounds of 2 on pairs of -5.3 and -14.6 ms
        a token, standard errors 15.1 and 13.9, and ``default`` ran at 0.985x and 0.974x
        ``lru``, issuing 4,201-4,619 prefetches of which 28 % were used, reading 13-15 % more
        bytes, its compute thread 6-10 % slower; docs/residency-notebook.md).

        The time between batches starts at a batch's end work (``end_batch``).  Where that
        did not run (an engine computing on the loop, whose all-hit batches give the loop no
        turn), the token's compute counted as its misses' time, which priced each miss at tens
        of ms and credited the prefetch's used loads with it: the trial kept a prefetch "saving
        36-48 ms a token" while ``default`` ran at 0.97-0.98x ``lru`` (qwen and gemma, 4 TD,
        io_uring, session 33).  A pair with such a token prices no miss: ``net`` is then the
        difference of the two token times, as ABBA pairs it.

        (The first trial compared the time between batches only, and priced the used
        prefetches at a miss.  It kept a prefetch whose reads slowed the demand reads: 207
        prefetches, 18 used, 0.965x ``lru``, critical path, synthetic trace s1, 3 GB/s,
        1 ms a layer, 4 TD, docs/residency-notebook.md.)"""
        trial = self._trial
        if trial is None:
            return
        sample = (seconds, self._tok_gaps_s, self._tok_misses, self._tok_used, self._tok_blind)
        if self._prefetching:
            self._pair_on = sample
        else:
            self._pair_off = sample
        self._decode_tokens += 1
        if self._decode_tokens % 2:
            return
        (t_on, _, misses_on, used_on, blind_on), (t_off, gaps_off, misses_off, _, blind_off) = \
            self._pair_on, self._pair_off
        # a token whose time between batches is not all known prices no miss (see above)
        price = 0.0 if blind_on or blind_off else max(t_off - gaps_off, 0.0) / max(misses_off, 1)
        trial.append(t_on - t_off - (misses_on + used_on - misses_off) * price)
        n = len(trial)
        if not self._trial_admitted:
            # its tokens had nothing to prefetch (at one token cycle every resident expert is
            # fresh): the trial can only measure noise, and LRU alone costs less.  After a
            # restart, from the first pair wholly after it (the one in progress began before)
            since = self._trial_restart[0] + 2 if self._trial_restart is not None else 0
            if n >= max(MIN_TRIAL_PAIRS, since):
                self._end_trial(False, trial, math.inf, nothing=True)
            return
        mean = sum(trial) / n
        se = math.sqrt(sum((d - mean) ** 2 for d in trial) / (n - 1) / n) if n > 1 else math.inf
        t = T_975.get(n - 1, 2.0)
        if n >= MIN_OFF_PAIRS and mean > OFF_SE * se:
            self._end_trial(False, trial, se)
        elif n >= MIN_TRIAL_PAIRS and mean < -t * se:
            self._end_trial(True, trial, se)
        elif n >= TRIAL_PAIRS:
            # no clear answer: the burden of proof is on the prefetch (see above)
            self._end_trial(False, trial, se)

    def _end_trial(self, on: bool, trial: list[float], se: float, nothing: bool = False) -> None:
        if nothing:
            since = f"in the pairs since {self._trial_restart[1]}" if self._trial_restart else "in them"
            verdict = (f"prefetch off after {len(trial)} pairs of decode tokens: the guard "
                       f"admitted no prefetch {since} (nothing to prefetch at this budget)")
        else:
            mean, median = sum(trial) / len(trial), statistics.median(trial)
            verdict = (
                f"prefetch {'on' if on else 'off'} after {len(trial)} pairs of decode tokens: with "
                f"it a token took {mean * 1e3:+.1f} ms (median {median * 1e3:+.1f} ms) beyond what "
                f"its routing explains (standard error {se * 1e3:.1f} ms)")
        self._close_trial(on, verdict)

    def _close_trial(self, on: bool, verdict: str) -> None:
        """The trial is over: the prefetch ``on`` or off for good, ``verdict`` says why; off,
        and without the engine's lookahead, the policy retires (:meth:`_retire`)."""
        self._trial = None
        self._prefetching = on
        self._verdict = verdict
        if not on and not self._engine_seen:
            self._ghosts.clear()  # no guess to weigh from here on (_guessing)
            self._retire()
            if self._retired:  # (``density`` retires only once its eviction is LRU's)
                self._verdict += "; LRU alone from here on"

    def _restart_admissions(self, why: str) -> None:
        """While the trial runs, its count of admitted prefetches starts again (``why``: the
        eviction's order changed, so the victims the guard weighs are no longer those it
        admitted over).  Where the guard then admits nothing in a pair wholly after this, the
        trial ends as one with nothing to prefetch: what it admitted over the ranking's
        victims says nothing of LRU's.  ``density`` calls it when its eviction turns to LRU's
        order above one token cycle of budget (the shadow's overrule); at one cycle or less
        it stops the trial instead (:meth:`_stop_trial`).  Measured at one token cycle, where
        it was first used (``density`` retired to LRU's order at tokens 3-6, paired real runs,
        qwen and gemma, session 49): in 12 of 12 runs the guard went on admitting in the pairs
        after the switch (over the ranking's leftovers, which are stale, then over unused
        guesses, 30 in the first token after it at qwen), so the trial ran on to 3-8 pairs, as
        before (docs/residency-notebook.md).  Kept above one cycle because the count it
        restarts is the trial's evidence that there is something to prefetch, and that
        evidence is of the order that evicts."""
        if self._trial is not None:
            self._trial_admitted = 0
            self._trial_restart = (len(self._trial), why)

    def _stop_trial(self, why: str) -> None:
        """While the trial runs, it ends now with the prefetch off (``why``: what left the
        guard no victim it may displace), and unless the engine passes its lookahead what is
        left is LRU's order (:meth:`_retire`).  ``density`` calls it when its eviction turns to
        LRU's order at a budget of one token cycle or less: there LRU's oldest experts at a
        batch's end are the next layer's own, routed one token ago (fresh: the module
        docstring's guard), and the guard admits only over the ranking's leftovers, unused
        guesses and the few experts that a layer of larger ones leaves stale.  Measured
        (paired real runs, 1 TD, 2.25 MiB experts, O_DIRECT, compute in a thread, eight rounds,
        session 50, docs/residency-notebook.md): with the count restarted instead
        (:meth:`_restart_admissions`) the trial ran 3-8 pairs at qwen, its tokens with the
        prefetch -12 to +20 ms beyond what their routing explains (median +8), and it ended
        with the prefetch off, as did every trial at one token cycle in the real runs of
        sessions 49-50 (46) and the critical path's 16 cells at 1 TD; stopped at the switch,
        qwen's first 16 tokens ran 6 ms above ``lru``'s against 80 (a second ``lru``: 10), its
        decode at 1.000x ``lru`` against 0.999x (paired medians).  At gemma, whose prefetch
        issues about a quarter as many guesses, the first 16 tokens ran 18 ms above ``lru``'s
        either way."""
        if self._trial is not None and not self._engine_seen:
            self._close_trial(False, f"prefetch off after {len(self._trial)} pairs of decode tokens: {why}")

    def _retire(self) -> None:
        """The prefetch is off for good and the engine passes no lookahead: what is left of
        this policy is LRU's order.  Its learning, batch bookkeeping and stale-eviction memory
        stop, and ``end_batch`` answers ``None``, so the store stops the batch-end work too
        (measured at one token cycle, where it never prefetches: the critical path charged it
        7-8 ms of CPU a token more than ``lru`` with the same hits, and paired real runs had it
        at 0.975-0.988x ``lru`` in 8 of 8, each arm on its own copy of the checkpoint,
        2026-12-02; after: 0.978-1.017x and 0.983-1.043x, docs/residency.md)."""
        self._retired = True
        self._picked, self._tail, self._rows = [], None, None
        self._batch, self._batch_pos = [], -1
        self._ghosts.clear()
        self._proposed.clear()
        self._hand_over()

    def _hand_over(self) -> None:
        """Retired, this policy is LRU's order and nothing else: its membership hooks become
        :class:`LRUPolicy`'s own, over this very order (its values each key's bytes from
        here), bound on the instance, where the table and the store look them up on each
        call; :meth:`_unretire` takes them back.  Why: even at its fewest (a check of
        ``_retired``, the held bytes, a subclass's layer above) the retired hooks cost a hit
        2.2x and a miss's insert and eviction 3x what LRU's do (225 against 109 ns, 579
        against 190, one core of the 2-core VM, a tight loop; 1.4x the whole request in the
        hit-rate replay, qwen 1 TD), and in paired real runs at one token cycle ``density``
        retired from the start ran 0.995 and 0.996x ``lru`` where a second ``lru`` ran
        1.000 (medians of 9 rounds, qwen and gemma, session 48, docs/residency-notebook.md);
        with LRU's own hooks, 1.002 and 1.000x, its loop CPU ``lru``'s within 0.3 ms a token
        (three rounds, beside a second ``lru``'s 1.002 and 0.993x).
        A guess still resident is forgotten (neither used nor wasted for :attr:`calibration`):
        a retired policy resolves no guess.  Once only: a second retirement finds it done."""
        if self._handed:
            return
        order = self._order
        for key in order:
            order[key] = self._bytes[key]  # (an existing key keeps its place)
        self._bytes, self._held = {}, 0
        self._guesses.clear()
        lru = LRUPolicy(order)
        for name in _LRU_HOOKS:
            setattr(self, name, getattr(lru, name))

    @property
    def _handed(self) -> bool:
        """Whether the membership hooks are LRU's own (:meth:`_hand_over`), bound on the
        instance: then the order's values are the keys' bytes, and ``_bytes`` and ``_held``
        are not kept."""
        return _LRU_HOOKS[0] in self.__dict__

    def _unretire(self) -> None:
        """The engine passes its lookahead after all (:meth:`on_expect`): the bookkeeping a
        retired policy skipped (its membership hooks keep only LRU's order and the held
        bytes; a retired ``density`` at 36 KiB ran 0.972-0.976x ``lru`` with all of it,
        session 45) is rebuilt.  Each resident expert counts as used at its layer's last
        visit: fresh, so that the guard keeps a guess from displacing it."""
        self._retired = False
        if self._handed:  # LRU's hooks give the membership back, the bytes kept in the order
            for name in _LRU_HOOKS:
                del self.__dict__[name]
            self._bytes = dict(self._order)
            self._held = sum(self._bytes.values())
        visits, resident_in = self._visits, [0] * self._L
        for key in self._order:
            p = self._pos_of(key)
            resident_in[p] += 1
            self._order[key] = visits[p]
        self._resident_in = resident_in

    def _learn(self) -> None:
        """Once a token: the token's pairs (neighbouring decode batches at neighbouring
        positions) into the co-activation table and its picks into the popularity counts,
        one scatter-add each."""
        seq, tail = self._picked, self._tail
        if not seq:
            return
        self._picked = []
        # mid-token (``history``), the last batch is kept to pair with the next one
        self._tail = seq[-1] if seq[-1] is not None and seq[-1][0] != self._L - 1 else None
        E, k, coact = self._E, self._k, self._coact
        if tail is not None:
            seq = [tail, *seq]
        new = slice(int(tail is not None), None)
        batches = [b for b in seq if b is not None]
        if len(batches) == len(seq) and all(len(b[1]) == k for b in batches):
            # the usual token: k picks at each layer, one array for the pairs and the counts
            picks = np.array([b[1] for b in batches], dtype=np.intp)
            pos = np.fromiter([b[0] for b in batches], dtype=np.intp, count=len(batches))
            if coact is not None:
                ok = pos[1:] == pos[:-1] + 1
                coact.learn_arrays(pos[:-1][ok], picks[:-1][ok], picks[1:][ok])
            np.add.at(self._popular.reshape(-1), (pos[new, None] * E + picks[new]).ravel(), 1.0)
            return
        if coact is not None:
            coact.learn_many([(a[0], a[1], b[1]) for a, b in itertools.pairwise(seq)
                              if a is not None and b is not None and b[0] == a[0] + 1])
        flat = [b[0] * E + e for b in seq[new] if b is not None for e in b[1]]
        if flat:
            np.add.at(self._popular.reshape(-1), flat, 1.0)

    def admit(self, key: Key, nbytes: int, victims: Sequence[Key] = ()) -> bool:
        return True

    def on_insert(self, key: Key, nbytes: int) -> None:
        if self._retired:  # LRU's order and the held bytes: the rest only the prefetch reads
            self._order[key] = 0
            self._bytes[key] = nbytes
            self._held += nbytes
            return
        p = self._pos_of(key)
        self._order[key] = self._visits[p]
        self._resident_in[p] += 1
        self._bytes[key] = nbytes
        self._held += nbytes
        if self._admitting == key:
            self._order.move_to_end(key, last=False)  # a guess: first to go if unused
            self._admitting = None

    def on_remove(self, key: Key) -> None:
        used = self._order.pop(key)
        self._held -= self._bytes.pop(key)
        guess = self._guesses.pop(key, None) if self._guesses else None
        if guess is not None:
            self._guessed_p += guess
        if self._retired:  # (no proposal nor ghost is kept once retired: _retire)
            return
        self._proposed.pop(key, None)
        p = self._pos_of(key)
        self._resident_in[p] -= 1
        if used < self._visits[p] and self._guessing:  # stale: remember it, to measure what evicting one costs
            self._ghosts[key] = self._visits[p]
            if len(self._ghosts) > max(len(self._order), 1):
                self._ghosts.popitem(last=False)
            decay = 1.0 - 1.0 / REUSE_MEMORY
            self._evicted = self._evicted * decay + 1.0
            self._reused *= decay

    def victims(self) -> Iterator[Key]:
        return iter(self._order)

    # ------------------------------------------------------------------ the optional abilities

    def end_batch(self) -> list[Key] | None:
        """The batch just made is complete: propose the next layer's likeliest experts that
        are not resident, best first; ``None`` once retired (:meth:`_retire`)."""
        if self._retired:
            return None
        batch, pos = self._batch, self._batch_pos
        if not batch:
            return []
        if self._now is not None and self._trial is not None:
            self._gap_start = self._now()  # the engine computes from here to the next batch
        if self._proposed:
            self._proposed.clear()
        coact = self._coact
        if coact is None or len(batch) > self._k or not (self._prefetching and self._width):
            return []
        nxt = pos + 1 if pos + 1 < self._L else 0
        if not self._could_admit(nxt):
            return []
        popular = self._popular[nxt]
        scores = coact.predict(pos, batch, self._k, popular / np.add.reduce(popular))
        if scores is None:
            return []
        chance = self._k / self._E
        layer, order, width = self._layers[nxt], self._order, self._width
        scale = self.calibration
        out: list[Key] = []
        top = np.argpartition(-scores, min(2 * width, self._E - 1))[:2 * width]
        for j in top[np.argsort(-scores[top], kind="stable")].tolist():
            raw = float(scores[j])
            s = min(1.0, raw * scale)
            if s <= chance or len(out) >= width:
                break
            key = (layer, j)
            if key not in order:
                self._proposed[key] = (s, raw)
                out.append(key)
        return out

    def _could_admit(self, nxt: int) -> bool:
        """Whether a proposal for position ``nxt`` could be admitted and pay: its last visit
        missed (else what it routes is resident: ``iosched hitpath`` with the batch-end work
        cut from ~35 to a few µs), one of its experts is not resident, and there are free bytes
        for it or LRU's oldest expert is stale (a guard that sees only fresh victims refuses)."""
        if self._resident_in[nxt] >= self._E or not self._missed[nxt]:
            # all resident, or its last visit found every expert it routed: a guess would
            # most likely be resident already (a budget that holds what the model routes)
            return False
        if self._budget is None or self._held + self._expert_bytes[nxt] <= self._budget:
            return True
        order, visits, pos = self._order, self._visits, self._pos
        return any(order[key] < visits[pos[key[0]]]  # type: ignore[index]
                   for key in itertools.islice(order, self._width))

    def prepare(self) -> None:
        return None

    def admit_prefetch(self, key: Key, nbytes: int, victims: Sequence[Key] = ()) -> bool:
        proposed = self._proposed.get(key)
        if proposed is None:
            proposed = self._engine_guess(key)
        if proposed is None:
            return not victims  # nobody's estimate: free bytes only
        if victims:
            order, visits, pos = self._order, self._visits, self._pos
            if any(order[v] >= visits[pos[v[0]]] for v in victims):  # type: ignore[index]
                return False  # a fresh victim: never displaced by a guess
            if proposed[0] <= self.stale_reuse:
                return False
        self._admitting = key
        self._guesses[key] = proposed[1] if key in self._proposed else None
        self._trial_admitted += 1
        return True

    def on_expect(self, layer: int, probabilities: npt.NDArray[np.float64]) -> None:
        """The engine's estimate for ``layer``'s next batch (``ExpertStore.expect``): the
        store proposes its likely experts, and the guard weighs them by the engine's
        probability (not calibrated: the engine's own) until that layer's batch begins.  A
        retired policy takes up its bookkeeping again (the store's batch-end work stays off:
        the engine's own estimates are issued without it)."""
        self._engine_seen = True
        if self._retired:
            self._unretire()
        pos = self._pos.get(layer)
        if pos is not None and probabilities.shape == (self._E,):
            self._expected[pos] = probabilities

    def _engine_guess(self, key: Key) -> tuple[float, float] | None:
        if not self._expected or not isinstance(key, tuple) or len(key) != 2:
            return None
        pos = self._pos.get(key[0])
        expected = self._expected.get(pos) if pos is not None else None
        if expected is None or type(key[1]) is not int or not 0 <= key[1] < self._E:
            return None
        p = float(expected[key[1]])
        return (p, p)

    def on_routing(self, layer: int, rows: npt.NDArray[np.int64]) -> None:
        """A prompt's router rows: each token's picks at this layer pair with its picks at
        the layer before (never across the wrap, whose rows are other tokens')."""
        pos = self._pos.get(layer)
        if self._coact is not None and pos is None:
            raise StoreError(f"policy 'coact': routing for layer {layer}, not a MoE layer of "
                             f"this model (layers {self._layers[0]}..{self._layers[-1]})")
        if self._coact is None or pos is None or rows.ndim != 2 or rows.shape[0] <= 1:
            return
        if rows.size and (int(rows.max()) >= self._E or int(rows.min()) < -1):
            raise StoreError(f"policy 'coact': routing for layer {layer} names an expert "
                             f"outside 0..{self._E - 1}")
        prev = self._rows
        if pos > 0 and prev is not None and prev[0] == pos - 1 and prev[1].shape[0] == rows.shape[0]:
            self._coact.learn_rows(pos - 1, prev[1], rows)
        picked = rows[rows >= 0]
        self._popular[pos] += np.bincount(picked, minlength=self._E)
        self._rows = (pos, rows)

    # ------------------------------------------------------------------ usage history

    @property
    def pinned_experts(self) -> int:
        """None: a history seeds the co-activation table and the popularity, and pins nothing
        (LRU's order is the run's own)."""
        return 0

    def history(self) -> dict[str, npt.NDArray[np.generic]]:
        """What the run learned, in ``moe``'s file format (``residency/_history.py``) less its
        hazard table: the shape, the picks per expert, the visits, the co-activation pairs."""
        if self._coact is None:
            raise StoreError("policy 'coact' has no shape, hence no history")
        self._learn()
        counts = self._coact.counts
        return {
            "layers": np.array(self._layers, dtype=np.int64), "n_expert": np.array(self._E),
            "k": np.array(self._k), "count": self._popular - 1.0,
            "visits": np.array(self._visits, dtype=np.float64),
            "pairs": counts if counts is not None else np.zeros((0,), dtype=np.float32),
            "picks": self._coact.picks,
        }

    def load_history(self, arrays: Mapping[str, npt.NDArray[np.generic]], source: str) -> None:
        """Seed the co-activation table and the popularity from a saved history (this policy's
        or ``moe``'s), decayed by half as ``moe`` does; a ``StoreError`` naming ``source`` and
        the field when it does not fit this model."""
        if self._coact is None:
            raise StoreError("policy 'coact' needs its shape before a history")
        L, E = self._L, self._E
        _history.require_fits(arrays, source, {"layers": (L,), "count": (L, E), "picks": (L, E)},
                              self._layers, E, self._k)
        d = _history.HISTORY_DECAY
        self._popular += d * np.asarray(arrays["count"], dtype=np.float64)
        self._coact.seed(arrays, d)

    def check(self, keys: set[Key]) -> None:
        require(set(self._order) == keys, "coact: the LRU order does not track the resident set")
        require(self._handed or (set(self._bytes) == keys and self._held == sum(self._bytes.values())),
                "coact: the held bytes do not track the resident set")
        bound = [name in self.__dict__ for name in _LRU_HOOKS]
        require(all(bound) or not any(bound), "coact: some membership hooks are LRU's, some not")
        require(not self._handed or self._retired, "coact: hooks handed to LRU's while not retired")
        if not self._retired:  # (retired, the membership hooks keep only the order and the bytes)
            per_layer = [0] * self._L
            for key, used in self._order.items():
                p = self._pos_of(key)
                per_layer[p] += 1
                require(used <= self._visits[p], f"coact: {key!r} was used after its layer's last visit")
            require(per_layer == self._resident_in, "coact: the per-layer resident counts are off")
        require(0.0 <= self.stale_reuse <= 1.0, "coact: the stale reuse is not a probability")
        require(self.calibration > 0.0, "coact: the calibration is not positive")
        require(not self._retired or (self._trial is None and not self.prefetching),
                "coact: retired with the trial running or the prefetch on")
        require(self._guessing or not self._ghosts, "coact: stale victims remembered with no guess to weigh")


__all__ = ["REUSE_MEMORY", "CoactPolicy"]
