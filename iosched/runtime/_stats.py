"""The store's statistics: live counters, and the deeply frozen snapshot ``statistics()`` returns.

Two kinds of object live here:

* **live counters** (:class:`DeviceCounters`, :class:`ReplicaCounters`,
  :class:`RequestCounts`): plain mutable records the read path and the acquire path bump on
  their hot paths (an attribute increment, nothing else);
* **snapshots** (:class:`StoreStats` and the records it holds): frozen dataclasses whose
  mappings are read-only (``types.MappingProxyType``) and whose sequences are tuples, all the
  way down, so a snapshot handed to an engine cannot be changed by it nor change under it.

``ExpertStore.stats()``, the contract's dict, is :func:`as_dict` of a snapshot: the same keys
and values as ever (plain dicts and lists), derived from the one typed record.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias

from ._growth import GrowthStats

JSONValue: TypeAlias = "None | bool | int | float | str | tuple[JSONValue, ...] | Mapping[str, JSONValue]"
"""What a frozen backend fact may be: JSON's values, with tuples and read-only mappings."""


_SCALARS = frozenset((int, float, str, bool, type(None)))
"""Exact types that freeze and thaw pass through (tested by ``type(...) in``: engines call
``stats()`` per token, and the abstract ``isinstance`` checks cost more than the copying)."""


def freeze(value: Any) -> JSONValue:
    """``value`` (JSON-like: dicts, lists, tuples, scalars) with every dict made a read-only
    mapping and every list a tuple, recursively."""
    kind = type(value)
    if kind in _SCALARS:
        return value  # type: ignore[no-any-return]
    if kind is dict or isinstance(value, Mapping):
        return types.MappingProxyType({str(k): freeze(v) for k, v in value.items()})
    if kind is list or kind is tuple:
        return tuple(freeze(v) for v in value)
    if isinstance(value, (bool, int, float, str)):  # subclasses (an IntEnum, say)
        return value
    raise TypeError(f"not a JSON value: {value!r}")


def thaw(value: Any) -> Any:
    """The plain form of a frozen value: dataclasses and mappings as dicts, tuples as lists."""
    kind = type(value)
    if kind in _SCALARS:
        return value
    if kind is tuple:
        return [thaw(v) for v in value]
    if kind is types.MappingProxyType or kind is dict:
        return {k: thaw(v) for k, v in value.items()}
    if hasattr(kind, "__dataclass_fields__"):  # a record of ours (frozen, with a __dict__)
        return {k: thaw(v) for k, v in vars(value).items()}
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    return value


# ---------------------------------------------------------------------------- live counters


@dataclass
class DeviceCounters:
    """One drive's counters, bumped by the read path."""

    reads: int = 0
    bytes: int = 0
    errors: int = 0
    in_flight: int = 0

    def snapshot(self) -> DeviceStats:
        return DeviceStats(self.reads, self.bytes, self.errors, self.in_flight)


@dataclass
class ReplicaCounters:
    """One replica root's counters, bumped by the read path."""

    reads: int = 0
    bytes: int = 0
    errors: int = 0
    pending: int = 0
    """Reads queued for or in flight on this replica: what ``least_pending`` balances."""

    def snapshot(self) -> ReplicaStats:
        return ReplicaStats(self.reads, self.bytes, self.errors, self.pending)


@dataclass
class RequestCounts:
    """How acquires were classified, bumped by the acquire path: ``requests == hits + misses +
    joins``.  Shared by reference with the prefetcher, which tells from ``requests`` whether
    another batch began since a batch ended."""

    requests: int = 0
    hits: int = 0
    misses: int = 0
    joins: int = 0

    def snapshot(self, felt_wait_s: float = 0.0) -> RequestTally:
        return RequestTally(self.requests, self.hits, self.misses, self.joins, felt_wait_s)


@dataclass(frozen=True)
class RequestTally:
    """``ExpertStore.request_tally``: the acquire counters alone, cheap to read per batch
    (``stats()`` builds the whole snapshot)."""

    requests: int
    hits: int
    misses: int
    single_flight_joins: int
    felt_wait_s: float = 0.0
    """``stats()["felt_wait_s"]`` so far: read per token, it gives felt wait per token."""


# ---------------------------------------------------------------------------- snapshots


@dataclass(frozen=True)
class DeviceStats:
    """``stats()["per_device"][drive]``: the contract's per-drive counters."""

    reads: int
    bytes: int
    errors: int
    in_flight: int


@dataclass(frozen=True)
class ReplicaStats:
    """``stats()["per_replica"][root]``: the same counted per replica root."""

    reads: int
    bytes: int
    errors: int
    pending: int


@dataclass(frozen=True)
class TierStats:
    """``stats()["hits_by_tier"]``: where the bytes of each served acquire came from."""

    resident: int
    """``hits``."""
    page_cache: int
    """Demand loads the page cache served wholly."""
    drive: int
    """The other demand loads that finished (``physical_misses``)."""


