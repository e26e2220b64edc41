"""Waiting for room: one wake-up passed along, by size, never a lost one (``iosched/runtime/_room.py``)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import numpy as np
import pytest

from iosched import ExpertStore, StoreError, UnknownExpertError
from iosched.runtime._room import Room

pytestmark = pytest.mark.asyncio


async def _waiter(room: Room, need: int, log: list[int], name: int) -> None:
    await room.wait(("key", name), need, room.ticket())
    log.append(name)


async def test_wake_takes_the_oldest_and_pass_below_only_smaller_needs() -> None:
    room, log = Room(), list[int]()
    tasks = [asyncio.create_task(_waiter(room, need, log, i)) for i, need in enumerate([30, 10, 30, 20])]
    await asyncio.sleep(0)
    room.wake()
    await asyncio.sleep(0)
    assert log == [0]  # the oldest, whatever its size
    room.pass_below(30)  # a 30-byte need found the room short: 30s skipped, the oldest smaller
    await asyncio.sleep(0)
    assert log == [0, 1]
    room.pass_below(10)  # nothing in line needs fewer than 10: the chain ends
    await asyncio.sleep(0)
    assert log == [0, 1]
    room.pass_on()  # a success passes to the oldest again
    await asyncio.sleep(0)
    assert log == [0, 1, 2]
    room.wake_all()
    await asyncio.gather(*tasks)
    assert log == [0, 1, 2, 3] and not room


async def test_a_waiter_whose_key_starts_loading_joins_without_the_wake_up() -> None:
    room, log = Room(), list[int]()
    first = asyncio.create_task(_waiter(room, 10, log, 0))
    second = asyncio.create_task(_waiter(room, 10, log, 1))
    await asyncio.sleep(0)
    room.loading(("key", 1))  # another acquire started loading the second's expert
    await asyncio.sleep(0)
    assert log == [1]  # it goes to join that load; the first still waits for room
    room.wake()
    await asyncio.gather(first, second)
    assert log == [1, 0] and all(f.done() for f in room.waiters)


async def test_a_cancelled_waiter_passes_on_a_wake_up_it_got() -> None:
    room, log = Room(), list[int]()
    first = asyncio.create_task(_waiter(room, 10, log, 0))
    second = asyncio.create_task(_waiter(room, 10, log, 1))
    await asyncio.sleep(0)
    room.wake()  # for the first, which is cancelled before it runs
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    await asyncio.sleep(0)
    assert log == [1]  # the wake-up was not lost
    await second


async def test_thousands_of_acquires_on_a_two_expert_budget_all_complete(st_checkpoint: Path) -> None:
    """Concurrent acquires, a fifth of them cancelled midway: every other one is served (no
    lost wake-up), and the table's invariants hold at the end."""
    async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 30, backend="pread") as probe:
        layouts = probe.index.experts
    one = max(layout.nbytes for layout in layouts.values())
    rng = random.Random(3)
    keys = [rng.choice(sorted(layouts)) for _ in range(3000)]
    async with await ExpertStore.open(st_checkpoint, budget_bytes=2 * one, backend="pread",
                                      policy="lru") as store:
        served = 0

        async def acquire(key: tuple[int, int]) -> None:
            nonlocal served
            async with store.acquire(key) as view:
                await asyncio.sleep(0)
                assert view.key == key
                served += 1

        tasks = [asyncio.create_task(acquire(key)) for key in keys]
        await asyncio.sleep(0.01)
        cancelled = [t for t in tasks[::5] if not t.done() and t.cancel()]
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=120)
        assert all(r is None or isinstance(r, asyncio.CancelledError) for r in results)
        assert served == len(keys) - sum(isinstance(r, asyncio.CancelledError) for r in results)
        assert len(cancelled) > 0 and served > 0
        stats = store.stats()
        assert stats["leased"] == 0 and stats["resident_bytes"] <= 2 * one
        store.check_invariants()


# ------------------------------------------------------------------------- strict keys


async def test_keys_must_be_true_integers(st_checkpoint: Path) -> None:
    async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20) as store:
        for bad in [(True, False), (1.0, 2.0), (1.5, 2), (1, 2, 3), [1, 2], "ab", 7, (np.bool_(True), 0),
                    (1, None)]:
            with pytest.raises(UnknownExpertError, match="tuple of ints"):
                async with store.acquire(bad):  # type: ignore[arg-type]
                    pass
        async with store.acquire((np.int64(1), np.int32(2))) as view:
            assert view.key == (1, 2) and type(view.key[0]) is int
        with pytest.raises(UnknownExpertError, match="tuple of ints"):
            store.prefetch([(True, 0)])
        with pytest.raises(UnknownExpertError, match=r"no expert \(99, 0\)"):
            async with store.acquire((99, 0)):
                pass
        assert store.stats()["requests"] == 1  # the refused keys touched nothing


async def test_unsigned_routing_ids_that_would_wrap_are_refused(st_checkpoint: Path) -> None:
    async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, experts_per_token=2) as store:
        rows = np.array([[0, 1], [2**64 - 1, 0]], dtype=np.uint64)  # 2**64 - 1 would read as -1
        with pytest.raises(StoreError, match="out of range"):
            store.observe_routing(0, rows)
        store.observe_routing(0, np.array([[0, 1], [1, 2]], dtype=np.uint8))  # small unsigned: fine
        assert store.stats()["routing_rows"] == 2
