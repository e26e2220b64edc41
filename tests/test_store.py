"""The store's contract: byte-exact views, leases, single-flight, the strict budget,
cancellation without leaks, and bad input that names its culprit.

Tests taking the ``backend`` fixture run once per read backend (see ``conftest.py``)."""

from __future__ import annotations

import asyncio
import os
import random
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from iosched import (
    BackendUnavailable,
    BudgetError,
    ExpertStore,
    ReadError,
    StoreClosed,
    StoreError,
    UnknownExpertError,
)
from iosched._layout import CheckpointIndex, ExpertKey
from tests._wrappers import GatedBackend
from tests.conftest import EXPERTS, LAYERS

pytestmark = pytest.mark.asyncio


def expected_bytes(index: CheckpointIndex, key: ExpertKey) -> bytes:
    """The expert's bytes read with plain file I/O, independent of the store's read path."""
    out = bytearray()
    for ext in index.experts[key].extents:
        with open(index.files[ext.file], "rb") as f:
            f.seek(ext.offset)
            out += f.read(ext.length)
    return bytes(out)


def one_expert_bytes(index: CheckpointIndex) -> int:
    return next(iter(index.experts.values())).nbytes


async def test_views_are_byte_exact_and_typed(st_checkpoint: Path, backend: str) -> None:
    tensors = {}
    for shard in sorted(st_checkpoint.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, backend=backend) as store:
        for layer in range(LAYERS):
            for expert in range(EXPERTS):
                async with store.acquire((layer, expert)) as view:
                    assert view.data.tobytes() == expected_bytes(store.index, (layer, expert))
                    assert set(view.tensors) == {"gate_proj", "up_proj", "down_proj"}
                    for name, arr in view.tensors.items():
                        ref = tensors[f"model.layers.{layer}.mlp.experts.{expert}.{name}.weight"]
                        assert arr.dtype == ref.dtype and arr.shape == ref.shape
                        np.testing.assert_array_equal(arr, ref)
                    with pytest.raises(ValueError):
                        view.data[0] = 1
        store.check_invariants()


async def test_gguf_views_are_byte_exact(gguf_checkpoint: Path, backend: str) -> None:
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_checkpoint), "r")
    merged = {t.name: np.array(t.data) for t in reader.tensors}
    del reader
    async with await ExpertStore.open(gguf_checkpoint, budget_bytes=1 << 20, backend=backend) as store:
        for key in [(0, 0), (1, 3), (LAYERS - 1, EXPERTS - 1)]:
            async with store.acquire(key) as view:
                assert view.data.tobytes() == expected_bytes(store.index, key)
                for name, part in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
                    np.testing.assert_array_equal(
                        view.tensors[name], merged[f"blk.{key[0]}.ffn_{part}_exps.weight"][key[1]]
                    )


async def test_hit_miss_accounting(st_checkpoint: Path, backend: str) -> None:
    async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, backend=backend) as store:
        async with store.acquire((0, 0)):
            pass
        async with store.acquire((0, 0)):
            pass
        s = store.stats()
        assert (s["requests"], s["hits"], s["misses"], s["single_flight_joins"]) == (2, 1, 1, 0)
        layout = store.index.experts[(0, 0)]
        # O_DIRECT reads whole blocks: at most one block of padding at each end of an extent.
        assert layout.nbytes <= s["bytes_read"] <= layout.nbytes + 2 * 4096 * len(layout.extents)
        assert s["resident_bytes"] == layout.nbytes and s["leased"] == 0 and s["loading"] == 0
        (dev,) = s["per_device"].values()
        assert dev["bytes"] == s["bytes_read"] and dev["in_flight"] == 0 and dev["errors"] == 0
        for key in ("felt_wait_s", "service_s"):
            assert isinstance(s[key], float) and s[key] > 0


