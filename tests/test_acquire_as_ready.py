"""``acquire_as_ready``: a layer's experts handed over as they become resident, every lease
held until the group exits, never one leaked, the felt wait only what the engine awaited."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import pytest

from iosched import ExpertStore, ExpertView, ReadError, UnknownExpertError
from iosched.backends import Caps
from iosched.backends.pread import PreadBackend
from tests._wrappers import GatedBackend
from tests.conftest import LAYERS, last_expert_cut_short
from tests.test_store import expected_bytes

pytestmark = pytest.mark.asyncio


class HeldReads:
    """A real ``pread`` backend whose every read waits until the test lets that read's
    offset go (:meth:`release`), so loads land in the order the test chooses."""

    name: ClassVar[str] = "pread"
    caps: ClassVar[Caps] = Caps.NONE

    def __init__(self) -> None:
        self.inner = PreadBackend(threads=4)
        self.open_all = asyncio.Event()
        self.released: set[tuple[int, int]] = set()
        self.changed = asyncio.Event()
        self.waiting: set[tuple[int, int]] = set()

    def open(self, paths: Sequence[str]) -> None:
        self.inner.open(paths)

    def alignment(self, file: int) -> int:
        return self.inner.alignment(file)

    def release(self, file: int, offset: int) -> None:
        self.released.add((file, offset))
        self.changed.set()

    async def read(self, file: int, offset: int, length: int, buf: memoryview) -> int:
        self.waiting.add((file, offset))
        while not self.open_all.is_set() and (file, offset) not in self.released:
            self.changed.clear()
            await self.changed.wait()
        self.waiting.discard((file, offset))
        return await self.inner.read(file, offset, length, buf)

    def info(self) -> dict[str, Any]:
        return self.inner.info()

    def undelivered(self) -> int:
        return self.inner.undelivered()

    def close(self) -> None:
        self.inner.close()


def _open(backend: HeldReads) -> None:
    """Let every read through, now and from now on."""
    backend.open_all.set()
    backend.changed.set()


async def _make_resident(store: ExpertStore, backend: HeldReads, key: tuple[int, int]) -> None:
    """Load ``key`` with every read let through, then hold the reads again."""
    backend.open_all.set()
    async with store.acquire(key):
        pass
    backend.open_all.clear()


def _release(store: ExpertStore, backend: HeldReads, key: tuple[int, int]) -> None:
    for extent in store.index.experts[key].extents:
        backend.release(extent.file, extent.offset)


async def _loaded(store: ExpertStore, n: int) -> None:
    """Until ``n`` loads are in flight (or none, ``n == 0``)."""
    for _ in range(5000):
        loading = store.stats()["loading"]
        if loading == n:
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"{store.stats()['loading']} loads in flight, waited for {n}")


def _check(store: ExpertStore, views: list[ExpertView]) -> list[tuple[int, int]]:
    for view in views:
        assert view.data.tobytes() == expected_bytes(store.index, view.key)
    return [view.key for view in views]


async def test_resident_first_then_each_load_as_it_lands(st_checkpoint: Path) -> None:
    backend = HeldReads()
    async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, backend=backend,
                                      policy="lru") as store:
        await _make_resident(store, backend, (0, 0))
        async with store.acquire_as_ready([(0, 1), (0, 0), (0, 2)]) as arrivals:
            batches = aiter(arrivals)
            assert _check(store, await anext(batches)) == [(0, 0)]  # resident: no read needed
            assert store.stats()["loading"] == 2 and store.stats()["leased"] == 1
            _release(store, backend, (0, 2))
            assert _check(store, await anext(batches)) == [(0, 2)]
            assert store.stats()["leased"] == 2  # (0, 0) stays leased: every lease until exit
            _release(store, backend, (0, 1))
            assert _check(store, await anext(batches)) == [(0, 1)]
            with pytest.raises(StopAsyncIteration):
                await anext(batches)
            assert store.stats()["leased"] == 3
        s = store.stats()
        assert s["leased"] == 0 and (s["requests"], s["hits"], s["misses"]) == (4, 1, 3)
        store.check_invariants()


async def test_the_misses_are_read_before_the_engine_computes_on_the_loop(st_checkpoint: Path) -> None:
    """An engine that computes on the event loop gets the experts at hand only once the
    misses' reads were handed to the backend: its compute then runs beside those reads, not
    before them (without the group's turn of the loop, the loads' tasks would start at the
    engine's next await)."""
    backend = HeldReads()
    async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, backend=backend,
                                      policy="lru") as store:
        await _make_resident(store, backend, (3, 0))
        missed = [(3, 1), (3, 2)]
        wanted = {(e.file, e.offset) for key in missed for e in store.index.experts[key].extents}
        try:
            async with store.acquire_as_ready([(3, 0), *missed]) as arrivals:
                assert backend.waiting == wanted  # submitted, though the engine has not awaited
                batches = aiter(arrivals)
                assert _check(store, await anext(batches)) == [(3, 0)]
                _open(backend)
                got = sorted(key for views in [v async for v in batches] for key in _check(store, views))
                assert got == missed
        finally:
            _open(backend)  # else a failed assertion leaves close() waiting for held reads
        assert store.stats()["leased"] == 0


