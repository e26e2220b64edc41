"""``iosched contention``: how waiting for room scales with the number of waiters.

Many acquires at once against a budget of a few experts: all but a few must wait for room,
and each lease that ends lets the next one in.  If a release woke every waiter (each then
retrying its reservation, all but one failing), N waiters would cost O(N) per release and
O(N²) in all; the store passes one wake-up along instead (``iosched/runtime/_room.py``), O(1) per
release.  This command measures it on a real (tiny) checkpoint read through the page cache:
``N`` concurrent acquires of random experts, each holding its lease for one event-loop turn,
under a budget of ``--budget-experts`` experts, for each ``N`` of ``--acquires``; the time to
serve them all, and its ratio to the first ``N``'s (10x the acquires should take about 10x the
time).  Results: docs/reliability.md, "Waiting for room".
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from iosched import ExpertStore, load_index

from . import _command, _runner
from .synth import write_safetensors_moe

LAYERS, EXPERTS = 4, 8


async def _serve(folder: Path, n: int, budget_experts: int, seed: int) -> dict[str, Any]:
    one = max(layout.nbytes for layout in load_index(folder).experts.values())
    rng = random.Random(seed)
    keys = [(rng.randrange(LAYERS), rng.randrange(EXPERTS)) for _ in range(n)]
    async with await ExpertStore.open(folder, budget_bytes=budget_experts * one, backend="pread",
                                      policy="lru") as store:

        async def one_acquire(key: tuple[int, int]) -> None:
            async with store.acquire(key):
                await asyncio.sleep(0)  # hold the lease across one turn of the loop

        t0 = time.perf_counter()
        await asyncio.gather(*(one_acquire(key) for key in keys))
        seconds = time.perf_counter() - t0
        stats = store.stats()
    return {"acquires": n, "seconds": seconds, "requests": stats["requests"], "misses": stats["misses"],
            "us_per_acquire": 1e6 * seconds / n}


def measure(acquires: list[int], budget_experts: int, seed: int = 1, reps: int = 5) -> dict[str, Any]:
    """One row per count of concurrent acquires: the median over ``reps`` runs (the counts
    interleaved, so a noisy minute spreads over all of them), with its time relative to the
    first row's, and per acquire relative to the first row's (1.0: linear)."""
    with tempfile.TemporaryDirectory(prefix="iosched-contention-") as tmp:
        folder = write_safetensors_moe(tmp, n_layers=LAYERS, n_experts=EXPERTS, hidden=64, intermediate=32,
                                       dtype="float16")
        runs: dict[int, list[dict[str, Any]]] = {n: [] for n in acquires}
        for _ in range(reps):
            for n in acquires:
                runs[n].append(_runner.run(functools.partial(_serve, folder, n, budget_experts, seed)))
    rows = []
    for n in acquires:
        ordered = sorted(runs[n], key=lambda row: row["seconds"])
        row = dict(ordered[len(ordered) // 2])
        row["runs_seconds"] = [r["seconds"] for r in runs[n]]
        rows.append(row)
    base = rows[0]
    for row in rows:
        row["time_ratio"] = row["seconds"] / base["seconds"]
        row["per_acquire_ratio"] = row["us_per_acquire"] / base["us_per_acquire"]
    return {"budget_experts": budget_experts, "reps": reps, "rows": rows}


def add_parser(sub: _command.SubParsers[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("contention", help="concurrent acquires against a budget of a few experts: "
                                          "how waiting for room scales")
    p.add_argument("--acquires", type=_command.int_list, default=[2000, 20000],
                   help="counts of concurrent acquires, comma-separated (default 2000,20000)")
    p.add_argument("--budget-experts", type=_command.positive_int, default=2,
                   help="the budget, in experts (default 2)")
    p.add_argument("--seed", type=int, default=1, help="seed of the random keys")
    p.add_argument("--reps", type=_command.positive_int, default=5,
                   help="runs per count, interleaved; the median is reported (default 5)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=_cmd)


def _cmd(args: argparse.Namespace) -> dict[str, Any]:
    out = measure(args.acquires, args.budget_experts, args.seed, args.reps)
    if not args.json:
        from rich.console import Console

        console = Console()
        for row in out["rows"]:
            console.print(f"{row['acquires']:>7d} acquires on a {out['budget_experts']}-expert budget: "
                          f"{row['seconds']:.2f} s ({row['us_per_acquire']:.1f} µs each, "
                          f"x{row['time_ratio']:.1f} the first row's time)")
    return out
