"""``iosched bench-replicas``: one replica, two with equal weights, two with measured weights,
and striping equal against weighted, with the second drive slowed by a token bucket.

Why a throttle: the development machine has one disk, and the question (does weighting by
measured bandwidth beat equal weights when one drive is slower?) needs two drives of different
speed.  The mirror is the same bytes in another folder; :class:`iosched.backends.throttle.ThrottledBackend`
paces its reads to ``--slow-fraction`` of the primary's measured bandwidth.  Every arm reads
every expert of a real checkpoint once, cold (O_DIRECT), with ``--concurrency`` acquires in
flight; arms run interleaved, ``--reps`` times, medians reported.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from iosched import ExpertStore, StoreError, backends, override_settings
from iosched.backends.throttle import ThrottledBackend

from . import _command, _runner
from .demo import cache_dir
from .synth import write_safetensors_moe

ARMS = ("one replica", "two, equal weights", "two, measured weights", "two, least pending",
        "striped, equal weights", "striped, measured weights")


def _checkpoint(layers: int, experts: int) -> tuple[Path, Path]:
    """A checkpoint of ~3 MiB experts (Qwen3-30B-A3B's shape, bf16) and its mirror copy."""
    base = cache_dir() / f"replicas-v1-{layers}x{experts}"
    primary, mirror = base / "primary", base / "mirror"
    if not (base / ".complete").exists():
        shutil.rmtree(base, ignore_errors=True)
        write_safetensors_moe(primary, n_layers=layers, n_experts=experts, hidden=2048,
                              intermediate=768, dtype="bfloat16", n_shards=2, dense=False)
        shutil.copytree(primary, mirror)
        (base / ".complete").write_text("ok\n")
    return primary, mirror


async def _read_everything(primary: Path, mirrors: list[Path], rates: dict[str, float],
                           weights: dict[str, float], concurrency: int,
                           routing: str = "hash") -> tuple[float, dict[str, Any]]:
    backend = ThrottledBackend(backends.create("odirect"), rates)
    async with await ExpertStore.open(primary, budget_bytes=1 << 30, backend=backend,
                                      mirrors=mirrors, weights=weights, routing=routing) as store:
        keys = sorted(store.index.experts)
        t0 = time.perf_counter()
        for i in range(0, len(keys), concurrency):
            async with store.acquire_many(keys[i:i + concurrency]):
                pass
        seconds = time.perf_counter() - t0
        s = store.stats()
        return s["bytes_read"] / seconds / 1e6, s


async def _measure(primary: Path, mirror: Path, rates: dict[str, float], concurrency: int) -> dict[str, float]:
    """Each replica's bandwidth alone: the probe the weights come from."""
    alone_primary, _ = await _read_everything(primary, [], rates, {}, concurrency)
    alone_mirror, _ = await _read_everything(mirror, [], rates, {}, concurrency)
    return {str(primary): alone_primary, str(mirror): alone_mirror}


async def run(layers: int, experts: int, slow_fraction: float, concurrency: int, reps: int) -> dict[str, Any]:
    primary, mirror = _checkpoint(layers, experts)
    # Measure the unthrottled disk first, then pace the mirror to a fraction of it.
    base = await _measure(primary, mirror, {}, concurrency)
    rate = base[str(primary)] * 1e6 * slow_fraction
    rates = {str(mirror): rate}
    measured = await _measure(primary, mirror, rates, concurrency)
    top = max(measured.values())
    weights = {path: mbps / top for path, mbps in measured.items()}
    equal = {str(primary): 1.0, str(mirror): 1.0}
    runs: dict[str, list[float]] = {arm: [] for arm in ARMS}
    shares: dict[str, list[float]] = {arm: [] for arm in ARMS}
    big = 1 << 40
    for _ in range(reps):
        for arm in ARMS:
            striped = arm.startswith("striped")
            mirrors = [] if arm == "one replica" else [mirror]
            w = {} if not mirrors else equal if "equal" in arm else weights
            routing = "least_pending" if "least pending" in arm else "hash"
            with override_settings(stripe_threshold=(1 << 20) if striped else big):
                mbps, s = await _read_everything(primary, mirrors, rates, w, concurrency, routing)
            runs[arm].append(mbps)
            reps_ = s["per_replica"]
            total = sum(r["bytes"] for r in reps_.values())
            shares[arm].append(reps_[str(primary)]["bytes"] / total if total else 1.0)
    return {
        "checkpoint": str(primary), "mirror": str(mirror), "layers": layers, "experts": experts,
        "slow_fraction": slow_fraction, "mirror_rate_mbps": rate / 1e6, "concurrency": concurrency,
        "reps": reps, "measured_mbps": measured, "weights": weights,
        "arms": [{"arm": arm, "mbps": statistics.median(runs[arm]), "mbps_reps": runs[arm],
                  "primary_share": statistics.median(shares[arm])} for arm in ARMS],
    }


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("bench-replicas", help="routing and striping over a fast and a throttled replica")
    p.add_argument("--layers", type=_command.positive_int, default=4)
    p.add_argument("--experts", type=_command.positive_int, default=16)
    p.add_argument("--slow-fraction", type=_command.fraction, default=0.33,
                   help="the mirror's bandwidth as a fraction of the primary's (default 0.33)")
    p.add_argument("--concurrency", type=_command.positive_int, default=8, help="acquires in flight (default 8)")
    p.add_argument("--reps", type=_command.positive_int, default=3)
    p.add_argument("--plot", metavar="PATH.png", help="write a bar chart of MB/s per arm")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=cmd)


def plot(out: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = out["arms"]
    fig, ax = plt.subplots(figsize=(9, 4.2))
    xs = range(len(arms))
    ax.bar(xs, [a["mbps"] for a in arms], color="#4c78a8", alpha=0.8, label="median")
    for x, arm in zip(xs, arms, strict=True):
        ax.scatter([x] * len(arm["mbps_reps"]), arm["mbps_reps"], color="black", s=12, zorder=3)
    ax.set_xticks(list(xs), [a["arm"] for a in arms], rotation=20, ha="right")
    ax.set_ylabel("MB/s (10^6 B/s)")
    ax.set_title(f"all experts read once, O_DIRECT, {out['concurrency']} in flight; mirror paced to "
                 f"{out['mirror_rate_mbps']:.0f} MB/s ({out['slow_fraction']:.0%})", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cmd(args: argparse.Namespace) -> dict[str, Any]:
    if not 0 < args.slow_fraction <= 1 or args.concurrency <= 0 or args.reps <= 0:
        raise StoreError("--slow-fraction must be in (0, 1]; --concurrency and --reps positive")
    out = _runner.run(lambda: run(args.layers, args.experts, args.slow_fraction, args.concurrency, args.reps))
    if args.plot:
        plot(out, args.plot)
        out["plot"] = args.plot
    if not args.json:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"replicas: mirror paced to {out['mirror_rate_mbps']:.0f} MB/s "
                            f"({out['slow_fraction']:.0%} of the primary)")
        for col in ("arm", "MB/s (median)", "primary's share of bytes", "reps"):
            table.add_column(col)
        for row in out["arms"]:
            table.add_row(row["arm"], f"{row['mbps']:.0f}", f"{row['primary_share']:.0%}",
                          ", ".join(f"{x:.0f}" for x in row["mbps_reps"]))
        Console().print(table)
    return out


def main(argv: Sequence[str] | None = None) -> int:  # pragma: no cover - via tools.cli
    return _command.run_one("bench-replicas", add_parser, argv)
