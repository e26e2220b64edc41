"""``acquire_as_ready(...).in_thread()``: a group's batches taken in the engine's compute
thread, in the order and with the errors ``async for`` gives, every lease held until the group
exits, the thread's blocked time counted as felt wait, and never a released view handed over."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from iosched import ExpertStore, StoreError, ThreadArrivals
from iosched.tools import compute, demo
from iosched.tools.synth import write_safetensors_moe
from tests._wrappers import GatedBackend
from tests.conftest import last_expert_cut_short
from tests.test_acquire_as_ready import (
    HeldReads,
    _loaded,
    _make_resident,
    _open,
    _release,
    check_after_a_failed_load,
)
from tests.test_store import expected_bytes

pytestmark = pytest.mark.asyncio

Key = tuple[int, int]


class Taker:
    """A thread taking a group's batches (``in_thread()``), checking each view's bytes there."""

    def __init__(self, store: ExpertStore, arrivals: ThreadArrivals) -> None:
        self.store, self.arrivals = store, arrivals
        self.batches: list[list[Key]] = []
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                views = next(self.arrivals)
            except StopIteration:
                return
            except StoreError as exc:  # a failed acquire: named, and the others still come
                self.errors.append(exc)
                continue
            for view in views:
                assert view.data.tobytes() == expected_bytes(self.store.index, view.key)
            self.batches.append([view.key for view in views])

    async def until(self, batches: int) -> None:
        for _ in range(5000):
            if len(self.batches) >= batches:
                return
            await asyncio.sleep(0.001)
        raise AssertionError(f"the thread took {self.batches}, waited for {batches} batches")

    async def join(self) -> None:
        await asyncio.to_thread(self.thread.join, 10.0)
        assert not self.thread.is_alive()


async def test_the_thread_gets_the_resident_first_then_each_load_as_it_lands(st_checkpoint: Path) -> None:
    backend = HeldReads()
    async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, backend=backend,
                                      policy="lru") as store:
        await _make_resident(store, backend, (0, 0))
        felt = store.request_tally.felt_wait_s
        try:
            async with store.acquire_as_ready([(0, 1), (0, 0), (0, 2)]) as arrivals:
                batches = arrivals.in_thread()
                taker = Taker(store, batches)
                await taker.until(1)
                assert taker.batches == [[(0, 0)]]  # resident: no read needed
                assert store.stats()["loading"] == 2 and store.stats()["leased"] == 1
                for _ in range(5000):  # until the thread waits for its next batch
                    if batches.blocked:
                        break
                    await asyncio.sleep(0.001)
                await asyncio.sleep(0.02)  # the thread blocks meanwhile: felt
                assert batches.blocked  # the store sees the wait as it runs
                assert store._acquirer.felt_so_far() - felt >= 0.015
                _release(store, backend, (0, 2))
                await taker.until(2)
                assert taker.batches[1] == [(0, 2)]
                assert store.stats()["leased"] == 2  # (0, 0) stays leased: every lease until exit
                _release(store, backend, (0, 1))
                await taker.join()  # the last load ends the iteration
                assert taker.batches == [[(0, 0)], [(0, 2)], [(0, 1)]] and not taker.errors
                assert store.stats()["leased"] == 3
        finally:
            _open(backend)
        s = store.stats()
        assert s["leased"] == 0 and (s["requests"], s["hits"], s["misses"]) == (4, 1, 3)
        assert store.request_tally.felt_wait_s - felt >= 0.015  # counted at the group's exit
        store.check_invariants()


async def test_loads_landed_before_the_thread_asks_come_in_one_batch_without_felt_wait(
        st_checkpoint: Path) -> None:
    """Each batch holds every expert in by the time the thread asks: here the resident one
    and the two loads that landed before it asked, together."""
    backend = HeldReads()
    async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, backend=backend,
                                      policy="lru") as store:
        await _make_resident(store, backend, (1, 0))
        felt = store.request_tally.felt_wait_s
        async with store.acquire_as_ready([(1, 0), (1, 1), (1, 2)]) as arrivals:
            batches = arrivals.in_thread()
            _open(backend)
            await _loaded(store, 0)
            await asyncio.sleep(0.01)  # the done callbacks run
            taker = Taker(store, batches)
            await taker.join()
        assert len(taker.batches) == 1 and taker.batches[0][0] == (1, 0)  # the resident first
        assert sorted(taker.batches[0]) == [(1, 0), (1, 1), (1, 2)]  # (the loads in the order they landed)
        assert store.request_tally.felt_wait_s == felt  # the thread never blocked
        assert store.stats()["leased"] == 0


async def test_a_failed_load_is_raised_in_the_thread_and_the_others_still_come(st_copy: Path) -> None:
    async with await ExpertStore.open(st_copy, budget_bytes=1 << 20, policy="lru") as store:
        with last_expert_cut_short(store) as (bad, good, path):
            async with store.acquire_as_ready([*good, bad]) as arrivals:
                taker = Taker(store, arrivals.in_thread())
                await taker.join()
        await check_after_a_failed_load(store, [k for batch in taker.batches for k in batch], taker.errors,
                                        bad, good, path)


async def test_a_thread_blocked_when_the_group_exits_is_woken_and_stops(st_checkpoint: Path) -> None:
    backend = GatedBackend()
    async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, backend=backend,
                                      policy="lru") as store:
        async with store.acquire_as_ready([(2, 1), (2, 2)]) as arrivals:
            taker = Taker(store, arrivals.in_thread())
            await asyncio.sleep(0.02)  # blocked: nothing landed
            assert taker.thread.is_alive()
        await taker.join()  # the exit woke it: no batch, no error
        assert taker.batches == [] and not taker.errors
        assert store.stats()["leased"] == 0 and store.stats()["loading"] == 2
        backend.gate.set()
        await _loaded(store, 0)  # the loads went on
        assert store.stats()["resident_experts"] == 2
        store.check_invariants()


async def test_a_batch_taken_after_the_exit_is_refused(st_checkpoint: Path) -> None:
    """The group's exit released the first batch's leases: the thread gets a ``StoreError``,
    never views whose buffers the store may reuse."""
    backend = HeldReads()
    async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, backend=backend,
                                      policy="lru") as store:
        await _make_resident(store, backend, (3, 4))
        try:
            async with store.acquire_as_ready([(3, 4), (3, 5)]) as arrivals:
                batches = arrivals.in_thread()
        finally:
            _open(backend)
        with pytest.raises(StoreError, match="exited before its thread took"):
            await asyncio.to_thread(next, batches)
        assert store.stats()["leased"] == 0
        store.check_invariants()


async def test_on_the_loop_and_twice_it_is_refused(st_checkpoint: Path) -> None:
    async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, policy="lru") as store:
        async with store.acquire_as_ready([(2, 4), (2, 5)]) as arrivals:
            batches = arrivals.in_thread()
            with pytest.raises(StoreError, match="compute thread"):
                next(batches)  # on the loop it would block the very loads it waits for
            with pytest.raises(StoreError, match="already taken"):
                arrivals.in_thread()
            with pytest.raises(StoreError, match="iterate there"):
                await anext(aiter(arrivals))
            got = await asyncio.to_thread(lambda: [k for views in batches for k in (v.key for v in views)])
        assert sorted(got) == [(2, 4), (2, 5)]
        async with store.acquire_as_ready([(2, 6)]) as arrivals:
            async for _ in arrivals:
                pass
            with pytest.raises(StoreError, match="already taken"):
                arrivals.in_thread()
        with pytest.raises(StoreError, match="entered"):
            store.acquire_as_ready([(2, 7)]).in_thread()
        assert store.stats()["leased"] == 0
        store.check_invariants()


async def test_the_engine_computing_in_a_thread_takes_each_layer_in_one_hand_off(tmp_path: Path) -> None:
    """``lease_and_compute`` with numpy compute in a thread: the batches go to the thread
    through ``in_thread``, one submit to the compute thread a layer however many batches
    land, and it computes every expert of the layer."""
    write_safetensors_moe(tmp_path, n_layers=1, n_experts=4, hidden=32, intermediate=16)
    keys = [(0, 0), (0, 1), (0, 2), (0, 3)]
    engine = compute.Compute(compute.NUMPY, "thread")
    assert engine.in_thread and engine._pool is not None
    pool, submitted = engine._pool, []
    submit = pool.submit

    def counting(fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        submitted.append(fn)
        return submit(fn, *args, **kwargs)

    computed: list[Key] = []
    run_layer = engine.run_layer

    def recording(views: Any, rows: Any) -> float:
        computed.extend(view.key for view in views)
        return run_layer(views, rows)

    pool.submit = counting  # type: ignore[method-assign]
    engine.run_layer = recording  # type: ignore[method-assign]
    try:
        async with await ExpertStore.open(tmp_path, budget_bytes=1 << 20, backend="pread",
                                          policy="lru") as store:
            async with store.acquire((0, 0)):
                pass
            requests, found = await demo.lease_and_compute(store, keys, [1] * 4, engine)
            assert (requests, found) == (4, 1)
            assert len(submitted) == 1 and sorted(computed) == keys and computed[0] == (0, 0)
            assert engine.seconds > 0 and store.stats()["leased"] == 0
    finally:
        engine.close()
