"""No stale view, ever (issue #13, point 3): an array kept past its lease never shows another
expert's bytes, on every backend.

Before the change, ``view.data`` and ``view.tensors[...]`` kept after their ``async with`` and
then read after a few hundred other loads under a budget of a few experts showed *another*
expert's bytes on ``pread``, ``odirect`` and ``uring`` (and on ``mmap`` for GGUF experts, whose
three extents are read into a slab rather than mapped): the slab was recycled under them.
Now a slab something still exports is *retired* (``iosched/runtime/_slab.py``): set aside, outside
the budget, and taken back only once the last reference died.

The budgets here leave a little slack above a whole number of experts, so slabs are recycled
through the idle pool (with an exact multiple the page-rounded slab never fits the headroom;
it is then handed straight to the next load as the pool's ``spare``, which the last test here
runs on every backend).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from iosched import ExpertStore, ExpertView, InvariantError, load_index
from iosched._layout import CheckpointIndex, ExpertKey, ExpertLayout
from iosched.runtime._slab import PAGE, Slab, SlabPool, round_up
from tests.conftest import EXPERTS, LAYERS
from tests.test_store import expected_bytes

KEYS = [(layer, expert) for layer in range(LAYERS) for expert in range(EXPERTS)]
KEPT = KEYS[:3]
OTHERS = KEYS[3:]


@pytest.fixture(params=["safetensors", "gguf"])
def checkpoint(request: pytest.FixtureRequest, st_checkpoint: Path, gguf_checkpoint: Path) -> Path:
    """Both formats: a safetensors expert is one extent (``mmap`` maps it), a GGUF expert three
    (every backend reads it into a slab, ``mmap`` too)."""
    return st_checkpoint if request.param == "safetensors" else gguf_checkpoint


def expert_bytes(ckpt: Path) -> int:
    return next(iter(load_index(ckpt).experts.values())).nbytes


def tight_budget(ckpt: Path, experts: int) -> int:
    """``experts`` experts plus half of one and two pages of slack, so slabs are recycled."""
    nbytes = expert_bytes(ckpt)
    return experts * nbytes + nbytes // 2 + 2 * PAGE


def mapped(store: ExpertStore, backend: str) -> bool:
    """Whether ``mmap`` serves the store's experts from the file's own mapping (one extent each)."""
    return backend == "mmap" and all(len(x.extents) == 1 for x in store.index.experts.values())


def tensor_of(expected: bytes, layout: ExpertLayout, name: str) -> npt.NDArray[Any]:
    """The tensor ``name`` of ``layout`` built from the file's bytes, not from the store."""
    spec = next(t for t in layout.tensors if t.name == name)
    return np.frombuffer(expected, dtype=spec.dtype, count=spec.nbytes // spec.dtype.itemsize,
                         offset=spec.buf_offset).reshape(spec.shape)


class Kept:
    """What an engine keeps of a view past its lease: ``data``, a tensor, a derived slice."""

    def __init__(self, view: ExpertView) -> None:
        self.key = view.key
        self.data = view.data
        self.up = view.tensors["up_proj"]
        self.down_slice = view.tensors["down_proj"][1:3, ::2].T

    def check(self, index: CheckpointIndex) -> None:
        """Exactly this expert's bytes, compared with the file's."""
        expected = expected_bytes(index, self.key)
        layout = index.experts[self.key]
        assert self.data.tobytes() == expected, f"kept view.data of {self.key} shows other bytes"
        np.testing.assert_array_equal(self.up, tensor_of(expected, layout, "up_proj"),
                                      err_msg=f"kept up_proj of {self.key}")
        np.testing.assert_array_equal(self.down_slice, tensor_of(expected, layout, "down_proj")[1:3, ::2].T,
                                      err_msg=f"kept down_proj slice of {self.key}")


async def use(store: ExpertStore, key: ExpertKey) -> int:
    """A normal acquire: the view is used inside the lease and nothing of it outlives the call."""
    async with store.acquire(key) as view:
        return int(view.data[:64].sum())


async def use_many(store: ExpertStore, keys: list[ExpertKey]) -> int:
    async with store.acquire_many(keys) as views:
        return sum(int(v.data[-64:].sum()) for v in views)


