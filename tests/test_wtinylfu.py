"""W-TinyLFU (residency/alternatives/wtinylfu.py), its sketch (residency/alternatives/sketch.py) and the table's
transient slot (residency/_table.py, ``transient_bytes``)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from iosched._errors import BudgetError
from iosched.residency import POLICIES, Capability, Entry, Key, LRUPolicy, ResidencyTable, make_policy
from iosched.residency.alternatives.sketch import MAX_COUNT, CountMinSketch, key_hash
from iosched.residency.alternatives.wtinylfu import WTinyLFUPolicy
from iosched.tools.replay import Requests, budget_for, simulate
from iosched.tools.trace import load_bundled_trace

UNIT = 1000


class RejectAll(LRUPolicy):
    def admit(self, key: Key, nbytes: int, victims: Sequence[Key] = ()) -> bool:
        return False


class Recording(LRUPolicy):
    """LRU that records what ``admit`` was shown."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[tuple[Key, list[Key]]] = []

    def admit(self, key: Key, nbytes: int, victims: Sequence[Key] = ()) -> bool:
        self.asked.append((key, list(victims)))
        return True


def load(table: ResidencyTable, key: Key, nbytes: int = UNIT) -> Entry:
    """A request as the store makes it: on_request, then reserve and publish on a miss."""
    hit = table.get(key) is not None
    table.policy.on_request(key, nbytes, hit)
    entry = table.get(key) if hit else table.reserve(key, nbytes)
    assert entry is not None
    if not hit:
        table.publish(entry)
    table.check()
    return entry


def request(table: ResidencyTable, key: Key, nbytes: int = UNIT) -> bool:
    """A replay-style request (transients dropped at once); returns whether it hit."""
    hit = table.get(key) is not None
    entry = load(table, key, nbytes)
    if entry.transient:
        table.remove(entry)
        table.check()
    return hit


# ------------------------------------------------------------------------------- the sketch


def test_sketch_counts_saturate_and_never_undercount() -> None:
    sketch = CountMinSketch(1000, sample_size=1 << 30)
    assert sketch.width == 1024 and sketch.table.dtype.name == "uint8"
    truth: dict[Key, int] = {}
    for i in range(3000):
        k = (i % 7, (i * 31) % 97)
        truth[k] = truth.get(k, 0) + 1
        sketch.increment(k)
    for key, n in truth.items():
        assert min(n, MAX_COUNT) <= sketch.estimate(key) <= MAX_COUNT
    assert sketch.estimate((999, 99_999)) <= 1  # an int key: hashed the same in every process
    assert int(sketch.table.max()) == MAX_COUNT


def test_sketch_is_accurate_for_a_skewed_stream() -> None:
    sketch = CountMinSketch(512, sample_size=1 << 30)
    for i in range(14):
        sketch.increment((0, 0))
        if i % 2 == 0:
            sketch.increment((0, 1))
    for e in range(2, 200):
        sketch.increment((1, e))
    assert sketch.estimate((0, 0)) == 14
    assert sketch.estimate((0, 1)) == 7
    exact = sum(sketch.estimate((1, e)) == 1 for e in range(2, 200))
    assert exact >= 190  # count-min overcounts only on collisions


def test_sketch_ages_by_halving_every_sample_size_increments() -> None:
    sketch = CountMinSketch(64, sample_size=20)
    for _ in range(12):
        sketch.increment("hot")
    assert sketch.estimate("hot") == 12 and sketch.resets == 0
    for i in range(8):
        sketch.increment(("cold", i))
    assert sketch.resets == 1  # the 20th counted increment halved everything
    assert sketch.estimate("hot") == 6
    assert sketch.additions == 10


def test_key_hash_is_deterministic_across_processes() -> None:
    root = Path(__file__).resolve().parents[1]
    code = "from residency.alternatives.sketch import key_hash; print(key_hash((3, 17)), key_hash(5))"
    outs = {subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                           env={"PYTHONHASHSEED": seed, "PATH": ""}, timeout=60).stdout
            for seed in ("1", "2")}
    assert outs == {f"{key_hash((3, 17))} {key_hash(5)}\n"}


# ------------------------------------------------------------------------------- the table's slot


def test_admit_is_shown_the_victims() -> None:
    policy = Recording()
    table = ResidencyTable(2 * UNIT, policy)
    load(table, "A")
    load(table, "B")
    load(table, "C", 2 * UNIT)
    assert policy.asked == [("A", []), ("B", []), ("C", ["A", "B"])]