async def test_with_io_uring_the_misses_reach_the_kernel_before_the_engine_computes(st_checkpoint: Path) -> None:
    """io_uring submits the reads started in a turn of the loop at the next turn
    (``Caps.TURN_BATCHED``): entering waits for that turn too, else an engine computing on the
    loop leaves its reads queued in the ring until its next await (with the real compute on
    the loop, that is three times the felt wait of O_DIRECT threads)."""
    from iosched import backends
    from iosched.backends.uring import UringBackend

    reason = backends.available()["uring"]
    if reason is not None:
        pytest.skip(f"io_uring is unavailable here: {reason}")
    backend = UringBackend(direct=False)
    assert Caps.TURN_BATCHED in backend.caps
    async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, backend=backend,
                                      policy="lru") as store:
        async with store.acquire((3, 0)):
            pass
        before = backend.info()["submissions"]
        missed = [(3, 1), (3, 2)]
        reads = sum(len(store.index.experts[key].extents) for key in missed)
        async with store.acquire_as_ready([(3, 0), *missed]) as arrivals:
            assert backend.info()["submissions"] - before == reads  # in the kernel's hands
            got = sorted(key for views in [v async for v in arrivals] for key in _check(store, views))
        assert got == [(3, 0), *missed]
        store.check_invariants()


async def test_the_batch_end_work_hands_the_gil_over_only_while_no_acquire_waits(
        st_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While the engine computes in a thread the policy's batch-end work first lets other
    threads take the GIL, once (``iosched/runtime/_prefetch.py``, ``release_gil``); while the engine
    awaits a read, it does not (each hand-over could then delay waking the engine)."""
    from iosched.runtime import _prefetch

    handed: list[int] = []

    def counted() -> None:
        handed.append(1)
        _real()

    _real = _prefetch.release_gil
    monkeypatch.setattr(_prefetch, "release_gil", counted)
    async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, policy="default",
                                      experts_per_token=2) as store:
        async with store.acquire_many([(0, 0), (0, 1)]):
            pass
        async with store.acquire_many([(0, 0), (0, 1)]):  # resident: nobody waits
            handed.clear()
            await asyncio.sleep(0)  # the engine's next await: the batch-end work runs
            assert len(handed) == 1
        handed.clear()
        async with store.acquire_as_ready([(1, 0), (1, 1)]) as arrivals:  # all missing
            got = [key for views in [v async for v in arrivals] for key in _check(store, views)]
        assert sorted(got) == [(1, 0), (1, 1)]
        assert not handed  # its batch-end work ran while the engine awaited the reads
        store.check_invariants()


async def _one_read_landed_while_computing_on_the_loop(
        st_checkpoint: Path, monkeypatch: pytest.MonkeyPatch, held: list[tuple[int, int]]) -> tuple[list[object], int]:
    """An engine computing on the loop: layer 3's group of (3, 0) resident, (3, 1) whose read
    runs at the group's entry, and ``held`` whose reads wait until the engine has (3, 1).  The
    engine holds the loop after the first batch until (3, 1)'s read finished in its worker
    thread (its result then queued for the loop), then takes the rest.  Returns the order of
    the keys it got and the policy's batch ends, and ``policy_batch_ends_put_off``."""
    import time

    from iosched.residency.default import DefaultPolicy

    events: list[object] = []
    real = DefaultPolicy.end_batch

    def end_batch(self: DefaultPolicy) -> Any:
        events.append("end_batch")
        return real(self)

    monkeypatch.setattr(DefaultPolicy, "end_batch", end_batch)
    backend = HeldReads()
    async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, backend=backend,
                                      policy="default", experts_per_token=2 + len(held)) as store:
        await _make_resident(store, backend, (3, 0))
        events.clear()
        _release(store, backend, (3, 1))
        try:
            async with store.acquire_as_ready([(3, 0), (3, 1), *held]) as arrivals:
                batches = aiter(arrivals)
                assert _check(store, await anext(batches)) == [(3, 0)]
                deadline = time.monotonic() + 10
                while backend.undelivered() == 0:  # computing: the loop held
                    assert time.monotonic() < deadline, "the read of (3, 1) did not finish"
                    time.sleep(0.001)
                events.extend(_check(store, await anext(batches)))
                for key in held:
                    _release(store, backend, key)
                    events.extend(_check(store, await anext(batches)))
        finally:
            _open(backend)
        store.check_invariants()
        return events, store.stats()["policy_batch_ends_put_off"]


