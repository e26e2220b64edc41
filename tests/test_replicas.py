"""Mirrors, routing, failover, per-device queues and the per-token prefetch budget, on real
copies of a real checkpoint (replicas as folders on this machine's one disk; a slower drive
emulated by a token bucket around the real backend)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from iosched import ExpertStore, StoreError, _settings, backends
from iosched.backends.throttle import ThrottledBackend
from iosched.formats._mirrors import MirrorError
from iosched.runtime._router import DEGRADE_AFTER, Replica, Router
from iosched.runtime._scheduler import DEMAND, PREFETCH, DeviceQueue, Ticket
from tests._wrappers import GatedBackend
from tests.test_store import expected_bytes

pytestmark = pytest.mark.asyncio


async def read_all(store: ExpertStore) -> None:
    for key in store.index.experts:
        async with store.acquire(key) as view:
            assert view.data.tobytes() == expected_bytes(store.index, key)


async def test_both_replicas_serve_byte_exact(mirrored: tuple[Path, Path], backend: str) -> None:
    primary, mirror = mirrored
    async with await ExpertStore.open(primary, budget_bytes=1 << 20, backend=backend, mirrors=[mirror]) as store:
        await read_all(store)
        reps = store.stats()["per_replica"]
        assert set(reps) == {str(primary), str(mirror)}
        assert all(r["reads"] > 0 and r["errors"] == 0 for r in reps.values())


async def test_routing_is_deterministic(mirrored: tuple[Path, Path]) -> None:
    primary, mirror = mirrored
    seen = []
    for _ in range(2):
        async with await ExpertStore.open(primary, budget_bytes=1 << 20, mirrors=[mirror]) as store:
            await read_all(store)
            seen.append(store.stats()["per_replica"])
    assert seen[0] == seen[1]


async def test_mismatched_mirrors_are_refused(mirrored: tuple[Path, Path], tmp_path: Path) -> None:
    primary, mirror = mirrored
    shard = sorted(mirror.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[20] ^= 0xFF  # inside the JSON header
    shard.write_bytes(bytes(data))
    with pytest.raises(MirrorError, match=shard.name):
        await ExpertStore.open(primary, budget_bytes=1 << 20, mirrors=[mirror])
    shard.write_bytes(bytes(data) + b"x")
    with pytest.raises(MirrorError, match=rf"{shard.name} is {len(data) + 1} bytes"):
        await ExpertStore.open(primary, budget_bytes=1 << 20, mirrors=[mirror])
    with pytest.raises(MirrorError, match="no-such-mirror"):
        await ExpertStore.open(primary, budget_bytes=1 << 20, mirrors=[tmp_path / "no-such-mirror"])
    empty = tmp_path / "empty-mirror"
    empty.mkdir()
    with pytest.raises(MirrorError, match="holds none"):
        await ExpertStore.open(primary, budget_bytes=1 << 20, mirrors=[empty])


async def test_partial_mirror_serves_what_it_has(mirrored: tuple[Path, Path]) -> None:
    primary, mirror = mirrored
    gone = sorted(mirror.glob("*.safetensors"))[-1]
    gone.unlink()
    async with await ExpertStore.open(primary, budget_bytes=1 << 20, mirrors=[mirror]) as store:
        await read_all(store)
        assert store.stats()["per_replica"][str(mirror)]["reads"] > 0


async def test_failover_when_a_replica_is_truncated(mirrored: tuple[Path, Path], backend: str) -> None:
    primary, mirror = mirrored
    async with await ExpertStore.open(primary, budget_bytes=1 << 20, backend=backend, mirrors=[mirror]) as store:
        for shard in mirror.glob("*.safetensors"):
            os.truncate(shard, 1000)  # under the running store
        await read_all(store)  # every byte still right: served by the primary
        s = store.stats()
        assert s["failovers"] > 0 and s["retries"] >= s["failovers"]
        assert s["per_replica"][str(mirror)]["errors"] >= DEGRADE_AFTER
        assert any(p.startswith(str(mirror)) for p in s["degraded"])
        assert s["load_errors"] == 0


async def test_every_replica_failing_names_a_file(mirrored: tuple[Path, Path]) -> None:
    primary, mirror = mirrored
    async with await ExpertStore.open(primary, budget_bytes=1 << 20, mirrors=[mirror]) as store:
        for folder in (primary, mirror):
            for shard in folder.glob("*.safetensors"):
                os.truncate(shard, 1000)
        with pytest.raises(StoreError, match=r"\.safetensors: short read"):
            async with store.acquire((0, 0)):
                pass


async def test_weighted_hash_follows_weights() -> None:
    replicas = [[Replica("/a/x", "sda", 0, weight=1.0), Replica("/b/x", "sdb", 1, weight=3.0)]]
    router = Router(replicas)
    firsts = [router.order((layer, expert), 0)[0].path for layer in range(100) for expert in range(100)]
    share = firsts.count("/b/x") / len(firsts)
    assert 0.72 < share < 0.78
    assert router.order((5, 5), 0)[0].path == router.order((5, 5), 0)[0].path


async def test_least_pending_prefers_the_idle_drive() -> None:
    pending = {"sda": 5, "sdb": 0}
    replicas = [[Replica("/a/x", "sda", 0), Replica("/b/x", "sdb", 1)]]
    router = Router(replicas, "least_pending", pending=lambda r: pending[r.device])
    assert all(router.order((i, 0), 0)[0].device == "sdb" for i in range(50))


async def test_degraded_replica_is_skipped_then_retried() -> None:
    now = [100.0]
    replicas = [[Replica("/a/x", "sda", 0), Replica("/b/x", "sdb", 1)]]
    router = Router(replicas, clock=lambda: now[0])
    bad = replicas[0][1]
    for _ in range(DEGRADE_AFTER):
        router.failed(bad)
    assert router.degraded() == ["/b/x"]
    assert all(router.order((i, 0), 0)[0] is not bad for i in range(50))
    now[0] += 10_000
    assert router.degraded() == []
    router.succeeded(bad)
    assert bad.failures == 0


async def test_weighted_routing_sends_less_to_a_slow_drive(mirrored: tuple[Path, Path]) -> None:
    primary, mirror = mirrored
    slow = ThrottledBackend(backends.create("pread"), {str(mirror): 2e6})
    weights = {str(primary): 4.0, str(mirror): 1.0}
    async with await ExpertStore.open(primary, budget_bytes=1 << 20, backend=slow, mirrors=[mirror],
                                      weights=weights) as store:
        await read_all(store)
        reps = store.stats()["per_replica"]
        # 32 experts hashed 4:1 (the tmp path enters the hash): the mirror's count is about
        # Binomial(32, 0.2), mean 6.4; it reaches 16 with probability ~3e-5 (the striping test
        # checks the proportions exactly).
        assert reps[str(primary)]["reads"] > reps[str(mirror)]["reads"]


async def test_queue_depth_and_priority() -> None:
    """Demand takes any free slot; prefetches only a drive no demand uses or waits for, at
    most speculative_depth at once, so demand never queues behind more than that."""
    queue = DeviceQueue(depth=4)
    assert queue.speculative_depth == 1
    order: list[str] = []

    async def read(name: str, ticket: Ticket) -> None:
        speculative = await queue.acquire(ticket)
        order.append(name)
        await asyncio.sleep(0.01)
        queue.release(speculative)

    prefetch, demand = Ticket(PREFETCH), Ticket(DEMAND)
    tasks = [asyncio.create_task(read(f"p{i}", prefetch)) for i in range(3)]
    await asyncio.sleep(0)
    assert queue.in_flight == 1 and queue.speculative_in_flight == 1 and queue.queued == 2
    tasks += [asyncio.create_task(read(f"d{i}", demand)) for i in range(2)]
    await asyncio.sleep(0)
    assert queue.in_flight == 3 and queue.queued == 2  # demand did not wait for the prefetches
    await asyncio.gather(*tasks)
    assert order == ["p0", "d0", "d1", "p1", "p2"]  # the rest only once demand was done
    assert queue.in_flight == 0 and queue.speculative_in_flight == 0 and queue.queued == 0


async def test_a_prefetch_waits_while_demand_is_in_flight() -> None:
    queue = DeviceQueue(depth=8)
    assert await queue.acquire(Ticket(DEMAND)) is False
    waiting = asyncio.create_task(queue.acquire(Ticket(PREFETCH)))
    await asyncio.sleep(0)
    assert not waiting.done() and queue.in_flight == 1
    queue.release(False)
    assert await waiting is True and queue.speculative_in_flight == 1
    queue.release(True)
    assert queue.in_flight == 0 and queue.speculative_in_flight == 0


async def test_promotion_and_cancellation_in_the_queue() -> None:
    queue = DeviceQueue(depth=1)
    await queue.acquire(Ticket(DEMAND))  # the one slot is taken
    late, promoted = Ticket(PREFETCH), Ticket(PREFETCH)
    cancelled = asyncio.create_task(queue.acquire(Ticket(DEMAND)))
    first = asyncio.create_task(queue.acquire(late))
    second = asyncio.create_task(queue.acquire(promoted))
    await asyncio.sleep(0)
    promoted.promote()
    cancelled.cancel()
    await asyncio.sleep(0)
    queue.release(False)
    await asyncio.sleep(0)
    assert second.done() and not first.done(), "the promoted read goes before an older prefetch"
    assert second.result() is False  # promoted: a demand slot
    queue.release(False)
    assert await first is True
    queue.release(True)
    assert queue.in_flight == 0 and queue.queued == 0 and queue.speculative_in_flight == 0


async def test_demand_promotes_a_queued_prefetch(st_checkpoint: Path) -> None:
    with _settings.override(pread_inline_max=0):  # every read a worker's: they queue, none is copied inline
        store = await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, queue_depth=1)
    async with store:
        keys = sorted(store.index.experts)[:6]
        assert store.prefetch(keys) == 6
        async with store.acquire(keys[-1]) as view:  # queued behind five prefetches
            assert view.data.tobytes() == expected_bytes(store.index, keys[-1])
        s = store.stats()
        assert s["prefetch_promoted"] == 1 and s["single_flight_joins"] == 1 and s["misses"] == 0
        assert s["queue_waits"] > 0


async def test_token_budget_refuses_prefetch_not_demand(st_checkpoint: Path) -> None:
    async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20) as probe:
        one = next(iter(probe.index.experts.values())).nbytes
    async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, token_budget_bytes=2 * one) as store:
        keys = sorted(store.index.experts)
        assert store.prefetch(keys[:5]) == 2
        s = store.stats()
        assert s["prefetch_refused"] == 3 and s["prefetch_refused_bytes"] == 3 * one
        async with store.acquire(keys[10]):  # demand is always served
            pass
        store.token_boundary()
        assert store.prefetch(keys[2:5]) == 2


async def test_bad_routing_options(st_checkpoint: Path, tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="round_robin"):
        await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, routing="round_robin")
    with pytest.raises(StoreError, match="queue_depth"):
        await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, queue_depth=0)
    with pytest.raises(StoreError, match="elsewhere"):
        await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, weights={str(tmp_path / "elsewhere"): 2.0})
    with pytest.raises(StoreError, match="token_budget_bytes"):
        await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, token_budget_bytes=-1)


@pytest.mark.parametrize("direct_backend", ["odirect", "uring"])
async def test_striping_weighted_and_all_or_nothing(mirrored: tuple[Path, Path], direct_backend: str) -> None:
    reason = backends.available()[direct_backend]
    if reason is not None:
        pytest.skip(f"backend {direct_backend} is unavailable here: {reason}")
    from iosched import override_settings

    primary, mirror = mirrored
    weights = {str(primary): 3.0, str(mirror): 1.0}
    with override_settings(stripe_threshold=4096):  # every expert of the small checkpoint
        async with await ExpertStore.open(primary, budget_bytes=1 << 20, backend=direct_backend,
                                          mirrors=[mirror], weights=weights) as store:
            await read_all(store)
            s = store.stats()
            reps = s["per_replica"]
            assert s["stripes"] == len(store.index.experts) and s["stripe_redos"] == 0
            share = reps[str(primary)]["bytes"] / (reps[str(primary)]["bytes"] + reps[str(mirror)]["bytes"])
            assert 0.65 < share < 0.85, share
        async with await ExpertStore.open(primary, budget_bytes=1 << 20, backend=direct_backend,
                                          mirrors=[mirror]) as store:
            for shard in mirror.glob("*.safetensors"):
                os.truncate(shard, 1000)
            await read_all(store)  # a failed leg redoes the whole read on the routed replica
            s = store.stats()
            assert s["stripe_redos"] > 0 and s["load_errors"] == 0


async def test_buffered_reads_are_never_striped(mirrored: tuple[Path, Path]) -> None:
    from iosched import override_settings

    primary, mirror = mirrored
    with override_settings(stripe_threshold=4096):
        async with await ExpertStore.open(primary, budget_bytes=1 << 20, backend="pread", mirrors=[mirror]) as store:
            await read_all(store)
            assert store.stats()["stripes"] == 0


async def test_open_a_topology_file(mirrored: tuple[Path, Path], tmp_path: Path) -> None:
    from iosched.topology._topology import TopologyError

    primary, mirror = mirrored
    topo = tmp_path / "topo.toml"
    topo.write_text(
        "version = 1\n[checkpoint]\n"
        f'primary = "{primary}"\nmirrors = ["{mirror}"]\n'
        '[routing]\npolicy = "least_pending"\nstripe_threshold_bytes = 4096\n'
        '[[device]]\nname = "does-not-exist"\nqueue_depth = 3\nweight = 1.0\n'
    )
    async with await ExpertStore.open(topo, budget_bytes=1 << 20, backend="odirect") as store:
        await read_all(store)
        s = store.stats()
        assert s["routing"] == "least_pending" and s["stripes"] > 0
        assert set(s["per_replica"]) == {str(primary), str(mirror)}
    topo.write_text(topo.read_text().replace("queue_depth = 3", "queue_depth = -3"))
    with pytest.raises(TopologyError, match=r"topo\.toml: device\[0\]\.queue_depth"):
        await ExpertStore.open(topo, budget_bytes=1 << 20)
    with pytest.raises(StoreError, match="not both"):
        await ExpertStore.open(topo, budget_bytes=1 << 20, mirrors=[mirror])


async def test_a_topology_file_sets_a_drives_inflight_bytes(st_checkpoint: Path, tmp_path: Path) -> None:
    """``inflight_bytes`` in a drive's table caps that drive's queue; 0 lifts the cap; a
    drive without one gets the setting."""
    from iosched import override_settings
    from iosched.topology._topology import Discovery

    name = Discovery().drive_of(str(st_checkpoint)).name
    topo = tmp_path / "topo.toml"
    for cap in (12345, 0):
        topo.write_text(f'[checkpoint]\nprimary = "{st_checkpoint}"\n'
                        f'[[device]]\nname = "{name}"\ninflight_bytes = {cap}\n')
        async with await ExpertStore.open(topo, budget_bytes=1 << 20, backend="pread") as store:
            assert store._io.queues[name].inflight_bytes == cap
            await read_all(store)
            assert store._io.queues[name].bytes_in_flight == 0
    topo.write_text(f'[checkpoint]\nprimary = "{st_checkpoint}"\n')
    with override_settings(inflight_bytes=777):
        async with await ExpertStore.open(topo, budget_bytes=1 << 20, backend="pread") as store:
            assert store._io.queues[name].inflight_bytes == 777


async def test_hints_own_nothing_and_wait_behind_reads(st_checkpoint: Path) -> None:
    from iosched.runtime._scheduler import HINT

    async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, backend="pread") as store:
        keys = sorted(store.index.experts)[:4]
        assert store.hint(keys) == sum(len(store.index.experts[k].extents) for k in keys)
        while store.stats()["hints"] < 4:
            await asyncio.sleep(0.001)
        s = store.stats()
        assert s["resident_bytes"] == 0 and s["bytes_read"] == 0 and s["leased"] == 0
    async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, backend="odirect") as store:
        assert store.hint(sorted(store.index.experts)[:3]) == 0
        assert store.stats()["hints_skipped"] == 3
    queue = DeviceQueue(depth=1)
    await queue.acquire(Ticket(DEMAND))
    hint = asyncio.create_task(queue.acquire(Ticket(HINT)))
    prefetch = asyncio.create_task(queue.acquire(Ticket(PREFETCH)))
    await asyncio.sleep(0)
    queue.release(False)
    await asyncio.sleep(0)
    assert prefetch.done() and not hint.done(), "a hint goes after a prefetch queued later"
    queue.release(prefetch.result())
    assert await hint is True
    queue.release(True)
    assert queue.in_flight == 0 and queue.speculative_in_flight == 0


async def test_promoting_a_just_granted_prefetch_keeps_the_counts() -> None:
    """A prefetch granted a slot, promoted before its task resumes: the queue's waiting counts
    must not change (a miscount once held every later prefetch back for good)."""
    queue = DeviceQueue(depth=1)
    assert await queue.acquire(Ticket(DEMAND)) is False
    ticket = Ticket(PREFETCH)
    waiting = asyncio.create_task(queue.acquire(ticket))
    await asyncio.sleep(0)
    queue.release(False)  # grants the prefetch; its task has not resumed yet
    ticket.promote()
    assert await waiting is True
    assert queue.queued == 0
    queue.release(True)
    later = asyncio.create_task(queue.acquire(Ticket(PREFETCH)))
    await asyncio.sleep(0)
    assert later.done() and later.result() is True  # still allowed onto the idle drive
    queue.release(True)
    assert queue.in_flight == 0 and queue.speculative_in_flight == 0


async def test_bytes_in_flight_cap() -> None:
    """A drive admits reads while their bytes fit ``inflight_bytes`` (up to ``depth``): two
    experts of 2 MiB go one after the other, small reads go several at once, a read larger
    than the cap starts alone, and every release gives its bytes back, also a cancelled
    waiter's."""
    mib = 1 << 20
    queue = DeviceQueue(depth=8, inflight_bytes=2 * mib)
    demand = Ticket(DEMAND)
    assert await queue.acquire(demand, 2 * mib) is False
    second = asyncio.create_task(queue.acquire(demand, 2 * mib))
    await asyncio.sleep(0)
    assert not second.done() and queue.in_flight == 1 and queue.bytes_in_flight == 2 * mib
    queue.release(False, 2 * mib)
    assert await second is False and queue.bytes_in_flight == 2 * mib
    queue.release(False, 2 * mib)
    assert queue.bytes_in_flight == 0
    smalls = [await queue.acquire(demand, 576 << 10) for _ in range(3)]  # 1.7 MiB: all three fit
    fourth = asyncio.create_task(queue.acquire(demand, 576 << 10))
    await asyncio.sleep(0)
    assert smalls == [False] * 3 and not fourth.done() and queue.in_flight == 3
    queue.release(False, 576 << 10)
    assert await fourth is False and queue.in_flight == 3
    for _ in range(3):
        queue.release(False, 576 << 10)
    assert queue.in_flight == 0 and queue.bytes_in_flight == 0
    await queue.acquire(demand, 5 * mib)  # larger than the cap: alone, at once
    waiter = asyncio.create_task(queue.acquire(demand, 4096))
    await asyncio.sleep(0)
    assert not waiter.done() and queue.bytes_in_flight == 5 * mib
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    queue.release(False, 5 * mib)
    assert queue.in_flight == 0 and queue.bytes_in_flight == 0 and queue.queued == 0
    uncapped = DeviceQueue(depth=8)
    assert uncapped.inflight_bytes == 0
    for _ in range(8):
        await uncapped.acquire(demand, 4 * mib)
    assert uncapped.in_flight == 8 and uncapped.bytes_in_flight == 32 * mib