def test_transient_slot_never_evicts_and_falls_back_to_free_main_bytes() -> None:
    evicted: list[Key] = []
    table = ResidencyTable(5 * UNIT, RejectAll(), lambda e: evicted.append(e.key),
                           transient_bytes=2 * UNIT)
    assert table.main_bytes == 3 * UNIT
    t1 = table.reserve("T1", UNIT)
    t2 = table.reserve("T2", UNIT)
    assert t1 is not None and t2 is not None and t1.transient and t2.transient
    assert table.transient_used == 2 * UNIT  # the slot is full
    t3 = table.reserve("T3", 3 * UNIT)  # free main bytes take it, nothing evicted
    assert t3 is not None and t3.transient and table.used_bytes == 5 * UNIT
    assert table.reserve("T4", UNIT) is None  # neither fits: the store waits
    table.check()
    assert evicted == [] and table.evictions == 0 and table.rejections == 3


def test_admitted_entries_stay_out_of_the_slot_and_rejections_do_not_evict() -> None:
    evicted: list[Key] = []

    class Switch(LRUPolicy):
        yes = True

        def admit(self, key: Key, nbytes: int, victims: Sequence[Key] = ()) -> bool:
            return self.yes

    policy = Switch()
    table = ResidencyTable(4 * UNIT, policy, lambda e: evicted.append(e.key), transient_bytes=UNIT)
    for key in "ABC":
        load(table, key)
    assert table.admitted_bytes == 3 * UNIT
    load(table, "D")  # admitted: the main region is full, so A goes, though the slot is free
    assert evicted == ["A"] and table.used_bytes == 3 * UNIT
    policy.yes = False
    t = load(table, "T")  # rejected: into the slot, nothing evicted
    assert t.transient and evicted == ["A"] and table.used_bytes == 4 * UNIT
    assert table.reserve("BIG", 4 * UNIT) is None  # T holds the slot: wait for it
    table.remove(t)
    big = table.reserve("BIG", 4 * UNIT)  # larger than the main region: never admitted, and
    assert big is not None and big.transient  # with no transient to wait for it evicts
    assert evicted == ["A", "B", "C", "D"]
    table.check()


def test_transient_bytes_must_leave_a_main_region() -> None:
    for bad in (-1, 4 * UNIT, 5 * UNIT):
        with pytest.raises(BudgetError):
            ResidencyTable(4 * UNIT, LRUPolicy(), transient_bytes=bad)


def test_set_budget_hook_gets_the_main_region() -> None:
    policy = WTinyLFUPolicy()
    ResidencyTable(100 * UNIT, policy, transient_bytes=10 * UNIT)
    assert policy.capacity == 90 * UNIT
    assert policy.window_cap == int(0.01 * 90 * UNIT)
    assert policy.protected_cap == int(0.8 * (90 * UNIT - policy.window_cap))


# ------------------------------------------------------------------------------- the policy


def test_registry_builds_wtinylfu() -> None:
    assert "wtinylfu" in POLICIES
    p = make_policy("wtinylfu")
    assert isinstance(p, WTinyLFUPolicy) and Capability.REJECTS in p.capabilities
    assert make_policy("wtinylfu") is not p


def test_segments_window_probation_protected() -> None:
    policy = WTinyLFUPolicy(window_fraction=0.25)
    table = ResidencyTable(9 * UNIT, policy, transient_bytes=UNIT)  # window 2 units
    for key in "ABC":
        load(table, key)
    assert [policy.segment(k) for k in "ABC"] == ["probation", "window", "window"]
    load(table, "A")  # a probation hit: promoted
    assert policy.segment("A") == "protected"
    load(table, "B")  # a window hit: stays in the window
    assert policy.segment("B") == "window"
    assert list(policy.victims()) == ["A", "C", "B"]  # probation, protected, window
    assert policy.segment_bytes() == (2 * UNIT, 0, UNIT)


def test_a_cold_scan_is_rejected_and_the_hot_set_stays() -> None:
    policy = WTinyLFUPolicy()
    table = ResidencyTable(12 * UNIT, policy, transient_bytes=UNIT)
    hot = [("hot", i) for i in range(10)]
    for _ in range(5):
        for key in hot:
            request(table, key)
    assert all(table.get(k) is not None for k in hot)
    scan_hits = sum(request(table, ("cold", i)) for i in range(200))
    assert scan_hits == 0
    assert all(table.get(k) is not None for k in hot), "the scan flushed the hot set"
    assert table.rejections >= 190
    assert all(request(table, k) for k in hot)


def test_leased_entries_are_never_victims() -> None:
    policy = WTinyLFUPolicy()
    table = ResidencyTable(4 * UNIT, policy, transient_bytes=UNIT)
    entries = [load(table, k) for k in "ABC"]
    for e in entries:
        e.leases += 1
    for _ in range(10):  # D is far more frequent than any resident key
        policy.on_request("D", UNIT, False)
    assert table.reserve("D", UNIT) is not None  # the slot serves it: nothing may go
    assert table.evictions == 0
    entries[0].leases -= 1
    d = table.get("D")
    assert d is not None and d.transient
    table.remove(d)
    again = table.reserve("D", UNIT)
    assert again is not None and not again.transient  # now A is evictable and loses the duel
    assert table.get("A") is None and table.get("B") is not None and table.get("C") is not None
    table.check()