async def churn(store: ExpertStore, rounds: int, keys: list[ExpertKey] = OTHERS) -> None:
    """Hundreds of loads of other experts under the tight budget: single acquires, groups."""
    for r in range(rounds):
        if r % 2:
            for key in keys:
                await use(store, key)
        else:
            for i in range(0, len(keys) - 1, 2):
                await use_many(store, keys[i:i + 2])
        store.check_invariants()


@pytest.mark.asyncio
async def test_kept_views_show_their_own_bytes(checkpoint: Path, backend: str) -> None:
    async with await ExpertStore.open(checkpoint, budget_bytes=tight_budget(checkpoint, 3),
                                      backend=backend, policy="lru") as store:
        kept: list[Kept] = []
        whole: ExpertView | None = None
        for key in KEPT:
            async with store.acquire(key) as view:
                kept.append(Kept(view))
                if whole is None:
                    whole = view  # the whole view object kept too
        for _ in range(5):
            await churn(store, 2)
            for k in kept:
                k.check(store.index)
        assert whole is not None and whole.data.tobytes() == expected_bytes(store.index, KEPT[0])
        s = store.stats()
        assert s["misses"] >= 280 and s["evictions"] >= 270, s  # hundreds of loads
        capacity = round_up(store.index.experts[KEPT[0]].nbytes, PAGE)
        if mapped(store, backend):
            # The file's own mapping, at the expert's own offset: nothing to retire, and the
            # evictions gave the pages back (MADV_PAGEOUT) under the kept views, which fault them in again.
            assert s["retired_slabs"] == 0 and s["retired_bytes"] == 0, s
            assert s["backend_info"]["released_bytes"] > 0
        else:
            assert s["retired_slabs"] == len(KEPT) and s["retired_released"] == 0, s
            assert s["retired_bytes"] >= len(KEPT) * capacity, s
            pool = store._loader.pool
            assert pool.allocated < pool.takes // 4, "retiring three slabs must not stop the recycling"
        del kept, whole, view, k
        s = store.stats()
        assert s["retired_bytes"] == 0 and s["retired_released"] == s["retired_slabs"], s
        await churn(store, 1)
        store.check_invariants()
        assert store.stats()["resident_bytes"] <= store.budget_bytes


@pytest.mark.asyncio
@pytest.mark.parametrize("policy", ["lru", "default"])
async def test_a_normal_run_retires_nothing(checkpoint: Path, backend: str, policy: str) -> None:
    """Nothing of the store's own (payload, leases, groups, tasks, the pool) keeps a view alive:
    with views not kept, no slab is retired: hits, misses, groups, joins and prefetches."""
    async with await ExpertStore.open(checkpoint, budget_bytes=tight_budget(checkpoint, 4), backend=backend,
                                      policy=policy, experts_per_token=2) as store:
        for r in range(4):
            await churn(store, 1, OTHERS if r % 2 else KEYS)
            store.prefetch(KEYS[r * 4:r * 4 + 2])
            await asyncio.gather(*(use(store, k) for k in KEYS[r * 4:r * 4 + 3] * 2))  # joins
            await use(store, KEYS[r * 4 + 2])  # a hit
            store.token_boundary()
        s = store.stats()
        assert s["retired_slabs"] == 0 and s["retired_bytes"] == 0, s
        assert s["misses"] >= 100 and s["hits"] >= 1, s
        pool = store._loader.pool
        assert mapped(store, backend) or pool.allocated < pool.takes // 4, (pool.allocated, pool.takes)


@pytest.mark.asyncio
async def test_transient_entries_come_back(checkpoint: Path, backend: str) -> None:
    """A policy that rejects (``wtinylfu``) serves some misses from a transient entry, dropped at
    its lease's end: inside ``__aexit__``, while the caller's ``as view`` is still bound.  That
    slab is retired for the moment, and taken back (recycled) once the caller let go."""
    async with await ExpertStore.open(checkpoint, budget_bytes=tight_budget(checkpoint, 4), backend=backend,
                                      policy="wtinylfu") as store:
        await churn(store, 6, KEYS)
        s = store.stats()
        assert s["rejections"] > 0, "the run must exercise transient entries"
        assert s["retired_slabs"] <= s["rejections"], s
        assert s["retired_bytes"] == 0 and s["retired_released"] == s["retired_slabs"], s
        pool = store._loader.pool
        assert mapped(store, backend) or pool.allocated < pool.takes // 4, (pool.allocated, pool.takes)


