"""``iosched replay --simulate --critical-path``: the store itself, on virtual time.

What it measures: the engine's critical path per token — tokens/s, felt wait per token (p50,
p99), bytes moved (demand and prefetch), prefetch precision and coverage, CPU per token — for
every policy and budget, without the noise of a real disk and without a disk at all.

How: each run opens the real :class:`iosched.ExpertStore` (its residency table, policy,
per-device queues, priorities, pacing, prefetch rules, on the store's own orchestration: no
second copy of the per-batch loop) on :class:`iosched.clock.VirtualTimeLoop`, and replays the
trace through the very engine loop of the real-I/O replay (:func:`iosched.tools.demo.drive_engine`).
Two things are modelled, because they are not the store:

* **the drive**: :class:`iosched.backends.modelled.ModelledBackend`, a bandwidth and a
  per-request latency per drive (``--drive-mbps``/``--drive-latency-us``, or ``--drive
  FILE.json``, the output of ``iosched topology PATH --probe --json``: its depth-``qd`` MB/s,
  and its depth-1 median read time less that read's transfer time), under the store's own
  queue depth;
* **the compute**: :class:`iosched.tools.compute.ComputeModel`, a sleep per layer of a
  constant, or of the layer's routed bytes times a per-byte (and per-byte-and-row) cost;
  ``calibrate`` (the default) measures those on this machine with the real numpy compute.

The store's and the policy's CPU are *measured*: the loop's clock runs on with the real time
Python spends on it (``charge_cpu``; ``--cpu free`` makes CPU cost nothing, and then the same
inputs give the same numbers to the last digit, but for the measured CPU columns).  These
effects of a real engine on the CPU are modelled, each measured on this machine:

* where the compute runs (``--compute-on``): ``loop`` holds the event loop for the layer's
  modelled time (:meth:`iosched.clock.VirtualTimeLoop.advance`: nothing else runs), as the
  README's engine does; ``thread`` sleeps, so the store's batch-end work and completions run
  meanwhile, as with compute elsewhere (a GPU, or cores of its own).  On a 2-core machine a
  compute thread also fights the loop for the GIL and the cores, which is *not* modelled:
  validate with ``loop`` there (docs/benchmarks.md);
* the reads' cost to the compute: :attr:`~iosched.tools.compute.ComputeModel.io_slowdown`,
  calibrated beside real O_DIRECT reads of the probe's file, scaled by the modelled drive's
  busy share, and :attr:`~iosched.tools.compute.ComputeModel.fresh_slowdown`, the compute on
  bytes a read has just brought in (a batch's misses), calibrated on that file too;
* the reads' cost to the loop: ``read_cpu`` per read (:func:`read_overhead`: the loop
  thread's CPU per real read, less the modelled one's), and the store's Python running slower
  beside reads: ``cpu_scale`` (:func:`cpu_scale`, per policy), which the loop's clock
  multiplies the real time spent on it by;
* the compute's cost to the store's Python: each modelled layer reads as many bytes as its
  experts hold from a buffer larger than the caches (off the clock), so the policy after it
  runs on caches as cold as real compute leaves them.

The checkpoint is the real-I/O replay's (:func:`iosched.tools.demo.demo_checkpoint`: same
tensor names, shapes and files, ``--scale``) written sparse, its data left as holes, so
``--scale 1``'s 17.6 GB Qwen3 shape costs a few KiB of disk: the store indexes it as any
checkpoint, and the modelled drive never reads it.

Row keys, beyond the real-I/O replay's: ``felt_p50_ms``/``felt_p99_ms`` (per decode token),
``demand_bytes``/``prefetch_bytes`` (``bytes_read`` split by who started the load),
``prefetch_precision`` (used / issued, ``None`` without prefetches), ``prefetch_coverage``
(used / (used + demand misses): the share of the misses prefetching took off the critical
path, the demand misses left counted as the ones it did not), ``cpu_ms_per_token`` (the
loop thread's CPU time per decode token: the store, the policy and the engine loop).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from iosched import ExpertStore, StoreError, clock, load_index
from iosched.backends.modelled import DriveModel, ModelledBackend

from . import demo, engine_replay
from ._replay_policies import HANDWRITTEN
from .compute import DEFAULT_AWAITS, DEFAULT_COMPUTE_ON, Compute, ComputeModel, ComputeSpec, calibrate
from .trace import RouteTrace

DEFAULT_DRIVE_MBPS = 1500.0
"""The drive when none is given: a PCIe 3 NVMe's order of random-read bandwidth at depth
(1.5 GB/s), the middle of the issue's 0.5-3 GB/s range."""
DEFAULT_DRIVE_LATENCY_US = 80.0
"""Per-request latency when none is given: a TLC NVMe's 4 KiB random-read latency at depth 1
is 60-100 µs (vendors' data sheets)."""


