"""``iosched bench-verify``: what ``verify="reads"`` costs, side by side with ``"off"``.

For each expert size (36 KiB, Qwen3-30B-A3B's bf16 expert scaled by 16; 2.5 MiB, about a real
Q4 expert; 16 MiB, a large bf16 expert) a real safetensors checkpoint is written once into the
cache folder (``tools/synth.py``), with its manifest.  Each arm reads every expert once through
``ExpertStore`` (``acquire_many`` of 8 at a time, an engine's k), on one backend, either
**cold** (the checkpoint dropped from the page cache first; the O_DIRECT backends read the
drive anyway) or **warm** (the files read whole into the page cache first; buffered backends
only), with verification off and on.  The two verify arms of one (size, backend, cache) run
back to back, in alternating order, ``--reps`` times: the disk's speed swings between minutes,
so only side-by-side medians are compared.  Also measured: XXH3's own throughput over
buffers not in the CPU cache (a 256 MiB array walked in expert-sized steps), and what one hash
costs on the event loop against a worker thread's round trip (``hash_placement_us``: the
measurement behind ``THREAD_BYTES`` in ``iosched/formats/_verify.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from iosched import ExpertStore, StoreError, backends, write_manifest

from . import _command, _runner
from .demo import cache_dir
from .synth import write_safetensors_moe

SHAPES: dict[str, tuple[int, int, int, int]] = {
    # name: (hidden, intermediate, layers, experts per layer); bf16, 3 tensors: 6 bytes per hidden x inter
    "36K": (128, 48, 4, 512),       # 36 KiB x 2048 experts = 72 MiB
    "2.5M": (1024, 427, 4, 24),     # 2.50 MiB x 96 = 240 MiB
    "16M": (2048, 1366, 2, 8),      # 16.0 MiB x 16 = 256 MiB
}
BUFFERED = ("pread", "mmap")
"""Backends that read through the page cache, so a warm run differs from a cold one."""
GROUP = 8


def checkpoint(size: str) -> Path:
    """The checkpoint of ``size`` experts with its manifest, built on first use."""
    hidden, inter, layers, experts = SHAPES[size]
    target = cache_dir() / f"verify-bench-v1-{size}"
    if not (target / ".complete").exists():
        tmp = target.parent / f"{target.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        write_safetensors_moe(tmp, n_layers=layers, n_experts=experts, hidden=hidden, intermediate=inter,
                              dtype="bfloat16", n_shards=2, dense=False)
        write_manifest(tmp)
        (tmp / ".complete").write_text("ok\n")
        shutil.rmtree(target, ignore_errors=True)
        os.rename(tmp, target)
    return target


def _cache(files: Sequence[str], warm: bool) -> None:
    for path in files:
        if warm:
            with open(path, "rb", buffering=0) as f:
                while f.read(8 << 20):
                    pass
        else:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


async def _arm(source: Path, backend: str, warm: bool, verify: str) -> dict[str, float]:
    """Every expert once; MB/s of expert bytes, and the share of the time spent hashing."""
    async with await ExpertStore.open(source, budget_bytes=1 << 30, backend=backend, policy="lru",
                                      verify=verify) as store:
        keys = sorted(store.index.experts)
        _cache(store.index.files, warm)
        t0 = time.perf_counter()
        for i in range(0, len(keys), GROUP):
            async with store.acquire_many(keys[i:i + GROUP]):
                pass
        seconds = time.perf_counter() - t0
        s = store.stats()
    nbytes = sum(layout.nbytes for layout in store.index.experts.values())
    return {"mbps": nbytes / seconds / 1e6, "verify_share": s["verify_s"] / seconds,
            "verified_bytes": s["verified_bytes"]}


def hash_throughput(sizes: Sequence[int], total: int = 256 << 20) -> dict[str, dict[str, float]]:
    """GB/s of xxh3_128 and xxh3_64 over ``total`` bytes not in the CPU cache, in steps of each size."""
    data = np.random.default_rng(0).integers(0, 255, total, dtype=np.uint8)
    view = data.data
    out: dict[str, dict[str, float]] = {}
    for name, fn in (("xxh3_128", xxhash.xxh3_128_intdigest), ("xxh3_64", xxhash.xxh3_64_intdigest)):
        row = {}
        for size in sizes:
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                for at in range(0, total - size + 1, size):
                    fn(view[at:at + size])
                times.append(time.perf_counter() - t0)
            row[str(size)] = (total // size) * size / statistics.median(times) / 1e9
        out[name] = row
    return out


async def hash_placement(sizes: Sequence[int] = (64 << 10, 1 << 20, 4 << 20, 16 << 20),
                         n: int = 200) -> dict[str, dict[str, float]]:
    """Median µs of one xxh3_128 of each size on the loop, and through ``asyncio.to_thread``."""
    data = memoryview(os.urandom(max(sizes)))
    out: dict[str, dict[str, float]] = {}
    for size in sizes:
        view, inline, thread = data[:size], [], []
        for _ in range(n):
            t0 = time.perf_counter()
            xxhash.xxh3_128_intdigest(view)
            t1 = time.perf_counter()
            await asyncio.to_thread(xxhash.xxh3_128_intdigest, view)
            inline.append(t1 - t0)
            thread.append(time.perf_counter() - t1)
        out[str(size)] = {"inline_us": statistics.median(inline) * 1e6,
                          "to_thread_us": statistics.median(thread) * 1e6}
    return out


async def run(sizes: Sequence[str], names: Sequence[str], reps: int) -> dict[str, Any]:
    rows = []
    sources = {size: checkpoint(size) for size in sizes}
    for size in sizes:
        for backend in names:
            for warm in ((False, True) if backend in BUFFERED else (False,)):
                arms: dict[str, list[dict[str, float]]] = {"off": [], "reads": []}
                for rep in range(reps):
                    for verify in (("off", "reads") if rep % 2 == 0 else ("reads", "off")):
                        arms[verify].append(await _arm(sources[size], backend, warm, verify))
                off = statistics.median(a["mbps"] for a in arms["off"])
                on = statistics.median(a["mbps"] for a in arms["reads"])
                rows.append({"size": size, "expert_bytes": 6 * SHAPES[size][0] * SHAPES[size][1],
                             "backend": backend, "cache": "warm" if warm else "cold",
                             "off_mbps": off, "reads_mbps": on, "cost_pct": 100.0 * (off - on) / off,
                             "verify_share": statistics.median(a["verify_share"] for a in arms["reads"]),
                             "off_runs": [a["mbps"] for a in arms["off"]],
                             "reads_runs": [a["mbps"] for a in arms["reads"]]})
    hashes = hash_throughput([6 * SHAPES[s][0] * SHAPES[s][1] for s in sizes])
    return {"reps": reps, "group": GROUP, "rows": rows, "hash_gbps": hashes,
            "hash_placement_us": await hash_placement()}


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("bench-verify", help="the cost of verify='reads' against 'off', per size and backend")
    p.add_argument("--sizes", default=",".join(SHAPES), help=f"expert sizes, of {', '.join(SHAPES)} (default all)")
    p.add_argument("--backends", default="pread,odirect,mmap,uring", help="backends (default all four)")
    p.add_argument("--reps", type=_command.positive_int, default=5, help="interleaved repetitions per arm (default 5)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=cmd)


def cmd(args: argparse.Namespace) -> dict[str, Any]:
    sizes = [s for s in args.sizes.split(",") if s]
    names = [b for b in args.backends.split(",") if b]
    unknown = [s for s in sizes if s not in SHAPES]
    if unknown or not sizes:
        raise StoreError(f"--sizes: choose among {', '.join(SHAPES)}, got {args.sizes!r}")
    for name in names:
        backends.resolve(name)  # a StoreError naming it, when it cannot run here
    if args.reps <= 0:
        raise StoreError("--reps must be positive")
    out = _runner.run(lambda: run(sizes, names, args.reps))
    if not args.json:
        from rich.console import Console
        from rich.table import Table

        table = Table(title="verify='reads' against 'off' (median MB/s of expert bytes)")
        for col in ("size", "backend", "cache", "off", "reads", "cost", "hashing"):
            table.add_column(col, justify="right")
        for r in out["rows"]:
            table.add_row(r["size"], r["backend"], r["cache"], f"{r['off_mbps']:.0f}", f"{r['reads_mbps']:.0f}",
                          f"{r['cost_pct']:.1f} %", f"{100 * r['verify_share']:.1f} %")
        Console().print(table)
    return out


def main(argv: Sequence[str] | None = None) -> int:  # pragma: no cover - via tools.cli
    return _command.run_one("bench-verify", add_parser, argv)