async def test_single_flight(st_checkpoint: Path) -> None:
    backend = GatedBackend()
    async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, backend=backend) as store:
        tasks = [asyncio.create_task(_hold(store, (1, 2), 0)) for _ in range(20)]
        while store.stats()["single_flight_joins"] < 19:
            await asyncio.sleep(0)
        backend.gate.set()
        views = await asyncio.gather(*tasks)
        assert all(v == expected_bytes(store.index, (1, 2)) for v in views)
        s = store.stats()
        assert (s["misses"], s["single_flight_joins"]) == (1, 19)
        assert backend.started == len(store.index.experts[(1, 2)].extents)
        assert s["bytes_read"] == store.index.experts[(1, 2)].nbytes


async def _hold(store: ExpertStore, key: ExpertKey, seconds: float) -> bytes:
    async with store.acquire(key) as view:
        data = view.data.tobytes()
        await asyncio.sleep(seconds)
        assert view.data.tobytes() == data, "a leased expert's bytes changed"
        return data


async def test_lease_blocks_eviction_and_budget_waits(st_checkpoint: Path, backend: str) -> None:
    async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, backend=backend) as probe:
        one = one_expert_bytes(probe.index)
    async with await ExpertStore.open(st_checkpoint, budget_bytes=2 * one, policy="lru", backend=backend) as store:
        a = store.acquire((0, 0))
        b = store.acquire((0, 1))
        view_a = await a.__aenter__()
        await b.__aenter__()
        waiter = asyncio.create_task(_hold(store, (0, 2), 0))
        for _ in range(50):
            await asyncio.sleep(0)
        assert not waiter.done(), "an acquire overcommitted the budget while all was leased"
        assert store.stats()["resident_bytes"] <= 2 * one
        assert view_a.data.tobytes() == expected_bytes(store.index, (0, 0))
        await b.__aexit__(None, None, None)  # frees (0, 1) for eviction; (0, 0) stays leased
        assert await waiter == expected_bytes(store.index, (0, 2))
        assert view_a.data.tobytes() == expected_bytes(store.index, (0, 0))
        assert store.stats()["evictions"] == 1
        await a.__aexit__(None, None, None)
        store.check_invariants()


async def test_expert_larger_than_budget(st_checkpoint: Path, backend: str) -> None:
    async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, backend=backend) as probe:
        one = one_expert_bytes(probe.index)
    async with await ExpertStore.open(st_checkpoint, budget_bytes=one - 1, backend=backend) as store:
        with pytest.raises(BudgetError, match=r"\(0, 0\).*budget"):
            async with store.acquire((0, 0)):
                pass
        assert store.stats()["resident_bytes"] == 0
        with pytest.raises(BudgetError):
            store.prefetch([(0, 1)])


@pytest.mark.parametrize("budget", [0, -5, True, 1.5, "1GB", None])
async def test_bad_budget(st_checkpoint: Path, budget: object) -> None:
    with pytest.raises(BudgetError, match="budget_bytes"):
        await ExpertStore.open(st_checkpoint, budget_bytes=budget)  # type: ignore[arg-type]


async def test_absurd_budget_names_the_memory(st_checkpoint: Path) -> None:
    with pytest.raises(BudgetError, match=r"budget_bytes=\d+ is more than this machine's memory"):
        await ExpertStore.open(st_checkpoint, budget_bytes=1 << 60)


async def test_bad_backend_and_policy(st_checkpoint: Path) -> None:
    with pytest.raises(BackendUnavailable, match="nvme9"):
        await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, backend="nvme9")
    with pytest.raises(StoreError, match="clock"):
        await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, policy="clock")


async def test_unknown_keys_name_the_key(st_checkpoint: Path, backend: str) -> None:
    async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, backend=backend) as store:
        for bad in [(LAYERS, 0), (0, EXPERTS), (-1, 0), "0,0", [0, 0], (0,), (0, 0, 0), None, (0.5, 1)]:
            with pytest.raises(UnknownExpertError) as info:
                async with store.acquire(bad):  # type: ignore[arg-type]
                    pass
            assert repr(bad) in str(info.value) or str(bad) in str(info.value)
        with pytest.raises(UnknownExpertError):
            store.prefetch([(0, 0), (LAYERS, 0)])
        assert store.stats()["loading"] == 0, "prefetch started loads before rejecting a bad key"
        async with store.acquire((0, 0)) as view:  # still usable
            assert view.data.tobytes() == expected_bytes(store.index, (0, 0))


