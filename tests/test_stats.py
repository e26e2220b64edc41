"""``statistics()`` is one deeply frozen, typed record; ``stats()`` is that record as plain
dicts, with the keys it always had."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from iosched import DeviceStats, ExpertStore, GrowthStats, StoreStats, TierStats

pytestmark = pytest.mark.asyncio

# stats()'s keys before the record was typed (the contract's, and the project's additions):
# a key may be added, none renamed or removed.
KEYS = {
    "admissions", "backend", "backend_info", "backend_reason", "budget_bytes", "budget_cycles",
    "budget_growth", "bytes_read", "degraded", "evictions", "experts_per_token", "failovers",
    "felt_wait_s", "hints", "hints_skipped", "history", "history_loaded", "hits", "hits_by_tier",
    "idle_slab_bytes", "leased", "load_errors", "loading", "loop", "migration_bytes", "misses",
    "per_device", "per_replica", "physical_misses", "pinned_experts", "policy", "policy_fallback",
    "policy_prefetch_batches", "prefetch_dropped", "prefetch_failed", "prefetch_guard_refusals",
    "prefetch_issued", "prefetch_paced_bytes", "prefetch_paced_refusals", "prefetch_promoted",
    "prefetch_refused", "prefetch_refused_bytes", "prefetch_unused", "prefetch_used",
    "prefetch_wasted", "queue_waits", "rejections", "requests", "resident_bytes",
    "resident_experts", "retries", "routing", "routing_rows", "service_s", "single_flight_joins",
    "stripe_redos", "stripes", "td_bytes", "token_budget_bytes", "tokens",
}


async def test_statistics_is_deeply_frozen(st_checkpoint: Path) -> None:
    async with await ExpertStore.open(st_checkpoint, budget_bytes="auto", experts_per_token=2) as store:
        async with store.acquire_many([(0, 0), (0, 1)]):
            pass
        snap = store.statistics()
        assert isinstance(snap, StoreStats)
        with pytest.raises(dataclasses.FrozenInstanceError):
            snap.hits = 99  # type: ignore[misc]
        (drive, device), = snap.per_device.items()
        assert isinstance(device, DeviceStats) and device.reads >= 1
        with pytest.raises(TypeError):
            snap.per_device[drive] = device  # type: ignore[index]
        with pytest.raises(dataclasses.FrozenInstanceError):
            device.reads = 0  # type: ignore[misc]
        with pytest.raises(TypeError):
            snap.backend_info["threads"] = 1  # type: ignore[index]
        assert isinstance(snap.hits_by_tier, TierStats) and isinstance(snap.degraded, tuple)
        assert isinstance(snap.budget_growth, GrowthStats) and isinstance(snap.budget_growth.grown_to, tuple)
        # and it does not change under the engine: a later acquire leaves this snapshot as it was
        async with store.acquire((1, 0)):
            pass
        assert snap.requests == 2 and store.statistics().requests == 3


async def test_stats_is_the_record_as_plain_dicts(st_checkpoint: Path) -> None:
    async with await ExpertStore.open(st_checkpoint, budget_bytes="auto", experts_per_token=2) as store:
        async with store.acquire((0, 0)):
            pass
        snap, plain = store.statistics(), store.stats()  # no await between: the same instant
        assert set(plain) == {f.name for f in dataclasses.fields(snap)}
        assert KEYS <= set(plain), f"keys gone: {sorted(KEYS - set(plain))}"
        assert plain["requests"] == snap.requests == 1 and plain["misses"] == 1
        assert type(plain["per_device"]) is dict
        assert all(type(d) is dict and set(d) == {"reads", "bytes", "errors", "in_flight"}
                   for d in plain["per_device"].values())
        assert plain["hits_by_tier"] == {"resident": 0, "page_cache": snap.hits_by_tier.page_cache,
                                         "drive": snap.hits_by_tier.drive}
        assert type(plain["degraded"]) is list and type(plain["backend_info"]) is dict
        growth = plain["budget_growth"]
        assert type(growth) is dict and growth["grown_to"] == [] and growth["last"] is None
        plain["per_device"].clear()  # a fresh object each call: mutating it changes nothing
        assert store.stats()["per_device"]


async def test_cheap_gauges_and_the_request_tally(st_checkpoint: Path) -> None:
    async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20) as store:
        async with store.acquire((0, 0)) as view:
            assert store.resident_bytes == view.data.nbytes == store.stats()["resident_bytes"]
        async with store.acquire((0, 0)):
            pass
        tally = store.request_tally
        assert (tally.requests, tally.hits, tally.misses, tally.single_flight_joins) == (2, 1, 1, 0)
        assert store.budget_bytes == 1 << 20