async def test_on_the_loop_the_batch_end_work_lets_a_result_on_its_way_through_first(
        st_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine computing on the loop finds, at its next wait, a read that finished meanwhile:
    the batch-end work queued at the group's entry lets that result reach the engine first
    and runs in its next wait of the group (run first, it would hold the engine ~200 us in
    28 % of the qwen trace's batches)."""
    events, put_off = await _one_read_landed_while_computing_on_the_loop(st_checkpoint, monkeypatch, [(3, 2)])
    assert events == [(3, 1), "end_batch", (3, 2)]
    assert put_off == 1


async def test_on_the_loop_the_batch_end_work_of_a_groups_last_wait_is_not_put_off(
        st_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """When every load the engine waits for has its result on the way, the engine will not
    wait again in the group: the work runs in this wait (put off, it would find the next batch
    begun and be skipped)."""
    events, put_off = await _one_read_landed_while_computing_on_the_loop(st_checkpoint, monkeypatch, [])
    assert events == ["end_batch", (3, 1)]
    assert put_off == 0


async def test_cancelled_while_the_misses_start_no_lease_leaks(st_checkpoint: Path) -> None:
    """Cancelled at the group's turn of the loop on entry: no lease is kept, and the loads it
    started go on and publish."""
    backend = HeldReads()
    async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, backend=backend,
                                      policy="lru") as store:
        await _make_resident(store, backend, (3, 0))

        async def engine() -> None:
            async with store.acquire_as_ready([(3, 0), (3, 3)]):
                pytest.fail("the group must not be entered")

        task = asyncio.create_task(engine())
        try:
            await asyncio.sleep(0)  # the task is now at the group's turn of the loop
            assert store.stats()["loading"] == 1
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert store.stats()["leased"] == 0
        finally:
            _open(backend)
        await _loaded(store, 0)
        assert store.stats()["resident_experts"] >= 2
        async with store.acquire((3, 3)) as view:  # published: a hit now
            _check(store, [view])
        s = store.stats()
        assert s["leased"] == 0 and s["misses"] == 2  # (3, 0) and (3, 3), each once
        store.check_invariants()


async def test_loads_that_landed_meanwhile_come_in_one_batch_without_felt_wait(st_checkpoint: Path) -> None:
    """The felt wait is the engine's awaits of the iteration only: loads that land while the
    engine computes cost it nothing, and come together in the next batch."""
    backend = HeldReads()
    async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, backend=backend,
                                      policy="lru") as store:
        await _make_resident(store, backend, (1, 0))
        felt = store.request_tally.felt_wait_s
        keys = [(1, 0), (1, 1), (1, 2), (1, 3)]
        async with store.acquire_as_ready(keys) as arrivals:
            got = []
            async for views in arrivals:
                got.append(_check(store, views))
                if len(got) == 1:  # "compute" on the first batch while the three load
                    await asyncio.sleep(0.02)
                    _open(backend)
                    await _loaded(store, 0)
            assert got == [[(1, 0)], [(1, 1), (1, 2), (1, 3)]]
        assert store.request_tally.felt_wait_s == felt  # nothing was awaited
        assert store.stats()["leased"] == 0


async def test_all_missing_the_first_batch_is_awaited_and_felt(st_checkpoint: Path) -> None:
    backend = GatedBackend()
    async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, backend=backend,
                                      policy="lru") as store:
        async with store.acquire_as_ready([(2, 1), (2, 2)]) as arrivals:
            async def opener() -> None:
                await asyncio.sleep(0.02)
                backend.gate.set()

            task = asyncio.create_task(opener())
            keys = [key for views in [v async for v in arrivals] for key in _check(store, views)]
            await task
        assert sorted(keys) == [(2, 1), (2, 2)]
        assert store.request_tally.felt_wait_s >= 0.015
        assert store.stats()["leased"] == 0


