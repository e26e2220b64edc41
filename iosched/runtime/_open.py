"""Opening a store: ``ExpertStore.open``'s arguments checked, then its parts built.

:class:`OpenArgs` holds the arguments as given; :func:`assemble` turns them into
:class:`StoreParts` in the order that fails cheapest first: every argument that can be
checked without a file is checked before the checkpoint is read (a bad budget, an unknown
backend, policy or routing never costs an index), the index before any file of it is opened,
and the backend opened last.  Every refusal is a :class:`StoreError` subclass naming the
argument or the file.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from iosched import _settings, backends
from iosched._errors import BudgetError, StoreError
from iosched._layout import CheckpointIndex
from iosched.formats import _verify
from iosched.formats._checkpoint import load_index
from iosched.formats._mirrors import find_replicas
from iosched.residency import make_policy
from iosched.topology._topology import Discovery, is_topology_file, load_topology

from . import _outputs as _outputs_mod
from . import _sizing
from ._growth import BudgetGrowth
from ._io import ReadPath
from ._router import POLICIES as ROUTING_POLICIES
from ._telemetry import TokenTelemetry

log = logging.getLogger("iosched")

PathLike = str | os.PathLike[str]


@dataclass
class OpenArgs:
    """``ExpertStore.open``'s arguments (its docstring says what each means)."""

    source: PathLike
    budget_bytes: int | str
    backend: str | backends.Backend | None = "auto"
    policy: str | None = "default"
    mirrors: Sequence[PathLike] = ()
    routing: str = "hash"
    weights: Mapping[str, float] | None = None
    queue_depth: int | None = None
    token_budget_bytes: int | None = None
    experts_per_token: int | None = None
    telemetry: PathLike | None = None
    history: PathLike | None = None
    verify: str | None = None
    manifest: PathLike | None = None
    verify_mirrors: int | None = None


@dataclass(frozen=True)
class StoreParts:
    """What a store is built from: the index, the sized budget, the opened read path."""

    index: CheckpointIndex
    budget_bytes: int
    io: ReadPath
    backend_reason: str | None
    policy_name: str
    token_budget_bytes: int | None
    telemetry: TokenTelemetry | None
    growth: BudgetGrowth | None
    verification: _verify.Verification = _verify.Verification()
    history: str | None = None
    """``history=`` as a checked absolute path (``iosched/runtime/_outputs.py``)."""

    def discard(self) -> None:
        """Close what was opened, when no store will be built on these parts after all."""
        if self.telemetry is not None:
            self.telemetry.discard()
        self.io.backend.close()


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


_BACKEND_MEMBERS = ("name", "caps", "open", "read", "alignment", "info", "close")
"""What a backend object must have (``iosched.backends.Backend``); checked before it is used."""


def _check_types(args: OpenArgs) -> None:
    """Each argument of the right kind, or a :class:`StoreError` naming it."""
    if not isinstance(args.source, (str, os.PathLike)):
        raise StoreError(f"source must be a path (str or os.PathLike), got {args.source!r}")
    be = args.backend
    if not (be is None or isinstance(be, str) or all(hasattr(be, m) for m in _BACKEND_MEMBERS)):
        raise StoreError(f"backend must be a backend's name ({', '.join(backends.NAMES)} or auto) or a "
                         f"Backend object, got {be!r}")
    if args.policy is not None and not isinstance(args.policy, str):
        raise StoreError(f"policy must be a policy's name, got {args.policy!r}")
    if not isinstance(args.routing, str):
        raise StoreError(f"routing must be a name, got {args.routing!r}")
    mirrors = args.mirrors
    if isinstance(mirrors, (str, bytes, os.PathLike)) or not all(
            isinstance(m, (str, os.PathLike)) for m in _iterable(mirrors, "mirrors")):
        raise StoreError(f"mirrors must be a list of paths, got {mirrors!r}")
    if args.weights is not None:
        if not isinstance(args.weights, Mapping):
            raise StoreError(f"weights must be a mapping of path to weight, got {args.weights!r}")
        for root, weight in args.weights.items():
            if (not isinstance(root, (str, os.PathLike)) or isinstance(weight, bool)
                    or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0):
                raise StoreError(f"weights: {root!r} -> {weight!r} is not a path and a finite weight >= 0")
    for name in ("telemetry", "history"):
        value = getattr(args, name)
        if value is not None and not isinstance(value, (str, os.PathLike)):
            raise StoreError(f"{name} must be a file path, got {value!r}")


def _iterable(value: object, name: str) -> list[object]:
    if not isinstance(value, Iterable):
        raise StoreError(f"{name} must be a list of paths, got {value!r}")
    return list(value)


