"""The residency table and LRU: eviction order, what may never be evicted, the strict budget,
transient entries, policy lookup by name, and a model-based state machine over all of it.

Everything here is synchronous: the table owns no event loop, so it is driven by hand.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from iosched._errors import BudgetError, InvariantError, StoreError
from iosched.residency import (
    POLICIES,
    BudgetAware,
    Capability,
    Entry,
    EntryState,
    Key,
    LRUPolicy,
    ModelShape,
    Policy,
    ResidencyTable,
    ShapeAware,
    bind,
    make_policy,
)
from tests._fresh import import_failures

UNIT = 1000  # bytes per "unit"; sizes below are in units unless they say bytes


# ----------------------------------------------------------------------------- helpers


class Evictions:
    """An ``on_evict`` callback that records every evicted entry and what it looked like then."""

    def __init__(self) -> None:
        self.entries: list[Entry] = []
        self.snapshots: list[tuple[Key, EntryState, int, int, bool]] = []

    def __call__(self, entry: Entry) -> None:
        self.entries.append(entry)
        self.snapshots.append((entry.key, entry.state, entry.leases, entry.pins, entry.transient))

    @property
    def keys(self) -> list[Key]:
        return [e.key for e in self.entries]


class SelectiveLRU(LRUPolicy):
    """LRU that refuses admission to the keys in ``reject`` (they are served transiently)."""

    def __init__(self, reject: set[Key] | None = None) -> None:
        super().__init__()
        self.reject: set[Key] = set(reject or ())

    def admit(self, key: Key, nbytes: int, victims: Sequence[Key] = ()) -> bool:
        return key not in self.reject


class RejectAllLRU(LRUPolicy):
    """LRU whose ``admit`` always says no."""

    def admit(self, key: Key, nbytes: int, victims: Sequence[Key] = ()) -> bool:
        return False


def state(entry: Entry) -> EntryState:
    """``entry.state``, read through a call so mypy does not narrow it across a publish."""
    return entry.state


def order(table: ResidencyTable) -> list[Key]:
    return list(table.policy.victims())


def counters(table: ResidencyTable) -> tuple[int, int, int, int, int]:
    return (table.used_bytes, table.admissions, table.rejections, table.evictions, table.evicted_bytes)


def snapshot(table: ResidencyTable) -> tuple[object, ...]:
    """Everything ``reserve`` could change, for 'returned None and changed nothing' checks."""
    return (
        counters(table),
        len(table),
        [(e.key, e.nbytes, e.state, e.leases, e.pins, e.transient, id(e)) for e in table.entries()],
        order(table),
    )


def load(table: ResidencyTable, key: Key, nbytes: int = UNIT) -> Entry:
    """Reserve and publish ``key`` (a successful load)."""
    entry = table.reserve(key, nbytes)
    assert entry is not None, f"reserve of {key!r} unexpectedly had no room"
    assert entry.state is EntryState.LOADING
    table.publish(entry)
    assert state(entry) is EntryState.RESIDENT
    table.check()
    return entry


# ----------------------------------------------------------------------------- 1. LRU order


def test_lru_evicts_least_recently_requested_not_least_recently_inserted() -> None:
    evicted = Evictions()
    table = ResidencyTable(3 * UNIT, LRUPolicy(), on_evict=evicted)
    a, b, c = (load(table, k) for k in ("A", "B", "C"))
    assert order(table) == ["A", "B", "C"]
    assert table.used_bytes == 3 * UNIT
    assert (table.admissions, table.evictions, table.evicted_bytes) == (3, 0, 0)

    table.policy.on_request("A", UNIT, True)  # a hit on A makes it the most recent
    assert order(table) == ["B", "C", "A"]

    d = table.reserve("D", UNIT)
    assert d is not None and d.state is EntryState.LOADING
    table.check()
    assert evicted.entries == [b]
    assert evicted.entries[0] is b  # the very Entry object, not a copy
    assert evicted.snapshots == [("B", EntryState.RESIDENT, 0, 0, False)]
    assert table.get("B") is None
    assert table.get("A") is a and table.get("C") is c and table.get("D") is d
    assert order(table) == ["C", "A", "D"]
    assert table.used_bytes == 3 * UNIT
    assert (table.admissions, table.rejections, table.evictions, table.evicted_bytes) == (4, 0, 1, UNIT)

    # The next eviction takes C, then A: the order keeps going by recency.
    table.publish(d)
    load(table, "E")
    assert evicted.keys == ["B", "C"]
    assert (table.admissions, table.evictions, table.evicted_bytes) == (5, 2, 2 * UNIT)
    load(table, "F")
    assert evicted.keys == ["B", "C", "A"]
    assert order(table) == ["D", "E", "F"]


def test_a_miss_request_does_not_refresh_and_unknown_keys_are_ignored() -> None:
    table = ResidencyTable(2 * UNIT, LRUPolicy())
    load(table, "A")
    load(table, "B")
    table.policy.on_request("A", UNIT, False)  # hit=False: not a recency event
    table.policy.on_request("Z", UNIT, True)  # not resident: LRU ignores it
    assert order(table) == ["A", "B"]
    table.check()
    assert table.reserve("C", UNIT) is not None
    assert table.get("A") is None and table.get("B") is not None


def test_eviction_frees_a_prefix_of_the_lru_order_until_enough() -> None:
    evicted = Evictions()
    table = ResidencyTable(4 * UNIT, LRUPolicy(), on_evict=evicted)
    load(table, "A", 1 * UNIT)
    load(table, "B", 2 * UNIT)
    load(table, "C", 1 * UNIT)
    # need 2 units: A (1) is not enough, A+B (3) is; C stays although it alone would not do.
    assert table.reserve("D", 2 * UNIT) is not None
    assert evicted.keys == ["A", "B"]
    assert table.used_bytes == 3 * UNIT
    assert (table.evictions, table.evicted_bytes) == (2, 3 * UNIT)
    table.check()


def test_reserve_that_fits_evicts_nothing() -> None:
    evicted = Evictions()
    table = ResidencyTable(5 * UNIT, LRUPolicy(), on_evict=evicted)
    load(table, "A", 2 * UNIT)
    assert table.reserve("B", 3 * UNIT) is not None  # exactly fills the budget
    assert evicted.entries == []
    assert table.used_bytes == table.budget_bytes
    table.check()


def test_reserve_of_a_key_already_in_the_table_is_refused() -> None:
    table = ResidencyTable(3 * UNIT, LRUPolicy())
    load(table, "A")
    with pytest.raises(AssertionError, match="already in the table"):
        table.reserve("A", UNIT)
    table.check()


# ----------------------------------------------------------------------------- 2. never-victims


def test_leased_entry_is_skipped_and_the_next_evictable_one_goes() -> None:
    evicted = Evictions()
    table = ResidencyTable(3 * UNIT, LRUPolicy(), on_evict=evicted)
    a = load(table, "A")
    load(table, "B")
    load(table, "C")
    a.leases = 1
    assert table.reserve("D", UNIT) is not None
    assert evicted.keys == ["B"]
    assert table.get("A") is a
    table.check()


def test_pinned_entry_is_skipped_and_the_next_evictable_one_goes() -> None:
    evicted = Evictions()
    table = ResidencyTable(3 * UNIT, LRUPolicy(), on_evict=evicted)
    a = load(table, "A")
    load(table, "B")
    load(table, "C")
    a.pins = 1
    assert table.reserve("D", UNIT) is not None
    assert evicted.keys == ["B"]
    assert table.get("A") is a
    table.check()


def test_loading_entry_is_skipped_and_the_next_evictable_one_goes() -> None:
    evicted = Evictions()
    table = ResidencyTable(3 * UNIT, LRUPolicy(), on_evict=evicted)
    a = table.reserve("A", UNIT)  # never published: still loading
    assert a is not None
    load(table, "B")
    load(table, "C")
    assert table.reserve("D", UNIT) is not None
    assert evicted.keys == ["B"]
    assert table.get("A") is a and a.state is EntryState.LOADING
    table.check()


@pytest.mark.parametrize("blocker", ["leased", "pinned", "loading", "pinned-loading"])
def test_reserve_returns_none_and_changes_nothing_when_nothing_can_be_freed(blocker: str) -> None:
    evicted = Evictions()
    table = ResidencyTable(3 * UNIT, LRUPolicy(), on_evict=evicted)
    entries: list[Entry] = []
    for key in ("A", "B", "C"):
        entry = table.reserve(key, UNIT)
        assert entry is not None
        if blocker != "loading" and blocker != "pinned-loading":
            table.publish(entry)
        if blocker == "leased":
            entry.leases = 1
        elif blocker.startswith("pinned"):
            entry.pins = 1
        entries.append(entry)
    table.policy.on_request("A", UNIT, True)
    table.check()
    before = snapshot(table)

    assert table.reserve("D", UNIT) is None
    assert table.reserve("D", UNIT) is None  # and again: still nothing changes
    assert snapshot(table) == before
    assert evicted.entries == []
    assert table.get("D") is None
    assert [table.get(k) for k in ("A", "B", "C")] == entries
    table.check()


def test_no_partial_eviction_when_the_reservation_cannot_be_satisfied() -> None:
    evicted = Evictions()
    table = ResidencyTable(4 * UNIT, LRUPolicy(), on_evict=evicted)
    load(table, "A")  # evictable, LRU-first
    b = load(table, "B")
    c = load(table, "C")
    e = table.reserve("E", UNIT)  # loading
    assert e is not None
    b.leases = 1
    c.pins = 1
    table.check()
    before = snapshot(table)

    # need 2 units; only A (1 unit) could go: evicting A alone would not make room, so
    # nothing at all may be evicted.
    assert table.reserve("D", 2 * UNIT) is None
    assert snapshot(table) == before
    assert evicted.entries == []
    table.check()

    # Once the lease on B ends, A and B go (in LRU order) and the reservation succeeds.
    b.leases = 0
    d = table.reserve("D", 2 * UNIT)
    assert d is not None
    assert evicted.keys == ["A", "B"]
    assert table.used_bytes == 4 * UNIT
    table.check()


def test_evict_refuses_non_evictable_entries() -> None:
    table = ResidencyTable(3 * UNIT, LRUPolicy())
    loading = table.reserve("L", UNIT)
    assert loading is not None
    leased = load(table, "A")
    leased.leases = 1
    pinned = load(table, "B")
    pinned.pins = 1
    before = snapshot(table)
    for entry in (loading, leased, pinned):
        with pytest.raises(AssertionError, match="not evictable"):
            table.evict(entry)
    assert snapshot(table) == before
    table.check()


def test_evict_all_evicts_exactly_the_evictable_entries() -> None:
    evicted = Evictions()
    table = ResidencyTable(10 * UNIT, SelectiveLRU(reject={"T"}), on_evict=evicted)
    loading = table.reserve("L", UNIT)
    assert loading is not None
    leased = load(table, "A")
    leased.leases = 1
    pinned = load(table, "B")
    pinned.pins = 1
    transient = load(table, "T")
    load(table, "X")
    load(table, "Y")
    table.evict_all()
    assert sorted(cast(str, k) for k in evicted.keys) == ["X", "Y"]
    assert {e.key for e in table.entries()} == {"L", "A", "B", "T"}
    assert transient.transient and table.get("T") is transient
    assert table.used_bytes == 4 * UNIT
    table.check()


# ----------------------------------------------------------------------------- 3. budget errors


def test_reserve_bigger_than_the_whole_budget_names_key_and_both_numbers() -> None:
    table = ResidencyTable(4000, LRUPolicy())
    load(table, (0, 1), 1000)
    before = snapshot(table)
    with pytest.raises(BudgetError) as info:
        table.reserve((3, 7), 4001)
    message = str(info.value)
    assert "(3, 7)" in message
    assert "4001" in message
    assert "4000" in message
    assert isinstance(info.value, StoreError)
    assert snapshot(table) == before
    table.check()


def test_reserve_of_exactly_the_budget_evicts_everything_evictable() -> None:
    evicted = Evictions()
    table = ResidencyTable(3 * UNIT, LRUPolicy(), on_evict=evicted)
    load(table, "A")
    load(table, "B")
    assert table.reserve("C", 3 * UNIT) is not None
    assert evicted.keys == ["A", "B"]
    assert table.used_bytes == 3 * UNIT
    table.check()


@pytest.mark.parametrize("budget", [0, -1, -4096, True, False, 3.0, 4096.0])
def test_malformed_budget_is_a_budget_error(budget: object) -> None:
    with pytest.raises(BudgetError, match="budget_bytes") as info:
        ResidencyTable(cast(int, budget), LRUPolicy())
    assert repr(budget) in str(info.value)


# ----------------------------------------------------------------------------- 4. transient entries


def test_rejected_admission_gives_a_transient_entry() -> None:
    table = ResidencyTable(3 * UNIT, RejectAllLRU())
    t = table.reserve("T", UNIT)
    assert t is not None
    assert t.transient and t.state is EntryState.LOADING
    assert table.get("T") is t
    assert table.used_bytes == UNIT
    assert (table.admissions, table.rejections) == (0, 1)
    assert order(table) == []
    table.check()
    table.publish(t)  # the store publishes a transient entry too, then drops it when unleased
    assert state(t) is EntryState.RESIDENT and not t.evictable
    table.check()
    table.remove(t)  # must not tell the policy: LRU would raise KeyError if it did
    assert table.get("T") is None and len(table) == 0
    assert table.used_bytes == 0
    assert (table.evictions, table.evicted_bytes) == (0, 0)
    table.check()


def test_transient_entries_are_never_evicted_and_leave_only_via_remove() -> None:
    evicted = Evictions()
    policy = SelectiveLRU(reject={"T"})
    table = ResidencyTable(3 * UNIT, policy, on_evict=evicted)
    t = load(table, "T")  # resident, unleased, unpinned: everything but admitted
    a = load(table, "A")
    b = load(table, "B")
    assert t.transient and not a.transient and not b.transient
    assert order(table) == ["A", "B"]
    assert (table.admissions, table.rejections) == (2, 1)
    assert table.used_bytes == 3 * UNIT

    # T is the oldest, yet A goes.
    c = table.reserve("C", UNIT)
    assert c is not None
    table.publish(c)
    table.check()
    assert evicted.keys == ["A"]
    assert table.get("T") is t

    # Two units wanted: B and C are evictable (2 units), T is not touched.
    d = table.reserve("D", 2 * UNIT)
    assert d is not None
    table.publish(d)
    table.check()
    assert evicted.keys == ["A", "B", "C"]
    assert table.get("T") is t

    # Three units wanted: only D (2 units) is evictable, T's unit cannot be freed.
    before = snapshot(table)
    assert table.reserve("E", 3 * UNIT) is None
    assert snapshot(table) == before
    assert table.get("T") is t and table.get("D") is d
    table.check()

    # Removing T (its last lease ended) returns its bytes; then E fits after evicting D.
    table.remove(t)
    table.check()
    assert table.used_bytes == 2 * UNIT
    assert (table.evictions, table.evicted_bytes) == (3, 3 * UNIT)  # a removal is no eviction
    e = table.reserve("E", 3 * UNIT)
    assert e is not None
    assert evicted.keys == ["A", "B", "C", "D"]
    assert all(not entry.transient for entry in evicted.entries)
    assert table.used_bytes == 3 * UNIT
    assert (table.admissions, table.rejections) == (5, 1)
    table.check()


def test_a_transient_reservation_may_evict_admitted_entries() -> None:
    evicted = Evictions()
    table = ResidencyTable(2 * UNIT, SelectiveLRU(reject={"T"}), on_evict=evicted)
    load(table, "A")
    load(table, "B")
    t = table.reserve("T", UNIT)
    assert t is not None and t.transient
    assert evicted.keys == ["A"]
    assert order(table) == ["B"]
    assert table.used_bytes == 2 * UNIT
    table.check()


def test_remove_of_an_entry_not_in_the_table_is_refused() -> None:
    table = ResidencyTable(2 * UNIT, LRUPolicy())
    a = load(table, "A")
    table.remove(a)
    with pytest.raises(AssertionError, match="not in the table"):
        table.remove(a)
    stranger = Entry("A", UNIT, transient=False)
    load(table, "A")
    with pytest.raises(AssertionError, match="not in the table"):
        table.remove(stranger)  # same key, different entry
    table.check()


# ----------------------------------------------------------------------------- 5. state machine

KEYS: list[Key] = [(layer, expert) for layer in range(3) for expert in range(4)]
SIZES: dict[Key, int] = {
    key: UNIT * size for key, size in zip(KEYS, [1, 2, 3, 1, 2, 1, 3, 2, 1, 2, 1, 3], strict=True)
}
BUDGET = 8 * UNIT  # sizes are 1 to 3 units (mean ~1.8): about 4 to 6 experts fit


class SwitchLRU(LRUPolicy):
    """LRU whose next admission answer is set by the test (to make transient entries)."""

    def __init__(self) -> None:
        super().__init__()
        self.next_admit = True

    def admit(self, key: Key, nbytes: int, victims: Sequence[Key] = ()) -> bool:
        return self.next_admit


@dataclass
class ModelEntry:
    nbytes: int
    transient: bool
    resident: bool = False
    leases: int = 0
    pins: int = 0

    @property
    def evictable(self) -> bool:
        return self.resident and self.leases == 0 and self.pins == 0 and not self.transient


class ResidencyMachine(RuleBasedStateMachine):
    """Drives a table the way the store does, against a plain reference model.

    The model keeps every entry's state and an LRU list of admitted keys (least recent
    first; a key moves to the back when inserted or hit).  Each reservation's evictions are
    predicted from the model and compared with what ``on_evict`` saw, in order.
    """

    def __init__(self) -> None:
        super().__init__()
        self.policy = SwitchLRU()
        self.evicted: list[Entry] = []
        self.bad_evictions: list[str] = []
        self.table = ResidencyTable(BUDGET, self.policy, on_evict=self._on_evict)
        self.handles: dict[Key, Entry] = {}
        self.model: dict[Key, ModelEntry] = {}
        self.lru: list[Key] = []
        self.admissions = self.rejections = self.evictions = self.evicted_bytes = 0

    def _on_evict(self, entry: Entry) -> None:
        if not (
            entry.leases == 0
            and entry.pins == 0
            and entry.state is EntryState.RESIDENT
            and not entry.transient
        ):
            self.bad_evictions.append(repr(entry))
        self.evicted.append(entry)

    def _keys(self, wanted: str) -> list[Key]:
        m = self.model
        if wanted == "absent":
            return [k for k in KEYS if k not in m]
        if wanted == "present":
            return [k for k in KEYS if k in m]
        if wanted == "loading":
            return [k for k in KEYS if k in m and not m[k].resident]
        if wanted == "resident":
            return [k for k in KEYS if k in m and m[k].resident]
        if wanted == "leased":
            return [k for k in KEYS if k in m and m[k].leases > 0]
        if wanted == "pinned":
            return [k for k in KEYS if k in m and m[k].pins > 0]
        if wanted == "droppable":  # a transient whose load finished and last lease ended
            return [k for k in KEYS if k in m and m[k].transient and m[k].resident
                    and m[k].leases == 0 and m[k].pins == 0]
        raise AssertionError(wanted)

    def _forget(self, key: Key) -> None:
        entry = self.model.pop(key)
        del self.handles[key]
        if not entry.transient:
            self.lru.remove(key)

    # -- rules

    @precondition(lambda self: bool(self._keys("absent")))
    @rule(data=st.data(), admit=st.sampled_from([True, True, True, False]), publish_now=st.booleans())
    def reserve(self, data: st.DataObject, admit: bool, publish_now: bool) -> None:
        key = data.draw(st.sampled_from(self._keys("absent")), label="key")
        nbytes = SIZES[key]
        # The store tells the policy about the (missed) request first.
        self.policy.on_request(key, nbytes, False)
        self.policy.next_admit = admit

        # Predict: the shortest LRU prefix of evictable entries that frees enough, or None.
        need = sum(e.nbytes for e in self.model.values()) + nbytes - BUDGET
        expected: list[Key] = []
        for k in self.lru:
            if need <= 0:
                break
            if self.model[k].evictable:
                expected.append(k)
                need -= self.model[k].nbytes
        before = snapshot(self.table)
        n_evicted = len(self.evicted)

        entry = self.table.reserve(key, nbytes)

        if need > 0:
            assert entry is None, f"reserve of {key!r} succeeded although only {expected} were evictable"
            assert snapshot(self.table) == before
            assert len(self.evicted) == n_evicted
            return
        assert entry is not None, f"reserve of {key!r} failed although evicting {expected} makes room"
        assert [e.key for e in self.evicted[n_evicted:]] == expected
        for k in expected:
            assert self.evicted[n_evicted + expected.index(k)] is self.handles[k]
            self.evictions += 1
            self.evicted_bytes += self.model[k].nbytes
            self._forget(k)
        assert entry.key == key and entry.nbytes == nbytes
        assert entry.state is EntryState.LOADING and entry.leases == 0 and entry.pins == 0
        assert entry.transient is (not admit)
        self.handles[key] = entry
        self.model[key] = ModelEntry(nbytes, transient=not admit)
        if admit:
            self.admissions += 1
            self.lru.append(key)
        else:
            self.rejections += 1
        if publish_now:  # the load finished before anything else happened
            self.table.publish(entry)
            self.model[key].resident = True

    @precondition(lambda self: bool(self._keys("loading")))
    @rule(data=st.data())
    def publish(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(self._keys("loading")), label="key")
        self.table.publish(self.handles[key])
        self.model[key].resident = True

    @precondition(lambda self: bool(self._keys("present")))
    @rule(data=st.data())
    def request_hit(self, data: st.DataObject) -> None:
        # The store reports a hit for resident and for loading (joined) entries alike.
        key = data.draw(st.sampled_from(self._keys("present")), label="key")
        self.request_hit_on(key)

    @precondition(lambda self: bool(self._keys("resident")))
    @rule(data=st.data(), with_hit=st.booleans())
    def lease(self, data: st.DataObject, with_hit: bool) -> None:
        key = data.draw(st.sampled_from(self._keys("resident")), label="key")
        if with_hit:  # the store's hit path: a hit request, then the lease
            self.request_hit_on(key)
        self.handles[key].leases += 1
        self.model[key].leases += 1

    def request_hit_on(self, key: Key) -> None:
        self.policy.on_request(key, SIZES[key], True)
        if key in self.lru:
            self.lru.remove(key)
            self.lru.append(key)

    @precondition(lambda self: bool(self._keys("leased")))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(self._keys("leased")), label="key")
        self.handles[key].leases -= 1
        self.model[key].leases -= 1

    @precondition(lambda self: bool(self._keys("present")))
    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(self._keys("present")), label="key")
        self.handles[key].pins += 1
        self.model[key].pins += 1

    @precondition(lambda self: bool(self._keys("pinned")))
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(self._keys("pinned")), label="key")
        self.handles[key].pins -= 1
        self.model[key].pins -= 1

    @precondition(lambda self: bool(self._keys("loading")))
    @rule(data=st.data())
    def fail_load(self, data: st.DataObject) -> None:
        # A failed load removes its reservation even while waiters hold pins on it.
        key = data.draw(st.sampled_from(self._keys("loading")), label="key")
        self.table.remove(self.handles[key])
        self._forget(key)

    @precondition(lambda self: bool(self._keys("droppable")))
    @rule(data=st.data())
    def drop_transient(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(self._keys("droppable")), label="key")
        self.table.remove(self.handles[key])
        self._forget(key)

    @rule(dice=st.integers(0, 7))
    def evict_all(self, dice: int) -> None:
        if dice != 0:  # closing is rare: let the table fill up between closes
            return
        n_evicted = len(self.evicted)
        expected = {k for k, e in self.model.items() if e.evictable}
        self.table.evict_all()
        got = [e.key for e in self.evicted[n_evicted:]]
        assert len(got) == len(set(got)) and set(got) == expected
        for k in expected:
            self.evictions += 1
            self.evicted_bytes += self.model[k].nbytes
            self._forget(k)

    # -- invariants

    @invariant()
    def table_is_consistent(self) -> None:
        self.table.check()
        assert 0 <= self.table.used_bytes <= self.table.budget_bytes

    @invariant()
    def nothing_unevictable_was_evicted(self) -> None:
        assert self.bad_evictions == [], self.bad_evictions

    @invariant()
    def table_matches_model(self) -> None:
        got = {
            e.key: (e.nbytes, e.transient, e.state is EntryState.RESIDENT, e.leases, e.pins)
            for e in self.table.entries()
        }
        want = {
            k: (m.nbytes, m.transient, m.resident, m.leases, m.pins) for k, m in self.model.items()
        }
        assert got == want
        for k, handle in self.handles.items():
            assert self.table.get(k) is handle
        assert self.table.used_bytes == sum(m.nbytes for m in self.model.values())
        assert len(self.table) == len(self.model)

    @invariant()
    def lru_order_matches_reference(self) -> None:
        assert order(self.table) == self.lru

    @invariant()
    def counters_match_model(self) -> None:
        t = self.table
        assert (t.admissions, t.rejections, t.evictions, t.evicted_bytes) == (
            self.admissions, self.rejections, self.evictions, self.evicted_bytes
        )


def test_residency_state_machine() -> None:
    run_state_machine_as_test(
        ResidencyMachine,
        settings=settings(
            max_examples=150,
            stateful_step_count=40,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


# ----------------------------------------------------------------------------- 6. make_policy


@pytest.mark.parametrize("name", ["lru"])
def test_make_policy_builds_a_fresh_working_policy(name: str) -> None:
    assert name in POLICIES
    policy: Policy = make_policy(name)
    assert isinstance(policy, LRUPolicy)
    assert policy.name == "lru"
    assert make_policy(name) is not policy  # each call builds its own state
    table = ResidencyTable(2 * UNIT, policy)
    load(table, "A")
    load(table, "B")
    load(table, "C")
    assert table.get("A") is None and table.evictions == 1


def test_make_policy_of_an_unknown_name_names_it() -> None:
    with pytest.raises(StoreError, match="'nope'") as info:
        make_policy("nope")
    assert "nope" in str(info.value)
    for name in POLICIES:  # and says what is available
        assert name in str(info.value)


# ----------------------------------------------------------------------------- importability


@pytest.mark.parametrize("statement", [
    "import iosched.residency", "from iosched.residency import make_policy", "import iosched.backends",
    "import iosched.residency.lru", "import iosched.backends.pread", "import iosched.tools.cli", "import iosched",
])
def test_each_package_imports_first_in_a_fresh_interpreter(statement: str) -> None:
    failures = import_failures([statement], timeout=60)
    assert not failures, "\n".join(failures)


# ----------------------------------------------------------------------------- invariants under -O


_CORRUPT = """
import sys
from iosched import InvariantError
from iosched.residency import LRUPolicy, ResidencyTable
table = ResidencyTable(100, LRUPolicy())
entry = table.reserve("a", 60)
table.publish(entry)
# above the budget, every sum consistent: the check must say so even under -O
entry.nbytes = table.used_bytes = table.admitted_bytes = 160
try:
    table.check()
