"""``ExpertStore``: what an engine awaits.

The store is a facade over parts of its own, each a module (``docs/design.md`` tells the
data path in prose):

* ``_open``: ``open()``'s arguments checked, the index read, the budget sized, the backend
  opened behind the read path (``_io``);
* ``_acquire``: the hit path, the wait for a load or for room, releases (what a lease asks);
* ``_felt``: the engine's felt wait, which the acquires make up and the prefetcher reads;
* ``_loads``: reading a reserved expert into a slab, publishing it, freeing it;
* ``_prefetch``: the engine's and the policy's prefetches, and the ledger of their outcome;
* ``_autogrow`` and ``_usage``: ``budget_bytes="auto"``'s growth, the policy's history file;
* ``_snapshot``: the frozen statistics.

The residency table (``iosched.residency``) owns bytes, leases and pins; the policy it binds
decides admission and eviction order.  Every part shares the store's :class:`Lifecycle` (open
or closed) and :class:`Room` (acquires waiting for bytes).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from iosched import _settings, backends
from iosched._errors import InvariantError, StoreError
from iosched._layout import CheckpointIndex, ExpertKey
from iosched.residency import Capability, Entry, ModelShape, Policy, ResidencyTable, make_policy

from . import _clock, _routing, _sizing
from ._acquire import Acquirer
from ._autogrow import AutoGrow
from ._felt import FeltWait
from ._lease import ArrivalGroup, Lease, LeaseGroup
from ._loads import Loader
from ._open import OpenArgs, StoreParts, assemble
from ._pacing import IdlePacer
from ._prefetch import Prefetcher, PrefetchLedger
from ._room import Lifecycle, Room
from ._scheduler import PREFETCH
from ._snapshot import Described, snapshot
from ._stats import RequestCounts, RequestTally, StoreStats, as_dict
from ._usage import UsageHistory

log = logging.getLogger("iosched")

_running_loop = asyncio._get_running_loop
"""The running loop of this thread, ``None`` (not an exception) when none runs."""
_thread_ident = threading.get_ident
"""This thread's identity: what the hit path compares (35 ns; the running loop costs 180 ns,
measured on the development VM, where asyncio's lookup checks the process id)."""


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


def _build_policy(name: str, index: CheckpointIndex) -> tuple[Policy, ModelShape | None, str | None]:
    """The policy ``name`` names, the shape it is given, and why another was used instead
    (``None`` when none was): ``default`` falls back to ``lru`` when the checkpoint does not
    say k, an explicit structure-aware policy is refused."""
    width = _settings.get("prefetch_width")
    policy = make_policy(name)
    if width != "k" and Capability.BATCHES in policy.capabilities:
        policy = make_policy(name, prefetch_width=width)
    if Capability.SHAPE not in policy.capabilities:
        return policy, None, None
    shape = _model_shape(index)
    if shape is None:
        why = (f"policy {name!r} needs k, the experts routed per token, and {index.root} does not "
               "say (no num_experts_per_tok in config.json, no expert_used_count in GGUF)")
        if name != "default":
            raise StoreError(why + "; pass experts_per_token=K to ExpertStore.open")
        log.warning("%s: using lru", why)
        return make_policy("lru"), None, why + ": lru used instead"
    return policy, shape, None


