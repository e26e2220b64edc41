"""The residency table: a strict byte budget, leases, and the policy that orders evictions.

Synchronous and free of asyncio, so the store (real reads) and the replay tool (virtual
time) drive the same object.  The store adds the waiting: when :meth:`ResidencyTable.reserve`
answers ``None`` it parks the caller until a lease or a load ends.

Invariants (re-checked by :meth:`check`):

* ``used_bytes`` is the sum of ``nbytes`` over all entries, loading ones included, and never
  exceeds ``budget_bytes``: bytes are reserved when a load *starts*;
* an entry is evicted only when it is resident, unleased, unpinned and not transient;
* the policy tracks exactly the non-transient entries;
* a transient entry (a demand miss the policy did not admit) is visible for single-flight
  while it loads and is dropped, never published, when its last lease ends;
* ``admitted_bytes`` (the non-transient entries) never exceeds ``budget_bytes -
  transient_bytes``, and ``transient_used`` is ``used_bytes - admitted_bytes``;
* leases and pins are counted by the table's own operations (:meth:`ResidencyTable.lease`,
  :meth:`~ResidencyTable.release`, :meth:`~ResidencyTable.pin`, :meth:`~ResidencyTable.unpin`),
  never below zero, and only a resident entry is leased; an entry's payload (the driver's
  record of its memory) is set by :meth:`~ResidencyTable.publish` and taken back by
  :meth:`~ResidencyTable.take_payload`.  Drivers read an :class:`Entry`, they never write it.

The transient slot (``transient_bytes``, default 0).  With a slot, admitted entries are
limited to ``budget_bytes - transient_bytes`` (the main region), so at least
``transient_bytes - transient_used`` bytes are always free for misses the policy rejects: a
rejected miss is reserved *without evicting anything* when ``used_bytes + nbytes <=
budget_bytes`` (first the slot's own bytes, then, when the slot is full, whatever the main
region leaves free), and otherwise it evicts as a slot-less table would.  It never waits for
another transient to end: an engine leasing a whole layer at once holds its own transients
until all its misses are served, so waiting would deadlock it.
Admitted entries never use the slot's free bytes, even when it is empty: simplest, and the
main region then behaves exactly like a table of ``budget_bytes - transient_bytes``.  A miss
larger than the main region but within the budget cannot be admitted at all; it is served
transiently without asking the policy, as is a miss whose admission would need more than
the evictable bytes (everything else leased, pinned or loading) when it fits beside them.

With ``transient_bytes=0`` (no slot) the behaviour is the historical one: a rejected miss
evicts exactly the victims an admitted one would (its bytes must be held somewhere while it
loads and is computed on), and ``None`` means the evictable entries cannot free enough.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any

from iosched._errors import BudgetError, InvariantError, require

from ._policy import Hooks, Key, ModelShape, Policy, bind


class EntryState(enum.Enum):
    LOADING = "loading"
    RESIDENT = "resident"


class Entry:
    """One expert in the table, owned by it: drivers read its fields, the table's operations
    change them.  ``pins`` counts waiters about to take a lease (they keep the entry from
    eviction between the load's completion and their wake-up); ``payload`` is the driver's
    record of the entry's memory, set when it is published."""

    __slots__ = ("key", "nbytes", "state", "leases", "pins", "transient", "payload")

    def __init__(self, key: Key, nbytes: int, transient: bool) -> None:
        self.key = key
        self.nbytes = nbytes
        self.state = EntryState.LOADING
        self.leases = 0
        self.pins = 0
        self.transient = transient
        self.payload: Any = None

    @property
    def evictable(self) -> bool:
        return (
            self.state is EntryState.RESIDENT
            and self.leases == 0
            and self.pins == 0
            and not self.transient
        )

    def __repr__(self) -> str:
        return (
            f"Entry({self.key!r}, {self.nbytes}, {self.state.value}, leases={self.leases}, "
            f"pins={self.pins}{', transient' if self.transient else ''})"
        )


class ResidencyTable:
    def __init__(
        self,
        budget_bytes: int,
        policy: Policy,
        on_evict: Callable[[Entry], None] | None = None,
        transient_bytes: int = 0,
        shape: ModelShape | None = None,
    ) -> None:
        """``shape``: the model's shape, given to a policy that declares ``Capability.SHAPE``
        before its budget (the store takes it from the checkpoint, the replay from the trace)."""
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
            raise BudgetError(f"budget_bytes must be a positive integer, got {budget_bytes!r}")
        if (isinstance(transient_bytes, bool) or not isinstance(transient_bytes, int)
                or not 0 <= transient_bytes < budget_bytes):
            raise BudgetError(f"transient_bytes must be an integer in [0, budget_bytes), "
                              f"got {transient_bytes!r} (budget {budget_bytes})")
        self.budget_bytes = budget_bytes
        self.transient_bytes = transient_bytes
        self.main_bytes = budget_bytes - transient_bytes
        """What admitted (non-transient) entries may use together."""
        self.policy = policy
        self._on_evict = on_evict
        self._entries: dict[Key, Entry] = {}
        self.used_bytes = 0
        self.admitted_bytes = 0
        self.admissions = 0
        self.rejections = 0
        self.evictions = 0
        self.evicted_bytes = 0
        self.refused_prefetches = 0
        """Speculative reservations the policy refused (the eviction guard) or that could never fit."""
        self.hooks: Hooks = bind(policy)
        """The policy's declared abilities, checked once here; drivers call hooks through it."""
        self._admit_prefetch = self.hooks.admit_prefetch or policy.admit
        if self.hooks.set_shape is not None and shape is not None:
            self.hooks.set_shape(shape)
        if self.hooks.set_budget is not None:
            self.hooks.set_budget(self.main_bytes)

    def grow(self, budget_bytes: int) -> None:
        """Raise the byte budget (``budget="auto"`` growing between turns); the transient slot
        keeps its size and the main region takes the rest.  Never shrinks: a smaller budget
        would have to evict leased or loading entries it cannot touch."""
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < self.budget_bytes:
            raise BudgetError(f"grow: budget_bytes must be an integer >= {self.budget_bytes}, got {budget_bytes!r}")
        self.budget_bytes = budget_bytes
        self.main_bytes = budget_bytes - self.transient_bytes
        if self.hooks.set_budget is not None:
            self.hooks.set_budget(self.main_bytes)

    def set_on_evict(self, on_evict: Callable[[Entry], None] | None) -> Callable[[Entry], None] | None:
        """Replace the eviction callback (a driver's statistics hook); returns the previous one."""
        previous, self._on_evict = self._on_evict, on_evict
        return previous

    @property
    def transient_used(self) -> int:
        """Bytes held by transient entries (in the slot or, when it is full, beyond it)."""
        return self.used_bytes - self.admitted_bytes

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Key) -> Entry | None:
        return self._entries.get(key)

    def entries(self) -> list[Entry]:
        return list(self._entries.values())

    def reserve(self, key: Key, nbytes: int, speculative: bool = False) -> Entry | None:
        """Reserve ``nbytes`` for a load of ``key``, evicting as the policy orders.

        Returns the new LOADING entry, or ``None`` (and changes nothing) when not enough
        bytes can be freed now because the rest is leased, pinned or loading.

        ``speculative``: a prefetch, not a demand.  It is admitted or not at all: the policy's
        ``admit_prefetch`` (or ``admit``) is asked with the victims, and a refusal, like a lack
        of room, answers ``None`` with nothing evicted; it never uses the transient slot.
        """
        if nbytes > self.budget_bytes:
            raise BudgetError(
                f"expert {key!r} needs {nbytes} bytes, more than the whole budget of "
                f"{self.budget_bytes} bytes"
            )
        if nbytes < 0:
            raise BudgetError(f"expert {key!r} has a negative size ({nbytes} bytes)")
        if key in self._entries:
            raise InvariantError(f"reserve of {key!r}, which is already in the table")
        if speculative:
            return self.reserve_speculative_many([(key, nbytes)])[0]
        victims: list[Entry] | None = None
        if nbytes <= self.main_bytes:  # else it can never be admitted
            victims = self._victims_for(max(self.used_bytes + nbytes - self.budget_bytes,
                                            self.admitted_bytes + nbytes - self.main_bytes))
        if self.transient_bytes == 0:
            # No slot: a rejected miss takes the same victims as an admitted one, so admission
            # is asked only once the reservation is certain and a stateful admission policy
            # sees each decision once however often a parked acquire retries.
            if victims is None:
                return None
            admitted = self.policy.admit(key, nbytes, [v.key for v in victims])
        else:
            # With a slot admission is asked whenever admitting is possible now; a rejection
            # that must wait answers None and is asked again on the retry.
            admitted = victims is not None and self.policy.admit(
                key, nbytes, [v.key for v in victims])
            if not admitted:
                if self.used_bytes + nbytes <= self.budget_bytes:
                    victims = []  # the slot, or free main bytes: nothing is evicted
                else:
                    # The slot is full: evict as a slot-less table would.  Waiting for a
                    # transient to end instead deadlocks an engine that leases a whole layer
                    # at once (acquire_many): its own transients hold the slot until every
                    # one of its misses is served (seen with 128-expert prefill batches).
                    victims = self._victims_for(self.used_bytes + nbytes - self.budget_bytes)
                    if victims is None:
                        return None
        for victim in victims or ():
            self.evict(victim)
        entry = Entry(key, nbytes, transient=not admitted)
        self._entries[key] = entry
        self.used_bytes += nbytes
        if admitted:
            self.admitted_bytes += nbytes
            self.admissions += 1
            self.policy.on_insert(key, nbytes)
        else:
            self.rejections += 1
        return entry

    def reserve_speculative_many(self, items: Sequence[tuple[Key, int]]) -> list[Entry | None]:
        """Speculative reservations (as ``reserve(key, nbytes, speculative=True)``) for several
        keys, best first, with one walk of the policy's victims: the evictable entries the
        whole batch could need are listed once (the walk changes nothing), then each key takes
        the next ones it needs and the guard decides; a refused key leaves them to the next.
        One entry (or ``None``: in the table already, no room, or refused) per item.

        Why not a loop over ``reserve``: a structure-aware policy ranks its victims afresh on
        each walk, and k walks per batch were most of its cost (``docs/residency.md``)."""
        for key, nbytes in items:  # as reserve does, and before anything is reserved
            if nbytes > self.budget_bytes or nbytes < 0:
                raise BudgetError(f"expert {key!r} needs {nbytes} bytes, outside the budget of "
                                  f"{self.budget_bytes} bytes")
        out: list[Entry | None] = []
        todo = [(key, n) for key, n in items if key not in self._entries and n <= self.main_bytes]
        total = sum(n for _, n in todo)
        pool = self._evictable(max(self.used_bytes + total - self.budget_bytes,
                                   self.admitted_bytes + total - self.main_bytes))
        admit = self._admit_prefetch
        cursor = 0
        for key, nbytes in items:
            if key in self._entries:
                out.append(None)
                continue
            if nbytes > self.main_bytes:
                self.refused_prefetches += 1
                out.append(None)
                continue
            need = max(self.used_bytes + nbytes - self.budget_bytes,
                       self.admitted_bytes + nbytes - self.main_bytes)
            victims: list[Entry] = []
            freed, j = 0, cursor
            while freed < need and j < len(pool):
                victims.append(pool[j])
                freed += pool[j].nbytes
                j += 1
            if freed < need:
                out.append(None)
                continue
            if not admit(key, nbytes, [v.key for v in victims]):
                self.refused_prefetches += 1
                out.append(None)
                continue
            for victim in victims:
                self.evict(victim)
            cursor = j
            out.append(self._insert(key, nbytes))
        return out

    def _evictable(self, need: int) -> list[Entry]:
        """Evictable entries in the policy's order until ``need`` bytes are covered (fewer
        when there are not enough); nothing is evicted."""
        chosen: list[Entry] = []
        for key in self.policy.victims() if need > 0 else ():
            entry = self._entries[key]
            if entry.evictable:
                chosen.append(entry)
                need -= entry.nbytes
                if need <= 0:
                    break
        return chosen

    def _insert(self, key: Key, nbytes: int) -> Entry:
        entry = Entry(key, nbytes, transient=False)
        self._entries[key] = entry
        self.used_bytes += nbytes
        self.admitted_bytes += nbytes
        self.admissions += 1
        self.policy.on_insert(key, nbytes)
        return entry

    def publish(self, entry: Entry, payload: Any = None) -> None:
        """The entry's whole read succeeded: it may now be hit (and, unleased, evicted);
        ``payload`` is the driver's record of its memory (the store's slab and views)."""
        if entry.state is not EntryState.LOADING:
            raise InvariantError(f"publish of {entry!r}, which is not loading")
        entry.payload = payload
        entry.state = EntryState.RESIDENT

    def take_payload(self, entry: Entry) -> Any:
        """The payload :meth:`publish` set (``None`` if none, or taken already), now detached
        from ``entry``: the driver frees that memory once the entry left the table."""
        payload, entry.payload = entry.payload, None
        return payload

    def lease_resident(self, key: Key) -> Entry | None:
        """The hit path's one call: lease ``key``'s entry if it is resident (``None``, and
        nothing changed, when it is absent or loading)."""
        entry = self._entries.get(key)
        if entry is None or entry.state is not EntryState.RESIDENT:
            return None
        entry.leases += 1
        return entry

    def lease(self, entry: Entry) -> None:
        """One more lease on a resident ``entry``: it cannot be evicted until released."""
        if entry.state is not EntryState.RESIDENT:
            raise InvariantError(f"lease of {entry!r}, which is not resident")
        entry.leases += 1

    def release(self, entry: Entry) -> bool:
        """End one lease; ``True`` when it was the last (the driver may then drop a transient
        entry and wake waiters for room)."""
        if entry.leases <= 0:
            raise InvariantError(f"release of {entry!r}, which holds no lease")
        entry.leases -= 1
        return entry.leases == 0

    def pin(self, entry: Entry) -> None:
        """A waiter will lease ``entry`` once its load ends: until then it cannot be evicted."""
        entry.pins += 1

    def unpin(self, entry: Entry) -> None:
        """The waiter :meth:`pin` counted leased the entry or gave up."""
        if entry.pins <= 0:
            raise InvariantError(f"unpin of {entry!r}, which holds no pin")
        entry.pins -= 1

    def remove(self, entry: Entry) -> None:
        """Drop an entry that failed to load, or a transient one whose last lease ended."""
        if self._entries.get(entry.key) is not entry:
            raise InvariantError(f"remove of {entry!r}, which is not in the table")
        del self._entries[entry.key]
        self.used_bytes -= entry.nbytes
        if not entry.transient:
            self.admitted_bytes -= entry.nbytes
            self.policy.on_remove(entry.key)

    def evict(self, entry: Entry) -> None:
        if not entry.evictable:
            raise InvariantError(f"eviction of {entry!r}, which is not evictable")
        self.remove(entry)
        self.evictions += 1
        self.evicted_bytes += entry.nbytes
        if self._on_evict is not None:
            self._on_evict(entry)

    def evict_all(self) -> None:
        """Evict every evictable entry (used by ``close``)."""
        for entry in [e for e in self._entries.values() if e.evictable]:
            self.evict(entry)

    def _victims_for(self, need: int) -> list[Entry] | None:
        """The entries to evict, in policy order, to free ``need`` bytes; ``None`` when the
        evictable entries cannot free enough (then nothing is evicted at all)."""
        chosen = self._evictable(need)
        return chosen if sum(e.nbytes for e in chosen) >= need else None

    def check(self) -> None:
        """Re-check every invariant in the module docstring; :class:`InvariantError` if one
        fails (explicit checks: they hold under ``python -O`` too)."""
        total = sum(e.nbytes for e in self._entries.values())
        if total != self.used_bytes:
            raise InvariantError(f"used_bytes {self.used_bytes} != sum of entries {total}")
        if self.used_bytes > self.budget_bytes:
            raise InvariantError(f"byte budget exceeded: {self.used_bytes} used of {self.budget_bytes}")
        admitted = sum(e.nbytes for e in self._entries.values() if not e.transient)
        if admitted != self.admitted_bytes:
            raise InvariantError(f"admitted_bytes {self.admitted_bytes} != sum of admitted entries {admitted}")
        require(self.admitted_bytes <= self.main_bytes, "admitted entries exceed the main region")
        require(self.main_bytes + self.transient_bytes == self.budget_bytes,
                "main region and transient slot do not add up to the budget")
        for e in self._entries.values():
            if not (e.leases >= 0 and e.pins >= 0):
                raise InvariantError(f"negative count in {e!r}")
            if not (e.state is EntryState.RESIDENT or e.leases == 0):
                raise InvariantError(f"lease on a loading entry {e!r}")
        self.policy.check({k for k, e in self._entries.items() if not e.transient})
