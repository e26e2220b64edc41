"""State-machine tests (hypothesis) of the store (issue #6 item 2).

A :class:`hypothesis.stateful.RuleBasedStateMachine` drives a real :class:`ExpertStore` over a
real small safetensors checkpoint and a byte-identical mirror (written once per module into a
temporary folder), read through ``FaultyBackend(backends.create("pread"), plan)``, on each
event loop the suite runs on (plain asyncio and uvloop) and under LRU, W-TinyLFU and the
MoE-aware default (which may propose prefetches of its own after each ``acquire_many``).
Rules interleave:

* ``acquire`` (held across steps as entered :class:`Lease` objects, or left pending as
  "waiting acquires" when the budget is leased, a load is in flight or the drive hangs) and two
  acquires of one key at once (a hit or a single-flight join);
* ``acquire_many`` of one to three keys (repeats allowed), held as entered groups, or pending,
  or cancelled mid-way: at once, after a few loop iterations, or by a later ``cancel`` step,
  whichever of its leases it holds by then;
* releases (``release()`` or ``__aexit__``, twice is a no-op) and cancellations;
* ``prefetch``, ``hint`` and ``token_boundary``;
* fault plans: EIO, short reads and latency spikes on the mirror (and sometimes EIO on the
  primary, which makes loads fail), and a drive that stops answering, on either replica:
  until the plan changes, or for a few milliseconds and then EIO (a command timeout);
* runs of the event loop.

After every step it checks:

* ``store.check_invariants()`` and ``resident_bytes <= budget_bytes``;
* the statistics add up: ``requests == hits + misses + single_flight_joins`` and equals the
  acquires issued; ``tokens`` and ``prefetch_issued`` match the model (the policy's own
  prefetches aside); every prefetch is used, wasted, failed or still unused; demand loads by
  tier never exceed the misses; reservations (admissions + rejections) are all accounted for
  by entries, evictions, failed loads and dropped transients; counters never go down;
* every slab the pool handed out is held by exactly one entry of the table;
* every held view holds exactly the file's bytes, and so does every *resident* entry (an entry
  is published only after its whole read succeeded);
* each held key's entry is the lease's and resident: a leased entry is never evicted; an entry
  has as many leases as held here, plus at most one per pending acquire of its key (a pending
  group holds its hits' leases already); only pending acquires pin entries or wait for room,
  and a cancelled one leaks neither;
* an entry seen loading leaves the table only after it was published, or with a failed load;
* with no fault that can fail both replicas, no acquire fails.

Teardown lifts the faults, cancels pending acquires, releases every lease, lets the loads and
hints finish, checks ``leased == 0`` and ``loading == 0``, closes the store, checks that every
reservation and slab came back, and that the per-token telemetry lines add up to ``stats()``.

Preconditions would depend on the reads' timing (pread reads in threads), which hypothesis
rejects as flaky data generation; rules that need a held lease or a pending acquire do nothing
when there is none.  Each machine runs its own event loop (made in ``__init__`` from the
loop's factory in ``conftest.py``, closed in ``teardown``), driven with ``run_until_complete``.
"""

from __future__ import annotations

import asyncio
import gc
import json
import shutil
import tempfile
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar, cast

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)

from iosched import ExpertStore, StoreError, backends
from iosched._layout import ExpertKey
from iosched.backends.faults import FaultPlan, Faults, FaultyBackend
from iosched.formats._checkpoint import load_index
from iosched.residency._table import Entry, EntryState
from iosched.runtime._lease import Lease, LeaseGroup
from iosched.runtime._telemetry import COUNTERS, TIERS
from iosched.runtime._view import ExpertView
from iosched.tools.synth import write_safetensors_moe
from tests.conftest import loop_factories
from tests.test_store import expected_bytes

T = TypeVar("T")

