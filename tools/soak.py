"""``iosched soak``: a long concurrent run against a faulty mirror that checks every byte.

1. Builds once, in the cache folder, a small real safetensors checkpoint and a mirror copy
   (36 KiB bf16 experts; Qwen3-30B-A3B's aspect ratio scaled down like the demo's).
2. Computes every expert's expected checksum (BLAKE2b) from the primary's files with plain
   reads, independent of the store's read path.
3. Opens the store over both replicas with a :class:`iosched.backends.faults.FaultyBackend` around the
   real backend: reads of the mirror fail with EIO, come back short, or stall for a latency
   spike, each with probability ``--fault-rate``.  The primary is healthy, so every acquire
   must succeed, by failover when its read went to the mirror.
4. ``--tasks`` tasks issue ``acquire`` and ``acquire_many`` (1 to ``--group`` experts) of
   random experts until ``--acquires`` expert acquires were issued, hold each lease across a
   loop iteration, and cancel a ``--cancel-rate`` fraction of them at a random point (before
   the call, while it waits for room or a read, or while the lease is held).  Every view
   received is hashed and compared to the expected checksum.
   With ``--verify`` the store checks every read against the checkpoint's manifest (written
   into the checkpoint's folder first) and ``--corrupt-rate`` flips a byte in that fraction of
   the mirror's reads: every one must be caught (a mismatch, then a read of the primary), or
   the byte check of step 4 counts wrong bytes.  Corruption without ``--verify`` is served, so
   such a run is a negative control: it is expected to fail.
5. A sampler task checks ``resident_bytes <= budget_bytes`` on every event-loop iteration;
   every 256 operations a worker runs ``check_invariants()``.
6. At the end, when the loads still in flight have finished: leases still held (leaked),
   retries, failovers, faults injected, p50/p99 acquire latency, and peak RSS (``VmHWM``, reset
   just before the store opens) against the budget and the RSS before the store opened.

``ok`` is true when wrong bytes, budget excursions, leaked leases, failed acquires and
invariant violations are all zero; otherwise the command exits with status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import math
import os
import random
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from iosched import (
    CheckpointIndex,
    ExpertKey,
    ExpertStore,
    StoreError,
    backends,
        load_index,
    write_manifest,
)
from iosched.backends.faults import FaultPlan, FaultyBackend

from . import _command, _runner
from .demo import cache_dir
from .synth import write_safetensors_moe

CHECKPOINT_VERSION = 1
HIDDEN, INTERMEDIATE = 128, 48
"""Qwen3-30B-A3B's expert (2048 x 768) divided by 16: 36 KiB per bf16 expert."""


@dataclass(frozen=True)
class SoakConfig:
    acquires: int = 100_000
    tasks: int = 16
    group: int = 4
    cancel_rate: float = 0.05
    fault_rate: float = 0.05
    spike_s: float = 0.002
    budget_experts: int = 64
    backend: str = "auto"
    seed: int = 0
    layers: int = 8
    experts: int = 32
    policy: str = "moe"
    """The residency policy; the store is told k = ``group`` (the largest batch).  ``moe``:
    its prefetches and their pacing run under the faults all along (``default`` and ``coact``
    may turn theirs off after a few tokens when it does not pay: residency/default/_trial.py)."""
    verify: bool = False
    """Open with ``verify="reads"`` (the manifest is written on first use)."""
    corrupt_rate: float = 0.0
    """Per mirror read: the chance that one byte of what it returned is flipped."""

    def check(self) -> None:
        if self.acquires <= 0 or self.tasks <= 0 or self.group <= 0 or self.layers <= 0 or self.experts <= 0:
            raise StoreError("--acquires, --tasks, --group, --layers and --experts must be positive")
        if (not 0 <= self.cancel_rate <= 1 or not 0 <= self.fault_rate <= 1 or not 0 <= self.corrupt_rate <= 1
                or self.spike_s < 0):
            raise StoreError("--cancel-rate, --fault-rate and --corrupt-rate must be in [0, 1], "
                             "--spike-ms not negative")
        if self.group > self.experts:
            raise StoreError("--group cannot exceed --experts")
        if self.budget_experts < self.tasks * self.group:
            # Each task may hold a partial group's leases while its other members wait for room:
            # below tasks x group experts the tasks can hold the whole budget between them.
            raise StoreError(f"--budget-experts must be at least --tasks x --group "
                             f"({self.tasks * self.group}), got {self.budget_experts}")


