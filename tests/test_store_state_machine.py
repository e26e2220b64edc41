"""State-machine tests (hypothesis) of the store (issue #6 item 2).

A :class:`hypothesis.stateful.RuleBasedStateMachine` drives a real :class:`ExpertStore` over a
real small safetensors checkpoint and a byte-identical mirror (written once per module into a
temporary folder), read through ``FaultyBackend(backends.create("pread"), plan)``.  Rules
interleave acquires (held across steps as entered :class:`Lease` objects, or left pending as
"waiting acquires" when the budget is leased or the load is still in flight), releases,
cancellations of pending acquires, prefetches, token boundaries, fault plans (EIO, short reads
and latency spikes on the mirror, and sometimes EIO on the primary too, which makes loads fail)
and runs of the event loop.  After every step it checks:

* ``store.check_invariants()`` and ``resident_bytes <= budget_bytes``;
* the statistics add up: ``requests == hits + misses + single_flight_joins`` and equals the
  acquires issued; ``tokens`` and ``prefetch_issued`` match the model; reservations
  (admissions + rejections) are all accounted for by entries, evictions, failed loads and
  dropped transients; counters never go down;
* every held view holds exactly the file's bytes, and so does every *resident* entry (an entry
  is published only after its whole read succeeded);
* each held key's entry is the lease's, resident, with exactly as many leases as held here
  (``stats()["leased"]`` is the number of distinct held keys): a leased entry is never evicted;
  only pending acquires pin entries or wait for room (a cancelled one leaks neither);
* an entry seen loading leaves the table only after it was published, or with a failed load;
* with no fault ever on the primary, the mirror's faults are failed over: no acquire fails.

Teardown cancels pending acquires, releases every lease, lets the loads finish, checks
``leased == 0`` and ``loading == 0``, closes the store and checks that every reservation and
buffer came back.

Preconditions would depend on the reads' timing (pread reads in threads), which hypothesis
rejects as flaky data generation; rules that need a held lease or a pending acquire do nothing
when there is none.

Plain asyncio only: each state-machine instance runs its own ``asyncio`` event loop (created
in ``__init__``, closed in ``teardown``) and each rule drives it with ``run_until_complete``;
the uvloop variants of the suite do not apply here.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path
from typing import Any, Coroutine, Iterator, TypeVar, cast

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)

import backends
from backends.faults import FaultPlan, Faults, FaultyBackend
from iosched import ExpertStore, StoreError
from iosched._checkpoint import load_index
from iosched._layout import ExpertKey
from iosched._lease import Lease
from iosched._view import ExpertView
from residency._table import Entry, EntryState
from tests.test_store import expected_bytes
from tools.synth import write_safetensors_moe

T = TypeVar("T")

LAYERS, EXPERTS, HIDDEN, INTER = 2, 4, 64, 48
BUDGET_EXPERTS = 3
"""The budget, in experts: a few, so that leases fill it and acquires wait for room."""
TOKEN_BUDGET_EXPERTS = 2
"""What prefetch may start between two token boundaries, in experts."""

MONOTONIC = ("requests", "hits", "misses", "single_flight_joins", "bytes_read", "admissions",
             "rejections", "evictions", "load_errors", "prefetch_issued", "prefetch_dropped",
             "tokens", "prefetch_refused", "prefetch_refused_bytes")


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
    __slots__ = ("key", "lease", "view")

    def __init__(self, key: ExpertKey, lease: Lease, view: ExpertView) -> None:
        self.key = key
        self.lease = lease
        self.view = view


class Pending:
    __slots__ = ("key", "lease", "task")

    def __init__(self, key: ExpertKey, lease: Lease, task: "asyncio.Task[ExpertView]") -> None:
        self.key = key
        self.lease = lease
        self.task = task


class StoreMachine(RuleBasedStateMachine):
    """One store, one event loop, a model of what the test holds."""

    ckpt: Checkpoint
    policy: str = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.backend = FaultyBackend(backends.create("pread"), FaultPlan())
        self.budget = BUDGET_EXPERTS * self.ckpt.expert_bytes
        self.store: ExpertStore = self.run(ExpertStore.open(
            self.ckpt.primary, budget_bytes=self.budget, backend=self.backend, policy=self.policy,
            mirrors=[self.ckpt.mirror], token_budget_bytes=TOKEN_BUDGET_EXPERTS * self.ckpt.expert_bytes,
        ))
        self.held: list[Held] = []
        self.pending: list[Pending] = []
        self.acquires = 0
        self.prefetched = 0
        self.tokens = 0
        self.acquire_errors = 0
        self.primary_faulted = False
        self.loading_seen: dict[int, Entry] = {}
        self.last: dict[str, Any] = {}

    # ------------------------------------------------------------------ helpers

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def spin(self, n: int) -> None:
        async def go() -> None:
            for _ in range(n):
                await asyncio.sleep(0)

        self.run(go())

    def settle(self, timeout: float = 5.0) -> None:
        """Let every load in flight finish (reads run in pread's threads), then the waiters wake."""
        async def go() -> None:
            loads = set(self.store._loads)
            if loads:
                await asyncio.wait(loads, timeout=timeout)
            for _ in range(5):
                await asyncio.sleep(0)

        self.run(go())

    def sweep(self) -> None:
        """Collect the pending acquires that finished: a lease held, an error, or cancelled."""
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
                view = p.task.result()
                assert view.data.tobytes() == self.ckpt.expected[p.key]
                self.held.append(Held(p.key, p.lease, view))
        self.pending = still

    def start_acquire(self, key: ExpertKey) -> Pending:
        lease = self.store.acquire(key)
        task = self.loop.create_task(lease.__aenter__())
        self.acquires += 1
        p = Pending(key, lease, task)
        self.pending.append(p)
        self.spin(1)  # the task starts: its request is counted
        return p

    # ------------------------------------------------------------------ rules

    @rule(key=st.integers(0, LAYERS * EXPERTS - 1), wait=st.booleans())
    def acquire(self, key: int, wait: bool) -> None:
        """Acquire; with ``wait`` let the loads finish, else leave it pending after a few steps.
        When the budget is fully leased it stays pending either way (a waiting acquire)."""
        self.start_acquire(self.ckpt.keys[key])
        if wait:
            self.settle()
        else:
            self.spin(3)
        self.sweep()

    @rule(key=st.integers(0, LAYERS * EXPERTS - 1))
    def acquire_hit_or_join(self, key: int) -> None:
        """Two acquires of one key in one step: the second is a hit or a single-flight join."""
        k = self.ckpt.keys[key]
        self.start_acquire(k)
        self.start_acquire(k)
        self.spin(2)
        self.sweep()

    @rule(i=st.integers(min_value=0), via_exit=st.booleans(), twice=st.booleans())
    def release(self, i: int, via_exit: bool, twice: bool) -> None:
        if not self.held:
            return  # not a precondition: what is held depends on the reads' timing
        h = self.held.pop(i % len(self.held))
        if via_exit:
            self.run(h.lease.__aexit__(None, None, None))
        else:
            h.lease.release()
        if twice:
            h.lease.release()  # a no-op
        self.spin(2)
        self.sweep()

    @rule(i=st.integers(min_value=0))
    def cancel(self, i: int) -> None:
        if not self.pending:
            return  # not a precondition: what is pending depends on the reads' timing
        p = self.pending[i % len(self.pending)]
        p.task.cancel()
        self.run(asyncio.wait({p.task}))
        self.sweep()

    @rule(keys=st.lists(st.integers(0, LAYERS * EXPERTS - 1), max_size=4))
    def prefetch(self, keys: list[int]) -> None:
        store = self.store
        wanted = [self.ckpt.keys[k] for k in keys]

        async def go() -> int:
            return store.prefetch(wanted)

        started = self.run(go())
        assert 0 <= started <= len(wanted)
        self.prefetched += started
        self.spin(1)
        self.sweep()

    @rule()
    def token_boundary(self) -> None:
        self.store.token_boundary()
        self.tokens += 1

    @rule(eio=st.sampled_from([0.0, 0.3, 1.0]), short=st.sampled_from([0.0, 0.5, 1.0]),
          spike=st.booleans(), primary_eio=st.sampled_from([0.0, 0.0, 0.5]))
    def set_faults(self, eio: float, short: float, spike: bool, primary_eio: float) -> None:
        rules = {str(self.ckpt.mirror): Faults(eio_rate=eio, short_rate=short,
                                               spike_rate=0.5 if spike else 0.0, spike_s=0.001)}
        if primary_eio:
            rules[str(self.ckpt.primary)] = Faults(eio_rate=primary_eio)
            self.primary_faulted = True
        self.backend.set_plan(FaultPlan(rules, seed=self.backend.plan.seed))

    @rule()
    def clear_faults(self) -> None:
        self.backend.set_plan(FaultPlan())

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

        # the statistics add up
        assert s["requests"] == s["hits"] + s["misses"] + s["single_flight_joins"]
        assert s["requests"] == self.acquires
        assert s["tokens"] == self.tokens
        assert s["prefetch_issued"] == self.prefetched
        for name in MONOTONIC:
            assert s[name] >= self.last.get(name, 0), f"{name} went down: {self.last[name]} -> {s[name]}"
        self.last = {name: s[name] for name in MONOTONIC}
        entries = table.entries()
        reserved = s["admissions"] + s["rejections"]
        assert reserved <= s["misses"] + s["prefetch_issued"]
        dropped_transients = reserved - len(entries) - s["evictions"] - s["load_errors"]
        assert 0 <= dropped_transients <= s["rejections"], (reserved, len(entries), s)
        assert s["loading"] == sum(1 for e in entries if e.state is EntryState.LOADING)
        assert s["resident_experts"] == sum(1 for e in entries if e.state is EntryState.RESIDENT)

        # held leases: right bytes, entry resident, leases counted exactly
        by_key: dict[ExpertKey, list[Held]] = {}
        for h in self.held:
            by_key.setdefault(h.key, []).append(h)
            assert h.view.data.tobytes() == self.ckpt.expected[h.key], f"held view of {h.key} changed"
        assert s["leased"] == len(by_key)
        for key, hs in by_key.items():
            entry = table.get(key)
            assert entry is not None, f"held expert {key} was evicted"
            assert entry.state is EntryState.RESIDENT
            assert entry.leases == len(hs), (entry, len(hs))
            assert all(h.lease._entry is entry for h in hs)
        waiting: dict[ExpertKey, int] = {}
        for p in self.pending:
            waiting[p.key] = waiting.get(p.key, 0) + 1
        for e in entries:
            if e.key not in by_key:
                assert e.leases == 0, f"{e!r} has leases nobody holds"
            # only a pending acquire pins: a finished or cancelled one has unpinned
            assert e.pins <= waiting.get(cast(ExpertKey, e.key), 0), f"{e!r} has a leaked pin"
        # A cancelled waiter's future stays in ``_room_waiters`` (done, skipped) until the next
        # wake-up; count the live ones.
        assert sum(1 for f in store._room_waiters if not f.done()) <= len(self.pending)

        # published only after the whole read succeeded
        for e in entries:
            if e.state is EntryState.RESIDENT:
                assert e.payload is not None
                published: ExpertKey = cast(ExpertKey, e.key)
                assert e.payload.view.data.tobytes() == self.ckpt.expected[published]
            else:
                assert e.payload is None
                self.loading_seen[id(e)] = e
        # a loading entry leaves the table only once published (then it may be evicted) or failed
        for ident, e in list(self.loading_seen.items()):
            if table.get(e.key) is e:
                if e.state is EntryState.RESIDENT:
                    del self.loading_seen[ident]
                continue
            if e.state is EntryState.LOADING:
                assert e.future.done() and e.future.exception() is not None, \
                    f"{e!r} left the table while loading"
            del self.loading_seen[ident]

        # faults on the mirror alone are failed over
        if not self.primary_faulted:
            assert s["load_errors"] == 0 and self.acquire_errors == 0, s

    # ------------------------------------------------------------------ teardown

    def teardown(self) -> None:
        try:
            self.backend.set_plan(FaultPlan())
            for p in self.pending:
                p.task.cancel()
            if self.pending:
                self.run(asyncio.wait({p.task for p in self.pending}))
            self.sweep()
            assert not self.pending
            for h in self.held:
                h.lease.release()
            self.held.clear()
            for _ in range(100):
                self.settle()
                if self.store.stats()["loading"] == 0:
                    break
            s = self.store.stats()
            assert s["loading"] == 0, s
            assert s["leased"] == 0, s
            assert all(e.leases == 0 and e.pins == 0 for e in self.store._table.entries())
            self.store.check_invariants()
            self.run(self.store.close())
            self.run(self.store.close())  # idempotent
            s = self.store.stats()
            assert s["resident_bytes"] == 0 and s["resident_experts"] == 0, s
            assert s["idle_slab_bytes"] == 0, s
            assert not self.store._loads and not self.store._room_waiters and not self.store._tickets
        finally:
            self.loop.close()


SETTINGS = settings(max_examples=100, stateful_step_count=30, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("policy", ["lru", "wtinylfu"])
def test_store_state_machine(checkpoint: Checkpoint, policy: str) -> None:
    """LRU (admits every miss) and W-TinyLFU (rejects some: a transient slot in the table)."""
    machine = type(f"StoreMachine_{policy}", (StoreMachine,), {"ckpt": checkpoint, "policy": policy})
    run_state_machine_as_test(machine, settings=SETTINGS)