async def test_a_whole_group_passes_the_byte_cap() -> None:
    """Reads of an unordered ticket (an ``acquire_many`` group, awaited whole) are held by the
    depth alone; an ordered read still waits for the bytes in flight, theirs included."""
    mib = 1 << 20
    queue = DeviceQueue(depth=4, inflight_bytes=2 * mib)
    whole, ordered = Ticket(DEMAND, ordered=False), Ticket(DEMAND)
    for _ in range(4):
        assert await queue.acquire(whole, 2 * mib) is False
    assert queue.in_flight == 4 and queue.bytes_in_flight == 8 * mib
    waiting = asyncio.create_task(queue.acquire(ordered, 4096))
    await asyncio.sleep(0)
    for _ in range(3):
        queue.release(False, 2 * mib)
        await asyncio.sleep(0)
        assert not waiting.done()  # 2 MiB still in flight: 4 KiB more would pass the cap
    queue.release(False, 2 * mib)
    assert await waiting is False and queue.bytes_in_flight == 4096
    queue.release(False, 4096)
    assert queue.in_flight == 0 and queue.bytes_in_flight == 0


@pytest.mark.parametrize("grouping", ["acquire_many", "acquire_as_ready"])
async def test_which_groups_go_one_read_at_a_time(st_checkpoint: Path, grouping: str) -> None:
    """With a cap below any read, an ``acquire_as_ready`` group's misses reach the drive one at
    a time, in order, while an ``acquire_many`` group's all go at once (its engine awaits them
    whole, so order buys it nothing)."""
    from iosched import override_settings

    backend = GatedBackend()
    keys = [(1, e) for e in range(4)]
    with override_settings(inflight_bytes=1):
        async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, backend=backend,
                                          policy="lru") as store:
            (queue,) = store._io.queues.values()

            async def use() -> None:
                if grouping == "acquire_many":
                    async with store.acquire_many(keys):
                        pass
                else:
                    async with store.acquire_as_ready(keys) as arrivals:
                        async for _ in arrivals:
                            pass

            task = asyncio.create_task(use())
            for _ in range(5000):  # (bounded: a store that never reads fails the asserts below)
                if backend.started >= (4 if grouping == "acquire_many" else 1):
                    break
                await asyncio.sleep(0.001)
            await asyncio.sleep(0.01)
            assert queue.in_flight == (4 if grouping == "acquire_many" else 1)
            tickets = {rec.ticket.ordered for rec in store._loader.in_flight.values()}
            assert tickets == {grouping == "acquire_as_ready"}
            backend.gate.set()
            await task
            assert queue.in_flight == 0 and queue.bytes_in_flight == 0
