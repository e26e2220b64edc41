"""``iosched bench-readpath``: the read path against 8 threads of ``os.pread``.

What an engine feels on a miss is the wait of one MoE layer's ``acquire_many`` of k experts
none of which is resident.  This measures only that: a real safetensors checkpoint of
real-size experts (``tools/synth.py``; 2.5 MiB, about a real Q4 expert, and 9 MiB), dropped
from the page cache before every arm (``posix_fadvise(DONTNEED)``), then the same random
sequence of groups of k=8 experts of one layer, consecutive groups from different layers, so
every group is 8 misses for every arm (equal hits: none), every expert once per pass
(``--passes``; later passes re-read what the page cache may still hold), read through

* **handwritten**: what a user writes instead: a ``ThreadPoolExecutor(8)`` of ``os.preadv``
  into a fresh ``bytearray`` per extent (the extents from :func:`iosched.load_index`), on
  buffered descriptors (the page cache's readahead included), awaited with
  ``asyncio.wrap_future``;
* **iosched:BACKEND**: ``ExpertStore`` with policy ``lru`` and a budget of one group, on each
  backend and ``auto``.

Per arm: felt wait per group (``acquire_many`` entered until the views are there) p50 / p99,
MB/s of expert bytes over the whole sequence, process CPU seconds per group (the event loop
and every worker thread: ``time.process_time``), the reads the backend was asked for, and the
loads the page cache served wholly (``stats()["hits_by_tier"]["page_cache"]``).
The arms run in a fresh order each round (rotated), ``--rounds`` rounds, each arm's numbers
are the median over rounds, and ``ratio`` is the median over rounds of the arm's p50 felt wait
divided by the hand-written arm's p50 *in the same round*: the virtual disk's speed swings
2-4x between minutes, so only within-round ratios compare.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import statistics
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from iosched import ExpertLayout, ExpertStore, StoreError, backends, load_index

from . import _command, _runner
from .demo import cache_dir
from .synth import write_safetensors_moe

SHAPES: dict[str, tuple[int, int, int, int]] = {
    # name: (hidden, intermediate, layers, experts per layer); bf16 gate, up, down: 6 bytes per hidden x inter
    "36K": (128, 48, 8, 128),       # 36 KiB x 1024 = 36 MiB: the demo's experts (--scale 16)
    "2.5M": (1024, 427, 3, 128),    # 2.50 MiB x 384 = 961 MiB
    "9M": (2048, 768, 2, 64),       # 9.00 MiB x 128 = 1.13 GiB
}
"""128 and 64 experts per layer, as Qwen3-30B-A3B (128) and other MoE checkpoints have, of which
a group reads 8: with 10 or 40 per layer a group would read most of its layer, and the page
cache's readahead past each expert would be mostly bytes the group wants next, which a real
model's 6 % of a layer does not give it."""
DEFAULT_SIZES = ("2.5M", "9M")
"""A real Q4 expert and a real bf16 one; ``36K`` (the demo's experts) on request."""
GROUP = 8
"""k: the experts one MoE layer routes a token to (Qwen3-30B-A3B and Mixtral's 8)."""
THREADS = 8
"""The hand-written engine's thread pool (``tools/handwritten.py``)."""


def checkpoint(size: str, root: Path | None = None) -> Path:
    """The checkpoint of ``size`` experts, built on first use (build, then rename)."""
    hidden, inter, layers, experts = SHAPES[size]
    target = (root or cache_dir()) / f"readpath-bench-v2-{size}"
    if not (target / ".complete").exists():
        tmp = target.parent / f"{target.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        write_safetensors_moe(tmp, n_layers=layers, n_experts=experts, hidden=hidden, intermediate=inter,
                              dtype="bfloat16", n_shards=2, dense=False)
        (tmp / ".complete").write_text("ok\n")
        shutil.rmtree(target, ignore_errors=True)
        os.rename(tmp, target)
    return target