def soak_checkpoint(layers: int, experts: int) -> tuple[Path, Path]:
    """The soak's checkpoint and its mirror, built on first use (build, then rename)."""
    name = f"soak-v{CHECKPOINT_VERSION}-{layers}x{experts}-{HIDDEN}x{INTERMEDIATE}"
    target = cache_dir() / name
    if not (target / ".complete").exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.parent / f"{name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        write_safetensors_moe(tmp / "primary", n_layers=layers, n_experts=experts, hidden=HIDDEN,
                              intermediate=INTERMEDIATE, dtype="bfloat16", n_shards=2, seed=0)
        shutil.copytree(tmp / "primary", tmp / "mirror")
        (tmp / ".complete").write_text("ok\n")
        try:
            os.rename(tmp, target)
        except OSError:  # another process built it first
            shutil.rmtree(tmp, ignore_errors=True)
    return target / "primary", target / "mirror"


def _digest(data: Any) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def expected_digests(index: CheckpointIndex) -> dict[ExpertKey, bytes]:
    """Every expert's checksum from plain file reads of its extents."""
    out: dict[ExpertKey, bytes] = {}
    handles = [open(path, "rb") for path in index.files]
    try:
        for key, layout in index.experts.items():
            h = hashlib.blake2b(digest_size=16)
            for ext in layout.extents:
                f = handles[ext.file]
                f.seek(ext.offset)
                h.update(f.read(ext.length))
            out[key] = h.digest()
    finally:
        for f in handles:
            f.close()
    return out


def _proc_status(field_name: str) -> int:
    """A ``VmRSS``/``VmHWM`` style field of /proc/self/status, in bytes (0 when unavailable)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    if field_name == "VmHWM":
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return 0


def _reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current RSS (Linux >= 4.0: write 5 to clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class _Histogram:
    """Latencies in log-spaced bins (1 µs to 100 s, 0.5 % wide): constant memory however
    long the run, so the soak's own bookkeeping does not grow the RSS it measures."""

    LO, HI, BINS = 1e-6, 100.0, 4000

    def __init__(self) -> None:
        self.counts = [0] * (self.BINS + 2)
        self.n = 0
        self._scale = self.BINS / math.log(self.HI / self.LO)

    def add(self, seconds: float) -> None:
        i = 0 if seconds <= self.LO else 1 + min(self.BINS, int(math.log(seconds / self.LO) * self._scale))
        self.counts[i] += 1
        self.n += 1

    def quantile(self, q: float) -> float:
        """The geometric middle of the bin holding quantile ``q`` (0.0 when empty)."""
        if not self.n:
            return 0.0
        rank, seen = q * (self.n - 1), 0
        for i, count in enumerate(self.counts):
            seen += count
            if seen > rank:
                if i == 0:
                    return self.LO
                return float(self.LO * math.exp((i - 0.5) / self._scale))
        return self.HI


class _Counters:
    def __init__(self) -> None:
        self.issued = self.completed = self.cancelled = self.failed = 0
        self.ops = self.group_ops = 0
        self.verified = self.wrong_bytes = 0
        self.excursions = self.samples = self.invariant_violations = 0
        self.peak_resident = 0
        self.latency = _Histogram()
        self.errors: list[str] = []