def _transient_bytes(policy: Policy, index: CheckpointIndex, budget_bytes: int) -> int:
    """The bounded slot that serves demand misses a policy does not admit: none for a policy
    that admits everything; else one layer's batch of the largest experts (k of them, k from
    the checkpoint, 1 when unknown), at most half the budget.  The same rule as the replay's
    (``iosched.tools.replay.transient_bytes_for``), so simulated and real runs size it alike."""
    if Capability.REJECTS not in policy.capabilities:
        return 0
    largest = max(layout.nbytes for layout in index.experts.values())
    return min((index.experts_per_token or 1) * largest, budget_bytes // 2)


class ExpertStore:
    """Streams experts of a checkpoint under a strict byte budget.  Create with :meth:`open`."""

    def __init__(self, parts: StoreParts) -> None:
        index, io = parts.index, parts.io
        self._index, self._io = index, io
        policy, shape, fallback = _build_policy(parts.policy_name, index)
        k = index.experts_per_token
        self._described = Described(parts.backend_reason, parts.policy_name, fallback, parts.verification,
                                    None if k is None else _sizing.token_cycle_bytes(index, k))
        self._table = table = ResidencyTable(
            parts.budget_bytes, policy, transient_bytes=_transient_bytes(policy, index, parts.budget_bytes),
            shape=shape)
        if table.hooks.costed is not None:  # a policy that weighs its own CPU reads our clock
            table.hooks.costed.set_clock(_clock.now)
        self._lifecycle = lifecycle = Lifecycle(index.root)
        self._room = Room()
        self._layer_sizes: dict[int, int] | None = None
        """Experts per layer for ``expect``, built at its first call."""
        self._ledger = PrefetchLedger(lifecycle)
        self._loader = loader = Loader(table, io, self._ledger, self._room)
        counts = RequestCounts()
        self._felt = felt = FeltWait(loader.undelivered)
        pacing = _settings.get("prefetch_pacing") == "idle"  # the policy's proposals, the engine's expect
        self._prefetcher = Prefetcher(
            table, index.experts, lambda entry, layout: loader.start(entry, layout, PREFETCH), self._ledger,
            counts, lifecycle, felt, token_budget_bytes=parts.token_budget_bytes,
            pacer=IdlePacer(io.drive_usage) if pacing else None)
        self._growth = (None if parts.growth is None
                        else AutoGrow(parts.growth, table, loader.pool, self._room, lifecycle))
        self._acquirer = Acquirer(index, table, loader, self._prefetcher, self._ledger, self._room, lifecycle,
                                  counts, self._growth, felt, owner=self._check_loop)
        if table.hooks.set_felt_wait is not None:  # a policy that weighs its own CPU against the felt wait
            prefetcher = self._prefetcher  # (less its own work inside it)
            table.hooks.set_felt_wait(lambda: felt.felt_so_far() - prefetcher.work_in_felt_s)
        table.set_on_evict(self._on_evict)
        self._telemetry = parts.telemetry
        self._usage: UsageHistory | None = None
        self._closers: list[Callable[[], None]] = []
        self._closing: asyncio.Future[None] | None = None
        self._loop = asyncio.get_running_loop()
        """The loop the store was opened on, and the only one it serves (``_check_loop``)."""
        self._thread, self._thread_name = threading.get_ident(), threading.current_thread().name
        self._routing_rows = 0
        """Token rows of router output observed (``observe_routing``)."""
        self._tokens = 0

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
        verify: str | None = None,
        manifest: str | os.PathLike[str] | None = None,
        verify_mirrors: int | None = None,
    ) -> ExpertStore:
        """Index ``source`` (a checkpoint folder or file, or a topology ``.toml`` naming one and
        its mirrors), open its files, return the store.

        ``backend``: a backend's name, or a :class:`iosched.backends.Backend` object (a
        fault-injecting wrapper around a real backend, say); ``None`` takes the setting.
        ``mirrors``: folders (or files) holding byte-identical copies on other drives;
        ``routing`` sends whole reads to a replica by a weighted hash of the key (``"hash"``,
        ``weights`` by the source's or a mirror's path) or to the least busy drive
        (``"least_pending"``); ``queue_depth`` caps reads in flight per drive;
        ``token_budget_bytes`` caps the bytes prefetch may start between two
        ``token_boundary()`` calls (demand reads are never refused).

        ``budget_bytes``: a positive integer, or ``"auto"``: ``auto_start_cycles`` whole token
        cycles (``k × Σ largest expert per layer``), fewer if fewer fit in half of
        ``MemAvailable``, grown between turns while the felt wait a larger budget would have
        saved exceeds the memory-stall time measured meanwhile (``iosched/runtime/_growth.py``).
        ``experts_per_token`` (k) overrides the checkpoint's own (``config.json``, GGUF
        ``expert_used_count``); ``"auto"`` needs one or the other.

        ``telemetry``: a file for one JSON line per token (``docs/telemetry.md``).
        ``history``: the policy's usage-history file (``moe``/``default`` keep one): read at
        open when it exists, written at ``close()``.

        ``verify="reads"`` checks every extent read against the ``manifest`` (``iosched
        manifest``; a mismatch fails over, on the last replica a :class:`ChecksumError`);
        ``verify_mirrors`` samples that many experts of every mirror at open
        (``iosched/formats/_verify.py``).  Every argument: ``docs/contract.md``.

        Raises :class:`StoreError` subclasses naming the culprit: a missing or malformed
        file, a mirror that does not match, a bad budget, an unknown backend or policy.
        """
        parts = await assemble(OpenArgs(
            source, budget_bytes, backend, policy, mirrors, routing=routing, weights=weights,
            queue_depth=queue_depth, token_budget_bytes=token_budget_bytes,
            experts_per_token=experts_per_token, telemetry=telemetry, history=history, verify=verify,
            manifest=manifest, verify_mirrors=verify_mirrors))
        try:
            store = cls(parts)
        except BaseException:  # a policy that needs k, say: close what assemble opened
            parts.discard()
            raise
        if parts.history is not None:
            try:
                fallback = ", fallen back to lru" if store._described.policy_fallback else ""
                store._usage = await UsageHistory.open(store._table.hooks.history, parts.history,
                                                       store._described.policy + fallback)
            except BaseException:
                await store.close(discard_telemetry=True)
                raise
        return store

    async def close(self, *, discard_telemetry: bool = False) -> None:
        """Wait for loads in flight, free every buffer, close the files (and write the
        usage history, when ``history=`` named one).  Idempotent, and it finishes even when
        the task awaiting it is cancelled (the closing goes on, shielded).  A history that
        cannot be written is reported (raised, to the first caller) after everything else
        was closed."""
        self._check_loop()
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._close(discard_telemetry))
            await asyncio.shield(self._closing)
            return
        with contextlib.suppress(Exception):  # reported to the first caller already
            await asyncio.shield(self._closing)

    async def _close(self, discard_telemetry: bool) -> None:
        self._lifecycle.closed = True
        self._room.wake_all()
        await self._loader.drain()
        self._prefetcher.close_last_batch()
        failure: BaseException | None = None
        try:
            if self._usage is not None:
                await self._usage.save()
        except Exception as exc:  # reported once the rest is closed
            failure = exc
        if self._telemetry is not None:
            if discard_telemetry:  # the store never opened for the user: no file of this run
                self._telemetry.discard()
            else:
                self._telemetry.record(self.stats(), "close")
                self._telemetry.close()
        for closer in self._closers:
            closer()
        self._table.evict_all()
        self._loader.pool.close()
        self._io.backend.close()
        if failure is not None:
            raise failure

    async def __aenter__(self) -> ExpertStore:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def on_close(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` when the store closes, once its loads have ended (the Prometheus
        exporter stops its server so)."""
        self._closers.append(callback)

    # ------------------------------------------------------------------ the public surface

    @property
    def index(self) -> CheckpointIndex:
        """Every expert's layout: keys, extents, tensor types and shapes."""
        return self._index

    @property
    def resident_bytes(self) -> int:
        """Bytes reserved now, by resident and loading experts (``stats()``'s gauge, cheap)."""
        return self._table.used_bytes

    @property
    def budget_bytes(self) -> int:
        """The byte budget now (it grows under ``budget_bytes="auto"``)."""
        return self._table.budget_bytes

    @property
    def request_tally(self) -> RequestTally:
        """How acquires were served so far, without building the whole :meth:`statistics`."""
        return self._acquirer.counts.snapshot(self._felt.felt_wait_s)

    def acquire(self, key: ExpertKey) -> Lease:
        """``async with store.acquire((layer, expert)) as view``; see :class:`Lease`."""
        if _thread_ident() != self._thread:  # the hit path's check (see _check_loop)
            self._check_loop()
        return Lease(self._acquirer, key)

    def acquire_many(self, keys: Iterable[ExpertKey]) -> LeaseGroup:
        """``async with store.acquire_many(keys) as views``: lease several experts at once,
        loading the missing ones concurrently; views come in the order of ``keys``.  Awaited
        whole, their reads go to the drives together (``queue_depth``), not one expert after
        another as an ``acquire_as_ready`` group's do (``inflight_bytes``)."""
        if _thread_ident() != self._thread:
            self._check_loop()
        return LeaseGroup(self._acquirer, keys)

    def acquire_as_ready(self, keys: Iterable[ExpertKey]) -> ArrivalGroup:
        """``async with store.acquire_as_ready(keys) as arrivals``, then ``async for views in
        arrivals``: lease several experts at once, as ``acquire_many`` does, but hand them over
        as they become resident: first every one resident now, then each batch of loads that
        finished, so the engine computes on those at hand while the others load.  Every view
        stays leased until the group exits; ``view.key`` says which expert it holds.  A failed
        acquire raises (a ``StoreError`` naming the expert) after the batch that held the
        others; exiting early gives up the loads not handed over (they go on for whoever else
        waits).  The felt wait counts only the awaits of the iteration.  The loads' reads go to
        each drive one expert after another (the ``inflight_bytes`` setting), so that the first
        lands early instead of all of them late (iosched/runtime/_scheduler.py)."""
        if _thread_ident() != self._thread:
            self._check_loop()
        return ArrivalGroup(self._acquirer, keys)

    def prefetch(self, keys: Iterable[ExpertKey]) -> int:
        """Start loads of the keys not resident nor loading, as far as the budget allows
        without evicting a leased, pinned or loading expert, nor one the policy values more
        (its eviction guard, ``admit_prefetch``).  Never blocks; returns how many loads it
        started.  Unknown keys raise before any load starts."""
        self._check_loop()
        self._lifecycle.check_open()
        return len(self._prefetcher.issue([self._acquirer.layout_of(key) for key in keys]))

    def hint(self, keys: Iterable[ExpertKey]) -> int:
        """Ask the kernel to start reading experts into the page cache (``posix_fadvise``
        WILLNEED), behind every demand and prefetch read of their drive.  A hint owns nothing:
        no budget, no lease, no slab; it helps the buffered backends (``pread``, and ``mmap``'s
        pre-touch) and is skipped by the O_DIRECT ones, which never read the page cache.  Never
        blocks; returns how many hints it queued.  Unknown keys raise before any is queued."""
        self._check_loop()
        self._lifecycle.check_open()
        return self._loader.hint([self._acquirer.layout_of(key) for key in keys])

    def observe_routing(self, layer: int, experts: Any) -> None:
        """The router's output for one MoE ``layer`` of a batch of tokens: ``experts`` is
        ``[tokens, k]`` expert ids (row ``t``: token ``t``'s picks in slot order, -1 for an
        empty slot), or ``[k]`` for one token.  Call it for a prompt's layers, before or
        after that layer's ``acquire_many``: the request keys only say *which* experts the
        batch needs, the rows say which go together, and the default policy learns its
        next-layer prediction from them (``residency/alternatives/moe.py``).  Synchronous and cheap (the
        learning is deferred to the policy's batch-end work); a policy without use for it
        (``lru``) ignores it.  Bad input raises a ``StoreError`` naming the layer or expert,
        and nothing is recorded."""
        self._check_loop()
        self._lifecycle.check_open()
        rows = _routing.routing_rows(self._index, layer, experts)
        self._routing_rows += int(rows.shape[0])
        on_routing = self._table.hooks.on_routing
        if on_routing is not None:
            on_routing(int(layer), rows)

    def expect(self, layer: int, probabilities: Any) -> int:
        """The engine's own lookahead: ``probabilities[e]`` is its estimate that expert ``e``
        of MoE ``layer`` is routed at that layer's next batch (an engine can apply the next
        layer's router to the current hidden state: Colibri measured 71.6-73.6 % recall of
        the true top-8 that way).  Call it as soon as it is known, before computing the
        current layer, so the drive reads while the engine computes.

        The store starts loads of the experts of at least ``lookahead_min_probability``
        (a setting), likeliest first, as it issues its policy's prefetches: within the bytes
        the drive's idle time can absorb (``prefetch_pacing``), the per-token byte budget,
        and only displacing what the policy values less (its eviction guard); a policy with
        ``Capability.LOOKAHEAD`` (``default``) also weighs the estimate with its own
        prediction.  Never blocks; returns how many loads it started.  Bad input (an unknown
        layer, a wrong length, a value outside [0, 1]) raises a ``StoreError`` naming it,
        and nothing is recorded."""
        self._check_loop()
        self._lifecycle.check_open()
        if self._layer_sizes is None:
            self._layer_sizes = _routing.layer_sizes(self._index)
        probs = _routing.expectation(self._index, self._layer_sizes, layer, probabilities)
        on_expect = self._table.hooks.on_expect
        if on_expect is not None:
            on_expect(int(layer), probs)
        minimum = float(_settings.get("lookahead_min_probability"))
        return len(self._prefetcher.expect(int(layer), probs, minimum))

    def end_turn(self) -> int:
        """Marks the end of a turn (a request served): with ``budget="auto"`` the budget grows
        here by the whole token cycles whose measured benefit exceeds their measured cost
        (``iosched/runtime/_growth.py``).  Returns the budget in bytes (unchanged for an integer one)."""
        self._check_loop()
        self._lifecycle.check_open()
        if self._growth is not None:
            self._growth.grow("end_turn")
        return self._table.budget_bytes

    def token_boundary(self) -> None:
        """Marks the start of the next token: the per-token prefetch byte budget starts over,
        and the telemetry file (if any) gets the line of the interval that ends here."""
        self._check_loop()
        self._tokens += 1
        self._prefetcher.token_boundary()
        if self._telemetry is not None:
            self._telemetry.record(self.stats())

    async def settle(self) -> None:
        """Wait until nothing this store started is still running: the policy's batch-end
        work scheduled for the engine's next await runs (and issues what it proposes), then
        every load (demand or prefetch) and hint in flight finishes.  Leases are untouched.

        For whoever hands the drive to other work between tokens: a benchmark that plays
        several stores in turn on one drive (``iosched replay --paired``), where a read still
        in flight would land in the next store's time, or an engine pausing to measure."""
        self._check_loop()
        self._lifecycle.check_open()
        await asyncio.sleep(0)  # the batch-end work is a call_soon callback (iosched/runtime/_prefetch.py)
        await self._loader.drain()

    def statistics(self) -> StoreStats:
        """Every counter of the store now, as one deeply frozen record.  From the store's own
        thread it first takes back the retired slabs whose last view died (so ``retired_*``
        are current); from another thread (a metrics exporter) it only reads."""
        if _thread_ident() == self._thread:
            self._loader.reclaim()
        return snapshot(index=self._index, table=self._table, io=self._io, acquirer=self._acquirer,
                        felt=self._felt, loader=self._loader, prefetcher=self._prefetcher, ledger=self._ledger,
                        growth=self._growth, usage=self._usage, described=self._described,
                        routing_rows=self._routing_rows, tokens=self._tokens)

    def stats(self) -> dict[str, Any]:
        """The contract's statistics dict: :meth:`statistics` as plain dicts and lists (a
        fresh object each call; engines may call it per token)."""
        return as_dict(self.statistics())

    def check_invariants(self) -> None:
        """Re-check the table's invariants, the pool's headroom, that no idle slab is still
        exported (a view of it referenced), and the retired slabs' counts;
        :class:`InvariantError` (an ``AssertionError``) if one is broken."""
        self._table.check()
        pool = self._loader.pool
        if pool.idle_bytes > self._loader.headroom():
            raise InvariantError("idle slabs exceed the budget's headroom")
        exported = pool.idle_exported()
        if exported:
            raise InvariantError(f"{exported} idle slab(s) still exported: a view would show another expert's bytes")
        retired = pool.retired
        if retired.slabs != retired.released + len(retired) or retired.bytes < 0:
            raise InvariantError(f"retired slabs miscounted: {retired.slabs} retired, {retired.released} "
                                 f"released, {len(retired)} held ({retired.bytes} bytes)")

    # ------------------------------------------------------------------ internals

    def _check_loop(self) -> None:
        """A store belongs to the event loop it was opened on: its futures, tasks and queues
        are that loop's, and used from another thread or loop they would hang or corrupt the
        bookkeeping: a :class:`StoreError` at once (docs/design.md, "Event loops": the hit path
        compares the thread alone; ``stats()`` may be called from any thread).  A synchronous
        call from the loop's thread while the loop is not running is the loop's too."""
        loop = _running_loop()
        if loop is self._loop or (loop is None and threading.get_ident() == self._thread):
            return
        raise StoreError(f"the store over {self._index.root} belongs to the event loop it was opened on "
                         f"(in thread {self._thread_name!r}); it was used from "
                         f"{'another event loop' if loop is not None else 'no event loop'} in thread "
                         f"{threading.current_thread().name!r}: open one store per loop")

    def _on_evict(self, entry: Entry) -> None:
        self._loader.evicted(entry)
        if self._growth is not None:
            self._growth.evicted(entry)