@pytest.mark.asyncio
@pytest.mark.timeout(120)
@pytest.mark.parametrize("budget_batches", [LAYERS, 1])
async def test_loop_variable_bound_across_batches_does_not_deadlock(
        st_checkpoint: Path, backend: str, budget_batches: int, caplog: pytest.LogCaptureFixture) -> None:
    """The engine's loop: ``views`` stays bound to the previous batch while the next
    ``acquire_many`` waits.  Retired bytes are outside the budget, so the next batch never waits
    for room that only its caller's variable holds: a budget of one token cycle (k experts x
    every layer) and of one batch (k experts: every batch evicts the previous one while
    ``views`` still holds it) both finish, every view byte-exact, and no warning: a variable
    rebound at the next batch is no keep."""
    k = 2
    nbytes = expert_bytes(st_checkpoint)
    budget = budget_batches * k * nbytes + nbytes // 2 + 2 * PAGE
    caplog.set_level(logging.WARNING, logger="iosched")
    async with await ExpertStore.open(st_checkpoint, budget_bytes=budget, backend=backend, policy="lru",
                                      experts_per_token=k) as store:
        views: list[ExpertView]
        for token in range(40):
            for layer in range(LAYERS):
                keys = [(layer, (token * 3 + layer + i) % EXPERTS) for i in range(k)]
                async with store.acquire_many(keys) as views:
                    for view in views:
                        assert view.data.tobytes() == expected_bytes(store.index, view.key)
            store.token_boundary()
        s = store.stats()
        assert s["resident_bytes"] <= s["budget_bytes"]
        for view in views:  # the last batch, still bound: still its own bytes
            assert view.data.tobytes() == expected_bytes(store.index, view.key)
        if budget_batches == 1 and not mapped(store, backend):
            assert s["retired_slabs"] > 0, "the loop must have evicted a batch its variable still held"
        assert s["retired_bytes"] <= (k + 1) * round_up(nbytes, PAGE), s
        del views, view
        s = store.stats()
        assert s["retired_bytes"] == 0 and s["retired_released"] == s["retired_slabs"], s
    assert not [r for r in caplog.records if r.name == "iosched" and "still referenced" in r.getMessage()]


@pytest.mark.asyncio
async def test_a_view_kept_across_a_budget_turnover_warns_once(
        gguf_checkpoint: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="iosched")
    async with await ExpertStore.open(gguf_checkpoint, budget_bytes=tight_budget(gguf_checkpoint, 3),
                                      backend="pread", policy="lru") as store:
        kept = []
        for key in KEPT:
            async with store.acquire(key) as view:
                kept.append(view.tensors["gate_proj"])
        del view
        await churn(store, 4)
        warnings = [r for r in caplog.records if r.name == "iosched" and "still referenced" in r.getMessage()]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        assert repr(KEPT[0]) in warnings[0].getMessage() and "budget" in warnings[0].getMessage()
        assert store.stats()["retired_slabs"] == len(KEPT)
        del kept


@pytest.mark.asyncio
async def test_close_with_kept_views(checkpoint: Path, backend: str) -> None:
    """Closing the store (evicting everything, closing the pool and the backend's files and
    mappings) with views kept neither crashes nor changes them; they free themselves later."""
    unraisable: list[Any] = []
    previous_hook = sys.unraisablehook
    sys.unraisablehook = unraisable.append
    try:
        store = await ExpertStore.open(checkpoint, budget_bytes=tight_budget(checkpoint, 3), backend=backend,
                                       policy="lru")
        kept = []
        for key in KEPT:
            async with store.acquire(key) as view:
                kept.append(Kept(view))
        del view
        await churn(store, 1)
        await use(store, KEPT[-1])  # resident at close: evicted by close() itself
        async with store.acquire(KEPT[-1]) as view:
            kept.append(Kept(view))
        del view
        await store.close()
        gc.collect()
        for k in kept:
            k.check(store.index)
        s = store.stats()
        assert s["retired_bytes"] == 0 and s["retired_released"] == s["retired_slabs"], s
        if not mapped(store, backend):
            assert s["retired_slabs"] == len(kept), s  # KEPT[-1] twice: evicted, then closed on
        del kept, k
        gc.collect()
    finally:
        sys.unraisablehook = previous_hook
    assert not unraisable, [u.exc_value for u in unraisable]