LAYERS, EXPERTS, HIDDEN, INTER = 2, 4, 64, 48
BUDGET_EXPERTS = 3
"""The budget, in experts: a few, so that leases fill it and acquires wait for room."""
TOKEN_BUDGET_EXPERTS = 2
"""What prefetch may start between two token boundaries, in experts."""
EXPERTS_PER_TOKEN = 2
"""k: the checkpoint has no config.json, and the moe policy needs it."""
KEY = st.integers(0, LAYERS * EXPERTS - 1)

MONOTONIC = ("requests", "hits", "misses", "single_flight_joins", "bytes_read", "admissions",
             "rejections", "evictions", "load_errors", "prefetch_issued", "prefetch_dropped",
             "tokens", "prefetch_refused", "prefetch_refused_bytes", "prefetch_used",
             "prefetch_wasted", "prefetch_failed", "physical_misses", "migration_bytes", "hints")


class Checkpoint:
    """The module's checkpoint: primary, mirror, keys and each expert's bytes."""

    def __init__(self, primary: Path, mirror: Path) -> None:
        self.primary = primary
        self.mirror = mirror
        index = load_index(primary)
        self.keys: list[ExpertKey] = sorted(index.experts)
        self.expected: dict[ExpertKey, bytes] = {k: expected_bytes(index, k) for k in self.keys}
        self.expert_bytes = max(layout.nbytes for layout in index.experts.values())


@pytest.fixture(scope="module")
def checkpoint() -> Iterator[Checkpoint]:
    folder = Path(tempfile.mkdtemp(prefix="iosched-sm-"))
    try:
        primary, mirror = folder / "primary", folder / "mirror"
        write_safetensors_moe(primary, n_layers=LAYERS, n_experts=EXPERTS, hidden=HIDDEN,
                              intermediate=INTER, dtype="float16", n_shards=2, seed=5)
        shutil.copytree(primary, mirror)
        yield Checkpoint(primary, mirror)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


