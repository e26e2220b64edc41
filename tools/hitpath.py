"""``iosched hitpath``: what ``acquire`` costs when the expert is already resident.

The hit path is the floor under every token: with k experts per layer and dozens of layers,
a few microseconds per acquire add up to a fraction of a millisecond per token.  Measured
here on a real (tiny) checkpoint, median over interleaved repetitions per event loop, so a
noisy neighbour shows up as spread rather than as a wrong median.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from iosched import ExpertStore

from . import _runner
from .synth import write_safetensors_moe

LAYERS = 8
"""Layers of the benchmark's checkpoint: acquires walk them in order, as a token does, so a
structure-aware policy sees one batch per layer (and its once-per-cycle work once in 8)."""


async def _one_rep(folder: Path, n: int, k: int, policy: str) -> tuple[float, float, float, float, float]:
    async with await ExpertStore.open(folder, budget_bytes=1 << 30, policy=policy,
                                      experts_per_token=k) as store:
        by_layer = [[(layer, e) for e in range(k)] for layer in range(LAYERS)]
        for keys in by_layer:  # everything resident first
            async with store.acquire_many(keys):
                pass
        walk = [key for keys in by_layer for key in keys]
        t0 = time.perf_counter()
        for i in range(n):
            async with store.acquire(walk[i % len(walk)]):
                pass
        single = (time.perf_counter() - t0) / n
        groups = max(1, n // k)
        t0 = time.perf_counter()
        for i in range(groups):
            async with store.acquire_many(by_layer[i % LAYERS]):
                pass
        group = (time.perf_counter() - t0) / groups
        # As an engine runs it: an await (its compute) between layers, during which the store
        # does the policy's batch-end work; only acquire_many itself is on the engine's path.
        held = awaited = 0.0
        for i in range(groups):
            t0 = time.perf_counter()
            async with store.acquire_many(by_layer[i % LAYERS]):
                t1 = time.perf_counter()
                await asyncio.sleep(0)
                t2 = time.perf_counter()
            held += (t1 - t0) + (time.perf_counter() - t2)
            awaited += t2 - t1
        # The same with acquire_as_ready, as an engine that computes each batch as it lands
        # iterates it: every expert resident, so one batch, handed over without an await.
        as_ready = 0.0
        for i in range(groups):
            t0 = time.perf_counter()
            async with store.acquire_as_ready(by_layer[i % LAYERS]) as arrivals:
                async for _views in arrivals:
                    pass
                t1 = time.perf_counter()
                await asyncio.sleep(0)
                t2 = time.perf_counter()
            as_ready += (t1 - t0) + (time.perf_counter() - t2)
        return single, group, held / groups, awaited / groups, as_ready / groups


def measure_hit_path(n: int = 20000, reps: int = 7, k: int = 6, policy: str = "default") -> dict[str, Any]:
    """Median costs per loop: one ``acquire`` (walking a layer's k experts one by one, layer
    after layer) and one ``acquire_many`` of a layer's k experts, layer after layer; every
    expert resident.  A structure-aware policy's per-batch work is in both, spread over k
    acquires in the first.  Then as an engine runs: ``acquire_many`` with an await between
    layers (its compute): ``group_awaited_median_us`` is what the engine waits for,
    ``between_median_us`` the await itself, where the store runs the policy's batch-end work
    (the CPU it takes from the engine's compute, plus the loop's own turn).
    ``as_ready_awaited_median_us`` is the first against ``acquire_as_ready``, its one batch
    iterated."""
    loops: list[tuple[str, Any]] = [("asyncio", None)]
    name, factory = _runner.loop_factory()
    if name == "uvloop":
        loops.append(("uvloop", factory))
    samples: dict[str, list[tuple[float, float, float, float, float]]] = {name: [] for name, _ in loops}
    with tempfile.TemporaryDirectory(prefix="iosched-hitpath-") as tmp:
        folder = write_safetensors_moe(tmp, n_layers=LAYERS, n_experts=8, hidden=64, intermediate=32,
                                       dtype="float16")
        for _ in range(reps):
            for loop_name, loop_factory in loops:
                samples[loop_name].append(
                    _runner.run(lambda: _one_rep(folder, n, k, policy), loop_factory or asyncio.new_event_loop)
                )
    out: dict[str, Any] = {"n": n, "reps": reps, "k": k, "policy": policy, "loops": {}}
    for loop_name, rows in samples.items():
        singles = sorted(1e6 * row[0] for row in rows)
        out["loops"][loop_name] = {
            "median_us": statistics.median(singles),
            "p90_us": singles[min(len(singles) - 1, int(0.9 * len(singles)))],
            "group_of_k_median_us": statistics.median(1e6 * row[1] for row in rows),
            "group_awaited_median_us": statistics.median(1e6 * row[2] for row in rows),
            "between_median_us": statistics.median(1e6 * row[3] for row in rows),
            "as_ready_awaited_median_us": statistics.median(1e6 * row[4] for row in rows),
        }
    return out