async def test_unknown_key_takes_no_lease(st_checkpoint: Path) -> None:
    async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20) as store:
        with pytest.raises(UnknownExpertError, match=str(LAYERS)):
            async with store.acquire_as_ready([(0, 0), (LAYERS, 1)]):
                pytest.fail("the group must not be entered")
        s = store.stats()
        assert s["leased"] == 0 and s["requests"] == 0 and s["loading"] == 0


async def test_a_failed_load_is_raised_and_the_others_still_come(st_copy: Path) -> None:
    async with await ExpertStore.open(st_copy, budget_bytes=1 << 20, policy="lru") as store:
        got: list[tuple[int, int]] = []
        errors: list[ReadError] = []
        with last_expert_cut_short(store) as (bad, good, path):
            async with store.acquire_as_ready([*good, bad]) as arrivals:
                batches = aiter(arrivals)
                while True:
                    try:
                        got += _check(store, await anext(batches))
                    except StopAsyncIteration:
                        break
                    except ReadError as exc:  # named, and the iteration goes on
                        errors.append(exc)
        await check_after_a_failed_load(store, got, errors, bad, good, path)


async def check_after_a_failed_load(store: ExpertStore, got: list[tuple[int, int]], errors: Sequence[BaseException],
                                    bad: tuple[int, int], good: list[tuple[int, int]], path: str) -> None:
    """What a group with one failed load leaves, whichever way its batches were taken
    (``async for``, or a thread's ``in_thread``): the others came, one ``ReadError`` naming
    the shard, nothing leased or loading, only the others resident, and the expert served
    once its shard is whole again."""
    assert sorted(got) == sorted(good)
    assert len(errors) == 1 and isinstance(errors[0], ReadError) and Path(path).name in str(errors[0])
    s = store.stats()
    assert s["leased"] == 0 and s["loading"] == 0
    assert s["resident_bytes"] == sum(store.index.experts[k].nbytes for k in good)
    store.check_invariants()
    async with store.acquire(bad) as view:  # the store serves the key once the file is whole
        assert view.data.tobytes() == expected_bytes(store.index, bad)


async def test_leaving_before_the_last_batch_gives_up_the_loads_and_leaks_nothing(st_checkpoint: Path) -> None:
    backend = GatedBackend()
    async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, backend=backend,
                                      policy="lru") as store:
        backend.gate.set()
        async with store.acquire((3, 0)):
            pass
        backend.gate.clear()
        async with store.acquire_as_ready([(3, 0), (3, 1), (3, 2)]) as arrivals:
            async for views in arrivals:
                assert _check(store, views) == [(3, 0)]
                break
        assert store.stats()["leased"] == 0 and store.stats()["loading"] == 2
        backend.gate.set()
        await _loaded(store, 0)
        s = store.stats()
        assert s["leased"] == 0 and s["resident_experts"] == 3  # the loads went on
        store.check_invariants()