def drive_from_probe(path: str, drive: str | None = None, *,
                     rate_limited: bool = False) -> tuple[float, float, dict[str, Any]]:
    """``(bandwidth bytes/s, latency s, facts)`` from ``iosched topology --probe --json``'s
    output in ``path``: the named drive's probe, or the only (first) probed one.

    The latency is the probe's depth-1 median read time less that read's transfer at the
    depth-``qd`` bandwidth: the drive's own transfer pipe carries the rest.  ``rate_limited``
    (the drive modelled as a rate limit in front of reads, ``--drive-burst-ms``): the whole
    depth-1 median, since the limit, not the drive, sets the bandwidth, and each read still
    takes the drive's own time behind it.  (Subtracting there, from a probe taken in a slow
    minute, gave 0 µs in two of three validation rounds, where the reads behind a 400 MB/s
    throttle took 0.9-2 ms: the model's felt wait came out 5-14 % short,
    docs/benchmarks.md.)"""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise StoreError(f"--drive {path}: cannot read a topology JSON: {exc}") from exc
    drives = doc.get("drives") if isinstance(doc, dict) else None
    if not isinstance(drives, dict):
        raise StoreError(f"--drive {path}: no \"drives\" object (write it with iosched topology PATH --probe --json)")
    probed = {n: d["probe"] for n, d in drives.items() if isinstance(d, dict) and isinstance(d.get("probe"), dict)}
    if drive is not None and drive not in probed:
        raise StoreError(f"--drive {path}: drive {drive!r} has no probe (probed: {', '.join(probed) or 'none'})")
    if not probed:
        raise StoreError(f"--drive {path}: no drive was probed (run iosched topology PATH --probe --json)")
    name = drive or next(iter(probed))
    p = probed[name]
    try:
        bw = float(p["mbps"]) * 1e6
        one = float(p["qd1"]["p50_ms"]) / 1e3
        bs = float(p["bs"])
    except (KeyError, TypeError, ValueError) as exc:
        raise StoreError(f"--drive {path}: drive {name!r}'s probe lacks mbps, bs or qd1.p50_ms") from exc
    if not bw > 0:
        raise StoreError(f"--drive {path}: drive {name!r} probed at {p['mbps']} MB/s")
    latency = one if rate_limited else max(0.0, one - bs / bw)
    return bw, latency, {"drive": name, "probe_mbps": p["mbps"], "probe_qd": p.get("qd"),
                                         "probe_qd1_p50_ms": p["qd1"]["p50_ms"], "probe_bs": bs,
                                         "probe_file": p.get("file")}


READ_OVERHEAD_READS = 256
"""Reads timed by :func:`read_overhead` (of the expert's size, from the page cache)."""


