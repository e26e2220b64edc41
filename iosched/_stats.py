"""The store's statistics: live per-device counters and the frozen snapshot ``stats()`` reports."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class DeviceStats:
    reads: int = 0
    bytes: int = 0
    errors: int = 0
    in_flight: int = 0


@dataclass(frozen=True)
class StoreStats:
    """A snapshot of the store's counters (``ExpertStore.stats()`` returns it as a dict).

    ``requests == hits + misses + single_flight_joins``: each acquire of a known key is
    classified once, by what it found when it asked (resident, nothing, or a load in flight).
    """

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
    per_device: dict[str, dict[str, int]]
    resident_experts: int
    load_errors: int
    prefetch_issued: int
    prefetch_dropped: int
    prefetch_used: int
    """Prefetched entries an acquire then leased (hit or joined), each counted once."""
    prefetch_wasted: int
    """Prefetched entries that left the table (evicted, or dropped unadmitted) unleased."""
    prefetch_failed: int
    """Prefetch loads that failed.  ``prefetch_issued == used + wasted + failed + unused``
    until ``close()``."""
    prefetch_unused: int
    """Prefetched entries (loading or resident) not leased yet: a gauge."""
    hits_by_tier: dict[str, int]
    """``resident``: ``hits``; ``page_cache``: demand loads the page cache served wholly;
    ``drive``: the other demand loads that finished (``physical_misses``)."""
    physical_misses: int
    migration_bytes: int
    """The part of ``bytes_read`` read by loads a prefetch started: moved ahead of demand."""
    tokens: int
    idle_slab_bytes: int
    backend: str
    backend_reason: str | None
    backend_info: dict[str, Any]
    policy: str
    loop: str
    extra: dict[str, Any] = field(default_factory=dict)