@pytest.mark.asyncio
async def test_views_dropped_on_other_threads(st_checkpoint: Path, backend: str) -> None:
    """The engine drops kept views on threads of its own while the loop loads: the finalizers
    run there, the loop takes the slabs back, the counters add up, and the views still kept
    stay exact."""
    async with await ExpertStore.open(st_checkpoint, budget_bytes=tight_budget(st_checkpoint, 3),
                                      backend=backend, policy="lru") as store:
        batches: list[list[Kept]] = []
        for r in range(8):
            batch = []
            for key in OTHERS[r * 3:r * 3 + 3]:
                async with store.acquire(key) as view:
                    batch.append(Kept(view))
            batches.append(batch)
        del view, batch
        forever = batches.pop()

        def drop(items: list[list[Kept]]) -> None:
            while items:
                items.pop()

        halves = [batches[:4], batches[4:]]
        del batches
        threads = [threading.Thread(target=drop, args=(h,)) for h in halves]
        del halves
        for t in threads:
            t.start()
        await churn(store, 3)  # loads while the threads drop
        for t in threads:
            t.join()
        await churn(store, 1)
        for k in forever:
            k.check(store.index)
        s = store.stats()
        held = 0 if mapped(store, backend) else len(forever)
        assert s["retired_slabs"] - s["retired_released"] == held, s
        store.check_invariants()
        del forever, k
        assert store.stats()["retired_bytes"] == 0


@pytest.mark.asyncio
async def test_a_memoryview_dug_out_of_base_still_protects(gguf_checkpoint: Path, backend: str) -> None:
    """The export check is exact: a memoryview sliced off ``view.data.base`` (numpy's own, which
    holds the slab's mapping but not the array the store watches) still keeps the slab from
    reuse; the slab lingers until it dies, then comes back."""
    async with await ExpertStore.open(gguf_checkpoint, budget_bytes=tight_budget(gguf_checkpoint, 3),
                                      backend=backend, policy="lru") as store:
        async with store.acquire(KEPT[0]) as view:
            base = view.data.base
            assert isinstance(base, memoryview)
            dug = base[:256]
        del view, base
        await churn(store, 2)
        assert bytes(dug) == expected_bytes(store.index, KEPT[0])[:256]
        assert store.stats()["retired_bytes"] > 0
        del dug
        s = store.stats()
        assert s["retired_bytes"] == 0 and s["retired_released"] == s["retired_slabs"] == 1, s


def test_slab_export_check() -> None:
    """``Slab.exported`` sees every kind of reference, and the check itself changes nothing."""
    slab = Slab(4 * PAGE)
    slab.mm[:4] = b"abcd"
    address = np.frombuffer(slab.mm, dtype=np.uint8).ctypes.data
    assert not slab.exported()

    def data() -> npt.NDArray[np.uint8]:
        return np.frombuffer(memoryview(slab.mm)[PAGE:].toreadonly(), dtype=np.uint8)

    holders: list[Callable[[], object]] = [
        data,
        lambda: data()[10:20].view(np.uint16),
        lambda: data().data,  # memoryview(array)
        lambda: np.frombuffer(data(), dtype=np.float16, count=8, offset=2).reshape(2, 4).T,
        lambda: memoryview(slab.mm)[:1],
        lambda: data().base,  # numpy's own memoryview under an array
    ]
    for make in holders:
        held = make()
        assert slab.exported(), type(held)
        del held
        assert not slab.exported()
    assert slab.mm[:4] == b"abcd" and np.frombuffer(slab.mm, dtype=np.uint8).ctypes.data == address
    slab.close()


@pytest.mark.asyncio
async def test_check_invariants_catches_an_exported_idle_slab(st_checkpoint: Path) -> None:
    """The invariant check can fail: an idle slab something still exports (what recycling
    without looking did) is an ``InvariantError``."""
    async with await ExpertStore.open(st_checkpoint, budget_bytes=tight_budget(st_checkpoint, 3),
                                      backend="pread", policy="lru") as store:
        await churn(store, 1)
        store._table.evict(next(iter(store._table.entries())))  # its slab goes idle: room for it now
        pool = store._loader.pool
        idle = [slab for free in pool._idle.values() for slab in free]
        assert idle, "the run must leave an idle slab"
        held = memoryview(idle[0].mm)
        with pytest.raises(InvariantError, match="still exported"):
            store.check_invariants()
        del held
        store.check_invariants()


