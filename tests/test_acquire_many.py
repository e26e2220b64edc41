"""``acquire_many``: a layer's experts leased together, never a lease leaked."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from iosched import ExpertStore, ReadError, UnknownExpertError
from tests._wrappers import GatedBackend
from tests.conftest import EXPERTS, LAYERS
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
        bad = (LAYERS - 1, EXPERTS - 1)
        layout = store.index.experts[bad]
        path = store.index.files[layout.extents[0].file]
        good = [k for k, lay in store.index.experts.items()
                if store.index.files[lay.extents[0].file] != path][:3]
        original = Path(path).read_bytes()
        os.truncate(path, layout.extents[0].offset)
        try:
            with pytest.raises(ReadError, match=Path(path).name):
                async with store.acquire_many([*good, bad]):
                    pass
        finally:
            Path(path).write_bytes(original)
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