async def test_cancel_starter_mid_read_keeps_the_joiner(st_checkpoint: Path) -> None:
    backend = GatedBackend()
    async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, backend=backend) as store:
        starter = asyncio.create_task(_hold(store, (2, 5), 0))
        while store.stats()["loading"] == 0:
            await asyncio.sleep(0)
        joiner = asyncio.create_task(_hold(store, (2, 5), 0))
        while store.stats()["single_flight_joins"] == 0:
            await asyncio.sleep(0)
        starter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await starter
        backend.gate.set()
        assert await joiner == expected_bytes(store.index, (2, 5))
        s = store.stats()
        assert s["leased"] == 0 and s["loading"] == 0
        assert s["resident_bytes"] == store.index.experts[(2, 5)].nbytes
        store.check_invariants()


async def test_cancel_everyone_mid_read_still_publishes(st_checkpoint: Path) -> None:
    backend = GatedBackend()
    async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, backend=backend) as store:
        tasks = [asyncio.create_task(_hold(store, (3, 1), 0)) for _ in range(3)]
        while store.stats()["single_flight_joins"] < 2:
            await asyncio.sleep(0)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        backend.gate.set()
        while store.stats()["loading"]:
            await asyncio.sleep(0.001)
        async with store.acquire((3, 1)) as view:
            assert view.data.tobytes() == expected_bytes(store.index, (3, 1))
        s = store.stats()
        assert s["hits"] == 1 and s["leased"] == 0
        store.check_invariants()


async def test_cancel_while_waiting_for_room(st_checkpoint: Path, backend: str) -> None:
    async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, backend=backend) as probe:
        one = one_expert_bytes(probe.index)
    async with await ExpertStore.open(st_checkpoint, budget_bytes=one, backend=backend) as store:
        lease = store.acquire((0, 0))
        await lease.__aenter__()
        waiter = asyncio.create_task(_hold(store, (0, 1), 0))
        for _ in range(20):
            await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        await lease.__aexit__(None, None, None)
        s = store.stats()
        assert s["resident_bytes"] == one and s["loading"] == 0 and s["leased"] == 0
        store.check_invariants()


async def test_budget_under_heavy_concurrency_with_cancellations(st_checkpoint: Path, backend: str) -> None:
    rng = random.Random(7)
    async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, backend=backend) as probe:
        one = one_expert_bytes(probe.index)
        truth = {key: expected_bytes(probe.index, key) for key in probe.index.experts}
    budget = 3 * one
    keys = list(truth)
    wrong = 0
    async with await ExpertStore.open(st_checkpoint, budget_bytes=budget, backend=backend) as store:
        peak = 0
        stop = False

        async def sampler() -> None:
            nonlocal peak
            while not stop:
                peak = max(peak, store.stats()["resident_bytes"])
                store.check_invariants()
                await asyncio.sleep(0)

        async def worker(key: ExpertKey) -> None:
            nonlocal wrong
            async with store.acquire(key) as view:
                await asyncio.sleep(rng.random() * 0.002)
                wrong += view.data.tobytes() != truth[key]

        sampling = asyncio.create_task(sampler())
        tasks = []
        for _ in range(400):
            tasks.append(asyncio.create_task(worker(rng.choice(keys))))
            if rng.random() < 0.3:
                rng.choice(tasks).cancel()
            if rng.random() < 0.2:
                await asyncio.sleep(0)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        stop = True
        await sampling
        errors = [r for r in results if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError)]
        assert not errors, errors[:3]
        assert wrong == 0
        assert peak <= budget
        s = store.stats()
        assert s["leased"] == 0 and s["loading"] == 0
        assert s["requests"] == s["hits"] + s["misses"] + s["single_flight_joins"]
        assert s["resident_bytes"] + s["idle_slab_bytes"] <= budget + 3 * 4096
        store.check_invariants()