except InvariantError as exc:
    print("caught:", exc)
    sys.exit(0)
sys.exit("check() passed with used_bytes above the budget")
"""


def test_invariant_checks_hold_under_python_dash_o() -> None:
    result = subprocess.run([sys.executable, "-O", "-c", _CORRUPT], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr + result.stdout
    assert "byte budget exceeded" in result.stdout


def test_a_policy_check_raises_invariant_error() -> None:
    policy = LRUPolicy()
    policy.on_insert("a", 1)
    with pytest.raises(InvariantError, match="LRU order"):
        policy.check(set())
    assert issubclass(InvariantError, AssertionError)  # what callers catching AssertionError expect


# ----------------------------------------------------------------------------- declared capabilities


def test_lru_declares_nothing_and_binds_no_hook() -> None:
    hooks = bind(LRUPolicy())
    assert hooks.capabilities == Capability.NONE
    assert (hooks.set_budget, hooks.set_shape, hooks.end_batch, hooks.prepare, hooks.admit_prefetch,
            hooks.on_wait, hooks.on_routing, hooks.history) == (None,) * 8
    assert not hooks.rejects_misses


def test_every_registered_policy_binds_its_declared_capabilities() -> None:
    for name in POLICIES:
        policy = make_policy(name)
        hooks = bind(policy)  # raises if declaration and hooks disagree
        assert hooks.capabilities == policy.capabilities
        assert (hooks.end_batch is not None) == (Capability.BATCHES in policy.capabilities)
        assert (hooks.history is not None) == (Capability.HISTORY in policy.capabilities)


def test_a_declared_capability_without_its_hooks_is_refused() -> None:
    class Boasting(LRUPolicy):
        capabilities = Capability.BATCHES  # but no end_batch / prepare

    with pytest.raises(TypeError, match=r"Boasting declares Capability\.BATCHES but lacks its hooks"):
        ResidencyTable(10, Boasting())


def test_an_undeclared_hook_is_refused_rather_than_silently_ignored() -> None:
    class Quiet(LRUPolicy):
        def on_wait(self, key: Key, seconds: float) -> None:
            pass

    with pytest.raises(TypeError, match=r"Quiet does not declare Capability\.WAIT_COST but implements"):
        ResidencyTable(10, Quiet())


def test_capabilities_must_be_a_flag_set() -> None:
    class Sloppy(LRUPolicy):
        capabilities = "batches"  # type: ignore[assignment]

    with pytest.raises(TypeError, match="must be a Capability flag set"):
        bind(Sloppy())  # type: ignore[arg-type]


def test_the_table_gives_the_shape_before_the_budget() -> None:
    calls: list[str] = []

    class Shaped(LRUPolicy, ShapeAware, BudgetAware):
        capabilities = Capability.SHAPE | Capability.BUDGET

        def set_shape(self, shape: ModelShape) -> None:
            calls.append("shape")

        def set_budget(self, budget_bytes: int) -> None:
            calls.append(f"budget {budget_bytes}")

    shape = ModelShape(layers=(0,), n_expert=2, experts_per_token=1, expert_bytes={0: 1})
    table = ResidencyTable(10, Shaped(), transient_bytes=2, shape=shape)
    table.grow(20)
    assert calls == ["shape", "budget 8", "budget 18"]
