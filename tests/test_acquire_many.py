"""``acquire_many``: a layer's experts leased together, never a lease leaked."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from iosched import ExpertStore, ReadError, UnknownExpertError
from tests._wrappers import GatedBackend
from tests.conftest import LAYERS, last_expert_cut_short
from tests.test_store import expected_bytes

pytestmark = pytest.mark.asyncio


async def test_views_in_key_order_mixing_hits_and_misses(st_checkpoint: Path) -> None:
    async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20) as store:
        async with store.acquire((1, 3)):
            pass
        keys = [(1, 5), (1, 3), (1, 0), (1, 7)]
        async with store.acquire_many(keys) as views:
            assert [v.key for v in views] == keys
            for key, view in zip(keys, views, strict=True):
                assert view.data.tobytes() == expected_bytes(store.index, key)
            assert store.stats()["leased"] == 4
        s = store.stats()
        assert s["leased"] == 0 and s["hits"] == 1 and s["misses"] == 4


async def test_unknown_key_takes_no_lease(st_checkpoint: Path) -> None:
    async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20) as store:
        with pytest.raises(UnknownExpertError, match=str(LAYERS)):
            async with store.acquire_many([(0, 0), (LAYERS, 1)]):
                pass
        s = store.stats()
        assert s["leased"] == 0 and s["requests"] == 0


async def test_failed_load_releases_the_others(st_copy: Path) -> None:
    async with await ExpertStore.open(st_copy, budget_bytes=1 << 20) as store:
        with last_expert_cut_short(store) as (bad, good, path):
            with pytest.raises(ReadError, match=Path(path).name):
                async with store.acquire_many([*good, bad]):
                    pass
        s = store.stats()
        assert s["leased"] == 0 and s["loading"] == 0
        assert s["resident_bytes"] == sum(store.index.experts[k].nbytes for k in good)
        store.check_invariants()


async def test_cancelled_group_leaks_nothing(st_checkpoint: Path) -> None:
    backend = GatedBackend()
    async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, backend=backend) as store:
        backend.gate.set()
        async with store.acquire((2, 0)):  # one hit inside the group; its lease is taken at once
            pass
        backend.gate.clear()

        async def group() -> None:
            async with store.acquire_many([(2, 0), (2, 1), (2, 2)]):
                pytest.fail("the group must not be entered")

        task = asyncio.create_task(group())
        while store.stats()["loading"] < 2:
            await asyncio.sleep(0)
        assert store.stats()["leased"] == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert store.stats()["leased"] == 0
        backend.gate.set()
        while store.stats()["loading"]:
            await asyncio.sleep(0.001)
        s = store.stats()
        assert s["leased"] == 0 and s["resident_experts"] == 3
        store.check_invariants()


# --- the group's misses awaited in one coroutine (Acquirer.wait_for_group) ----------------------


async def test_a_group_counts_each_acquire_as_single_acquires_do(st_checkpoint: Path) -> None:
    """Duplicates join the load the first started; a prefetch in flight is joined and promoted;
    the counts are those of the acquires made one by one."""
    backend = GatedBackend()
    async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, backend=backend,
                                      policy="lru") as store:
        backend.gate.set()
        async with store.acquire((0, 0)):
            pass
        backend.gate.clear()
        assert store.prefetch([(0, 3)]) == 1
        keys = [(0, 1), (0, 1), (0, 2), (0, 0), (0, 3)]
        inside: dict[str, int] = {}

        async def group() -> None:
            async with store.acquire_many(keys) as views:
                assert [v.key for v in views] == keys
                for key, view in zip(keys, views, strict=True):
                    assert view.data.tobytes() == expected_bytes(store.index, key)
                inside.update(store.stats())

        task = asyncio.create_task(group())
        while backend.started < 3:
            await asyncio.sleep(0.001)
        s = store.stats()
        assert s["loading"] == 3 and s["leased"] == 1  # the hit's lease is held already
        backend.gate.set()
        await task
        assert inside["leased"] == 4  # entries: (0, 1) holds two leases
        s = store.stats()
        assert (s["requests"], s["hits"], s["misses"], s["single_flight_joins"]) == (6, 1, 3, 2)
        assert s["leased"] == 0 and s["prefetch_used"] == 1 and s["prefetch_promoted"] == 1
        store.check_invariants()


async def test_a_group_member_without_room_waits_its_turn(st_checkpoint: Path) -> None:
    """Leases elsewhere hold all but one expert's room: the group's first miss loads, the
    second waits in the room's line until a lease ends, then the group is entered."""
    async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, policy="lru") as store:
        size = store.index.experts[(1, 0)].nbytes
    async with await ExpertStore.open(st_checkpoint, budget_bytes=3 * size, policy="lru") as store:
        held = store.acquire((1, 0))
        await held.__aenter__()
        async with store.acquire((1, 1)):
            async def group() -> list[tuple[int, int]]:
                async with store.acquire_many([(1, 2), (1, 3)]) as views:
                    for view in views:
                        assert view.data.tobytes() == expected_bytes(store.index, view.key)
                    return [v.key for v in views]

            task = asyncio.create_task(group())
            for _ in range(50):
                await asyncio.sleep(0.002)
            assert not task.done()  # (1, 3) has no room: (1, 0), (1, 1), (1, 2) are held
        assert await task == [(1, 2), (1, 3)]
        await held.__aexit__(None, None, None)
        s = store.stats()
        assert s["leased"] == 0 and s["misses"] == 4
        store.check_invariants()
