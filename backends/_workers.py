"""``Workers``: a fixed set of threads running a backend's blocking calls for the event loop.

Why not ``loop.run_in_executor`` on a ``ThreadPoolExecutor``: at the demo's 36 KiB experts,
served by the page cache in a few microseconds, the executor's machinery is most of a read's
cost.  Each read makes a ``concurrent.futures.Future`` (a ``threading.Condition`` each, taken
on both threads), chains it into an asyncio future (``wrap_future``, ``_chain_future``,
``_copy_future_state``), and awaiting it through ``asyncio.shield`` adds an outer future and two
callbacks.  docs/benchmarks.md, "The miss path's CPU cut": 85-95 µs of CPU a cached 36 KiB read
through the executor, 37-44 µs through this class.  No library offers this: ``aiofiles`` and
``anyio.to_thread`` are built on the same executor path.

A job is one tuple on a ``SimpleQueue``; the worker posts its result back with one
``call_soon_threadsafe``.  :meth:`Workers.undelivered` counts the calls that finished whose
awaiting coroutine has not resumed yet: their results sit in the loop's queue, and the core
lets them through before batch-end work it could run later (``iosched/runtime/_prefetch.py``).

**Invariant: :meth:`run` returns or raises only once the call has finished**, also when its
task is cancelled meanwhile: a read keeps writing into its buffer until the system call
returns, and the core must not recycle that buffer before then.  The future :meth:`run`
awaits refuses cancellation (:class:`_Completion`).  A task cancelled while awaiting it is
marked (asyncio's ``Task.cancel`` sets ``_must_cancel`` when the awaited future will not
cancel) and receives its ``CancelledError`` at that same ``await``, as soon as the result
arrives.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from queue import SimpleQueue
from typing import Any, TypeVar

T = TypeVar("T")

_STOP = None


class _Completion(asyncio.Future[Any]):
    """A future only its worker completes: a cancellation of the awaiting task is delivered
    when the call is over (see the module docstring), never by cancelling this future."""

    def cancel(self, msg: Any = None) -> bool:
        return False


def _set_result(fut: _Completion, result: Any) -> None:
    if not fut.done():
        fut.set_result(result)


def _set_exception(fut: _Completion, exc: Any) -> None:
    if not fut.done():
        fut.set_exception(exc)


class Workers:
    """``threads`` daemon threads, started at construction, stopped by :meth:`close`.

    Daemon threads, so that a store never closed does not keep the interpreter from exiting
    (the executor's threads are joined at exit); :meth:`close` lets the queued calls run,
    then joins every thread."""

    def __init__(self, threads: int, name: str) -> None:
        self._queue: SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...],
                                       asyncio.AbstractEventLoop | None, _Completion | None] | None]
        self._queue = SimpleQueue()
        self._posted = [0] * threads
        """Results each thread posted to a loop (one writer a slot: no lock needed)."""
        self._resumed = 0
        """Awaits of :meth:`run` that got their result (the loop's thread only)."""
        self._threads = [threading.Thread(target=self._work, args=(i,), name=f"{name}_{i}", daemon=True)
                         for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def _work(self, slot: int) -> None:
        get = self._queue.get
        posted = self._posted
        while (job := get()) is not _STOP:
            fn, args, loop, fut = job
            del job
            post: Callable[..., None]
            try:
                value: object = fn(*args)
                post = _set_result
            except BaseException as exc:  # delivered to the awaiting task, re-raised there
                value, post = exc, _set_exception
            del fn, args  # the buffer the call wrote is not held once the result is posted
            if loop is None or fut is None:  # submit(): nobody waits for it
                del fut, value
                continue
            posted[slot] += 1  # before the post: the count may lead, never trail, the loop's
            try:
                loop.call_soon_threadsafe(post, fut, value)
            except RuntimeError:  # the loop is closed: nobody awaits the call any more
                posted[slot] -= 1
            del fut, value

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a worker thread; see the module's invariant on cancellation."""
        loop = asyncio.get_running_loop()
        fut = _Completion(loop=loop)
        self._queue.put((fn, args, loop, fut))
        try:
            result: T = await fut
        finally:
            self._resumed += 1
        return result

    def undelivered(self) -> int:
        """Calls of :meth:`run` that finished in a thread and whose awaiting coroutine has not
        resumed yet (their results wait in the loop's queue); read on the loop's thread."""
        return max(0, sum(self._posted) - self._resumed)

    def submit(self, fn: Callable[..., object], *args: Any) -> None:
        """``fn(*args)`` in a worker thread, nobody waiting for it (an error is dropped, as an
        executor's future nobody reads drops it)."""
        self._queue.put((fn, args, None, None))

    def close(self) -> None:
        """Run what is queued, then stop and join every thread (idempotent)."""
        for _ in self._threads:
            self._queue.put(_STOP)
        for thread in self._threads:
            thread.join()
        self._threads = []
