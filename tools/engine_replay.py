"""``iosched replay`` with real reads: the store itself replays a routing trace.

Real-I/O replay (``iosched replay TRACE`` without ``--simulate``)
    Builds once, in the cache folder, the demo's safetensors checkpoint for the trace's shape
    (its MoE layers and experts, each expert scaled down as ``iosched demo`` does:
    :func:`iosched.tools.demo.demo_checkpoint`), then for every budget and every policy, policies
    interleaved per budget so that drift of the disk or the page cache hits every arm alike:
    drops the checkpoint from the page cache, opens ``ExpertStore(folder, budget_bytes=int(cycles
    x TD), policy=name, backend=...)`` with TD = k x the checkpoint's expert bytes summed over
    layers, and replays the trace as the demo's engine does (:func:`iosched.tools.demo.drive_engine`:
    ``acquire_many`` per batch, real numpy compute on the experts' own tensors per layer
    (``tools/compute.py``; ``--compute sleep:MS`` emulates it), ``token_boundary`` per decode
    token).  The policy name ``handwritten`` is the hand-written arm (``tools/handwritten.py``):
    an LRU dict of bytes under the same budget read by 8 threads of ``os.pread``, through the
    same engine loop and compute, its page cache dropped before the run as the others'.
    A request is a hit when its expert was resident *or already loading* when
    it was asked for (a store hit or a single-flight join), the simulation's semantics; the
    replay counts them per batch, since the store's ``hits`` leaves joins out.  Belady needs the
    future, which the store cannot have: rejected here.

The simulation, ``--train``'s seeded replay and the command are ``tools/replay.py``'s, which
imports this module for the runs without ``--simulate``; this one needs only the names of the
offline policies (``tools/_replay_policies.py``), so the two do not import each other.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from iosched import CheckpointIndex, ExpertStore, StoreError, load_index
from iosched.backends import Backend, create, resolve
from iosched.backends.throttle import ThrottledBackend

from . import demo
from ._replay_policies import HANDWRITTEN, OFFLINE
from .compute import DEFAULT_AWAITS, DEFAULT_COMPUTE_ON, NUMPY, Compute, ComputeSpec
from .handwritten import HandwrittenEngineStore
from .trace import RouteTrace

THROTTLE_BURST_S = 0.002
"""``--throttle-mbps``'s bucket holds 2 ms of reads: a steady pace.  The throttle's default
burst (50 ms) let the reads after each layer's compute through at the real drive's speed,
which made a 400 MB/s throttle deliver 500 MB/s in decode (measured on the development VM)."""
DEFAULT_COMPUTE_MS = 1.0
"""A layer's emulated compute in milliseconds, ``--compute-ms``'s ``sleep:1``."""

# ---------------------------------------------------------------------------------------------
# real I/O


def reject_offline(policies: Sequence[str], mode: str) -> None:
    """A StoreError naming the first offline (future-reading) policy in ``policies``."""
    for name in policies:
        if name in OFFLINE:
            raise StoreError(f"--policy {name} is an offline reference (it reads the future of "
                             f"the trace) and cannot run {mode}; use it with --simulate only")


async def _one_real_run(folder: Path, files: tuple[str, ...], trace: RouteTrace, policy: str,
                        cycles: float, budget: int | str, compute: ComputeSpec | float, backend: str,
                        max_tokens: int | None, expert_bytes: dict[int, int],
                        layer_map: dict[int, int], cold: bool, routing: bool = True,
                        compute_on: str = DEFAULT_COMPUTE_ON,
                        lookahead_recall: float | None = None,
                        throttle_mbps: float | None = None, awaits: str = DEFAULT_AWAITS) -> dict[str, Any]:
    spec = compute if isinstance(compute, ComputeSpec) else ComputeSpec("sleep", float(compute))
    engine = Compute(spec, compute_on, awaits)
    if cold:
        await asyncio.to_thread(demo.drop_from_page_cache, files)
    try:
        if policy == HANDWRITTEN:
            return await _handwritten_run(folder, trace, cycles, budget, engine, backend,
                                          max_tokens, expert_bytes, layer_map, routing)
        store_backend: str | Backend = backend
        if throttle_mbps is not None:  # the drive paced to a known speed (validating the model)
            store_backend = ThrottledBackend(create(resolve(backend, files)[0]), {str(folder): throttle_mbps * 1e6},
                                             burst_s=THROTTLE_BURST_S)
        async with await ExpertStore.open(folder, budget_bytes=budget, backend=store_backend,
                                          policy=policy, experts_per_token=trace.k) as store:
            t0 = time.perf_counter()
            ahead = (None if lookahead_recall is None
                     else demo.SyntheticLookahead(lookahead_recall, trace.n_expert))
            run = await demo.drive_engine(store, trace, engine, max_tokens,
                                          expert_bytes=expert_bytes, layer_map=layer_map,
                                          routing=routing, lookahead=ahead)
            wall = time.perf_counter() - t0
            store.end_turn()  # the trace's last turn ends: the growth rule's final decision
            s = store.stats()
    finally:
        engine.close()
    return result_row(policy, cycles, s, run, wall, engine)


async def _handwritten_run(folder: Path, trace: RouteTrace, cycles: float, budget: int | str,
                           engine: Compute, backend: str, max_tokens: int | None,
                           expert_bytes: dict[int, int], layer_map: dict[int, int],
                           routing: bool) -> dict[str, Any]:
    """The hand-written arm's run: same loop, same compute, same budget (a number only).
    Its page cache is dropped behind its reads where the store's backend reads O_DIRECT, so
    it gets no more memory than the iosched arms."""
    if not isinstance(budget, int):
        raise StoreError("the handwritten arm has a fixed budget; it does not run with --auto-budget")
    index = await asyncio.to_thread(load_index, folder)
    direct = resolve(backend, index.files)[0] in ("odirect", "uring")
    hand = HandwrittenEngineStore(index, budget, drop_behind=direct)
    try:
        t0 = time.perf_counter()
        run = await demo.drive_engine(hand, trace, engine, max_tokens, expert_bytes=expert_bytes,
                                      layer_map=layer_map, routing=routing)
        wall = time.perf_counter() - t0
    finally:
        hand.close()
    s: dict[str, Any] = {
        **hand.stats(), "budget_growth": None, "budget_cycles": float(cycles), "service_s": None,
        "admissions": None, "rejections": None, "loop": type(asyncio.get_running_loop()).__module__,
        "drop_behind": direct,
    }
    return result_row(HANDWRITTEN, cycles, s, run, wall, engine)


def map_layers(trace: RouteTrace, label: str, ckpt: Path,
               index: CheckpointIndex) -> tuple[dict[int, int], dict[int, int], int]:
    """The checkpoint built for ``trace`` against the trace: the trace's layers renamed to the
    checkpoint's (in order), each trace layer's expert bytes, and TD (k x the checkpoint's
    expert bytes summed over layers); a StoreError naming both when the layer counts differ."""
    by_layer = index.expert_bytes_by_layer()
    ck_layers = sorted(by_layer)
    if len(ck_layers) != len(trace.layers):
        raise StoreError(f"checkpoint {ckpt} has {len(ck_layers)} MoE layers, the trace "
                         f"{label} {len(trace.layers)}; delete the folder to rebuild it")
    layer_map = dict(zip(trace.layers, ck_layers, strict=True))
    expert_bytes = {tl: by_layer[cl] for tl, cl in layer_map.items()}
    return layer_map, expert_bytes, trace.k * sum(by_layer.values())


def checkpoint_bytes(index: CheckpointIndex) -> int:
    """The bytes of every expert of the checkpoint: the budget that holds all of it."""
    return sum(lay.nbytes for lay in index.experts.values())


def require_holds(budget: int, cycles: float, index: CheckpointIndex, ckpt: Path, td: int) -> None:
    """A StoreError unless ``budget`` (``cycles`` token cycles of ``td`` bytes) holds every
    expert of the checkpoint ``ckpt``, naming the cycles that would."""
    everything = checkpoint_bytes(index)
    if budget < everything:
        raise StoreError(f"--resident: {cycles:g} token cycles ({budget:,} B) do not hold the "
                         f"checkpoint {ckpt} ({everything:,} B of experts); give --cycles "
                         f"{math.ceil(everything / td * 100) / 100:g} or more, or leave --cycles out")


async def load_everything(store: ExpertStore | HandwrittenEngineStore, index: CheckpointIndex) -> None:
    """``--resident`` (``tools/resident_bench.py``): lease every expert of the checkpoint once,
    a layer at a time, then once more, each of which must hit (the fully resident case: the
    budget holds the checkpoint, so nothing is evicted and the timed run misses nothing).  A
    StoreError if an expert did not stay resident."""
    by_layer: dict[int, list[tuple[int, int]]] = {}
    for layer, expert in index.experts:
        by_layer.setdefault(layer, []).append((layer, expert))
    for layer in sorted(by_layer):
        async with store.acquire_many(sorted(by_layer[layer])):
            pass
    before = store.request_tally.hits
    for layer in sorted(by_layer):  # a second pass: every expert must hit
        async with store.acquire_many(sorted(by_layer[layer])):
            pass
    if store.request_tally.hits - before != len(index.experts):
        raise StoreError(f"--resident: the checkpoint {index.root} did not stay resident under "
                         f"this budget; give --cycles that hold all of it")


def result_row(policy: str, cycles: float, s: dict[str, Any], run: demo.EngineRun, wall: float,
               engine: Compute) -> dict[str, Any]:
    growth = s["budget_growth"]
    return {
        "policy": policy,
        "cycles": float(cycles) if growth is None else s["budget_cycles"],
        "budget_bytes": s["budget_bytes"],
        "auto": growth is not None,
        "start_cycles": float(cycles),
        "budget_growth": growth,
        "requests": run.requests,
        "decode_hit": run.decode_hits / run.decode_requests if run.decode_requests else 0.0,
        "byte_hit": run.hit_bytes / run.requested_bytes if run.requested_bytes else 0.0,
        "felt_wait_s": s["felt_wait_s"],
        "felt_wait_per_token_ms": 1e3 * run.decode_felt_wait_s / max(run.tokens, 1),
        "service_s": s["service_s"],
        "bytes_read": s["bytes_read"],
        "tokens_per_s": run.tokens / run.decode_seconds if run.decode_seconds else 0.0,
        "tokens": run.tokens,
        "decode_seconds": run.decode_seconds,
        "decode_felt_wait_s": run.decode_felt_wait_s,
        "decode_requests": run.decode_requests,
        "decode_hits": run.decode_hits,
        "hits": run.hits,
        "requested_bytes": run.requested_bytes,
        "hit_bytes": run.hit_bytes,
        "store_hits": s["hits"],
        "store_misses": s["misses"],
        "single_flight_joins": s["single_flight_joins"],
        "admissions": s["admissions"],
        "rejections": s["rejections"],
        "evictions": s["evictions"],
        "backend": s["backend"],
        "loop": s["loop"],
        "seconds": wall,
        "compute_ms_per_token": 1e3 * run.decode_compute_s / max(run.tokens, 1),
        "other_ms_per_token": demo.other_ms_per_token(run),
        "loop_cpu_ms_per_token": 1e3 * run.decode_cpu_s / max(run.tokens, 1),
        "policy_verdict": s.get("policy_verdict"),
        "policy_state": dict(s["policy_state"]) if s.get("policy_state") is not None else None,
        **engine.describe(),
    }


async def replay_real(trace: RouteTrace, label: str, cycles: Sequence[float],
                      policies: Sequence[str], *, compute_ms: float | None = None,
                      compute: ComputeSpec | None = None, compute_on: str = DEFAULT_COMPUTE_ON,
                      awaits: str = DEFAULT_AWAITS,
                      backend: str = "auto", max_tokens: int | None = None, cold: bool = True,
                      folder: Path | None = None, scale: int = demo.SCALE,
                      on_run: Callable[[str], None] | None = None,
                      auto: bool = False, routing: bool = True,
                      lookahead_recall: float | None = None,
                      throttle_mbps: float | None = None) -> dict[str, Any]:
    """Every policy at every budget against the trace's checkpoint, with real reads.

    ``folder``: where the checkpoint is built or found (default: the cache folder, as for
    ``iosched demo``).  ``cold``: drop it from the page cache before each run.  ``auto``: one
    more run per policy with ``budget_bytes="auto"`` (it opens at ``auto_start_cycles`` and
    grows, ``iosched/runtime/_growth.py``); its row's ``cycles`` is the budget it ended with.
    ``routing``: the engine hands each prompt batch's router output to ``observe_routing``
    (``False``: keys only, ``--keys-only``).  ``compute``: real numpy compute (the default)
    or a sleep, run where ``compute_on`` says; ``compute_ms``, the older spelling of
    ``compute=sleep:MS``.  The policy :data:`HANDWRITTEN` is the hand-written arm.
    """
    reject_offline(policies, "with real I/O")
    if compute_ms is not None and compute is not None:
        raise StoreError("give --compute or --compute-ms (the same as --compute sleep:MS), not both")
    if (compute_ms is not None and compute_ms < 0) or (max_tokens is not None and max_tokens <= 0):
        raise StoreError("--compute-ms must not be negative and --tokens must be positive")
    spec = ComputeSpec("sleep", compute_ms / 1e3) if compute_ms is not None else compute or NUMPY
    ckpt = await asyncio.to_thread(demo.demo_checkpoint, trace, folder, scale)
    index = await asyncio.to_thread(load_index, ckpt)
    layer_map, expert_bytes, td = map_layers(trace, label, ckpt, index)
    results: list[dict[str, Any]] = []
    arms: list[tuple[float, int | str]] = [(c, max(1, int(c * td))) for c in cycles]
    if auto:
        from iosched import settings

        arms.append((float(settings.get("auto_start_cycles")), "auto"))
    for c, budget in arms:
        for name in policies:
            if on_run is not None:
                on_run(f"{name} @ {c:g} cycles{' (auto)' if budget == 'auto' else ''}")
            results.append(await _one_real_run(
                ckpt, index.files, trace, name, c, budget, spec, backend,
                max_tokens, expert_bytes, layer_map, cold, routing, compute_on, lookahead_recall,
                throttle_mbps, awaits))
    return {
        "trace": label,
        "mode": "real",
        "k": trace.k,
        "td_bytes": td,
        "trace_td_bytes": trace.td_bytes,
        "results": results,
        "checkpoint": str(ckpt),
        "source": trace.source,
        "model": trace.model,
        "arch": trace.arch,
        "compute_ms": 1e3 * spec.sleep_s if spec.kind == "sleep" else None,
        "compute": spec.label,
        "compute_on": compute_on if spec.kind == "numpy" else None, "engine_awaits": awaits,
        "backend": backend,
        "cold": cold,
        "tokens": max_tokens if max_tokens is not None else trace.n_decode_tokens(),
        "routing": routing,
        "lookahead_recall": lookahead_recall,
        "throttle_mbps": throttle_mbps,
    }


# ---------------------------------------------------------------------------------------------
# tables


def real_table(out: dict[str, Any]) -> Any:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    where = f" on {out['compute_on']}" if out.get("compute_on") else ""
    table = Table(title=f"iosched replay {out['trace']} (real I/O, {out['backend']} backend, "
                        f"compute {out.get('compute', 'sleep')}{where})")
    for col in ("policy", "TD", "decode hit %", "byte hit %", "felt ms/token", "compute ms/token",
                "other ms/token", "service s", "MB read", "tokens/s"):
        table.add_column(col, justify="left" if col == "policy" else "right", no_wrap=True)
    for r in out["results"]:
        td = (f"auto {r['start_cycles']:g}→{r['cycles']:.3g}" if r.get("auto")
              else f"{r['cycles']:g}")
        table.add_row(r["policy"], td, f"{100 * r['decode_hit']:.1f}",
                      f"{100 * r['byte_hit']:.1f}", f"{r['felt_wait_per_token_ms']:.2f}",
                      f"{r.get('compute_ms_per_token', 0.0):.2f}", f"{r.get('other_ms_per_token', 0.0):.2f}",
                      "-" if r["service_s"] is None else f"{r['service_s']:.2f}",
                      f"{r['bytes_read'] / 1e6:.1f}",
                      f"{r['tokens_per_s']:.1f}")
    note = (f"{out['model'] or out['source']}: k={out['k']}, checkpoint TD="
            f"{out['td_bytes'] / 2**20:.2f} MiB, {out['tokens']} decode tokens, "
            f"{'cold' if out['cold'] else 'warm'} page cache; {out['checkpoint']}")
    return Group(table, Text(note, style="dim"))