def _check_arguments(args: OpenArgs) -> None:
    """Everything that can be refused before a file is read."""
    _check_types(args)
    budget = args.budget_bytes
    if budget != "auto" and not _positive_int(budget):
        raise BudgetError(f'budget_bytes must be a positive integer or "auto", got {budget!r}')
    total = _sizing.mem_total()
    if isinstance(budget, int) and total is not None and budget > total:
        # An absurd budget: the store could never hold it, and a typo (GiB for MiB) should
        # not surface hours later as the OOM killer.
        raise BudgetError(f"budget_bytes={budget} is more than this machine's memory "
                          f"(MemTotal {total} bytes)")
    if args.experts_per_token is not None and not _positive_int(args.experts_per_token):
        raise BudgetError(f"experts_per_token must be a positive integer, got {args.experts_per_token!r}")
    tb = args.token_budget_bytes
    if tb is not None and (isinstance(tb, bool) or not isinstance(tb, int) or tb < 0):
        raise BudgetError(f"token_budget_bytes must be a non-negative integer, got {tb!r}")
    if isinstance(args.backend, str) and args.backend != "auto":
        backends.resolve(args.backend)  # fail early, before the checkpoint is read
    make_policy(args.policy or str(_settings.get("policy")))  # likewise
    _verify.check_arguments(args.verify, args.verify_mirrors)


def _drive_names(paths: Sequence[str]) -> dict[str, str]:
    discovery = Discovery()
    return {path: discovery.drive_of(path).name for path in paths}


@dataclass(frozen=True)
class _Layout:
    """Where the bytes are and how the drives are driven: from the arguments, or a topology file."""

    source: PathLike
    mirrors: Sequence[PathLike]
    routing: str
    weights: Mapping[str, float] | None
    depths: int | Mapping[str, int]
    stripe_threshold: int
    inflight: Mapping[str, int] | None = None
    """Per drive, the topology file's ``inflight_bytes`` (the drives it names with one)."""


async def _drives(args: OpenArgs) -> _Layout:
    """The replicas, routing, weights and queue depths: a topology file (``iosched topology
    --write``) names the checkpoint, its mirrors, the routing and each drive's weight and queue
    depth; explicit arguments win."""
    layout = _Layout(args.source, args.mirrors, args.routing, args.weights, 0,
                     int(_settings.get("stripe_threshold")))
    depths: Mapping[str, int] | None = None
    inflight: Mapping[str, int] | None = None
    if is_topology_file(args.source):
        if args.mirrors:
            raise StoreError(f"{args.source}: give mirrors in the topology file or as an argument, not both")
        topo = await asyncio.to_thread(load_topology, args.source)
        drives = await asyncio.to_thread(_drive_names, topo.paths)
        weights = args.weights
        if weights is None:
            weights = {root: topo.device(name).weight for root, name in drives.items()}
        depths = {name: cfg.queue_depth for name, cfg in topo.devices.items()}
        inflight = {name: cfg.inflight_bytes for name, cfg in topo.devices.items() if cfg.inflight_bytes is not None}
        layout = _Layout(topo.primary, topo.mirrors, topo.routing_policy, weights, 0,
                         topo.stripe_threshold_bytes)
    if layout.routing not in ROUTING_POLICIES:
        raise StoreError(f"unknown routing {layout.routing!r}; choose one of {', '.join(ROUTING_POLICIES)}")
    depth = int(_settings.get("queue_depth")) if args.queue_depth is None else args.queue_depth
    if not _positive_int(depth):
        raise StoreError(f"queue_depth must be a positive integer, got {args.queue_depth!r}")
    chosen: int | Mapping[str, int] = depths if depths is not None and args.queue_depth is None else depth
    return dataclasses.replace(layout, depths=chosen, inflight=inflight)