async def run(config: SoakConfig, progress: Any = None) -> dict[str, Any]:
    config.check()
    primary, mirror = await asyncio.to_thread(soak_checkpoint, config.layers, config.experts)
    index = await asyncio.to_thread(load_index, primary)
    if config.verify:  # written afresh each time (milliseconds here): never a stale one
        await asyncio.to_thread(write_manifest, primary)
    digests = await asyncio.to_thread(expected_digests, index)
    keys = sorted(index.experts)
    layers: dict[int, list[ExpertKey]] = {}
    for key in keys:
        layers.setdefault(key[0], []).append(key)
    by_layer = list(layers.values())
    expert_bytes = max(layout.nbytes for layout in index.experts.values())
    budget = config.budget_experts * expert_bytes
    name, _ = await asyncio.to_thread(backends.resolve, config.backend, index.files)
    rate = config.fault_rate
    plan = FaultPlan.on(str(mirror), seed=config.seed, eio_rate=rate, short_rate=rate,
                        spike_rate=rate, spike_s=config.spike_s, corrupt_rate=config.corrupt_rate)
    faulty = FaultyBackend(backends.create(name), plan)
    c = _Counters()
    rss_baseline = _proc_status("VmRSS")
    peak_reset = _reset_peak_rss()
    task = progress.add_task("soak", total=config.acquires) if progress is not None else None
    done = asyncio.Event()
    t_start = time.perf_counter()

    async with await ExpertStore.open(primary, budget_bytes=budget, backend=faulty, mirrors=[mirror],
                                      policy=config.policy, experts_per_token=config.group,
                                      verify="reads" if config.verify else "off") as store:
        async def sampler() -> None:
            # the cheap gauges, not stats(): this runs at every await of the soak
            while not done.is_set():
                used = store.resident_bytes
                c.samples += 1
                if used > c.peak_resident:
                    c.peak_resident = used
                if used > store.budget_bytes:
                    c.excursions += 1
                await asyncio.sleep(0)

        def verify(key: ExpertKey, data: np.ndarray[Any, Any]) -> None:
            c.verified += 1
            if _digest(data) != digests[key]:
                c.wrong_bytes += 1
                if len(c.errors) < 10:
                    c.errors.append(f"wrong bytes for expert {key}")

        async def one_op(batch: list[ExpertKey]) -> None:
            t0 = time.perf_counter()
            if len(batch) == 1:
                async with store.acquire(batch[0]) as view:
                    c.latency.add(time.perf_counter() - t0)
                    verify(batch[0], view.data)
                    await asyncio.sleep(0)  # hold the lease across a loop iteration
            else:
                async with store.acquire_many(batch) as views:
                    c.latency.add(time.perf_counter() - t0)
                    for key, view in zip(batch, views, strict=True):
                        verify(key, view.data)
                    await asyncio.sleep(0)

        def check_mid_run() -> None:
            try:
                store.check_invariants()
            except AssertionError as error:
                c.invariant_violations += 1
                if len(c.errors) < 10:
                    c.errors.append(f"invariant: {error}")

        async def worker(wid: int) -> None:
            rng = random.Random(config.seed * 100_003 + wid)
            while c.issued < config.acquires:
                n = 1 if config.group == 1 or rng.random() < 0.5 else rng.randint(2, config.group)
                n = min(n, config.acquires - c.issued)
                batch = rng.sample(by_layer[rng.randrange(len(by_layer))], n)
                c.issued += n
                c.ops += 1
                c.group_ops += n > 1
                op = asyncio.ensure_future(one_op(batch))
                if rng.random() < config.cancel_rate:
                    when = rng.random()
                    if when < 0.3:
                        pass  # cancelled before it ever ran
                    elif when < 0.6:
                        await asyncio.sleep(0)
                    else:
                        await asyncio.wait({op}, timeout=rng.random() * 0.002)
                    op.cancel()
                try:
                    await op
                    c.completed += n
                except asyncio.CancelledError:
                    if not op.cancelled():
                        raise
                    c.cancelled += n
                except StoreError as exc:
                    c.failed += n
                    if len(c.errors) < 10:
                        c.errors.append(f"{type(exc).__name__}: {exc}")
                if c.ops % 256 == 0:
                    check_mid_run()
                if progress is not None and c.ops % 64 == 0:
                    progress.update(task, completed=c.issued)

        sampling = asyncio.ensure_future(sampler())
        await asyncio.gather(*(worker(i) for i in range(config.tasks)))
        # Loads whose acquirers were cancelled still finish and publish; wait for them.
        deadline = time.monotonic() + 30
        while store.stats()["loading"] and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        done.set()
        await sampling
        seconds = time.perf_counter() - t_start
        if progress is not None:
            progress.update(task, completed=c.issued)
        try:
            store.check_invariants()
        except AssertionError as exc:
            c.invariant_violations += 1
            c.errors.append(f"invariant: {exc}")
        s = store.stats()
    rss_peak = _proc_status("VmHWM")
    faults = s["backend_info"]["faults"]
    leaked = s["leased"]
    ok = (c.wrong_bytes == 0 and c.excursions == 0 and leaked == 0 and c.failed == 0
          and c.invariant_violations == 0)
    return {
        "ok": ok,
        "config": asdict(config),
        "checkpoint": str(primary), "mirror": str(mirror), "backend": s["backend"],
        "experts_in_checkpoint": len(keys), "expert_bytes": expert_bytes,
        "seconds": seconds,
        "acquires": c.issued, "completed": c.completed, "cancelled": c.cancelled, "failed": c.failed,
        "operations": c.ops, "acquire_many_operations": c.group_ops,
        "acquires_per_s": c.issued / seconds if seconds else 0.0,
        "verified_views": c.verified, "wrong_bytes": c.wrong_bytes,
        "budget_bytes": budget, "peak_resident_bytes": c.peak_resident,
        "budget_samples": c.samples, "excursions": c.excursions,
        "leaked_leases": leaked, "invariant_violations": c.invariant_violations,
        "retries": s["retries"], "failovers": s["failovers"], "load_errors": s["load_errors"],
        "faults_injected": {k: faults[k] for k in ("reads", "eio", "short", "spike", "corrupt")},
        "verify": s["verify"], "verified_bytes": s["verified_bytes"],
        "verify_mismatches": s["verify_mismatches"], "verify_retries": s["verify_retries"],
        "verify_s": s["verify_s"],
        "per_replica": s["per_replica"],
        "hits": s["hits"], "misses": s["misses"], "single_flight_joins": s["single_flight_joins"],
        "requests": s["requests"],
        "latency_p50_ms": c.latency.quantile(0.50) * 1e3,
        "latency_p99_ms": c.latency.quantile(0.99) * 1e3,
        "rss_baseline_bytes": rss_baseline, "rss_peak_bytes": rss_peak,
        "rss_peak_reset": peak_reset,
        "rss_growth_bytes": rss_peak - rss_baseline,
        "overhead_bytes": rss_peak - budget,
        "overhead_over_baseline_bytes": rss_peak - rss_baseline - budget,
        "errors": c.errors,
    }


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    d = SoakConfig()
    p = sub.add_parser("soak", help="long concurrent run with faults on one replica; checks every byte")
    p.add_argument("--acquires", type=_command.positive_int, default=d.acquires,
                   help=f"expert acquires to issue (default {d.acquires})")
    p.add_argument("--tasks", type=_command.positive_int, default=d.tasks,
                   help=f"concurrent tasks (default {d.tasks})")
    p.add_argument("--group", type=_command.positive_int, default=d.group,
                   help=f"largest acquire_many (default {d.group})")
    p.add_argument("--cancel-rate", type=_command.fraction, default=d.cancel_rate,
                   help=f"fraction of operations cancelled at a random point (default {d.cancel_rate})")
    p.add_argument("--fault-rate", type=_command.fraction, default=d.fault_rate,
                   help=f"per mirror read: chance of EIO, of a short read, of a spike, each (default {d.fault_rate})")
    p.add_argument("--spike-ms", type=_command.non_negative_float, default=d.spike_s * 1e3,
                   help="latency spike (default 2 ms)")
    p.add_argument("--budget-experts", type=_command.positive_int, default=d.budget_experts,
                   help=f"budget in experts (default {d.budget_experts}; at least tasks x group)")
    p.add_argument("--layers", type=_command.positive_int, default=d.layers)
    p.add_argument("--experts", type=_command.positive_int, default=d.experts, help="experts per layer")
    p.add_argument("--backend", default=d.backend)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--policy", default=d.policy, help=f"residency policy (default {d.policy})")
    p.add_argument("--verify", action="store_true",
                   help="check every read against the checkpoint's manifest (verify='reads')")
    p.add_argument("--corrupt-rate", type=_command.fraction, default=d.corrupt_rate,
                   help="per mirror read: chance that a byte of it is flipped (default 0; "
                        "without --verify the wrong bytes are served and the soak fails)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=cmd)


def cmd(args: argparse.Namespace) -> dict[str, Any]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    config = SoakConfig(
        acquires=args.acquires, tasks=args.tasks, group=args.group, cancel_rate=args.cancel_rate,
        fault_rate=args.fault_rate, spike_s=args.spike_ms / 1e3, budget_experts=args.budget_experts,
        backend=args.backend, seed=args.seed, layers=args.layers, experts=args.experts,
        policy=args.policy, verify=args.verify, corrupt_rate=args.corrupt_rate,
    )
    config.check()
    err = Console(stderr=True)
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("acquires"), TimeRemainingColumn(), console=err,
                  disable=not err.is_terminal) as progress:
        out = _runner.run(lambda: run(config, progress))
    if not args.json:
        from rich.table import Table

        table = Table(title=f"soak: {'ok' if out['ok'] else 'FAILED'}")
        table.add_column("")
        table.add_column("value", justify="right")
        mib = 1 << 20
        rows = [
            ("acquires (completed / cancelled / failed)",
             f"{out['acquires']} ({out['completed']} / {out['cancelled']} / {out['failed']})"),
            ("wrong bytes", str(out["wrong_bytes"])),
            ("budget excursions", f"{out['excursions']} in {out['budget_samples']} samples"),
            ("leaked leases", str(out["leaked_leases"])),
            ("retries / failovers", f"{out['retries']} / {out['failovers']}"),
            ("verify: bytes / mismatches / retries",
             f"{out['verify']}: {out['verified_bytes']} / {out['verify_mismatches']} / {out['verify_retries']}"),
            ("faults injected", ", ".join(f"{k} {v}" for k, v in out["faults_injected"].items())),
            ("acquire latency p50 / p99", f"{out['latency_p50_ms']:.3f} / {out['latency_p99_ms']:.3f} ms"),
            ("budget / peak resident", f"{out['budget_bytes'] / mib:.1f} / {out['peak_resident_bytes'] / mib:.1f} MiB"),
            ("RSS before open / peak",
             f"{out['rss_baseline_bytes'] / mib:.1f} / {out['rss_peak_bytes'] / mib:.1f} MiB"),
            ("seconds", f"{out['seconds']:.1f} ({out['acquires_per_s']:.0f} acquires/s)"),
        ]
        for row in rows:
            table.add_row(*row)
        Console().print(table)
        for line in out["errors"]:
            err.print(f"[red]{line}[/red]")
    if not out["ok"]:
        if args.json:
            import json

            print(json.dumps(out, sort_keys=True))
        raise SystemExit(1)
    return out


def main(argv: Sequence[str] | None = None) -> int:  # pragma: no cover - via tools.cli
    return _command.run_one("soak", add_parser, argv)
