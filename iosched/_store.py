"""``ExpertStore``: what an engine awaits.

The data path of one ``acquire`` (``docs/design.md`` tells it in prose):

1. **hit**: the key's entry is resident: take a lease, return the views made at publish time.
   No await, no allocation beyond the lease object.
2. **join**: the entry is loading: pin it, await the load's future (shielded, so a cancelled
   waiter never cancels the load others wait on), then turn the pin into a lease.
3. **miss**: reserve the expert's bytes in the :class:`iosched.residency.ResidencyTable` (evicting
   what the policy names, never a leased, pinned or loading entry); when nothing can be freed
   now, wait until a lease or a load ends.  Then start the load as a task of its own, and
   join it like any other waiter.

A load takes a page-aligned slab from the pool, reads each extent through the backend (the
core counts per-device reads, bytes, errors and in-flight), builds the views, and only then
publishes the entry.  A failed load removes its reservation, returns its slab and hands a
:class:`StoreError` to every waiter; the next acquire of that key tries again.

Where the bytes came from (``docs/telemetry.md``): a demand load that the backend shows was
served wholly by the page cache counts in ``hits_by_tier["page_cache"]``, any other one in
``hits_by_tier["drive"]`` (= ``physical_misses``).  An entry a prefetch loaded stays in
``_unused_prefetch`` until an acquire leases it (``prefetch_used``) or it leaves the table
unused (``prefetch_wasted``; ``prefetch_failed`` when its load failed); the hit path pays one
test of that dict's emptiness for it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import asdict, fields
from typing import Any

from iosched import backends
from iosched.residency import Entry, EntryState, ModelShape, Policy, ResidencyTable
from iosched.residency import history as _history
from iosched.residency.registry import make_policy

from . import _routing, _settings, _sizing
from ._checkpoint import load_index
from ._errors import BudgetError, ReadError, StoreClosed, StoreError, UnknownExpertError
from ._growth import BudgetGrowth
from ._io import ReadPath
from ._layout import CheckpointIndex, ExpertKey, ExpertLayout
from ._lease import Lease, LeaseGroup
from ._mirrors import find_replicas
from ._pacing import IdlePacer
from ._readplan import ReadPlan, pack, plan_reads
from ._router import POLICIES as ROUTING_POLICIES
from ._scheduler import DEMAND, PREFETCH, Ticket
from ._slab import Slab, SlabPool
from ._stats import StoreStats
from ._telemetry import TokenTelemetry
from ._topology import Discovery, is_topology_file, load_topology
from ._view import ExpertView

log = logging.getLogger("iosched")


def _transient_bytes(policy: object, index: CheckpointIndex, budget_bytes: int) -> int:
    """The bounded slot that serves demand misses a policy does not admit: none for a policy
    that admits everything; else one layer's batch of the largest experts (k of them, k from
    the checkpoint, 1 when unknown), at most half the budget.  The same rule as the replay's
    (``tools.replay.transient_bytes_for``), so simulated and real runs size it alike."""
    if not getattr(policy, "uses_admission", False):
        return 0
    largest = max(layout.nbytes for layout in index.experts.values())
    return min((index.experts_per_token or 1) * largest, budget_bytes // 2)


def _model_shape(index: CheckpointIndex) -> ModelShape | None:
    """The checkpoint's shape as a structure-aware policy takes it (``None`` without k):
    its MoE layers ascending (the order a token visits them), experts per layer, k, and the
    largest expert of each layer."""
    k = index.experts_per_token
    if k is None or not index.experts:
        return None
    sizes = index.expert_bytes_by_layer()
    n_expert = 1 + max(expert for _, expert in index.experts)
    return ModelShape(layers=tuple(sorted(sizes)), n_expert=n_expert, experts_per_token=k,
                      expert_bytes=sizes)


def _build_policy(name: str, index: CheckpointIndex) -> tuple[Policy, str | None]:
    """The policy ``name`` names, given the checkpoint's shape when it takes one; and why
    another was used instead (``None`` when none was): ``default`` falls back to ``lru`` when
    the checkpoint does not say k, an explicit structure-aware policy is refused."""
    width = _settings.get("prefetch_width")
    policy = make_policy(name)
    if width != "k" and callable(getattr(policy, "end_batch", None)):
        policy = make_policy(name, prefetch_width=width)
    set_shape = getattr(policy, "set_shape", None)
    if not callable(set_shape):
        return policy, None
    shape = _model_shape(index)
    if shape is None:
        why = (f"policy {name!r} needs k, the experts routed per token, and {index.root} does not "
               "say (no num_experts_per_tok in config.json, no expert_used_count in GGUF)")
        if name != "default":
            raise StoreError(why + "; pass experts_per_token=K to ExpertStore.open")
        log.warning("%s: using lru", why)
        return make_policy("lru"), why + ": lru used instead"
    set_shape(shape)
    return policy, None


def _drive_names(paths: Sequence[str]) -> dict[str, str]:
    discovery = Discovery()
    return {path: discovery.drive_of(path).name for path in paths}


class _Loaded:
    """A published expert's memory: a slab of ours, or a range of a zero-copy backend's."""

    __slots__ = ("slab", "view", "mapped")

    def __init__(self, slab: Slab | None, view: ExpertView, mapped: tuple[int, int, int] | None) -> None:
        self.slab = slab
        self.view = view
        self.mapped = mapped


class ExpertStore:
    """Streams experts of a checkpoint under a strict byte budget.  Create with :meth:`open`."""

    def __init__(
        self,
        index: CheckpointIndex,
        budget_bytes: int,
        io: ReadPath,
        backend_reason: str | None,
        policy_name: str,
        token_budget_bytes: int | None = None,
        *,
        telemetry: TokenTelemetry | None = None,
        growth: BudgetGrowth | None = None,
    ) -> None:
        self._index = index
        self._layouts = index.experts
        self._io = io
        self._backend = io.backend
        self._zero_copy = io.zero_copy
        self._backend_reason = backend_reason
        self._policy_name = policy_name
        policy, self._policy_fallback = _build_policy(policy_name, index)
        self._prefetching = callable(getattr(policy, "end_batch", None))
        self._prepare: Callable[[], None] | None = getattr(policy, "prepare", None)
        self._batch_end_at: int | None = None
        """``requests`` when the last ``acquire_many`` completed, until the policy was told."""
        self._on_wait: Callable[[Hashable, float], None] | None = getattr(policy, "on_wait", None)
        self._table = ResidencyTable(budget_bytes, policy, self._on_evict,
                                     transient_bytes=_transient_bytes(policy, index, budget_bytes))
        self._pool = SlabPool()
        self._closed = False
        self._loads: set[asyncio.Task[Any]] = set()
        self._room_waiters: list[asyncio.Future[None]] = []
        self._tickets: dict[ExpertKey, Ticket] = {}
        """The priority of each load in flight (a demand join promotes a prefetch's)."""
        self._history_path: str | None = None
        self._history_loaded: bool | None = None
        """``None`` until a history was set up (then saved at close), True once loaded."""
        self._pacer = (IdlePacer(io.drive_usage)
                       if self._prefetching and _settings.get("prefetch_pacing") == "idle" else None)
        self._policy_prefetches = 0
        """Batches after which the policy proposed prefetches."""
        self._token_budget = token_budget_bytes
        self._speculative_bytes = 0
        """Bytes prefetch started since the last token boundary."""
        self._prefetch_refused = self._prefetch_refused_bytes = self._prefetch_promoted = 0
        self._hints_skipped = 0
        self._routing_rows = 0
        """Token rows of router output observed (``observe_routing``)."""
        self._requests = self._hits = self._misses = self._joins = 0
        self._load_errors = 0
        self._prefetch_issued = self._prefetch_dropped = 0
        self._unused_prefetch: dict[Hashable, Entry] = {}
        """Entries a prefetch started (loading or resident) that no acquire has leased yet."""
        self._prefetch_used = self._prefetch_wasted = self._prefetch_failed = 0
        self._page_cache_misses = self._physical_misses = 0
        """Demand loads the page cache served wholly / the others (drive, or not known)."""
        self._tokens = 0
        self._felt_wait_s = self._service_s = 0.0
        # felt wait is the union of the intervals during which some acquire was waiting:
        # six experts awaited together for 2 ms cost the engine 2 ms, not 12.
        self._waiting = 0
        self._wait_since = 0.0
        self._telemetry = telemetry
        self._closers: list[Callable[[], None]] = []
        """Called by ``close()`` (``iosched._telemetry.start_exporter`` stops its server so)."""
        self._growth = growth
        """``budget="auto"``'s growth rule (``iosched/_growth.py``); ``None`` for an integer budget."""
        self._growth_due = False

    # ------------------------------------------------------------------ opening and closing

    @classmethod
    async def open(
        cls,
        source: str | os.PathLike[str],
        budget_bytes: int | str,
        backend: str | backends.Backend | None = "auto",
        policy: str | None = "default",
        mirrors: Sequence[str | os.PathLike[str]] = (),
        *,
        routing: str = "hash",
        weights: Mapping[str, float] | None = None,
        queue_depth: int | None = None,
        token_budget_bytes: int | None = None,
        experts_per_token: int | None = None,
        telemetry: str | os.PathLike[str] | None = None,
        history: str | os.PathLike[str] | None = None,
    ) -> ExpertStore:
        """Index ``source`` (a checkpoint folder or file, or a topology ``.toml`` naming one and
        its mirrors), open its files, return the store.

        ``backend`` is a backend's name, or a :class:`iosched.backends.Backend` object (for example a
        fault-injecting wrapper around a real backend); ``None`` takes the ``backend`` setting.

        ``mirrors`` are folders (or files) holding byte-identical copies of the checkpoint on
        other drives; ``routing`` sends whole reads to a replica by a weighted hash of the key
        (``"hash"``) or to the least busy drive (``"least_pending"``); ``weights`` (by the
        source's or a mirror's path) bias the hash; ``queue_depth`` caps reads in flight per
        drive (setting ``queue_depth``); ``token_budget_bytes`` caps the bytes prefetch may
        start between two ``token_boundary()`` calls (demand reads are never refused).

        ``budget_bytes`` is a positive integer or ``"auto"``: ``auto_start_cycles`` whole token
        cycles (``k × Σ largest expert per layer``, see ``iosched._sizing``), fewer if fewer fit
        in half of ``MemAvailable``, grown between turns (``end_turn()``, and after each full
        turnover of the budget) while the felt wait a larger budget would have saved exceeds
        the memory-stall time measured meanwhile (``iosched._growth``).  ``experts_per_token``
        (k) overrides the checkpoint's own value (``config.json`` / GGUF
        ``expert_used_count``); ``"auto"`` needs one or the other. An integer budget below one
        cycle logs a warning: LRU hits nothing below one cycle.

        ``telemetry`` names a file to write one JSON line per token to (the counters' deltas
        at each ``token_boundary()`` and at ``close()``; see ``docs/telemetry.md``).

        ``history`` names a usage-history file of the policy (``moe``/``default`` keep one,
        ``residency/_history.py``): read at open when it exists (the policy starts from what
        the last run learned, decayed by half, and pins the experts it routed at more than half
        of their layer's visits), written at ``close()``.

        Raises :class:`StoreError` subclasses naming the culprit: a missing or malformed
        file, a mirror that does not match, a bad budget, an unknown backend or policy.
        """
        auto = budget_bytes == "auto"
        if not auto and (isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int)
                         or budget_bytes <= 0):
            raise BudgetError(f'budget_bytes must be a positive integer or "auto", got {budget_bytes!r}')
        total = _sizing.mem_total()
        if isinstance(budget_bytes, int) and total is not None and budget_bytes > total:
            # An absurd budget: the store could never hold it, and a typo (GiB for MiB) should
            # not surface hours later as the OOM killer.
            raise BudgetError(f"budget_bytes={budget_bytes} is more than this machine's memory "
                              f"(MemTotal {total} bytes)")
        if experts_per_token is not None and (
                isinstance(experts_per_token, bool) or not isinstance(experts_per_token, int)
                or experts_per_token <= 0):
            raise BudgetError(f"experts_per_token must be a positive integer, got {experts_per_token!r}")
        stripe_threshold = int(_settings.get("stripe_threshold"))
        depths: dict[str, int] | None = None
        if is_topology_file(source):
            # A topology file (``iosched topology --write``) names the checkpoint, its mirrors,
            # the routing and each drive's weight and queue depth; explicit arguments win.
            if mirrors:
                raise StoreError(f"{source}: give mirrors in the topology file or as an argument, not both")
            topo = await asyncio.to_thread(load_topology, source)
            source, mirrors, routing = topo.primary, topo.mirrors, topo.routing_policy
            stripe_threshold = topo.stripe_threshold_bytes
            drives = await asyncio.to_thread(_drive_names, topo.paths)
            if weights is None:
                weights = {root: topo.device(name).weight for root, name in drives.items()}
            depths = {name: cfg.queue_depth for name, cfg in topo.devices.items()}
        if routing not in ROUTING_POLICIES:
            raise StoreError(f"unknown routing {routing!r}; choose one of {', '.join(ROUTING_POLICIES)}")
        depth = int(_settings.get("queue_depth")) if queue_depth is None else queue_depth
        if isinstance(depth, bool) or not isinstance(depth, int) or depth <= 0:
            raise StoreError(f"queue_depth must be a positive integer, got {queue_depth!r}")
        if token_budget_bytes is not None and (
                isinstance(token_budget_bytes, bool) or not isinstance(token_budget_bytes, int)
                or token_budget_bytes < 0):
            raise BudgetError(f"token_budget_bytes must be a non-negative integer, got {token_budget_bytes!r}")
        be: backends.Backend | None = None
        if backend is None or isinstance(backend, str):
            backend_name = backend or str(_settings.get("backend"))
            if backend_name != "auto":
                backends.resolve(backend_name)  # fail early, before the checkpoint is read
        else:  # a Backend object: fault injection and throttling wrap a real backend this way
            be, backend_name = backend, backend.name
        policy_name = policy or str(_settings.get("policy"))
        make_policy(policy_name)  # fail early, before any file is opened
        index = await asyncio.to_thread(load_index, source)
        if experts_per_token is not None:
            from dataclasses import replace  # the caller's k wins over the checkpoint's

            index = replace(index, experts_per_token=experts_per_token)
        k = index.experts_per_token
        if auto and k is None:
            raise BudgetError(
                f'budget_bytes="auto" needs k, the experts routed per token, and {index.root} does '
                "not say (no num_experts_per_tok in config.json, no expert_used_count in GGUF); "
                "pass experts_per_token=K to ExpertStore.open"
            )
        td = None if k is None else _sizing.token_cycle_bytes(index, k)
        if auto:
            assert k is not None
            available = await asyncio.to_thread(_sizing.mem_available)
            budget_bytes = _sizing.auto_budget(index, k, available,
                                               int(_settings.get("auto_start_cycles")))
            log.info("budget_bytes=\"auto\": %d bytes, %d token cycles of %d bytes (k=%d, "
                     "MemAvailable %d)", budget_bytes, budget_bytes // (td or 1), td, k, available)
        assert isinstance(budget_bytes, int)
        if td is not None and budget_bytes < td:
            log.warning(
                "budget_bytes=%d is below one token cycle (%d bytes = k=%d experts per token x "
                "the largest expert of each layer): LRU hits nothing below one cycle, every "
                "expert is evicted before the next token reuses it", budget_bytes, td, k,
            )
        reason: str | None = None
        if be is None:
            backend_name, reason = await asyncio.to_thread(backends.resolve, backend_name, index.files)
        largest = max(layout.nbytes for layout in index.experts.values())
        if largest > budget_bytes:
            log.warning(
                "budget_bytes=%d is smaller than the largest expert (%d bytes): acquiring it "
                "will raise BudgetError", budget_bytes, largest,
            )
        replicas = await asyncio.to_thread(find_replicas, index, mirrors)
        roots = [index.root] + [os.path.abspath(os.fspath(m)) for m in mirrors]
        known = set(roots)
        for root in (weights or {}):
            if os.path.abspath(root) not in known:
                raise StoreError(f"weights: {root} is neither the source nor a mirror")
        if be is None:
            be = backends.create(backend_name)
        await asyncio.to_thread(be.open, [path for paths in replicas for path in paths])
        io = ReadPath(be, replicas, roots, {os.path.abspath(k): v for k, v in (weights or {}).items()},
                      routing, depths if depths is not None and queue_depth is None else depth,
                      stripe_threshold)
        sink = None if telemetry is None else await asyncio.to_thread(TokenTelemetry, telemetry)
        growth = (None if not auto or k is None or td is None
                  else BudgetGrowth(td, budget_bytes, _sizing.whole_cycles(index, k)))
        store = cls(index, budget_bytes, io, reason, policy_name, token_budget_bytes, telemetry=sink,
                    growth=growth)
        if history is not None:
            await store._load_history(os.fspath(history))
        return store

    async def _load_history(self, path: str) -> None:
        policy = self._table.policy
        if not callable(getattr(policy, "load_history", None)):
            await self.close()
            raise StoreError(f"history={path}: the policy in use ({self._policy_name}"
                             f"{', fallen back to lru' if self._policy_fallback else ''}) keeps no usage history")
        self._history_path = path
        self._history_loaded = False
        if os.path.exists(path):
            try:
                arrays = await asyncio.to_thread(_history.load, path)
                policy.load_history(arrays, path)  # type: ignore[attr-defined]
            except StoreError:
                self._history_path = None  # never overwrite the file it could not read
                await self.close()
                raise
            self._history_loaded = True

    async def close(self) -> None:
        """Wait for loads in flight, free every buffer, close the files (and write the
        usage history, when ``history=`` named one).  Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._wake_room()
        while self._loads:
            await asyncio.gather(*list(self._loads), return_exceptions=True)
        if self._batch_end_at == self._requests:  # the last batch ended, the policy not yet told
            self._batch_end_at = None
            self._table.policy.end_batch()  # type: ignore[attr-defined]
        if self._history_path is not None and self._history_loaded is not None:
            arrays = self._table.policy.history()  # type: ignore[attr-defined]
            await asyncio.to_thread(_history.save, self._history_path, arrays)
        if self._telemetry is not None:
            self._telemetry.record(self, "close")
            self._telemetry.close()
        for closer in self._closers:
            closer()
        self._table.evict_all()
        self._pool.close()
        self._backend.close()

    async def __aenter__(self) -> ExpertStore:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ the public surface

    @property
    def index(self) -> CheckpointIndex:
        """Every expert's layout: keys, extents, tensor types and shapes."""
        return self._index

    def acquire(self, key: ExpertKey) -> Lease:
        """``async with store.acquire((layer, expert)) as view``; see :class:`Lease`."""
        return Lease(self, key)

    def acquire_many(self, keys: Iterable[ExpertKey]) -> LeaseGroup:
        """``async with store.acquire_many(keys) as views``: lease several experts at once,
        loading the missing ones concurrently; views come in the order of ``keys``."""
        return LeaseGroup(self, keys)

    def prefetch(self, keys: Iterable[ExpertKey]) -> int:
        """Start loads of the keys not resident nor loading, as far as the budget allows
        without evicting a leased, pinned or loading expert, nor one the policy values more
        (its eviction guard, ``admit_prefetch``).  Never blocks; returns how many loads it
        started.  Unknown keys raise before any load starts."""
        self._check_open()
        return len(self._prefetch([self._layout_of(key) for key in keys]))

    def _prefetch(self, layouts: list[ExpertLayout]) -> list[ExpertKey]:
        """:meth:`prefetch` of known layouts; returns the keys whose loads it started."""
        wanted: dict[ExpertKey, ExpertLayout] = {}
        planned = self._speculative_bytes
        for layout in layouts:
            if self._table.get(layout.key) is not None or layout.key in wanted:
                continue  # resident, or loading: a demand read got there first
            if self._token_budget is not None and planned + layout.nbytes > self._token_budget:
                self._prefetch_refused += 1
                self._prefetch_refused_bytes += layout.nbytes
                continue
            planned += layout.nbytes
            wanted[layout.key] = layout
        entries = self._table.reserve_speculative_many([(k, lay.nbytes) for k, lay in wanted.items()])
        started: list[ExpertKey] = []
        for layout, entry in zip(wanted.values(), entries, strict=True):
            if entry is None:  # no room without a leased/pinned/loading victim, or the
                self._prefetch_dropped += 1  # policy's eviction guard refused
                continue
            self._speculative_bytes += layout.nbytes
            self._start_load(entry, layout, PREFETCH)
            self._unused_prefetch[layout.key] = entry
            started.append(layout.key)
        self._prefetch_issued += len(started)
        return started

    def _batch_done(self) -> None:
        """An ``acquire_many`` holds all its leases: the engine computes on this layer now, so
        this is when the policy's predicted experts of the next layer are worth loading."""
        if self._prefetching and not self._closed:
            # All of the policy's batch-end work (learning, predicting, the reservations its
            # guard weighs, ranking the next batch's victims) runs at the engine's next await,
            # not before it gets this layer's views: together they cost a few hundred
            # microseconds per batch, and the engine should be computing meanwhile.
            self._batch_end_at = self._requests
            asyncio.get_running_loop().call_soon(self._policy_batch_end)

    def _policy_batch_end(self) -> None:
        if self._closed or self._batch_end_at != self._requests:
            return  # the next batch began first: the policy closed this one itself, and
            # prefetches for the layer now being requested would come too late
        self._batch_end_at = None
        if self._pacer is not None:
            self._pacer.interval_done()
        policy = self._table.policy
        wanted = policy.end_batch()  # type: ignore[attr-defined]
        if wanted:
            self._policy_prefetches += 1
            self._prefetch_proposed(wanted)
        if self._prepare is not None:
            self._prepare()

    def _prefetch_proposed(self, keys: list[ExpertKey]) -> None:
        if self._closed:
            return
        # (a key of the policy's shape that the checkpoint lacks is skipped)
        layouts = [self._layouts[key] for key in keys if key in self._layouts]
        pacer = self._pacer
        if pacer is None:
            self._prefetch(layouts)
            return
        # Only what the drives' idle time can absorb (iosched/_pacing.py); what the guard then
        # refuses read nothing and goes back to the allowance.
        charged: list[ExpertLayout] = []
        for layout in layouts:
            if self._table.get(layout.key) is not None:
                continue  # resident or loading: costs nothing, and prefetch skips it
            if not pacer.take(layout.nbytes):
                break
            charged.append(layout)
        started = set(self._prefetch(charged))
        for layout in charged:
            if layout.key not in started:
                pacer.refund(layout.nbytes)

    def hint(self, keys: Iterable[ExpertKey]) -> int:
        """Ask the kernel to start reading experts into the page cache (``posix_fadvise``
        WILLNEED), behind every demand and prefetch read of their drive.  A hint owns nothing:
        no budget, no lease, no slab; it helps the buffered backends (``pread``, and ``mmap``'s
        pre-touch) and is skipped by the O_DIRECT ones, which never read the page cache.  Never
        blocks; returns how many hints it queued.  Unknown keys raise before any is queued."""
        self._check_open()
        layouts = [self._layout_of(key) for key in keys]
        if self._backend.caps & backends.Caps.DIRECT:
            self._hints_skipped += len(layouts)
            return 0
        loop = asyncio.get_running_loop()
        queued = 0
        for layout in layouts:
            if self._table.get(layout.key) is not None:
                continue
            for ext in layout.extents:
                task = loop.create_task(self._io.hint(layout.key, ext.file, ext.offset, ext.length))
                self._loads.add(task)  # close() waits for it like a load
                task.add_done_callback(self._loads.discard)
                queued += 1
        return queued

    def observe_routing(self, layer: int, experts: Any) -> None:
        """The router's output for one MoE ``layer`` of a batch of tokens: ``experts`` is
        ``[tokens, k]`` expert ids (row ``t``: token ``t``'s picks in slot order, -1 for an
        empty slot), or ``[k]`` for one token.  Call it for a prompt's layers, before or
        after that layer's ``acquire_many``: the request keys only say *which* experts the
        batch needs, the rows say which go together, and the default policy learns its
        next-layer prediction from them (``residency/moe.py``).  Synchronous and cheap (the
        learning is deferred to the policy's batch-end work); a policy without use for it
        (``lru``) ignores it.  Bad input raises a ``StoreError`` naming the layer or expert,
        and nothing is recorded."""
        self._check_open()
        rows = _routing.routing_rows(self._index, layer, experts)
        self._routing_rows += int(rows.shape[0])
        on_routing = getattr(self._table.policy, "on_routing", None)
        if callable(on_routing):
            on_routing(int(layer), rows)

    def end_turn(self) -> int:
        """Marks the end of a turn (a request served): with ``budget="auto"`` the budget grows
        here by the whole token cycles whose measured benefit exceeds their measured cost
        (``iosched/_growth.py``).  Returns the budget in bytes (unchanged for an integer one)."""
        self._check_open()
        self._grow("end_turn")
        return self._table.budget_bytes

    def _grow(self, reason: str) -> None:
        self._growth_due = False
        growth = self._growth
        if growth is None or self._closed:
            return
        try:
            available = _sizing.mem_available()
        except BudgetError as exc:  # /proc/meminfo went away: keep the budget
            log.warning("budget growth skipped: %s", exc)
            return
        decision = growth.decide(reason, self._table.budget_bytes,
                                 self._table.used_bytes + self._pool.idle_bytes, available,
                                 _sizing.AUTO_FRACTION)
        if decision.added_cycles:
            self._table.grow(decision.budget_after)
            log.info("budget grew by %d token cycles to %d bytes (%s; felt wait per cycle %s s, "
                     "memory stall %s s)", decision.added_cycles, decision.budget_after, reason,
                     decision.benefit_s[:decision.added_cycles], decision.cost_s)
            self._wake_room()

    def token_boundary(self) -> None:
        """Marks the start of the next token: the per-token prefetch byte budget starts over,
        and the telemetry file (if any) gets the line of the interval that ends here."""
        self._tokens += 1
        self._speculative_bytes = 0
        if self._telemetry is not None:
            self._telemetry.record(self)

    def statistics(self) -> StoreStats:
        entries = self._table.entries()
        loop_name = "none"
        try:
            loop_name = "uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop") else "asyncio"
        except RuntimeError:
            pass
        return StoreStats(
            requests=self._requests,
            hits=self._hits,
            misses=self._misses,
            single_flight_joins=self._joins,
            bytes_read=self._io.bytes_read,
            resident_bytes=self._table.used_bytes,
            budget_bytes=self._table.budget_bytes,
            leased=sum(1 for e in entries if e.leases),
            loading=sum(1 for e in entries if e.state is EntryState.LOADING),
            admissions=self._table.admissions,
            rejections=self._table.rejections,
            evictions=self._table.evictions,
            felt_wait_s=self._felt_wait_s,
            service_s=self._service_s,
            per_device={name: asdict(d) for name, d in self._io.devices.items()},
            resident_experts=sum(1 for e in entries if e.state is EntryState.RESIDENT),
            load_errors=self._load_errors,
            prefetch_issued=self._prefetch_issued,
            prefetch_dropped=self._prefetch_dropped,
            prefetch_used=self._prefetch_used,
            prefetch_wasted=self._prefetch_wasted,
            prefetch_failed=self._prefetch_failed,
            prefetch_unused=len(self._unused_prefetch),
            hits_by_tier={"resident": self._hits, "page_cache": self._page_cache_misses,
                          "drive": self._physical_misses},
            physical_misses=self._physical_misses,
            migration_bytes=self._io.migration_bytes,
            tokens=self._tokens,
            idle_slab_bytes=self._pool.idle_bytes,
            backend=self._backend.name,
            backend_reason=self._backend_reason,
            backend_info=self._backend.info(),
            policy=self._policy_name,
            loop=loop_name,
            extra={
                **{k: v for k, v in self._io.stats().items() if k != "per_device"},
                "prefetch_refused": self._prefetch_refused,
                "prefetch_refused_bytes": self._prefetch_refused_bytes,
                "prefetch_promoted": self._prefetch_promoted,
                "hints_skipped": self._hints_skipped,
                "routing_rows": self._routing_rows,
                "token_budget_bytes": self._token_budget,
                "policy_fallback": self._policy_fallback,
                "history": self._history_path,
                "history_loaded": bool(self._history_loaded),
                "pinned_experts": getattr(self._table.policy, "pinned_experts", 0),
                "policy_prefetch_batches": self._policy_prefetches,
                "prefetch_paced_bytes": None if self._pacer is None else self._pacer.granted_bytes,
                "prefetch_paced_refusals": None if self._pacer is None else self._pacer.refused,
                "prefetch_guard_refusals": self._table.refused_prefetches,
                "budget_growth": None if self._growth is None else self._growth.stats(),
                **_sizing.cycle_stats(self._index, self._table.budget_bytes),
            },
        )

    def stats(self) -> dict[str, Any]:
        """The contract's statistics dict (see ``StoreStats``).  A shallow conversion: every
        nested dict is built afresh by ``statistics()``, and engines may call this per token."""
        snapshot = self.statistics()
        out = {f.name: getattr(snapshot, f.name) for f in fields(snapshot) if f.name != "extra"}
        out.update(snapshot.extra)
        return out

    def check_invariants(self) -> None:
        """Re-check the table's invariants and the pool's headroom; ``AssertionError`` if broken."""
        self._table.check()
        if self._pool.idle_bytes > max(0, self._table.budget_bytes - self._table.used_bytes):
            raise AssertionError("idle slabs exceed the budget's headroom")

    # ------------------------------------------------------------------ internals

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed(f"the store over {self._index.root} is closed")

    def _layout_of(self, key: ExpertKey) -> ExpertLayout:
        try:
            layout = self._layouts.get(key)
        except TypeError:
            raise UnknownExpertError(
                f"expert key must be a (layer, expert) tuple of ints, got {key!r}"
            ) from None
        if layout is None:
            if not (isinstance(key, tuple) and len(key) == 2
                    and all(isinstance(k, int) and not isinstance(k, bool) for k in key)):
                raise UnknownExpertError(
                    f"expert key must be a (layer, expert) tuple of ints, got {key!r}"
                )
            raise UnknownExpertError(
                f"no expert {key!r} in {self._index.root} "
                f"(layers {self._index.layers()[0]}..{self._index.layers()[-1]})"
            )
        return layout

    def _try_hit(self, layout: ExpertLayout) -> Entry | None:
        """The hit path: lease a resident expert without awaiting; ``None`` if not resident."""
        entry = self._table.get(layout.key)
        if entry is None or entry.state is not EntryState.RESIDENT or self._closed:
            return None
        self._requests += 1
        self._hits += 1
        self._table.policy.on_request(layout.key, layout.nbytes, True)
        entry.leases += 1
        if self._unused_prefetch:
            self._lease_taken(entry)
        return entry

    async def _enter_slow(self, layout: ExpertLayout) -> Entry:
        """Acquire when the expert is not resident (or the store is closed)."""
        self._check_open()
        started = time.perf_counter()
        if self._waiting == 0:
            self._wait_since = started
        self._waiting += 1
        concurrent = self._waiting  # the acquires this one's wait is shared with, so far
        table = self._table
        key = layout.key
        entry = table.get(key)
        self._requests += 1
        table.policy.on_request(key, layout.nbytes, entry is not None)
        band: int | None = None
        if entry is None:
            self._misses += 1
            if self._growth is not None:
                band = self._growth.missed(key)
        else:
            self._joins += 1
        try:
            while True:
                entry = table.get(key)
                if entry is None:
                    entry = table.reserve(key, layout.nbytes)
                    if entry is None:
                        await self._wait_room()
                        self._check_open()
                        continue
                    self._start_load(entry, layout)
                if entry.state is EntryState.RESIDENT:
                    entry.leases += 1
                    self._lease_taken(entry)
                    return entry
                ticket = self._tickets.get(key)
                if ticket is not None and ticket.priority != DEMAND:
                    ticket.promote()  # a demand joined a prefetch: its reads jump the queue
                    self._prefetch_promoted += 1
                entry.pins += 1
                try:
                    await asyncio.shield(entry.future)
                finally:
                    entry.pins -= 1
                # The load published the entry (a failed load raised above); the pin kept it
                # from eviction until this line turns it into a lease.
                entry.leases += 1
                self._lease_taken(entry)
                return entry
        except BaseException:
            if entry is not None:
                self._after_unpin(entry)
            raise
        finally:
            self._waiting -= 1
            now = time.perf_counter()
            if self._waiting == 0:
                self._felt_wait_s += now - self._wait_since
            if self._on_wait is not None:
                self._on_wait(key, now - started)  # the miss cost the policy weighs
            if band is not None and self._growth is not None:
                self._growth.credit(band, (now - started) / concurrent)

    def _lease_taken(self, entry: Entry) -> None:
        """The first lease of an entry a prefetch loaded: the prefetch was used."""
        if self._unused_prefetch.get(entry.key) is entry:
            del self._unused_prefetch[entry.key]
            self._prefetch_used += 1

    def _left_table(self, entry: Entry, failed: bool = False) -> None:
        """``entry`` left the table: if a prefetch loaded it and nobody leased it, the prefetch
        was wasted (or failed).  Entries still unused when the store closes are neither."""
        if self._unused_prefetch.get(entry.key) is entry:
            del self._unused_prefetch[entry.key]
            if failed:
                self._prefetch_failed += 1
            elif not self._closed:
                self._prefetch_wasted += 1

    def _release(self, entry: Entry) -> None:
        entry.leases -= 1
        if entry.leases == 0:
            self._after_unpin(entry)

    def _after_unpin(self, entry: Entry) -> None:
        """A lease or pin ended: drop a finished transient entry, wake waiters for room."""
        if (entry.transient and entry.state is EntryState.RESIDENT and entry.leases == 0
                and entry.pins == 0 and self._table.get(entry.key) is entry):
            self._table.remove(entry)
            self._left_table(entry)  # a prefetch the policy did not admit, unjoined: wasted
            self._free_payload(entry)
        if self._room_waiters:
            self._wake_room()

    async def _wait_room(self) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._room_waiters.append(fut)
        try:
            await fut
        finally:
            # A cancelled waiter's future is done (cancelled) but still listed: drop it now
            # rather than at the next wake-up.
            if fut in self._room_waiters:
                self._room_waiters.remove(fut)

    def _wake_room(self) -> None:
        waiters, self._room_waiters = self._room_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def _start_load(self, entry: Entry, layout: ExpertLayout, priority: int = DEMAND) -> None:
        self._tickets[layout.key] = Ticket(priority)
        loop = asyncio.get_running_loop()
        entry.future = loop.create_future()
        plan: ReadPlan | None = None
        slab: Slab | None = None
        if self._zero_copy is None or len(layout.extents) != 1:
            # The slab is taken in the same step as the reservation, so the idle pool never
            # holds more than the budget's headroom, not even until the load task starts: the
            # slab an eviction just returned is usually the one taken here.
            plan = plan_reads(layout, self._io.alignment)
            slab = self._pool.take(plan.capacity)
            self._pool.trim(self._headroom())
        task = loop.create_task(self._load(entry, layout, plan, slab))
        self._loads.add(task)
        task.add_done_callback(self._loads.discard)

    def _headroom(self) -> int:
        return max(0, self._table.budget_bytes - self._table.used_bytes)

    async def _load(self, entry: Entry, layout: ExpertLayout, plan: ReadPlan | None,
                    slab: Slab | None) -> None:
        """Read (into ``slab`` by ``plan``) or map the expert, then publish it."""
        t0 = time.perf_counter()
        ticket = self._tickets[layout.key]
        mapped: tuple[int, int, int] | None = None
        try:
            if plan is None or slab is None:
                ext = layout.extents[0]
                view_bytes, backend_file, cached = await self._io.map(
                    layout.key, ext.file, ext.offset, ext.length, ticket)
                mapped = (backend_file, ext.offset, ext.length)
                view = ExpertView.over(layout, view_bytes)
            else:
                cached = await self._read_plan(layout, plan, slab, ticket)
                data = memoryview(slab.mm)[plan.data_start:plan.data_start + layout.nbytes]
                view = ExpertView.over(layout, data)
        except BaseException as exc:
            del self._tickets[layout.key]
            self._load_errors += 1
            self._table.remove(entry)
            self._left_table(entry, failed=True)
            if slab is not None:
                self._pool.give(slab, self._headroom())
            if mapped is not None and self._zero_copy is not None:
                self._zero_copy.unmap(*mapped)
            if isinstance(exc, StoreError):
                error: StoreError = exc
            elif isinstance(exc, asyncio.CancelledError):
                error = StoreClosed(f"load of expert {layout.key!r} was cancelled")
            else:
                error = ReadError(f"load of expert {layout.key!r} failed: {exc!r}")
                error.__cause__ = exc
            entry.future.set_exception(error)
            entry.future.exception()  # retrieved: waiters, if any, re-raise it
            self._wake_room()
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        del self._tickets[layout.key]
        self._service_s += time.perf_counter() - t0
        if not ticket.prefetch:
            if cached:
                self._page_cache_misses += 1
            else:
                self._physical_misses += 1
        entry.payload = _Loaded(slab, view, mapped)
        self._table.publish(entry)
        entry.future.set_result(None)
        self._after_unpin(entry)

    async def _read_plan(self, layout: ExpertLayout, plan: ReadPlan, slab: Slab, ticket: Ticket) -> bool:
        """Read every span into ``slab``; ``True`` when the page cache served all of them."""
        buf = memoryview(slab.mm)
        spans = plan.spans
        if len(spans) == 1:
            span = spans[0]
            _, cached = await self._io.read_span(
                layout.key, span, buf[span.slab_pos:span.slab_pos + span.length], ticket)
            return cached
        jobs = [self._io.read_span(layout.key, s, buf[s.slab_pos:s.slab_pos + s.length], ticket)
                for s in spans]
        # Every span finishes (or fails) before the slab can be recycled.
        results = await asyncio.gather(*jobs, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        pack(plan, slab.mm)
        return all(r[1] for r in results if isinstance(r, tuple))

    def _on_evict(self, entry: Entry) -> None:
        self._left_table(entry)
        self._free_payload(entry)
        growth = self._growth
        if growth is not None and growth.evicted(entry.key, entry.nbytes) and not self._growth_due:
            self._growth_due = True  # the budget turned over: decide at the next await
            asyncio.get_running_loop().call_soon(self._grow, "turnover")

    def _free_payload(self, entry: Entry) -> None:
        loaded: _Loaded | None = entry.payload
        entry.payload = None
        if loaded is None:
            return
        slab, mapped = loaded.slab, loaded.mapped
        del loaded  # drop the views first, so the pool may unmap the slab
        if slab is not None:
            self._pool.give(slab, self._headroom())
        if mapped is not None and self._zero_copy is not None:
            self._zero_copy.unmap(*mapped)