async def _sized_budget(args: OpenArgs, index: CheckpointIndex) -> int:
    """The budget in bytes (``"auto"`` sized from the checkpoint and ``MemAvailable``), with
    the warnings an integer budget deserves."""
    k = index.experts_per_token
    td = None if k is None else _sizing.token_cycle_bytes(index, k)
    if isinstance(args.budget_bytes, int):
        budget = args.budget_bytes
    elif k is None:
        raise BudgetError(
            f'budget_bytes="auto" needs k, the experts routed per token, and {index.root} does '
            "not say (no num_experts_per_tok in config.json, no expert_used_count in GGUF); "
            "pass experts_per_token=K to ExpertStore.open")
    else:
        available = await asyncio.to_thread(_sizing.mem_available)
        budget = _sizing.auto_budget(index, k, available, int(_settings.get("auto_start_cycles")))
        log.info('budget_bytes="auto": %d bytes, %d token cycles of %d bytes (k=%d, MemAvailable %d)',
                 budget, budget // (td or 1), td, k, available)
    if td is not None and budget < td:
        log.warning(
            "budget_bytes=%d is below one token cycle (%d bytes = k=%d experts per token x "
            "the largest expert of each layer): LRU hits nothing below one cycle, every "
            "expert is evicted before the next token reuses it", budget, td, k)
    largest = max(layout.nbytes for layout in index.experts.values())
    if largest > budget:
        log.warning("budget_bytes=%d is smaller than the largest expert (%d bytes): acquiring it "
                    "will raise BudgetError", budget, largest)
    return budget


async def _read_path(args: OpenArgs, drives: _Layout, index: CheckpointIndex,
                     verification: _verify.Verification) -> tuple[ReadPath, str | None, _verify.Verification]:
    """The backend (resolved, created and opened on every replica's files) behind its read
    path, why ``auto`` chose it, and the verification (mirrors sampled before any file is
    opened by the backend)."""
    reason: str | None = None
    name = ""
    if args.backend is None or isinstance(args.backend, str):
        name, reason = await asyncio.to_thread(backends.resolve, args.backend or str(_settings.get("backend")),
                                               index.files)
    replicas = await asyncio.to_thread(find_replicas, index, drives.mirrors)
    verification = await asyncio.to_thread(verification.sample, index, replicas)
    roots = [index.root] + [os.path.abspath(os.fspath(m)) for m in drives.mirrors]
    for root in drives.weights or {}:
        if os.path.abspath(root) not in roots:
            raise StoreError(f"weights: {root} is neither the source nor a mirror")
    # a Backend object: fault injection and throttling wrap a real backend this way
    be = backends.create(name) if args.backend is None or isinstance(args.backend, str) else args.backend
    await _open_backend(be, [path for paths in replicas for path in paths])
    try:
        weights = {os.path.abspath(k): v for k, v in (drives.weights or {}).items()}
        paths = [path for row in replicas for path in row]
        return ReadPath(be, replicas, roots, weights, drives.routing, drives.depths, drives.stripe_threshold,
                        verification.verifier(paths), inflight_bytes=drives.inflight), reason, verification
    except BaseException:
        be.close()
        raise


async def _open_backend(be: backends.Backend, paths: list[str]) -> None:
    """``be.open(paths)`` in a worker thread.  A cancelled ``to_thread`` does not stop its
    thread: if the caller is cancelled (or the open fails) while the thread runs, the backend
    is closed once the thread has finished, so no descriptor or ring outlives the cancel."""
    task = asyncio.ensure_future(asyncio.to_thread(be.open, paths))
    try:
        await asyncio.shield(task)
    except BaseException:
        def close_once_opened(done: asyncio.Future[None]) -> None:
            if not done.cancelled() and done.exception() is None:
                be.close()
        if task.done():
            close_once_opened(task)
        else:
            task.add_done_callback(close_once_opened)
        raise


def _outputs(args: OpenArgs, drives: _Layout) -> dict[str, str]:
    """``telemetry=`` and ``history=`` as absolute paths, checked against the checkpoints'
    folders before anything is opened (``iosched/runtime/_outputs.py``)."""
    checkpoints = [os.fspath(drives.source), *(os.fspath(m) for m in drives.mirrors)]
    out = {}
    for name in ("telemetry", "history"):
        value = getattr(args, name)
        if value is not None:
            out[name] = _outputs_mod.check_output_path(name, value, checkpoints)
    if "telemetry" in out and out["telemetry"] == out.get("history"):
        raise StoreError(f"telemetry and history name the same file {out['telemetry']}")
    return out


async def assemble(args: OpenArgs) -> StoreParts:
    """Check ``args``, read the index, size the budget, open the read path; on any failure,
    and on cancellation at any await, close whatever was opened before re-raising."""
    _check_arguments(args)
    drives = await _drives(args)
    outputs = _outputs(args, drives)
    index = await asyncio.to_thread(load_index, drives.source)
    for name, path in outputs.items():
        _outputs_mod.check_not_a_checkpoint_file(name, path, index.files)
    if "telemetry" in outputs:
        _outputs_mod.check_telemetry_target(outputs["telemetry"], args.telemetry)
    if args.experts_per_token is not None:  # the caller's k wins over the checkpoint's
        fewest = index.fewest_experts_per_layer()
        if args.experts_per_token > fewest:  # as config.json's k is checked
            raise BudgetError(f"experts_per_token={args.experts_per_token} is more than the "
                              f"{fewest} experts of a layer of {index.root}")
        index = dataclasses.replace(index, experts_per_token=args.experts_per_token,
                                    k_source="ExpertStore.open(experts_per_token=...)", k_by_layer=None)
    verification = await asyncio.to_thread(_verify.prepare, index, args.verify, args.manifest,
                                           args.verify_mirrors)
    budget = await _sized_budget(args, index)
    io, reason, verification = await _read_path(args, drives, index, verification)
    sink: TokenTelemetry | None = None
    try:
        if "telemetry" in outputs:
            sink = TokenTelemetry(outputs["telemetry"])  # one small open: no thread to outlive a cancel
        k = index.experts_per_token
        growth = None
        if args.budget_bytes == "auto" and k is not None:
            growth = BudgetGrowth(_sizing.token_cycle_bytes(index, k), budget, _sizing.whole_cycles(index, k))
    except BaseException:
        if sink is not None:
            sink.discard()
        io.backend.close()
        raise
    return StoreParts(index, budget, io, reason, args.policy or str(_settings.get("policy")),
                      args.token_budget_bytes, sink, growth, verification, outputs.get("history"))