@dataclass(frozen=True)
class StoreStats:
    """A snapshot of the store's counters; ``ExpertStore.stats()`` is :func:`as_dict` of it.

    ``requests == hits + misses + single_flight_joins``: each acquire of a known key is
    classified once, by what it found when it asked (resident, nothing, or a load in flight).
    ``prefetch_issued == prefetch_used + prefetch_wasted + prefetch_failed + prefetch_unused``
    until ``close()``.  ``docs/telemetry.md`` says how each field is measured.
    """

    # -- the contract's keys
    requests: int
    hits: int
    misses: int
    single_flight_joins: int
    bytes_read: int
    resident_bytes: int
    budget_bytes: int
    leased: int
    loading: int
    admissions: int
    rejections: int
    evictions: int
    felt_wait_s: float
    """Wall time during which at least one acquire was waiting (union of the waits)."""
    service_s: float
    """Read service time summed over loads (loads overlap, so this can exceed wall time)."""
    per_device: Mapping[str, DeviceStats]
    # -- residency and loads
    resident_experts: int
    load_errors: int
    hits_by_tier: TierStats
    physical_misses: int
    idle_slab_bytes: int
    retired_slabs: int
    """Slabs set aside instead of recycled because something still referenced a view of their
    expert when it left the store (kept past its lease): monotonic."""
    retired_released: int
    """Retired slabs taken back since, their last reference gone (recycled or closed; at
    ``close()`` every one): monotonic.  ``retired_slabs - retired_released`` are held now."""
    retired_bytes: int
    """Page-rounded bytes of the retired slabs held now: a gauge, outside ``budget_bytes``
    (memory the engine keeps referenced, not resident experts)."""
    tokens: int
    # -- prefetch
    prefetch_issued: int
    prefetch_dropped: int
    prefetch_used: int
    """Prefetched entries an acquire then leased (hit or joined), each counted once."""
    prefetch_wasted: int
    """Prefetched entries that left the table (evicted, or dropped unadmitted) unleased."""
    prefetch_failed: int
    """Prefetch loads that failed."""
    prefetch_unused: int
    """Prefetched entries (loading or resident) not leased yet: a gauge."""
    prefetch_refused: int
    """Prefetches the per-token byte budget refused."""
    prefetch_refused_bytes: int
    prefetch_promoted: int
    """Prefetch loads a demand acquire joined (their reads then jump the queue)."""
    prefetch_guard_refusals: int
    """Speculative reservations the policy's eviction guard refused (or that never fit)."""
    prefetch_paced_bytes: int | None
    """Bytes the idle-time pacer granted (``None`` without pacing)."""
    prefetch_paced_refusals: int | None
    policy_prefetch_batches: int
    """Batches after which the policy proposed prefetches."""
    policy_batch_ends_put_off: int
    """Batch ends whose work let the engine resume first: its felt wait had a read's result
    on its way, and it waited again in that group (``iosched/runtime/_prefetch.py``)."""
    lookahead_expected: int
    """Experts an engine's lookahead (``expect``) gave at least ``lookahead_min_probability``."""
    lookahead_started: int
    """Loads of them that started (the rest were resident or loading, or not paced in, or
    refused by the budget or the eviction guard); their fate is counted with every prefetch's
    (``prefetch_used``, ``prefetch_wasted``)."""
    token_budget_bytes: int | None
    migration_bytes: int
    """The part of ``bytes_read`` read by loads a prefetch started: moved ahead of demand."""
    # -- hints
    hints: int
    hints_skipped: int
    # -- the read path
    per_replica: Mapping[str, ReplicaStats]
    retries: int
    failovers: int
    degraded: tuple[str, ...]
    """Replica paths the router holds unhealthy now."""
    routing: str
    queue_waits: int
    stripes: int
    stripe_redos: int
    # -- what runs
    backend: str
    backend_reason: str | None
    backend_info: Mapping[str, JSONValue]
    policy: str
    policy_fallback: str | None
    policy_verdict: str | None
    """What a policy that times its own work concluded (``default``, ``coact``: whether its
    trial kept the prefetch, and the ranking's verdicts; ``earned``: when and why it left
    ``moe`` for ``coact``); ``None`` while it has concluded nothing."""
    policy_state: Mapping[str, JSONValue] | None
    """Where a policy that changes how it decides is (``Capability.STATE``: ``default``,
    ``coact``): ``mode``, ``why`` (its last change's reason) and ``since_token``; ``None``
    for a policy that does not say."""
    loop: str
    routing_rows: int
    """Token rows of router output observed (``observe_routing``)."""
    # -- the policy's usage history and budget sizing
    history: str | None
    history_loaded: bool
    pinned_experts: int
    budget_growth: GrowthStats | None
    experts_per_token: int | None
    td_bytes: int | None
    budget_cycles: float | None
    # -- verified bytes (``verify=``, iosched/formats/_verify.py)
    verify: str
    """``"off"`` or ``"reads"``."""
    manifest: str | None
    """The manifest file loaded at open (``None``: none)."""
    verified_bytes: int
    """Extent bytes hashed and found equal to the manifest (read or mapped)."""
    verify_mismatches: int
    """Extent reads whose bytes differed from the manifest (each replica's counted)."""
    verify_retries: int
    """Extent reads redone after a mismatch (on another replica, or a stripe read whole)."""
    verify_bad_extents: int
    """``(replica, extent)`` pairs whose last read mismatched, tried last for that extent: a gauge."""
    verify_s: float
    """Seconds spent hashing, summed over the hashes (on the loop, or in worker threads for
    large extents, where several overlap)."""
    mirror_samples: int
    """Extents of mirrors compared with the manifest or the primary at open (``verify_mirrors``)."""


_NESTED = ("per_device", "per_replica", "hits_by_tier", "degraded", "backend_info", "budget_growth",
           "policy_state")
"""The fields of :class:`StoreStats` that are not scalars: the only ones :func:`as_dict` thaws."""


def as_dict(stats: StoreStats) -> dict[str, Any]:
    """``stats()``: every field by name, nested records and mappings as plain dicts, tuples as
    lists (the contract's dict, with the keys and values it always had).  Engines call it per
    token and monitors in a loop, so the scalar fields are copied as they are (``vars``) and
    only the few nested ones go through :func:`thaw`: about 10 µs, where thawing every field
    generically took 240 µs (measured on the development VM)."""
    out = dict(vars(stats))
    for name in _NESTED:
        out[name] = thaw(out[name])
    return out
