"""Fault injection around a real backend (``backends.faults``), through a real store with a
mirror in a temporary folder: every fault kind keeps the bytes right and is failed over."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from iosched import ExpertStore, ReadError, backends
from iosched.backends.faults import FaultPlan, Faults, FaultyBackend, replace_file, truncate_file
from tests.test_store import expected_bytes

pytestmark = pytest.mark.asyncio


def faulty(backend: str, plan: FaultPlan) -> FaultyBackend:
    return FaultyBackend(backends.create(backend), plan)


async def read_all_exact(store: ExpertStore) -> None:
    for key in store.index.experts:
        async with store.acquire(key) as view:
            assert view.data.tobytes() == expected_bytes(store.index, key)
    store.check_invariants()


@pytest.mark.parametrize("kind", [
    {"eio_rate": 1.0}, {"short_rate": 1.0}, {"spike_rate": 1.0, "spike_s": 0.001},
    {"eio_rate": 0.3, "short_rate": 0.3, "spike_rate": 0.3, "spike_s": 0.001},
], ids=["eio", "short", "spike", "mixed"])
async def test_faults_on_the_mirror_are_failed_over(
        mirrored: tuple[Path, Path], backend: str, kind: dict[str, float]) -> None:
    primary, mirror = mirrored
    be = faulty(backend, FaultPlan.on(mirror, seed=7, **kind))
    async with await ExpertStore.open(primary, budget_bytes=1 << 20, backend=be, mirrors=[mirror]) as store:
        await read_all_exact(store)
        s = store.stats()
        counts = s["backend_info"]["faults"]
        injected = counts["eio"] + counts["short"]
        assert s["load_errors"] == 0
        assert s["per_replica"][str(primary)]["errors"] == 0
        assert s["per_replica"][str(mirror)]["errors"] == injected
        if injected:
            assert s["retries"] >= injected and s["failovers"] > 0
        if "spike_rate" in kind and kind["spike_rate"] == 1.0:
            assert counts["spike"] > 0 and s["retries"] == 0
        assert s["leased"] == 0


async def test_eio_on_the_only_replica_names_the_file(st_copy: Path, backend: str) -> None:
    be = faulty(backend, FaultPlan.on(st_copy, eio_rate=1.0))
    async with await ExpertStore.open(st_copy, budget_bytes=1 << 20, backend=be) as store:
        key = next(iter(store.index.experts))
        shard = store.index.files[store.index.experts[key].extents[0].file]
        with pytest.raises(ReadError, match=rf"{shard}: injected fault: EIO"):
            async with store.acquire(key):
                pass
        assert store.stats()["load_errors"] == 1 and store.stats()["resident_bytes"] == 0
        store.check_invariants()
        be.set_plan(FaultPlan())  # the drive recovers: the store is usable, the next acquire reads again
        await read_all_exact(store)
        assert be.info()["faults"]["eio"] == 1


async def test_a_short_read_is_a_read_error(st_copy: Path) -> None:
    be = faulty("pread", FaultPlan.on(st_copy, short_rate=1.0))
    async with await ExpertStore.open(st_copy, budget_bytes=1 << 20, backend=be) as store:
        key = next(iter(store.index.experts))
        with pytest.raises(ReadError, match="short read"):
            async with store.acquire(key):
                pass
        assert be.counts["short"] == 1
        store.check_invariants()


async def test_hang_cancelled_leaks_nothing(mirrored: tuple[Path, Path], backend: str) -> None:
    primary, mirror = mirrored
    plan = FaultPlan({str(primary): Faults(hang=True), str(mirror): Faults(hang=True)})
    be = faulty(backend, plan)
    store = await ExpertStore.open(primary, budget_bytes=1 << 20, backend=be, mirrors=[mirror])
    keys = sorted(store.index.experts)[:3]
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(store.acquire_many(keys).__aenter__(), 0.05)

    async def hold() -> None:
        async with store.acquire(keys[0]):
            pass

    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(hold(), 0.05)
    s = store.stats()
    assert s["leased"] == 0 and s["loading"] == 3 and be.counts["hang"] == 3
    store.check_invariants()
    be.set_plan(FaultPlan())  # the drive answers again: the hung loads finish and publish
    await asyncio.wait_for(store.close(), 5)
    s = store.stats()
    assert s["leased"] == 0 and s["loading"] == 0 and s["load_errors"] == 0


async def test_hang_with_timeout_fails_over(mirrored: tuple[Path, Path]) -> None:
    primary, mirror = mirrored
    be = faulty("pread", FaultPlan.on(mirror, hang=True, hang_s=0.01))
    async with await ExpertStore.open(primary, budget_bytes=1 << 20, backend=be, mirrors=[mirror]) as store:
        await read_all_exact(store)
        counts = be.info()["faults"]
        assert counts["hang"] == counts["hang_timeouts"] > 0
        assert store.stats()["failovers"] > 0


async def test_truncated_mirror_is_failed_over(mirrored: tuple[Path, Path], backend: str) -> None:
    primary, mirror = mirrored
    async with await ExpertStore.open(primary, budget_bytes=1 << 20, backend=backend, mirrors=[mirror]) as store:
        for shard in mirror.glob("*.safetensors"):
            truncate_file(shard, shard.stat().st_size // 2)
        await read_all_exact(store)
        s = store.stats()
        assert s["per_replica"][str(mirror)]["errors"] > 0 and s["failovers"] > 0


async def test_replaced_file_keeps_serving_the_opened_bytes(st_copy: Path, backend: str) -> None:
    async with await ExpertStore.open(st_copy, budget_bytes=1 << 20, backend=backend) as store:
        expected = {key: expected_bytes(store.index, key) for key in store.index.experts}
        for shard in st_copy.glob("*.safetensors"):
            replace_file(shard, b"\xff" * shard.stat().st_size)
        assert all(p.read_bytes().count(b"\xff") == p.stat().st_size for p in st_copy.glob("*.safetensors"))
        for key, data in expected.items():  # the descriptors opened hold the old files
            async with store.acquire(key) as view:
                assert view.data.tobytes() == data
    assert not list(st_copy.glob(".replace-*"))


async def test_plan_and_counters_are_reproducible(mirrored: tuple[Path, Path]) -> None:
    primary, mirror = mirrored
    seen = []
    for _ in range(2):
        be = faulty("pread", FaultPlan.on(mirror, seed=3, eio_rate=0.5, short_rate=0.2))
        async with await ExpertStore.open(primary, budget_bytes=1 << 20, backend=be, mirrors=[mirror]) as store:
            await read_all_exact(store)
            info = store.stats()["backend_info"]["faults"]
        seen.append({k: info[k] for k in ("reads", "eio", "short")})
        assert info["plan"]["rules"][str(mirror)]["eio_rate"] == 0.5
    assert seen[0] == seen[1] and seen[0]["eio"] > 0


async def test_plan_validation_and_prefixes() -> None:
    with pytest.raises(ValueError, match="eio_rate"):
        Faults(eio_rate=1.5)
    plan = FaultPlan({"/a": Faults(eio_rate=0.1), "/a/b": Faults(short_rate=0.2)})
    assert plan.faults_for("/a/b/x") == Faults(short_rate=0.2)
    assert plan.faults_for("/a/c") == Faults(eio_rate=0.1)
    assert plan.faults_for("/z") is None
