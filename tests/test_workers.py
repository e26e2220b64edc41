"""``backends/_workers.py``: the thread backends' worker pool, on both event loops.

What it must keep from the executor it replaced: results and errors reach the awaiting task,
and a task cancelled while its call runs gets its ``CancelledError`` only once the call has
finished (a read still writing into a buffer the core would recycle)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from iosched.backends._workers import Workers


def _loops() -> list[Callable[[Coroutine[Any, Any, None]], None]]:
    runs: list[Callable[[Coroutine[Any, Any, None]], None]] = [asyncio.run]
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; plain asyncio still runs
        return runs
    runs.append(uvloop.run)
    return runs


LOOPS = _loops()


@pytest.fixture
def workers() -> Any:
    pool = Workers(2, "test-workers")
    yield pool
    pool.close()


@pytest.mark.parametrize("run", LOOPS)
def test_results_and_errors_reach_the_caller(run: Callable[[Coroutine[Any, Any, None]], None],
                                              workers: Workers) -> None:
    async def main() -> None:
        assert await workers.run(sum, [1, 2, 3]) == 6
        assert await workers.run(threading.current_thread) is not threading.current_thread()
        with pytest.raises(ValueError, match="invalid literal"):
            await workers.run(int, "x")
        # many at once: every one answered, in whatever order the threads finish
        got = await asyncio.gather(*(workers.run(pow, i, 2) for i in range(64)))
        assert got == [i * i for i in range(64)]

    run(main())


@pytest.mark.parametrize("run", LOOPS)
def test_a_cancelled_call_is_waited_for(run: Callable[[Coroutine[Any, Any, None]], None],
                                        workers: Workers) -> None:
    finished: list[float] = []

    def slow() -> str:
        time.sleep(0.2)
        finished.append(time.perf_counter())
        return "done"

    async def main() -> None:
        task = asyncio.ensure_future(workers.run(slow))
        await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert finished, "the cancellation was delivered before the call finished"
        # a timeout is a cancellation too
        with pytest.raises((TimeoutError, asyncio.TimeoutError)):
            await asyncio.wait_for(workers.run(slow), 0.02)
        assert len(finished) == 2

    run(main())


def test_close_runs_what_is_queued_and_stops_the_threads() -> None:
    pool = Workers(1, "test-close")
    done: list[int] = []
    for i in range(5):
        pool.submit(done.append, i)
    pool.submit(int, "not a number")  # an error nobody waits for is dropped, the worker goes on
    pool.submit(done.append, 5)
    pool.close()
    assert done == [0, 1, 2, 3, 4, 5]
    assert not any(t.name.startswith("test-close") for t in threading.enumerate())
    pool.close()  # idempotent


def test_a_result_for_a_closed_loop_is_dropped() -> None:
    pool = Workers(1, "test-closed-loop")
    started = threading.Event()
    release = threading.Event()

    def blocked() -> int:
        started.set()
        release.wait(5)
        return 1

    async def main() -> None:
        task = asyncio.ensure_future(pool.run(blocked))
        task._log_destroy_pending = False  # type: ignore[attr-defined]  # it stays pending: the point
        await asyncio.sleep(0)

    loop = asyncio.new_event_loop()
    loop.run_until_complete(main())
    assert started.wait(5)
    loop.close()
    release.set()
    pool.submit(lambda: None)
    pool.close()  # the worker survived posting to a closed loop