@pytest.mark.asyncio
@pytest.mark.parametrize("keep_variable", [True, False])
async def test_a_budget_of_exactly_one_batch_recycles_its_slabs(
        checkpoint: Path, backend: str, keep_variable: bool) -> None:
    """A budget of exactly k experts (no slack for the slabs' page or block rounding), every
    batch k misses: the slabs the evictions free are reused, with the loop variable bound to
    the previous batch (its slabs retired, then reused once it is rebound) or not, and every
    view still shows its own bytes.  Before, the page-rounded slab never fitted back into the
    headroom and each of the 80 loads mapped a fresh one (its page faults and munmap were most
    of the gap to a hand-written pread engine, docs/benchmarks.md)."""
    k, batches = 2, 40
    nbytes = expert_bytes(checkpoint)
    async with await ExpertStore.open(checkpoint, budget_bytes=k * nbytes, backend=backend,
                                      policy="lru") as store:
        views: list[ExpertView]
        for b in range(batches):
            layer = b % LAYERS
            keys = [(layer, (b * 3 + i) % EXPERTS) for i in range(k)]
            async with store.acquire_many(keys) as views:
                for view in views:
                    assert view.data.tobytes() == expected_bytes(store.index, view.key)
            if not keep_variable:
                views = []
                del view
        s = store.stats()
        assert s["misses"] == k * batches, s
        if not mapped(store, backend):
            allocated = store._loader.pool.allocated
            # the batch loading, and the one its caller's variable still holds
            assert allocated <= (2 * k if keep_variable else k), (allocated, s)
        for view in views:
            assert view.data.tobytes() == expected_bytes(store.index, view.key)
        assert s["resident_bytes"] <= s["budget_bytes"]


@pytest.mark.asyncio
async def test_a_batch_of_prefetches_reuses_the_slabs_its_evictions_free(checkpoint: Path, backend: str) -> None:
    """A full budget of exactly k experts (no slack for the slabs' rounding), then k prefetches
    in one call: they evict all k residents before their loads start, and every load takes a
    freed slab.  Before, the pool held one such slab for the step and closed the others, so
    k - 1 prefetch loads of every batch mapped fresh slabs (measured in a paired real run,
    2.25 MiB experts, 4 TD: 111 of 137 prefetch loads; with their page faults and munmaps the
    prefetch lost to LRU alone, and with the slabs reused it paid, docs/benchmarks.md).  A
    freed slab no load took is closed when the step ends."""
    k = 4
    nbytes = expert_bytes(checkpoint)
    async with await ExpertStore.open(checkpoint, budget_bytes=k * nbytes, backend=backend,
                                      policy="lru") as store:
        first = [(0, e) for e in range(k)]
        async with store.acquire_many(first):
            pass
        pool = store._loader.pool
        before = pool.allocated
        others = [(1, e) for e in range(k)]
        assert store.prefetch(others) == k
        assert not pool.spares, "every spare was taken in the step that freed it"
        await store.settle()
        async with store.acquire_many(others) as views:
            for view in views:
                assert view.data.tobytes() == expected_bytes(store.index, view.key)
        s = store.stats()
        assert s["prefetch_used"] == k and s["misses"] == k, s
        if not mapped(store, backend):
            assert pool.allocated == before, (pool.allocated, before, s)
        assert s["resident_bytes"] <= s["budget_bytes"]


@pytest.mark.asyncio
async def test_a_spare_no_load_takes_is_closed_when_its_step_ends() -> None:
    """A slab an eviction handed over is held only for the event-loop step that freed it: the
    ones no load took are closed then, so the pool never holds more than the budget past it."""
    pool = SlabPool()
    slabs = [Slab(round_up(3 * PAGE, PAGE)) for _ in range(3)]
    for slab in slabs:
        pool.give_back(slab, 0, hand_over=True)
    assert pool.spares == slabs
    taken = pool.take(3 * PAGE)
    assert taken in slabs and pool.allocated == 0
    await asyncio.sleep(0)
    assert pool.spares == []
    assert [s.mm.closed for s in slabs if s is not taken] == [True, True]
    assert not taken.mm.closed
    taken.close()