class Held:
    """Leases the test holds: one (``acquire``) or a group (``acquire_many``), key by key."""

    __slots__ = ("keys", "leases", "views", "exit")

    def __init__(self, keys: list[ExpertKey], leases: list[Lease], views: list[ExpertView],
                 exit: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self.keys = keys
        self.leases = leases
        self.views = views
        self.exit = exit


class Pending:
    """An acquire or a group not entered yet: waiting for room, joined to a load, or hung."""

    __slots__ = ("keys", "task", "held")

    def __init__(self, keys: list[ExpertKey], task: asyncio.Task[Any],
                 held: Callable[[Any], Held]) -> None:
        self.keys = keys
        self.task = task
        self.held = held


class StoreMachine(RuleBasedStateMachine):
    """One store, one event loop, a model of what the test holds."""

    ckpt: Checkpoint
    policy: str = "lru"
    loop_factory: Callable[[], asyncio.AbstractEventLoop] = asyncio.new_event_loop

    def __init__(self) -> None:
        super().__init__()
        self.loop = type(self).loop_factory()
        self.folder = Path(tempfile.mkdtemp(prefix="iosched-sm-run-"))
        self.backend = FaultyBackend(backends.create("pread"), FaultPlan())
        self.budget = BUDGET_EXPERTS * self.ckpt.expert_bytes
        self.store: ExpertStore = self.run(ExpertStore.open(
            self.ckpt.primary, budget_bytes=self.budget, backend=self.backend, policy=self.policy,
            mirrors=[self.ckpt.mirror], token_budget_bytes=TOKEN_BUDGET_EXPERTS * self.ckpt.expert_bytes,
            telemetry=self.folder / "telemetry.jsonl", experts_per_token=EXPERTS_PER_TOKEN,
        ))
        self.policy_prefetches = self.policy == "moe"
        """The policy proposes prefetches itself, after each acquire_many."""
        self.held: list[Held] = []
        self.pending: list[Pending] = []
        self.acquires = 0
        self.prefetched = 0
        self.hints_queued = 0
        self.tokens = 0
        self.acquire_errors = 0
        self.may_fail = False
        self.faults_seen = False
        """Whether any fault was ever planned (a timed hang after one may fail a load twice)."""
        """A fault that can fail both replicas of a read: EIO on the primary too."""
        self.hanging = False
        """A drive stopped answering until the plan changes: loads may not finish by waiting."""
        self.loading_seen: dict[int, tuple[Entry, asyncio.Future[None]]] = {}
        self.last: dict[str, Any] = {}

    # ------------------------------------------------------------------ helpers

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def spin(self, n: int) -> None:
        async def go() -> None:
            for _ in range(n):
                await asyncio.sleep(0)

        self.run(go())

    def settle(self) -> None:
        """Let the loads and hints in flight finish (reads run in pread's threads), then the
        waiters wake; with a hung drive, only briefly: its loads wait for the plan to change."""
        async def go() -> None:
            loads = set(self.store._loader.tasks)
            if loads:
                await asyncio.wait(loads, timeout=0.02 if self.hanging else 5.0)
            for _ in range(5):
                await asyncio.sleep(0)

        self.run(go())

    def sweep(self) -> None:
        """Collect the pending acquires that finished: leases held, an error, or cancelled."""
        still: list[Pending] = []
        for p in self.pending:
            if not p.task.done():
                still.append(p)
            elif p.task.cancelled():
                pass
            elif p.task.exception() is not None:
                exc = p.task.exception()
                assert isinstance(exc, StoreError), repr(exc)
                self.acquire_errors += 1
            else:
                h = p.held(p.task.result())
                for key, view in zip(h.keys, h.views, strict=True):
                    assert view.data.tobytes() == self.ckpt.expected[key]
                self.held.append(h)
        self.pending = still

    def start(self, keys: list[ExpertKey], coro: Coroutine[Any, Any, Any],
              held: Callable[[Any], Held]) -> Pending:
        task = self.loop.create_task(coro)
        self.acquires += len(keys)
        p = Pending(keys, task, held)
        self.pending.append(p)
        self.spin(2)  # the task starts, and a group's own acquires: every request is counted
        return p

    def start_acquire(self, key: ExpertKey) -> Pending:
        lease = self.store.acquire(key)

        def held(view: ExpertView) -> Held:
            return Held([key], [lease], [view], lambda: lease.__aexit__(None, None, None))

        return self.start([key], lease.__aenter__(), held)

    def cancel_pending(self, p: Pending) -> None:
        p.task.cancel()
        self.run(asyncio.wait({p.task}))
        self.sweep()

    # ------------------------------------------------------------------ rules

    @rule(key=KEY, wait=st.booleans())
    def acquire(self, key: int, wait: bool) -> None:
        """Acquire; with ``wait`` let the loads finish, else leave it pending after a few steps.
        When the budget is fully leased it stays pending either way (a waiting acquire)."""
        self.start_acquire(self.ckpt.keys[key])
        if wait:
            self.settle()
        else:
            self.spin(3)
        self.sweep()

    @rule(key=KEY)
    def acquire_hit_or_join(self, key: int) -> None:
        """Two acquires of one key in one step: the second is a hit or a single-flight join."""
        k = self.ckpt.keys[key]
        self.start_acquire(k)
        self.start_acquire(k)
        self.spin(2)
        self.sweep()

    @rule(keys=st.lists(KEY, min_size=1, max_size=3),
          cancel_after=st.sampled_from([None, None, 0, 1, 3]))
    def acquire_many(self, keys: list[int], cancel_after: int | None) -> None:
        """Lease a group; ``cancel_after``: cancel it after that many loop iterations if it is
        still pending (0: as soon as its own acquires started), else let the loads run."""
        wanted = [self.ckpt.keys[k] for k in keys]
        group: LeaseGroup = self.store.acquire_many(wanted)

        def held(views: list[ExpertView]) -> Held:
            return Held(wanted, list(group._leases), views, lambda: group.__aexit__(None, None, None))

        p = self.start(wanted, group.__aenter__(), held)
        if cancel_after is None:
            self.settle()
        else:
            self.spin(cancel_after)
            if not p.task.done():
                self.cancel_pending(p)
        self.sweep()

    @rule(i=st.integers(min_value=0), via_exit=st.booleans(), twice=st.booleans())
    def release(self, i: int, via_exit: bool, twice: bool) -> None:
        if not self.held:
            return  # not a precondition: what is held depends on the reads' timing
        h = self.held.pop(i % len(self.held))
        if via_exit:
            self.run(h.exit())
        else:
            for lease in h.leases:
                lease.release()
        if twice:
            for lease in h.leases:
                lease.release()  # a no-op
        self.spin(2)
        self.sweep()

    @rule(i=st.integers(min_value=0))
    def cancel(self, i: int) -> None:
        if not self.pending:
            return  # not a precondition: what is pending depends on the reads' timing
        self.cancel_pending(self.pending[i % len(self.pending)])

    def on_loop(self, method: Callable[[list[ExpertKey]], int], keys: list[int]) -> int:
        """Call ``store.prefetch`` or ``store.hint`` (they need a running loop) with these
        keys, let the loop run once; what it returned, at most one per key (one extent an
        expert here)."""
        wanted = [self.ckpt.keys[k] for k in keys]

        async def go() -> int:
            return method(wanted)

        n = self.run(go())
        assert 0 <= n <= len(wanted)
        self.spin(1)
        self.sweep()
        return n

    @rule(keys=st.lists(KEY, max_size=4))
    def prefetch(self, keys: list[int]) -> None:
        self.prefetched += self.on_loop(self.store.prefetch, keys)

    @rule(keys=st.lists(KEY, max_size=3))
    def hint(self, keys: list[int]) -> None:
        self.hints_queued += self.on_loop(self.store.hint, keys)

    @rule()
    def token_boundary(self) -> None:
        self.store.token_boundary()
        self.tokens += 1

    @rule(eio=st.sampled_from([0.0, 0.3, 1.0]), short=st.sampled_from([0.0, 0.5, 1.0]),
          spike=st.sampled_from([0.0, 0.5, 1.0]), primary_eio=st.sampled_from([0.0, 0.0, 0.5]))
    def set_faults(self, eio: float, short: float, spike: float, primary_eio: float) -> None:
        """EIO, short reads and latency spikes on the mirror; sometimes EIO on the primary."""
        rules = {str(self.ckpt.mirror): Faults(eio_rate=eio, short_rate=short, spike_rate=spike,
                                               spike_s=0.002)}
        self.faults_seen = self.faults_seen or bool(eio or short or primary_eio)
        if primary_eio:
            rules[str(self.ckpt.primary)] = Faults(eio_rate=primary_eio)
            self.may_fail = True
        self.set_plan(FaultPlan(rules, seed=self.backend.plan.seed), hanging=False)

    @rule(primary=st.booleans(), timeout=st.booleans())
    def hang(self, primary: bool, timeout: bool) -> None:
        """A drive stops answering: until the plan changes, or for 3 ms and then EIO (its reads
        fail over to the other replica)."""
        root = self.ckpt.primary if primary else self.ckpt.mirror
        if timeout and self.faults_seen:
            # A read that failed on the other replica under an earlier plan (and is still being
            # retried) fails over to this one, whose hang times out into EIO: both failed it.
            self.may_fail = True
        self.faults_seen = True
        self.set_plan(FaultPlan.on(root, seed=self.backend.plan.seed, hang=True,
                                   hang_s=0.003 if timeout else None), hanging=not timeout)

    @rule()
    def clear_faults(self) -> None:
        self.set_plan(FaultPlan(), hanging=False)

    def set_plan(self, plan: FaultPlan, hanging: bool) -> None:
        self.backend.set_plan(plan)  # reads hung under the old plan resume
        self.hanging = hanging

    @rule(n=st.integers(1, 10), settle=st.booleans())
    def run_loop(self, n: int, settle: bool) -> None:
        self.spin(n)
        if settle:
            self.settle()
        self.sweep()

    # ------------------------------------------------------------------ invariants

    @invariant()
    def store_is_consistent(self) -> None:
        self.sweep()
        store = self.store
        table = store._table
        store.check_invariants()
        s = store.stats()
        assert s["resident_bytes"] <= s["budget_bytes"] == self.budget
        entries = table.entries()

        # the statistics add up
        assert s["requests"] == s["hits"] + s["misses"] + s["single_flight_joins"]
        assert s["requests"] == self.acquires
        assert s["tokens"] == self.tokens
        assert s["prefetch_issued"] == self.prefetched or (
            self.policy_prefetches and s["prefetch_issued"] > self.prefetched)
        for name in MONOTONIC:
            assert s[name] >= self.last.get(name, 0), f"{name} went down: {self.last[name]} -> {s[name]}"
        self.last = {name: s[name] for name in MONOTONIC}
        reserved = s["admissions"] + s["rejections"]
        assert reserved <= s["misses"] + s["prefetch_issued"]
        dropped_transients = reserved - len(entries) - s["evictions"] - s["load_errors"]
        assert 0 <= dropped_transients <= s["rejections"], (reserved, len(entries), s)
        assert s["loading"] == sum(1 for e in entries if e.state is EntryState.LOADING)
        assert s["resident_experts"] == sum(1 for e in entries if e.state is EntryState.RESIDENT)
        # every prefetch ends one way; an unused one is still in the table
        unused = store._ledger.unused
        assert s["prefetch_issued"] == (s["prefetch_used"] + s["prefetch_wasted"]
                                        + s["prefetch_failed"] + s["prefetch_unused"])
        assert s["prefetch_unused"] == len(unused)
        assert all(table.get(key) is e for key, e in unused.items())
        assert s["migration_bytes"] <= s["bytes_read"]
        # demand loads: finished (by tier), failed, or in flight; at most one a miss
        tiers = s["hits_by_tier"]
        assert set(tiers) == set(TIERS) and tiers["resident"] == s["hits"]
        assert tiers["drive"] == s["physical_misses"]
        demand_loading = s["loading"] - sum(1 for e in unused.values() if e.state is EntryState.LOADING)
        demand_failed = s["load_errors"] - s["prefetch_failed"]
        assert tiers["page_cache"] + tiers["drive"] + demand_failed + demand_loading <= s["misses"], s
        assert s["hints"] <= self.hints_queued and s["hints_skipped"] == 0
        # every slab handed out is held by one entry (pread: every entry has one)
        assert store._loader.pool.takes - store._loader.pool.gives == len(entries)

        # held leases: right bytes, entry resident, leases counted exactly.  A pending group
        # may hold some of its leases already (its hits, its finished loads): an entry has
        # between the held leases and those plus the pending acquires of its key.
        by_key: dict[ExpertKey, list[Lease]] = {}
        for h in self.held:
            for key, lease, view in zip(h.keys, h.leases, h.views, strict=True):
                by_key.setdefault(key, []).append(lease)
                assert view.data.tobytes() == self.ckpt.expected[key], f"held view of {key} changed"
        for key, leases in by_key.items():
            entry = table.get(key)
            assert entry is not None, f"held expert {key} was evicted"
            assert entry.state is EntryState.RESIDENT
            assert all(lease._entry is entry for lease in leases)
        waiting: dict[ExpertKey, int] = {}
        for p in self.pending:
            for key in p.keys:
                waiting[key] = waiting.get(key, 0) + 1
        for e in entries:
            key = cast(ExpertKey, e.key)
            held = len(by_key.get(key, ()))
            assert held <= e.leases <= held + waiting.get(key, 0), (e, held, waiting.get(key, 0))
            # only a pending acquire pins: a finished or cancelled one has unpinned
            assert e.pins <= waiting.get(key, 0), f"{e!r} has a leaked pin"
        assert len(by_key) <= s["leased"] <= len(set(by_key) | set(waiting))
        assert sum(1 for f in store._room.waiters if not f.done()) <= sum(waiting.values())

        # published only after the whole read succeeded
        for e in entries:
            if e.state is EntryState.RESIDENT:
                assert e.payload is not None
                published: ExpertKey = cast(ExpertKey, e.key)
                assert e.payload.view.data.tobytes() == self.ckpt.expected[published]
            else:
                assert e.payload is None
                if id(e) not in self.loading_seen:
                    self.loading_seen[id(e)] = (e, store._loader.in_flight[cast(ExpertKey, e.key)].future)
        # a loading entry leaves the table only once published (then it may be evicted) or failed
        for ident, (e, future) in list(self.loading_seen.items()):
            if table.get(e.key) is e:
                if e.state is EntryState.RESIDENT:
                    del self.loading_seen[ident]
                continue
            if e.state is EntryState.LOADING:
                assert future.done() and future.exception() is not None, f"{e!r} left the table while loading"
            del self.loading_seen[ident]

        # faults that leave one replica serving are failed over
        if not self.may_fail:
            assert s["load_errors"] == 0 and self.acquire_errors == 0, s

    # ------------------------------------------------------------------ teardown

    def teardown(self) -> None:
        try:
            self.set_plan(FaultPlan(), hanging=False)  # a hung drive answers again
            for p in list(self.pending):
                p.task.cancel()
            if self.pending:
                self.run(asyncio.wait({p.task for p in self.pending}))
            self.sweep()
            assert not self.pending
            for h in self.held:
                for lease in h.leases:
                    lease.release()
            self.held.clear()
            for _ in range(100):
                self.settle()
                if not self.store._loader.tasks:
                    break
            store = self.store
            s = store.stats()
            assert s["loading"] == 0 and not store._loader.tasks, s
            assert s["leased"] == 0, s
            assert s["hints"] == self.hints_queued, s
            assert all(e.leases == 0 and e.pins == 0 for e in store._table.entries())
            store.check_invariants()
            self.run(store.close())
            self.run(store.close())  # idempotent
            after = store.stats()
            assert after["resident_bytes"] == 0 and after["resident_experts"] == 0, after
            assert after["idle_slab_bytes"] == 0, after
            assert store._loader.pool.takes == store._loader.pool.gives, "a slab was never given back"
            assert not store._loader.tasks and not store._room.waiters and not store._loader.in_flight
            assert not store._ledger.unused
            # the telemetry lines add up to the totals before the closing evictions
            lines = [json.loads(line) for line in (self.folder / "telemetry.jsonl").read_text().splitlines()]
            assert len(lines) == self.tokens + 1 and lines[-1]["end"] == "close"
            for name in COUNTERS:
                assert sum(r[name] for r in lines) == s[name], name
            for tier in TIERS:
                assert sum(r["hits_by_tier"][tier] for r in lines) == s["hits_by_tier"][tier], tier
        finally:
            self.loop.close()
            shutil.rmtree(self.folder, ignore_errors=True)


SETTINGS = settings(max_examples=120, stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("loop_name", list(loop_factories()))
@pytest.mark.parametrize("policy", ["lru", "wtinylfu", "moe"])
def test_store_state_machine(checkpoint: Checkpoint, policy: str, loop_name: str) -> None:
    """LRU (admits every miss), W-TinyLFU (rejects some: a transient slot in the table) and
    moe (guards evictions by prefetches, proposes its own), each on asyncio and on uvloop."""
    factory = loop_factories()[loop_name]
    factory().close()  # skips here, with the reason, where the loop is not installed
    machine = type(f"StoreMachine_{policy}_{loop_name}", (StoreMachine,),
                   {"ckpt": checkpoint, "policy": policy, "loop_factory": staticmethod(factory)})
    # Hypothesis first digests the machine's source (inspect.getsource, hence ast.parse). A
    # failed task left by an earlier test, collected during that parse, logs from its
    # finalizer, and CPython 3.11 then aborts the parse ("SystemError: AST constructor
    # recursion depth mismatch"): collect such garbage before, not during.
    gc.collect()
    run_state_machine_as_test(machine, settings=SETTINGS)
