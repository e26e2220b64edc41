"""The prefetch's trial: decode tokens alternate with and without it until their times say
whether it pays.

A prefetch saves felt wait and costs time elsewhere: its reads take the drive from the demand
reads, and on a few cores reader threads and the event loop take the GIL from a compute
thread. No accounting inside the store sees all of that; the token's time does. So the tokens
of the first :data:`TRIAL_PAIRS` pairs alternate ABBA (on, off, off, on: a drift in the drive's
speed cancels) and each pair gives

    net = (token time, with) - (without)
          - (misses with + used prefetches with - misses without) x price,

``price`` being the token's time outside compute (outside the time between batches) per
miss, measured on the token without: the last term takes out what the routing alone changes
between the two tokens. The verdict: off when the mean ``net`` is above zero by more than
:data:`OFF_SE` standard errors (from :data:`MIN_OFF_PAIRS` pairs); on when below zero by more
than :data:`T_975` standard errors (from :data:`MIN_TRIAL_PAIRS`); off after
:data:`TRIAL_PAIRS` pairs without so clear an answer (the burden of proof is on the prefetch);
off when its first pairs admitted no prefetch at all (nothing to prefetch at this budget).

A token's time between batches starts at a batch's end work; where that did not run (an
engine computing on the loop) the token is *blind*, and a pair with a blind token prices no
miss (``net`` is then the difference of the two token times).

Invariants: the trial's pairs are complete pairs (one token each way); the arm of a token is
set when its first layer's batch begins and stays for the token.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

TRIAL_PAIRS = 8
"""Pairs of decode tokens the trial runs at most: 16 tokens, half of the benchmarks' 32, so
that what the trial costs stays a few percent of a short run."""

MIN_TRIAL_PAIRS = 3
"""Pairs before the trial may keep the prefetch, or find nothing to prefetch: the fewest from
which a standard error means anything."""

MIN_OFF_PAIRS = MIN_TRIAL_PAIRS
"""Pairs before the trial may turn the prefetch off early (as many as to keep it)."""

T_975 = {2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365}
"""Student's t, 97.5th percentile, by degrees of freedom (pairs - 1): a prefetch that changes
nothing is kept by chance in at most 2.5 % of the looks."""

OFF_SE = 1.0
"""Standard errors above zero from which the prefetch is turned off early: off is ``lru``, the
side that cannot lose to ``lru``, so the burden of proof is on the prefetch (a prefetch that
changes nothing is turned off early in about 16 % of the looks)."""


@dataclass(frozen=True)
class TrialVerdict:
    """What the trial concluded: the prefetch ``on`` or off for good, and why."""

    on: bool
    why: str


class PrefetchTrial:
    """The ABBA trial of the next-layer prefetch, fed by the policy's batch and token events."""

    def __init__(self, now: Callable[[], float]) -> None:
        self._now = now
        self.pairs: list[float] = []
        """Per complete pair of decode tokens: ``net`` (module docstring)."""
        self.prefetching = True
        """The arm of the token in progress."""
        self.admitted = 0
        """Prefetches the guard admitted (since :attr:`restart`)."""
        self.restart: tuple[int, str] | None = None
        """The pairs when the count of admissions started again, and why (:meth:`restart_admissions`)."""
        self._decode_tokens = 0
        self._token_start: float | None = None
        self._gap_start: float | None = None
        """When the last batch ended (its leases held), until the next batch's first request."""
        self.gaps_s = 0.0
        self.misses = self.used = 0
        """The token in progress: its time between batches, its misses and used prefetches."""
        self.blind = False
        """Whether a decode batch of the token in progress closed without its batch-end work."""
        self.prompt = False
        """Whether a prompt batch (more than ``k`` experts) closed in the token in progress."""
        self._on: tuple[float, float, int, int, bool] = (0.0, 0.0, 0, 0, False)
        self._off: tuple[float, float, int, int, bool] = (0.0, 0.0, 0, 0, False)

    def batch_ended(self) -> None:
        """A batch's end work runs: the engine computes from here to the next batch."""
        self._gap_start = self._now()

    def batch_begins(self, after_decode: bool, first_layer: bool) -> TrialVerdict | None:
        """A batch begins (``after_decode``: the one before was a decode batch); at the first
        layer a token begins, and the one before it, a decode token, is judged."""
        if self._gap_start is not None:
            self.gaps_s += self._now() - self._gap_start
            self._gap_start = None
        elif after_decode:
            self.blind = True  # its batch-end work did not run: its gaps are unknown
        if not first_layer:
            return None
        now = self._now()
        verdict = None
        if after_decode and not self.prompt and self._token_start is not None:
            # a decode token: every batch of it was (a prompt's last batch can route k experts)
            verdict = self._token_done(now - self._token_start)
        self.prompt = False
        self._token_start = now
        self.gaps_s = 0.0
        self.misses = self.used = 0
        self.blind = False
        if verdict is None:
            self.prefetching = (self._decode_tokens % 4) in (0, 3)  # ABBA
        return verdict

    def restart_admissions(self, why: str) -> None:
        """The count of admitted prefetches starts again (the eviction's order changed, so the
        victims the guard weighs are no longer those it admitted over); a pair wholly after
        this that admitted nothing ends the trial as one with nothing to prefetch."""
        self.admitted = 0
        self.restart = (len(self.pairs), why)

    def _token_done(self, seconds: float) -> TrialVerdict | None:
        sample = (seconds, self.gaps_s, self.misses, self.used, self.blind)
        if self.prefetching:
            self._on = sample
        else:
            self._off = sample
        self._decode_tokens += 1
        if self._decode_tokens % 2:
            return None
        (t_on, _, misses_on, used_on, blind_on), (t_off, gaps_off, misses_off, _, blind_off) = self._on, self._off
        price = 0.0 if blind_on or blind_off else max(t_off - gaps_off, 0.0) / max(misses_off, 1)
        pairs = self.pairs
        pairs.append(t_on - t_off - (misses_on + used_on - misses_off) * price)
        n = len(pairs)
        if not self.admitted:
            # nothing admitted: the trial can only measure noise, and LRU alone costs less.
            # After a restart, from the first pair wholly after it.
            since = self.restart[0] + 2 if self.restart is not None else 0
            if n >= max(MIN_TRIAL_PAIRS, since):
                where = f"in the pairs since {self.restart[1]}" if self.restart else "in them"
                return TrialVerdict(False, f"prefetch off after {n} pairs of decode tokens: the guard admitted "
                                           f"no prefetch {where} (nothing to prefetch at this budget)")
            return None
        mean = sum(pairs) / n
        se = math.sqrt(sum((d - mean) ** 2 for d in pairs) / (n - 1) / n) if n > 1 else math.inf
        if n >= MIN_OFF_PAIRS and mean > OFF_SE * se:
            return self._verdict(False, se)
        if n >= MIN_TRIAL_PAIRS and mean < -T_975.get(n - 1, 2.0) * se:
            return self._verdict(True, se)
        if n >= TRIAL_PAIRS:
            return self._verdict(False, se)  # no clear answer: the burden of proof is on the prefetch
        return None

    def _verdict(self, on: bool, se: float) -> TrialVerdict:
        pairs = self.pairs
        mean, median = sum(pairs) / len(pairs), statistics.median(pairs)
        return TrialVerdict(on, f"prefetch {'on' if on else 'off'} after {len(pairs)} pairs of decode tokens: with "
                                f"it a token took {mean * 1e3:+.1f} ms (median {median * 1e3:+.1f} ms) beyond what "
                                f"its routing explains (standard error {se * 1e3:.1f} ms)")