async def test_prefetch_never_evicts_leased(st_checkpoint: Path, backend: str) -> None:
    async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, backend=backend) as probe:
        one = one_expert_bytes(probe.index)
    async with await ExpertStore.open(st_checkpoint, budget_bytes=2 * one, backend=backend) as store:
        assert store.prefetch([(1, 1), (1, 2)]) == 2
        while store.stats()["loading"]:
            await asyncio.sleep(0.001)
        async with store.acquire((1, 1)), store.acquire((1, 2)):
            assert store.stats()["hits"] == 2
            assert store.prefetch([(1, 3)]) == 0
            assert store.stats()["prefetch_dropped"] == 1
        assert store.prefetch([(1, 3)]) == 1
        async with store.acquire((1, 3)) as view:
            assert view.data.tobytes() == expected_bytes(store.index, (1, 3))


async def test_read_error_names_file_and_store_stays_usable(st_copy: Path, backend: str) -> None:
    async with await ExpertStore.open(st_copy, budget_bytes=1 << 20, backend=backend) as store:
        last = (LAYERS - 1, EXPERTS - 1)
        path = store.index.files[store.index.experts[last].extents[0].file]
        other = next(k for k, lay in store.index.experts.items()
                     if store.index.files[lay.extents[0].file] != path)
        original = Path(path).read_bytes()
        os.truncate(path, store.index.experts[last].extents[0].offset + 10)
        with pytest.raises(ReadError, match=Path(path).name):
            async with store.acquire(last):
                pass
        s = store.stats()
        assert s["resident_bytes"] == 0 and s["loading"] == 0 and s["load_errors"] == 1
        assert sum(d["errors"] for d in s["per_device"].values()) == 1
        async with store.acquire(other) as view:
            assert view.data.tobytes() == expected_bytes(store.index, other)
        Path(path).write_bytes(original)
        async with store.acquire(last) as view:  # retried afresh once the file is whole again
            assert view.data.tobytes() == expected_bytes(store.index, last)
        store.check_invariants()


async def test_closed_store(st_checkpoint: Path, backend: str) -> None:
    store = await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, backend=backend)
    async with store.acquire((0, 0)):
        pass
    await store.close()
    await store.close()
    with pytest.raises(StoreClosed):
        async with store.acquire((0, 0)):
            pass
    with pytest.raises(StoreClosed):
        store.prefetch([(0, 0)])


async def test_close_wakes_waiters(st_checkpoint: Path, backend: str) -> None:
    async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, backend=backend) as probe:
        one = one_expert_bytes(probe.index)
    store = await ExpertStore.open(st_checkpoint, budget_bytes=one, backend=backend)
    lease = store.acquire((0, 0))
    await lease.__aenter__()
    waiter = asyncio.create_task(_hold(store, (0, 1), 0))
    await asyncio.sleep(0.01)
    await store.close()
    with pytest.raises(StoreClosed):
        await waiter
    await lease.__aexit__(None, None, None)


async def test_settle_waits_for_prefetches_in_flight(st_checkpoint: Path, backend: str) -> None:
    """``settle()``: once it returns nothing is loading, and what was prefetched is resident;
    on a closed store it raises, as every call does."""
    store = await ExpertStore.open(st_checkpoint, budget_bytes=1 << 30, backend=backend, policy="lru")
    async with store:
        keys = [(0, e) for e in range(4)]
        assert store.prefetch(keys) == 4
        assert store.stats()["loading"] == 4  # started, not done: prefetch never blocks
        await store.settle()
        s = store.stats()
        assert s["loading"] == 0 and s["misses"] == 0 and s["resident_bytes"] > 0
        async with store.acquire_many(keys):
            pass
        assert store.stats()["hits"] == 4
        await store.settle()  # nothing in flight: returns at once
    with pytest.raises(StoreClosed):
        await store.settle()
