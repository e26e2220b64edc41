"""The policy's own CPU, on the store's clock: what its ranking costs the engine.

The visits and the rankings are Python and numpy on the event loop; where the reads cost the
engine little, no eviction order can save that much, so the default times its own work and
weighs it against the felt wait its lead could have saved (``_judge.py``). The clock is the
store's (``set_clock``: real time, or the critical-path replay's virtual time); without one
(the hit-rate replay) nothing is timed and nothing is judged by cost.

Invariant: :attr:`CostMeter.spent_s` only grows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

_T = TypeVar("_T")


class CostMeter:
    """Seconds spent in the work it timed, by the clock it was given."""

    def __init__(self) -> None:
        self.now: Callable[[], float] | None = None
        self.spent_s = 0.0

    def timed(self, kind: str, work: Callable[..., _T], *args: object) -> _T:
        """``work(*args)``, its time counted in :attr:`spent_s`; ``kind`` says what it is
        (``visit``, ``rank``, ``late``: the parts a measurement can tell apart)."""
        now = self.now
        if now is None:
            return work(*args)
        t0 = now()
        result = work(*args)
        self.spent_s += now() - t0
        return result