def read_overhead(path: str, nbytes: int, backend: str = "pread", reads: int = READ_OVERHEAD_READS) -> float:
    """Seconds of the event loop's thread per read through a real backend (``backend``, on
    ``path``), beyond the modelled backend's own: the loop thread's CPU time over
    ``reads`` sequential reads of ``nbytes`` that the page cache serves (so the drive's time
    is left out: a worker thread's copy is not the loop's), less the same for
    :class:`ModelledBackend` reads of no time.  The part of a real read the modelled drive
    does not cost: handing it to a worker, the wake-up, the future's completion."""
    import asyncio
    import mmap
    import time

    from iosched.backends import create

    size = os.path.getsize(path)
    nbytes = max(4096, min(nbytes, size) // 4096 * 4096)

    async def timed(be: Any) -> float:
        be.open([path])
        buf = mmap.mmap(-1, nbytes)
        view = memoryview(buf)
        try:
            for _ in range(8):
                await be.read(0, 0, nbytes, view)  # warm: the page cache, the pool's threads
            t0 = time.thread_time()
            for _ in range(reads):
                await be.read(0, 0, nbytes, view)
            return (time.thread_time() - t0) / reads
        finally:
            view.release()
            buf.close()
            be.close()

    async def both() -> float:
        real = await timed(create(backend))
        modelled = await timed(ModelledBackend(DriveModel(bandwidth=1e18, latency=0.0)))
        return max(0.0, real - modelled)

    return asyncio.run(both())


CPU_SCALE_WINDOW_S = 0.4
"""Seconds each arm of :func:`cpu_scale` runs the hit path for (three interleaved pairs)."""


def cpu_scale(folder: Path, policy: str, k: int, contend: str, nbytes: int, depth: int) -> float:
    """How much slower the store's Python runs beside real reads than alone: the store on
    ``folder`` (the modelled drive, everything resident), ``acquire_many`` of ``k`` experts
    layer after layer under ``policy`` (its hit path and batch-end work), timed alone and
    beside ``depth`` threads of O_DIRECT reads of ``contend`` (their completions take the
    GIL and a core, as a real backend's do), three interleaved pairs, the median ratio."""
    import asyncio
    import statistics
    import time

    from .compute import DirectReaders

    index = load_index(folder)
    budget = 2 * k * sum(index.expert_bytes_by_layer().values())  # two token cycles: all resident

    async def main() -> float:
        async with await ExpertStore.open(folder, budget_bytes=budget, policy=policy, experts_per_token=k,
                                          backend=ModelledBackend(DriveModel(1e18, 0.0))) as store:
            layers = sorted(store.index.expert_bytes_by_layer())
            batches = [[(layer, e) for e in range(k)] for layer in layers]
            for keys in batches:
                async with store.acquire_many(keys):
                    pass

            async def window() -> float:
                n, t0 = 0, time.perf_counter()
                while time.perf_counter() - t0 < CPU_SCALE_WINDOW_S:
                    async with store.acquire_many(batches[n % len(batches)]):
                        await asyncio.sleep(0)  # the batch-end work runs here
                    n += 1
                return (time.perf_counter() - t0) / n

            ratios = []
            for _ in range(3):
                alone = await window()
                with DirectReaders(contend, nbytes, depth):
                    ratios.append(await window() / alone)
            return max(1.0, statistics.median(ratios))

    return asyncio.run(main())


async def _one_run(folder: Path, trace: RouteTrace, policy: str, cycles: float, budget: int,
                   model: ComputeModel, bandwidth: float, latency: float, queue_depth: int | None,
                   max_tokens: int | None, expert_bytes: dict[int, int], layer_map: dict[int, int],
                   routing: bool, compute_on: str, read_cpu: float,
                   lookahead_recall: float | None, burst: float, awaits: str = DEFAULT_AWAITS) -> dict[str, Any]:
    loop = clock.running_virtual_loop()
    if loop is None:
        raise StoreError("the critical-path replay runs on iosched.clock.VirtualTimeLoop")
    drive = DriveModel(bandwidth, latency, burst)
    engine = Compute(ComputeSpec("model", model=model), compute_on, awaits)
    engine.drive_busy = lambda: drive.busy_s
    backend = ModelledBackend(drive, cpu_per_read=read_cpu)
    async with await ExpertStore.open(folder, budget_bytes=budget, backend=backend, policy=policy,
                                      experts_per_token=trace.k, queue_depth=queue_depth) as store:
        loop.skipping = True
        loop.executor_calls = 0
        t0 = clock.now()
        ahead = (None if lookahead_recall is None
                 else demo.SyntheticLookahead(lookahead_recall, trace.n_expert))
        run = await demo.drive_engine(store, trace, engine, max_tokens, expert_bytes=expert_bytes,
                                      layer_map=layer_map, routing=routing, lookahead=ahead)
        wall = clock.now() - t0
        store.end_turn()
        with loop.uncharged():
            s = store.stats()
    if loop.executor_calls:
        raise StoreError(f"policy {policy}: {loop.executor_calls} calls went to threads during the "
                         "virtual-time run; their time would have been skipped, not waited for")
    row = engine_replay.result_row(policy, cycles, s, run, wall, engine)
    felt_ms = [1e3 * f for f in run.token_felt_s]
    p50, p99 = (float(v) for v in np.percentile(felt_ms, [50, 99], method="nearest")) if felt_ms else (0.0, 0.0)
    issued, used = s["prefetch_issued"], s["prefetch_used"]
    misses = s["misses"]
    row.update({
        "felt_p50_ms": p50, "felt_p99_ms": p99,
        "prefetch_bytes": s["migration_bytes"], "demand_bytes": s["bytes_read"] - s["migration_bytes"],
        "prefetch_issued": issued, "prefetch_used": used,
        "prefetch_precision": used / issued if issued else None,
        "prefetch_coverage": used / (used + misses) if used + misses else None,
        "cpu_ms_per_token": 1e3 * run.decode_cpu_s / max(run.tokens, 1),
        "drive": drive.describe(),
        "lookahead_recall": lookahead_recall,
        "lookahead_expected": s["lookahead_expected"], "lookahead_started": s["lookahead_started"],
    })
    return row


def replay_critical_path(trace: RouteTrace, label: str, cycles: Sequence[float], policies: Sequence[str], *,
                         compute_model: ComputeModel | None = None, bandwidth: float = DEFAULT_DRIVE_MBPS * 1e6,
                         latency: float = DEFAULT_DRIVE_LATENCY_US / 1e6, drive_facts: dict[str, Any] | None = None,
                         queue_depth: int | None = None, charge_cpu: bool = True, max_tokens: int | None = None,
                         folder: Path | None = None, scale: int = demo.SCALE,
                         on_run: Callable[[str], None] | None = None, routing: bool = True,
                         compute_on: str = DEFAULT_COMPUTE_ON, read_cpu: float | None = None,
                         backend: str = "odirect", lookahead_recall: float | None = None,
                         burst: float = 0.0, awaits: str = DEFAULT_AWAITS) -> dict[str, Any]:
    """Every policy at every budget, each run on a fresh virtual-time loop (module docstring).
    ``compute_model``: ``None`` calibrates it here (:func:`iosched.tools.compute.calibrate`).
    ``read_cpu``: the loop's CPU per read a real backend costs beyond the model; ``None``
    measures ``backend``'s on the probe's file (:func:`read_overhead`), 0 without one."""
    engine_replay.reject_offline(policies, "on the critical path (it runs the store)")
    if HANDWRITTEN in policies:
        raise StoreError("--policy handwritten runs with real reads only (its thread pool of preads "
                         "is not the store and cannot run on virtual time)")
    if max_tokens is not None and max_tokens <= 0:
        raise StoreError("--tokens must be positive")
    ckpt = demo.demo_checkpoint(trace, folder, scale, sparse=True)
    index = load_index(ckpt)
    layer_map, expert_bytes, td = engine_replay.map_layers(trace, label, ckpt, index)
    largest = max(expert_bytes.values())
    calibrated = compute_model is None
    contend = (drive_facts or {}).get("probe_file")
    if contend is not None and not os.path.isfile(contend):
        contend = None
    read_cpu_measured = read_cpu is None
    if read_cpu is None:
        read_cpu = read_overhead(contend, largest, backend) if contend is not None else 0.0
    if compute_model is None:
        hidden, inter = demo.REAL_HIDDEN // scale, demo.REAL_INTERMEDIATE // scale
        compute_model = calibrate(hidden, inter, trace.k, contend=contend,
                                  contend_depth=int((drive_facts or {}).get("probe_qd") or 8))
    depth = int((drive_facts or {}).get("probe_qd") or 8)
    scales = {name: (cpu_scale(ckpt, name, trace.k, contend, largest, depth)
                     if contend is not None and charge_cpu else 1.0) for name in policies}
    results: list[dict[str, Any]] = []
    for c in cycles:
        budget = max(1, int(c * td))
        for name in policies:
            if on_run is not None:
                on_run(f"{name} @ {c:g} cycles")
            results.append(clock.run(_one_run(
                ckpt, trace, name, c, budget, compute_model, bandwidth, latency, queue_depth,
                max_tokens, expert_bytes, layer_map, routing, compute_on, read_cpu, lookahead_recall, burst, awaits),
                charge_cpu=charge_cpu, cpu_scale=scales[name]))
    return {
        "trace": label, "mode": "critical-path", "k": trace.k, "td_bytes": td,
        "trace_td_bytes": trace.td_bytes, "results": results, "checkpoint": str(ckpt),
        "source": trace.source, "model": trace.model, "arch": trace.arch,
        "compute": compute_model.label, "compute_calibrated": calibrated, "compute_on": compute_on,
        "engine_awaits": awaits,
        "compute_io_calibrated_on": contend if calibrated else None,
        "cpu_scale": scales,
        "read_cpu_us": 1e6 * read_cpu, "read_cpu_measured_with": backend if read_cpu_measured and contend else None,
        "drive_mbps": bandwidth / 1e6, "drive_latency_us": latency * 1e6, "drive_burst_ms": burst * 1e3,
        "drive_probe": drive_facts,
        "queue_depth": queue_depth, "cpu": "measured" if charge_cpu else "free",
        "tokens": max_tokens if max_tokens is not None else trace.n_decode_tokens(),
        "routing": routing, "scale": scale, "lookahead_recall": lookahead_recall,
    }


def critical_table(out: dict[str, Any]) -> Any:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"iosched replay {out['trace']} --critical-path (virtual time: drive "
                        f"{out['drive_mbps']:.0f} MB/s + {out['drive_latency_us']:.0f} µs, "
                        f"compute {out['compute']} on {out['compute_on']}, CPU {out['cpu']})")
    for col in ("policy", "TD", "tokens/s", "felt ms/tok p50", "p99", "other ms/tok",
                "GB demand", "GB prefetch", "precision", "coverage", "CPU ms/tok"):
        table.add_column(col, justify="left" if col == "policy" else "right", no_wrap=True)

    def pct(v: float | None) -> str:
        return "-" if v is None else f"{100 * v:.0f}%"

    for r in out["results"]:
        table.add_row(r["policy"], f"{r['cycles']:g}", f"{r['tokens_per_s']:.2f}",
                      f"{r['felt_p50_ms']:.2f}", f"{r['felt_p99_ms']:.2f}", f"{r['other_ms_per_token']:.2f}",
                      f"{r['demand_bytes'] / 1e9:.2f}", f"{r['prefetch_bytes'] / 1e9:.2f}",
                      pct(r["prefetch_precision"]), pct(r["prefetch_coverage"]), f"{r['cpu_ms_per_token']:.2f}")
    note = (f"{out['model'] or out['source']}: k={out['k']}, TD={out['td_bytes'] / 2**20:.1f} MiB "
            f"(--scale {out['scale']}), {out['tokens']} decode tokens; modelled drive and compute, "
            f"the store and its policy real")
    return Group(table, Text(note, style="dim"))