KEYS = [(layer, expert) for layer in range(4) for expert in range(6)]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(st.tuples(st.sampled_from(KEYS), st.integers(1, 3), st.integers(0, 9)),
                 min_size=1, max_size=150),
    window=st.sampled_from([0.01, 0.2, 0.5]),
    slot=st.sampled_from([0, 1, 3]),
)
def test_segment_invariants_under_random_requests(
        ops: list[tuple[Key, int, int]], window: float, slot: int) -> None:
    policy = WTinyLFUPolicy(window_fraction=window, jitter=0.5)
    table = ResidencyTable(10 * UNIT, policy, transient_bytes=slot * UNIT)
    sizes: dict[Key, int] = {}
    leased: list[Entry] = []
    for key, size, action in ops:
        nbytes = sizes.setdefault(key, size * UNIT)
        entry = table.get(key)
        policy.on_request(key, nbytes, entry is not None)
        if entry is None:
            entry = table.reserve(key, nbytes)
            if entry is None:  # leased or busy: release one and move on
                assert leased
                done = leased.pop(0)
                done.leases -= 1
                if done.transient and done.leases == 0:
                    table.remove(done)
                table.check()
                continue
            table.publish(entry)
        if action < 3:  # hold a lease for a while
            entry.leases += 1
            leased.append(entry)
        elif entry.transient and entry.leases == 0:
            table.remove(entry)
        if action == 9 and leased:
            done = leased.pop(0)
            done.leases -= 1
            if done.transient and done.leases == 0 and table.get(done.key) is done:
                table.remove(done)
        table.check()
        assert table.admitted_bytes <= table.main_bytes
        for e in table.entries():
            assert (policy.segment(e.key) is None) is e.transient


# ------------------------------------------------------------------------------- the replay


@pytest.mark.parametrize("name", ["qwen", "gemma"])
def test_replay_of_the_bundled_traces(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    trace = load_bundled_trace(name)
    reqs = Requests.of(trace)
    for cycles in (1.0, 2.0, 4.0, 8.0):
        row = simulate(reqs, "wtinylfu", cycles, budget_for(trace, cycles))
        assert 0.0 <= row["decode_hit"] <= 1.0 and 0.0 <= row["byte_hit"] <= 1.0
        assert row["rejections"] > 0 and row["oversize"] == 0
        with capsys.disabled():
            print(f"\n{name} wtinylfu @ {cycles:g} cycles: decode hit {row['decode_hit']:.4f}",
                  end="")


@pytest.mark.asyncio
async def test_store_runs_wtinylfu_with_a_transient_slot(st_checkpoint: Path) -> None:
    """The store gives an admitting policy the bounded slot: every byte is still right, the
    budget holds, and rejected misses leave nothing behind."""
    from iosched import ExpertStore
    from tests.test_store import expected_bytes

    async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20) as probe:
        one = next(iter(probe.index.experts.values())).nbytes
    async with await ExpertStore.open(st_checkpoint, budget_bytes=4 * one, policy="wtinylfu") as store:
        assert store._table.transient_bytes == one  # k unknown here: one expert
        keys = sorted(store.index.experts)
        for round_ in range(3):
            for key in keys[:3] + keys[3 + round_ * 8: 11 + round_ * 8]:
                async with store.acquire(key) as view:
                    assert view.data.tobytes() == expected_bytes(store.index, key)
        s = store.stats()
        assert s["resident_bytes"] <= s["budget_bytes"] and s["leased"] == 0
        assert s["rejections"] > 0
        store.check_invariants()


@pytest.mark.asyncio
async def test_a_layer_of_rejected_misses_does_not_deadlock(st_checkpoint: Path) -> None:
    """acquire_many holds its own transients until every miss is served: a rejected miss that
    finds the slot full must evict (as a slot-less table would), never wait for them."""
    import asyncio

    from iosched import ExpertStore

    async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20) as probe:
        one = next(iter(probe.index.experts.values())).nbytes
    async with await ExpertStore.open(st_checkpoint, budget_bytes=8 * one, policy="wtinylfu") as store:
        keys = sorted(store.index.experts)
        hot, cold = keys[:6], keys[6:12]  # a layer of 6, within the 8-expert budget
        for _ in range(5):  # make the resident set frequent, so cold misses are rejected
            async with store.acquire_many(hot):
                pass
        async with asyncio.timeout(10) if hasattr(asyncio, "timeout") else _nullcontext():
            async with store.acquire_many(cold) as views:
                assert len(views) == len(cold)
        s = store.stats()
        assert s["rejections"] > 1 and s["leased"] == 0
        store.check_invariants()


class _nullcontext:
    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        return None
