"""The store's clock: every duration the core measures reads :func:`now`.

Why one swappable clock (trio's ``Clock``, in miniature): the critical-path replay
(``tools/critical_path.py``) runs the real store on an event loop whose time is virtual (its
sleeps are skipped, its reads are modelled), and the store's own measurements (felt wait,
drive busy time, the pacer's idle time, a load's service time) must then be taken on that
loop's clock, or they would see none of the time it skipped.  Outside a simulation this is
``time.perf_counter``: the finest clock there is, and the one the store always used.

Invariant: :func:`now` never goes backwards between two calls in one process, and it is
swapped only by :func:`use`, which restores the previous clock when its block ends (also on an
exception).  One simulation at a time per process: the swap is process-wide, and the event
loops of real stores must not run while a simulation holds it (the simulator runs its own
loop to completion inside the block).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

_now: Callable[[], float] = time.perf_counter


def now() -> float:
    """Seconds on the store's clock (an arbitrary origin: only differences mean anything)."""
    return _now()


@contextlib.contextmanager
def use(clock: Callable[[], float]) -> Iterator[None]:
    """Run the block with ``clock`` as the store's clock."""
    global _now
    previous, _now = _now, clock
    try:
        yield
    finally:
        _now = previous