async def test_cancelled_while_awaiting_leaks_nothing(st_checkpoint: Path) -> None:
    backend = GatedBackend()
    async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, backend=backend,
                                      policy="lru") as store:
        backend.gate.set()
        async with store.acquire((2, 0)):
            pass
        backend.gate.clear()
        seen: list[tuple[int, int]] = []

        async def engine() -> None:
            async with store.acquire_as_ready([(2, 0), (2, 3), (2, 4)]) as arrivals:
                async for views in arrivals:
                    seen.extend(_check(store, views))

        task = asyncio.create_task(engine())
        await _loaded(store, 2)
        while not seen:
            await asyncio.sleep(0.001)
        assert store.stats()["leased"] == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert seen == [(2, 0)] and store.stats()["leased"] == 0
        backend.gate.set()
        await _loaded(store, 0)
        assert store.stats()["leased"] == 0 and store.stats()["resident_experts"] == 3
        store.check_invariants()


async def test_counts_are_those_of_acquire_many(st_checkpoint: Path) -> None:
    """Duplicates join the load the first started; a prefetch in flight is joined and
    promoted; a duplicate comes as a view of its own."""
    backend = GatedBackend()
    async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, backend=backend,
                                      policy="lru") as store:
        backend.gate.set()
        async with store.acquire((0, 0)):
            pass
        backend.gate.clear()
        assert store.prefetch([(0, 3)]) == 1
        keys = [(0, 1), (0, 1), (0, 2), (0, 0), (0, 3)]
        async with store.acquire_as_ready(keys) as arrivals:
            backend.gate.set()
            got = [key for views in [v async for v in arrivals] for key in _check(store, views)]
            assert store.stats()["leased"] == 4  # entries: (0, 1) holds two leases
        assert got[0] == (0, 0) and sorted(got) == sorted(keys)
        s = store.stats()
        assert (s["requests"], s["hits"], s["misses"], s["single_flight_joins"]) == (6, 1, 3, 2)
        assert s["leased"] == 0 and s["prefetch_used"] == 1 and s["prefetch_promoted"] == 1
        store.check_invariants()


async def test_a_member_without_room_comes_once_a_lease_ends(st_checkpoint: Path) -> None:
    async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, policy="lru") as store:
        size = store.index.experts[(1, 0)].nbytes
    async with await ExpertStore.open(st_checkpoint, budget_bytes=3 * size, policy="lru") as store:
        await store.acquire((1, 0)).__aenter__()  # held to the end
        held = store.acquire((1, 1))
        await held.__aenter__()
        async with store.acquire_as_ready([(1, 2), (1, 3)]) as arrivals:
            batches = aiter(arrivals)
            assert _check(store, await anext(batches)) == [(1, 2)]  # (1, 3) has no room yet
            waiting = asyncio.ensure_future(anext(batches))
            for _ in range(20):
                await asyncio.sleep(0.002)
            assert not waiting.done()
            await held.__aexit__(None, None, None)
            assert _check(store, await waiting) == [(1, 3)]
        s = store.stats()
        assert s["leased"] == 1 and s["misses"] == 4
        store.check_invariants()


@pytest.mark.parametrize("policy", ["moe", "earned"])
async def test_a_policy_weighing_each_wait_gets_every_acquire(st_checkpoint: Path, policy: str) -> None:
    """Policies with ``on_wait`` wait per acquire (a task each); the group counts them all on
    entry, hands every one over, and leaks nothing."""
    async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, policy=policy,
                                      experts_per_token=2) as store:
        async with store.acquire((3, 0)):
            pass
        keys = [(3, 0), (3, 1), (3, 2)]
        before = store.request_tally
        async with store.acquire_as_ready(keys) as arrivals:
            after = store.request_tally
            assert after.requests - before.requests == 3  # all counted before the first await
            got = [key for views in [v async for v in arrivals] for key in _check(store, views)]
        assert got[0] == (3, 0) and sorted(got) == keys
        assert store.stats()["leased"] == 0
        store.check_invariants()


async def test_entered_twice_is_refused(st_checkpoint: Path) -> None:
    from iosched import StoreError
    async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20) as store:
        group = store.acquire_as_ready([(0, 0)])
        async with group:
            with pytest.raises(StoreError, match="twice"):
                await group.__aenter__()
        assert store.stats()["leased"] == 0