def drop(files: Sequence[str]) -> None:
    """Drop ``files`` from the page cache (clean pages: DONTNEED evicts them)."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def sequence(keys_by_layer: dict[int, list[Any]], passes: int, seed: int) -> list[list[Any]]:
    """Groups of ``GROUP`` distinct experts of one layer, consecutive groups of different layers
    (so that a budget of one group never hits), every expert once per pass: a pass is a pure
    drive read path, later passes re-read what the page cache may still hold for the buffered
    arms (the hand-written one included), never for the O_DIRECT ones."""
    rng = random.Random(seed)
    layers = sorted(keys_by_layer)
    out: list[list[Any]] = []
    for _ in range(passes):
        chunks = []
        for layer in layers:
            keys = list(keys_by_layer[layer])
            rng.shuffle(keys)
            chunks.append([keys[i:i + GROUP] for i in range(0, len(keys) - GROUP + 1, GROUP)])
        for i in range(max(len(c) for c in chunks)):
            out.extend(c[i] for c in chunks if i < len(c))
    return out


def _summary(waits: list[float], seconds: float, nbytes: int, cpu: float, reads: int) -> dict[str, float]:
    waits = sorted(waits)
    p99 = waits[min(len(waits) - 1, int(round(0.99 * (len(waits) - 1))))]
    return {"p50_ms": 1e3 * statistics.median(waits), "p99_ms": 1e3 * p99, "mean_ms": 1e3 * statistics.fmean(waits),
            "mbps": nbytes / seconds / 1e6, "cpu_ms_per_group": 1e3 * cpu / len(waits),
            "reads": float(reads)}


async def handwritten(files: Sequence[str], layouts: dict[Any, ExpertLayout],
                      groups: list[list[Any]]) -> dict[str, float]:
    """8 threads of ``os.preadv`` into fresh bytearrays, one read per extent."""
    fds = [os.open(p, os.O_RDONLY | os.O_CLOEXEC) for p in files]
    pool = ThreadPoolExecutor(THREADS)

    def read(fd: int, offset: int, length: int) -> bytearray:
        buf = bytearray(length)
        view, done = memoryview(buf), 0
        while done < length:
            n = os.preadv(fd, [view[done:]], offset + done)
            if n == 0:
                raise StoreError("short read")
            done += n
        return buf

    waits, reads, nbytes = [], 0, 0
    try:
        drop(files)
        c0, t0 = time.process_time(), time.perf_counter()
        for group in groups:
            g0 = time.perf_counter()
            futs = [asyncio.wrap_future(pool.submit(read, fds[e.file], e.offset, e.length))
                    for key in group for e in layouts[key].extents]
            bufs = await asyncio.gather(*futs)
            waits.append(time.perf_counter() - g0)
            reads += len(futs)
            nbytes += sum(len(b) for b in bufs)
            del bufs
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        pool.shutdown(wait=True)
        for fd in fds:
            os.close(fd)
    return _summary(waits, seconds, nbytes, cpu, reads)


async def through_store(source: Path, backend: str, layouts: dict[Any, ExpertLayout],
                        groups: list[list[Any]]) -> dict[str, Any]:
    """``ExpertStore`` (``lru``, a budget of one group) on ``backend``."""
    budget = GROUP * max(layout.nbytes for layout in layouts.values())
    async with await ExpertStore.open(source, budget_bytes=budget, backend=backend, policy="lru") as store:
        drop(store.index.files)
        waits, nbytes = [], 0
        c0, t0 = time.process_time(), time.perf_counter()
        for group in groups:
            g0 = time.perf_counter()
            async with store.acquire_many(group) as views:
                waits.append(time.perf_counter() - g0)
                nbytes += sum(v.data.nbytes for v in views)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        s = store.stats()
    reads = sum(int(d["reads"]) for d in s["per_device"].values())
    out: dict[str, Any] = _summary(waits, seconds, nbytes, cpu, reads)
    out["backend"] = s["backend"]
    out["page_cache_served"] = float(s["hits_by_tier"]["page_cache"])
    if backend == "auto":
        out["backend_reason"] = s["backend_reason"]
    return out


async def run(sizes: Sequence[str], arms: Sequence[str], rounds: int, passes: int, seed: int,
              root: Path | None, rotate: int = 0) -> dict[str, Any]:
    rows = []
    groups: dict[str, int] = {}
    for size in sizes:
        source = checkpoint(size, root)
        index = load_index(source)
        layouts = dict(index.experts)
        by_layer: dict[int, list[Any]] = {}
        for key in sorted(layouts):
            by_layer.setdefault(key[0], []).append(key)
        seq = sequence(by_layer, passes, seed)
        groups[size] = len(seq)
        runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
        for r in range(rotate, rotate + rounds):
            order = list(arms[r % len(arms):]) + list(arms[:r % len(arms)])  # rotated each round
            for arm in order:
                if arm == "handwritten":
                    runs[arm].append(await handwritten(index.files, layouts, seq))
                else:
                    runs[arm].append(await through_store(source, arm.split(":", 1)[1], layouts, seq))
        base = runs.get("handwritten")
        for arm in arms:
            per = runs[arm]
            row: dict[str, Any] = {"size": size, "expert_bytes": next(iter(layouts.values())).nbytes, "arm": arm}
            for metric in ("p50_ms", "p99_ms", "mean_ms", "mbps", "cpu_ms_per_group", "reads", "page_cache_served"):
                if metric not in per[0]:
                    continue
                row[metric] = statistics.median(p[metric] for p in per)
            row["p50_runs"] = [round(p["p50_ms"], 2) for p in per]
            if base is not None:
                row["ratio"] = statistics.median(p["p50_ms"] / b["p50_ms"] for p, b in zip(per, base, strict=True))
                row["ratio_mean"] = statistics.median(p["mean_ms"] / b["mean_ms"]
                                                      for p, b in zip(per, base, strict=True))
            for extra in ("backend", "backend_reason"):
                if extra in per[0]:
                    row[extra] = per[0][extra]
            rows.append(row)
    return {"rounds": rounds, "passes": passes, "group": GROUP, "threads": THREADS, "rows": rows,
            "groups": groups}


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("bench-readpath",
                       help="cold misses of k=8 experts: iosched's backends against 8 threads of pread")
    p.add_argument("--sizes", default=",".join(DEFAULT_SIZES),
                   help=f"expert sizes, of {', '.join(SHAPES)} (default {','.join(DEFAULT_SIZES)})")
    p.add_argument("--backends", default="pread,odirect,mmap,uring,auto",
                   help="iosched backends to compare (default: all four and auto)")
    p.add_argument("--rounds", type=_command.positive_int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--passes", type=_command.positive_int, default=1,
                   help="passes over every expert per arm and round (default 1: each read once, from the "
                        "drive; more: re-reads the page cache may serve to the buffered arms)")
    p.add_argument("--seed", type=_command.non_negative_int, default=0, help="seed of the expert sequence")
    p.add_argument("--rotate", type=_command.non_negative_int, default=0,
                   help="start the arms' rotation here (a driver running one round per process, "
                        "alternating two trees, passes the round number)")
    p.add_argument("--dir", default=None, help="where the checkpoints are written (default: the cache folder)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=cmd)


def cmd(args: argparse.Namespace) -> dict[str, Any]:
    sizes = [s for s in args.sizes.split(",") if s]
    names = [b for b in args.backends.split(",") if b]
    if not sizes or any(s not in SHAPES for s in sizes):
        raise StoreError(f"--sizes: choose among {', '.join(SHAPES)}, got {args.sizes!r}")
    for name in names:
        if name != "auto":
            backends.resolve(name)  # a StoreError naming it, when it cannot run here
    arms = ["handwritten", *(f"iosched:{n}" for n in names)]
    root = Path(args.dir) if args.dir else None
    out = _runner.run(lambda: run(sizes, arms, args.rounds, args.passes, args.seed, root, args.rotate))
    if not args.json:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"cold acquire_many of {GROUP} misses: felt wait per group "
                            f"(median of {args.rounds} rounds)")
        for col in ("size", "arm", "p50 ms", "p99 ms", "MB/s", "CPU ms/group", "reads", "p50 vs handwritten"):
            table.add_column(col, justify="right")
        for r in out["rows"]:
            table.add_row(r["size"], r["arm"] + (f" ({r['backend']})" if r["arm"].endswith("auto") else ""),
                          f"{r['p50_ms']:.1f}", f"{r['p99_ms']:.1f}", f"{r['mbps']:.0f}",
                          f"{r['cpu_ms_per_group']:.2f}", f"{r['reads']:.0f}", f"{r.get('ratio', 1.0):.2f}x")
        Console().print(table)
    return out


def main(argv: Sequence[str] | None = None) -> int:  # pragma: no cover - via tools.cli
    return _command.run_one("bench-readpath", add_parser, argv)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
