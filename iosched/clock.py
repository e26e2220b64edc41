"""Virtual time for the store: an event loop whose sleeps are skipped, and the store's clock.

Why: the engine's objective is critical-path time per token, and a real run measures it
through a disk whose speed swings 2-4x between minutes and a CPU the engine's compute shares.
A run on virtual time replaces the two things that are not the store with models (the drive:
``iosched.backends.modelled``; the compute: a sleep of the modelled length) and keeps
everything that *is* the store real: its residency table, policy, per-device queues,
priorities, pacing and prefetch rules, on its own orchestration.  ``iosched replay
--simulate --critical-path`` (``tools/critical_path.py``) is built on it, and an engine can run
its own loop against a store the same way in its tests.

:class:`VirtualTimeLoop` is a plain asyncio selector loop (not uvloop: its clock cannot be
swapped) with two changes:

* when nothing is ready and the next timer is ``t`` seconds away, it does not wait: it moves
  its clock ``t`` ahead (a sleep, a modelled read, a modelled layer's compute all take no
  wall time);
* its :meth:`~VirtualTimeLoop.time` is that skipped time plus, with ``charge_cpu=True`` (the
  default), the real time spent running Python on the loop (``time.perf_counter``): the
  store's and the policy's own CPU is *measured* and lands on the engine's critical path, as
  it would in a real engine.  With ``charge_cpu=False`` only skipped time counts: CPU is free,
  and the same inputs give the same numbers to the last digit (tests rely on that).

:meth:`~VirtualTimeLoop.uncharged` is for the simulator's own instruments (reading
``stats()`` per token): the real time spent inside it is taken back, so measuring costs the
simulated engine nothing.  While skipping is off (:attr:`~VirtualTimeLoop.skipping`, set by
:func:`run`'s caller around the measured part), the loop waits as any loop does, so set-up
that hands work to threads (``ExpertStore.open`` indexes the checkpoint in one) is not
disturbed.

Invariants: the loop's time never goes backwards; a skip is exactly the next timer's delay
(no timer fires early or late); :attr:`~VirtualTimeLoop.executor_calls` counts work handed to
threads while skipping was on, which a simulation must keep at zero (a thread's real time
would be skipped, not waited for).

:func:`now` and :func:`use` are the store's clock (``iosched/runtime/_clock.py``): the simulator runs
its loop under ``use(loop.time)`` so the store's felt wait, busy time and pacing are measured
in virtual seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import selectors
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping
from typing import Any, TypeVar

from .runtime._clock import now, use

__all__ = ["VirtualTimeLoop", "now", "run", "running_virtual_loop", "use"]

T = TypeVar("T")


class _SkippingSelector(selectors.BaseSelector):
    """The loop's selector, which skips the wait for the next timer instead of sleeping."""

    def __init__(self, inner: selectors.BaseSelector, loop: VirtualTimeLoop) -> None:
        self._inner = inner
        self._loop = loop

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._inner.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._inner.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._inner.modify(fileobj, events, data)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if not self._loop.skipping:
            return self._inner.select(timeout)
        ready = self._inner.select(0)
        if ready or (timeout is not None and timeout <= 0):
            return ready
        if timeout is None:  # no timer at all: only a thread or a signal can wake the loop
            return self._inner.select(None)
        self._loop._skip(timeout)
        return []

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return self._inner.get_map()

    def close(self) -> None:
        self._inner.close()


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An asyncio loop on virtual time (module docstring)."""

    def __init__(self, charge_cpu: bool = True, cpu_scale: float = 1.0) -> None:
        """``cpu_scale``: real time on the loop counts this many times over (``charge_cpu``):
        the simulator's measured slowdown of the store's Python where a real engine's reads
        and compute share the machine with it (``tools/critical_path.py``)."""
        if not 0 < cpu_scale < float("inf"):
            raise ValueError(f"cpu_scale must be a positive number, got {cpu_scale!r}")
        self.charge_cpu = charge_cpu
        self.cpu_scale = cpu_scale
        self.skipping = False
        """Whether waits for timers are skipped (off: the loop waits in real time)."""
        self.skipped_s = 0.0
        """Seconds of waiting skipped so far."""
        self.uncharged_s = 0.0
        """Real seconds taken back by :meth:`uncharged`."""
        self.executor_calls = 0
        """Work handed to threads while :attr:`skipping` was on (a simulation keeps it 0)."""
        self._frozen: float | None = None
        self._origin = time.perf_counter()
        super().__init__(_SkippingSelector(selectors.DefaultSelector(), self))

    def time(self) -> float:
        if self._frozen is not None:
            return self._frozen
        if self.charge_cpu:
            return (time.perf_counter() - self._origin - self.uncharged_s) * self.cpu_scale + self.skipped_s
        return self.skipped_s

    def _skip(self, seconds: float) -> None:
        self.skipped_s += seconds

    def advance(self, seconds: float) -> None:
        """The running callback took ``seconds`` more (modelled work that holds the loop, such
        as an engine's compute on the event loop): the clock moves on at once, and nothing
        else runs meanwhile, exactly as if the callback had computed that long."""
        if not seconds >= 0:
            raise ValueError(f"advance by {seconds!r}: a number of seconds >= 0")
        self.skipped_s += seconds

    @contextlib.contextmanager
    def uncharged(self) -> Iterator[None]:
        """Run the block off the virtual clock: its real time is taken back (the loop's time
        stands still meanwhile, so it never goes backwards)."""
        if self._frozen is not None:  # nested: the outer block takes it back
            yield
            return
        self._frozen = self.time()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.uncharged_s += time.perf_counter() - t0
            self._frozen = None

    # typeshed spells the arguments with a TypeVarTuple (3.11+); this loop only counts calls
    def run_in_executor(self, executor: Any, func: Callable[..., T],  # type: ignore[override]
                        *args: Any) -> asyncio.Future[T]:
        if self.skipping:
            self.executor_calls += 1
        return super().run_in_executor(executor, func, *args)


def run(main: Coroutine[Any, Any, T], charge_cpu: bool = True, cpu_scale: float = 1.0) -> T:
    """Run ``main`` to completion on a fresh :class:`VirtualTimeLoop`, with the store's clock
    on that loop's time.  ``main`` turns :attr:`VirtualTimeLoop.skipping` on for the part it
    simulates (``asyncio.get_running_loop()`` is the loop)."""
    loop = VirtualTimeLoop(charge_cpu, cpu_scale)
    try:
        with use(loop.time):
            return loop.run_until_complete(main)
    finally:
        with contextlib.suppress(Exception):
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        loop.close()


def running_virtual_loop() -> VirtualTimeLoop | None:
    """The running loop when it is a :class:`VirtualTimeLoop`, else ``None``."""
    loop = asyncio.get_running_loop()
    return loop if isinstance(loop, VirtualTimeLoop) else None
