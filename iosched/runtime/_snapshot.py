"""Assembling :class:`~iosched.runtime._stats.StoreStats` from the store's parts.

Each part keeps its own live counters (the acquire path its :class:`RequestCounts`, the felt
wait its seconds, the loader its load outcomes, the prefetcher and its ledger theirs, the read path its
per-drive and per-replica counters, the table its admissions); :func:`snapshot` reads them
all at one instant into one frozen record.  Nothing here runs on the hot path: engines call
``stats()`` per token at most.
"""

from __future__ import annotations

import asyncio
import types
from dataclasses import dataclass

from iosched._layout import CheckpointIndex
from iosched.formats._verify import Verification
from iosched.residency import EntryState, Hooks, ResidencyTable

from ._acquire import Acquirer
from ._autogrow import AutoGrow
from ._felt import FeltWait
from ._io import ReadPath
from ._loads import Loader
from ._prefetch import Prefetcher, PrefetchLedger
from ._stats import StoreStats, TierStats, freeze
from ._usage import UsageHistory


@dataclass(frozen=True)
class Described:
    """What the store is, as ``stats()`` names it: fixed when it opens."""

    backend_reason: str | None
    policy: str
    policy_fallback: str | None
    verification: Verification
    td_bytes: int | None = None
    """One token cycle in bytes (``None`` without k): computed once, it walks every expert."""


def _loop_name() -> str:
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return "none"
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"


def snapshot(*, index: CheckpointIndex, table: ResidencyTable, io: ReadPath, acquirer: Acquirer,
             felt: FeltWait, loader: Loader, prefetcher: Prefetcher, ledger: PrefetchLedger, growth: AutoGrow | None,
             usage: UsageHistory | None, described: Described, routing_rows: int,
             tokens: int) -> StoreStats:
    """Every counter of the store, now."""
    entries = table.entries()
    counts = acquirer.counts
    hooks: Hooks = table.hooks
    pacer = prefetcher.pacer
    retired = loader.pool.retired
    td = described.td_bytes
    budget_cycles = table.budget_bytes / td if td else None
    verification, verifier = described.verification, io.verifier
    return StoreStats(
        requests=counts.requests, hits=counts.hits, misses=counts.misses,
        single_flight_joins=counts.joins, bytes_read=io.bytes_read,
        resident_bytes=table.used_bytes, budget_bytes=table.budget_bytes,
        leased=sum(1 for e in entries if e.leases),
        loading=sum(1 for e in entries if e.state is EntryState.LOADING),
        admissions=table.admissions, rejections=table.rejections, evictions=table.evictions,
        felt_wait_s=felt.felt_wait_s, service_s=loader.service_s,
        per_device=types.MappingProxyType({n: d.snapshot() for n, d in io.devices.items()}),
        resident_experts=sum(1 for e in entries if e.state is EntryState.RESIDENT),
        load_errors=loader.load_errors,
        hits_by_tier=TierStats(counts.hits, loader.page_cache_misses, loader.physical_misses),
        physical_misses=loader.physical_misses, idle_slab_bytes=loader.pool.idle_bytes,
        retired_slabs=retired.slabs, retired_released=retired.released, retired_bytes=retired.bytes,
        tokens=tokens,
        prefetch_issued=prefetcher.issued, prefetch_dropped=prefetcher.dropped,
        prefetch_used=ledger.used, prefetch_wasted=ledger.wasted, prefetch_failed=ledger.failed,
        prefetch_unused=len(ledger.unused), prefetch_refused=prefetcher.refused,
        prefetch_refused_bytes=prefetcher.refused_bytes, prefetch_promoted=loader.promoted,
        prefetch_guard_refusals=table.refused_prefetches,
        prefetch_paced_bytes=None if pacer is None else pacer.granted_bytes,
        prefetch_paced_refusals=None if pacer is None else pacer.refused,
        policy_prefetch_batches=prefetcher.policy_batches,
        policy_batch_ends_put_off=prefetcher.put_off,
        lookahead_expected=prefetcher.expected, lookahead_started=prefetcher.expect_started,
        token_budget_bytes=prefetcher.token_budget_bytes, migration_bytes=io.migration_bytes,
        hints=io.hints, hints_skipped=loader.hints_skipped,
        per_replica=types.MappingProxyType({r: c.snapshot() for r, c in io.per_replica.items()}),
        retries=io.retries, failovers=io.failovers, degraded=tuple(io.router.degraded()),
        routing=io.router.policy, queue_waits=io.queue_waits, stripes=io.stripes,
        stripe_redos=io.stripe_redos,
        backend=io.backend.name, backend_reason=described.backend_reason,
        backend_info=types.MappingProxyType({k: freeze(v) for k, v in io.backend.info().items()}),
        policy=described.policy, policy_fallback=described.policy_fallback,
        policy_verdict=None if hooks.costed is None else hooks.costed.cost_verdict,
        policy_state=None if hooks.stateful is None else types.MappingProxyType(
            {k: freeze(v) for k, v in hooks.stateful.state.as_dict().items()}),
        loop=_loop_name(),
        routing_rows=routing_rows,
        history=None if usage is None else usage.path, history_loaded=usage is not None and usage.loaded,
        pinned_experts=0 if hooks.history is None else hooks.history.pinned_experts,
        budget_growth=None if growth is None else growth.growth.snapshot(),
        experts_per_token=index.experts_per_token,
        td_bytes=None if td is None else int(td),
        budget_cycles=None if budget_cycles is None else float(budget_cycles),
        verify=verification.mode,
        manifest=None if verification.manifest is None else verification.manifest.path,
        verified_bytes=0 if verifier is None else verifier.verified_bytes,
        verify_mismatches=0 if verifier is None else verifier.mismatches,
        verify_retries=0 if verifier is None else verifier.retries,
        verify_bad_extents=0 if verifier is None else len(verifier.bad),
        verify_s=0.0 if verifier is None else verifier.seconds,
        mirror_samples=verification.mirror_samples,
    )
