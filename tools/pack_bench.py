"""``iosched bench-pack``: random expert reads from a GGUF file and from its packed copy.

The source is a GGUF as llama.cpp lays it out, its experts of real size: Qwen3-30B-A3B's
(hidden 2048, expert intermediate 768), in F16 (9 MiB an expert, three slices of three
merged tensors, so three reads) or Q8_0 (4.8 MiB). Defaults: 2 layers of 80 experts, 1.5 GB
in F16. ``iosched pack`` copies it with every expert one 4096-aligned extent (and its time
is reported too). Then each round reads the same random experts from both, through
``ExpertStore`` on each O_DIRECT backend (``odirect``, ``uring``), the four arms interleaved
and their order rotated from round to round: the disk's speed swings 2-4x between minutes,
so the packed/unpacked ratio is taken within each round and the medians over rounds are
reported. The budget holds exactly one group of experts and consecutive groups share no
expert, so every acquire is a miss, that is a read from the drive (checked: ``hits`` is 0).

Per arm: experts/s, MB/s (10^6 bytes of expert data per second), reads per expert (the
store's per-drive read count over the experts), and the felt latency of each acquire (from
the call to the view in hand) at p50 and p99. The files are deleted at the end unless
``--keep``.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from iosched import ExpertStore, StoreError, backends, pack_checkpoint

from . import _command, _runner
from .demo import cache_dir, drop_from_page_cache

ARCH = "qwen3moe"
HIDDEN, INTERMEDIATE = 2048, 768
"""Qwen3-30B-A3B's hidden size and expert (``moe_intermediate_size``) width."""
DTYPES = ("F16", "Q8_0")
Q8_BLOCK, Q8_BYTES = 32, 34
"""Q8_0: 32 weights in 34 bytes (an f16 scale and 32 int8), ``gguf.GGML_QUANT_SIZES``."""


def write_source(path: Path, layers: int, experts: int, hidden: int, inter: int, dtype: str, seed: int = 0) -> int:
    """A llama.cpp-style GGUF with ``layers`` x ``experts`` experts, written by
    ``gguf.GGUFWriter``; random finite values (random bits with the top exponent bit clear);
    its size in bytes."""
    import gguf

    rng = np.random.default_rng(seed)

    def merged(rows: int, cols: int) -> tuple[np.ndarray[Any, Any], Any]:
        if dtype == "F16":
            bits = rng.integers(0, 1 << 16, (experts, rows, cols), dtype=np.uint16) & 0xBFFF
            return bits.view(np.float16), None
        raw = rng.integers(0, 256, (experts, rows, cols // Q8_BLOCK, Q8_BYTES), dtype=np.uint8)
        raw[..., 1] &= 0x3B  # the f16 scale's high byte: a small finite number
        return raw.reshape(experts, rows, cols // Q8_BLOCK * Q8_BYTES), gguf.GGMLQuantizationType.Q8_0

    writer = gguf.GGUFWriter(str(path), arch=ARCH)
    try:
        writer.add_block_count(layers)
        writer.add_embedding_length(hidden)
        writer.add_expert_feed_forward_length(inter)
        writer.add_expert_count(experts)
        writer.add_expert_used_count(min(8, experts))
        for layer in range(layers):
            writer.add_tensor(f"blk.{layer}.ffn_gate_inp.weight",
                              rng.standard_normal((experts, hidden)).astype(np.float32))
            for part, (rows, cols) in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))):
                data, raw_dtype = merged(rows, cols)
                writer.add_tensor(f"blk.{layer}.ffn_{part}_exps.weight", data, raw_dtype=raw_dtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return path.stat().st_size


def _groups(keys: list[tuple[int, int]], n: int, group: int, rng: np.random.Generator) -> list[list[tuple[int, int]]]:
    """``n`` groups of ``group`` distinct random keys, no two consecutive groups sharing one
    (with a budget of one group, every acquire is then a miss)."""
    out: list[list[tuple[int, int]]] = []
    previous: set[tuple[int, int]] = set()
    for _ in range(n):
        allowed = [k for k in keys if k not in previous]
        g = [allowed[int(i)] for i in rng.choice(len(allowed), size=group, replace=False)]
        out.append(g)
        previous = set(g)
    return out


async def _arm(source: Path, backend: str, groups: list[list[tuple[int, int]]], nbytes: int) -> dict[str, Any]:
    group = len(groups[0])
    log = logging.getLogger("iosched")
    level = log.level
    log.setLevel(logging.ERROR)  # "budget below one token cycle": on purpose, so every acquire misses
    try:
        store = await ExpertStore.open(source, budget_bytes=group * nbytes, backend=backend, policy="lru")
    finally:
        log.setLevel(level)
    async with store:
        drop_from_page_cache(tuple(store.index.files))
        lat = []
        t0 = time.perf_counter()
        for g in groups:
            t = time.perf_counter()
            if group == 1:
                async with store.acquire(g[0]):
                    lat.append(time.perf_counter() - t)
            else:
                async with store.acquire_many(g):
                    lat.append(time.perf_counter() - t)
        seconds = time.perf_counter() - t0
        s = store.stats()
    n = len(groups) * group
    reads = sum(d["reads"] for d in s["per_device"].values())
    ms = np.asarray(lat) * 1e3
    return {"experts_per_s": n / seconds, "mbps": n * nbytes / seconds / 1e6, "reads_per_expert": reads / n,
            "p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
            "hits": s["hits"], "misses": s["misses"], "seconds": seconds}


async def measure(src: Path, dst: Path, names: Sequence[str], rounds: int, reads: int, group: int,
                  seed: int = 1) -> dict[str, Any]:
    """Interleaved rounds over (layout, backend); per-arm medians and within-round ratios."""
    from iosched import load_index

    index = load_index(src)
    keys = sorted(index.experts)
    nbytes = max(lay.nbytes for lay in index.experts.values())
    rng = np.random.default_rng(seed)
    arms = [(layout, backend) for backend in names for layout in ("gguf", "packed")]
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {arm: [] for arm in arms}
    for r in range(rounds):
        groups = _groups(keys, max(1, reads // group), group, rng)
        for layout, backend in arms[r % len(arms):] + arms[:r % len(arms)]:
            runs[(layout, backend)].append(await _arm(src if layout == "gguf" else dst, backend, groups, nbytes))
    rows = []
    for (layout, backend), got in runs.items():
        row: dict[str, Any] = {"layout": layout, "backend": backend, "group": group}
        for k in ("experts_per_s", "mbps", "reads_per_expert", "p50_ms", "p99_ms"):
            row[k] = statistics.median(g[k] for g in got)
        row["hits"] = sum(g["hits"] for g in got)
        row["mbps_runs"] = [g["mbps"] for g in got]
        if layout == "packed":
            base = runs[("gguf", backend)]
            pairs = list(zip(got, base, strict=True))
            row["speedup_median"] = statistics.median(p["mbps"] / b["mbps"] for p, b in pairs)
            row["p50_ratio_median"] = statistics.median(p["p50_ms"] / b["p50_ms"] for p, b in pairs)
        rows.append(row)
    return {"expert_bytes": nbytes, "experts": len(keys), "rows": rows}


def run(args: argparse.Namespace) -> dict[str, Any]:
    folder = Path(args.dir) if args.dir else cache_dir() / "pack-bench"
    folder.mkdir(parents=True, exist_ok=True)
    src, dst = folder / f"qwen3moe-{args.dtype.lower()}.gguf", folder / f"qwen3moe-{args.dtype.lower()}-packed"
    per_expert = 3 * args.intermediate * args.hidden * (2 if args.dtype == "F16" else Q8_BYTES / Q8_BLOCK)
    need = 2.1 * per_expert * args.layers * args.experts
    free = shutil.disk_usage(folder).free
    if not src.exists() and free < need:
        raise StoreError(f"{folder}: {free / 1e9:.1f} GB free, the benchmark needs {need / 1e9:.1f} GB")
    try:
        t0 = time.perf_counter()
        size = src.stat().st_size if src.exists() else write_source(
            src, args.layers, args.experts, args.hidden, args.intermediate, args.dtype)
        write_s = time.perf_counter() - t0
        if dst.exists():
            shutil.rmtree(dst)
        drop_from_page_cache((str(src),))
        report = pack_checkpoint(src, dst)
        out = _runner.run(lambda: measure(src, dst, args.backends_list, args.rounds, args.reads, args.group))
    finally:
        if not args.keep:
            shutil.rmtree(dst, ignore_errors=True)
            src.unlink(missing_ok=True)
    out.update({"dtype": args.dtype, "layers": args.layers, "hidden": args.hidden, "intermediate": args.intermediate,
                "source_bytes": size, "source_write_s": write_s, "rounds": args.rounds, "reads": args.reads,
                "pack": {k: v for k, v in report.as_dict().items() if k != "experts_detail"},
                "pack_mbps": report.bytes_written / report.seconds / 1e6, "kept": bool(args.keep)})
    return out


def add_parser(sub: _command.SubParsers[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("bench-pack", help="random expert reads: a GGUF against its packed copy (O_DIRECT backends)")
    p.add_argument("--dtype", default="F16", choices=DTYPES, help="expert tensor type (default F16: 9 MiB experts)")
    p.add_argument("--layers", type=_command.positive_int, default=2, help="MoE layers (default 2)")
    p.add_argument("--experts", type=_command.positive_int, default=80, help="experts per layer (default 80)")
    p.add_argument("--hidden", type=_command.positive_int, default=HIDDEN, help=f"hidden size (default {HIDDEN})")
    p.add_argument("--intermediate", type=_command.positive_int, default=INTERMEDIATE,
                   help=f"expert intermediate size (default {INTERMEDIATE})")
    p.add_argument("--rounds", type=_command.positive_int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--reads", type=_command.positive_int, default=64,
                   help="experts read per arm and round (default 64)")
    p.add_argument("--group", type=_command.positive_int, default=1,
                   help="experts acquired together (acquire_many; default 1: one at a time)")
    p.add_argument("--backends", default="odirect,uring", help="backends (default odirect,uring)")
    p.add_argument("--dir", default=None, help="folder for the two checkpoints (default the iosched cache folder)")
    p.add_argument("--keep", action="store_true", help="keep the files (default: delete them at the end)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=cmd)


def cmd(args: argparse.Namespace) -> dict[str, Any]:
    names = [b for b in args.backends.split(",") if b]
    if not names:
        raise StoreError("--backends names no backend")
    for name in names:
        backends.resolve(name)  # a StoreError naming it, when it cannot run here
    if args.hidden % Q8_BLOCK or args.intermediate % Q8_BLOCK:
        raise StoreError(f"--hidden and --intermediate must be multiples of {Q8_BLOCK} (Q8_0 blocks)")
    if args.group > args.layers * args.experts // 2:
        raise StoreError(f"--group {args.group} is more than half the {args.layers * args.experts} experts")
    args.backends_list = names
    out = run(args)
    if not args.json:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"random expert reads, {out['expert_bytes'] / (1 << 20):.1f} MiB experts "
                            f"({out['dtype']}), medians of {out['rounds']} interleaved rounds")
        for col in ("layout", "backend", "experts/s", "MB/s", "reads/expert", "p50 ms", "p99 ms", "packed/gguf"):
            table.add_column(col, justify="right")
        for r in out["rows"]:
            table.add_row(r["layout"], r["backend"], f"{r['experts_per_s']:.1f}", f"{r['mbps']:.0f}",
                          f"{r['reads_per_expert']:.2f}", f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}",
                          f"{r['speedup_median']:.2f}x" if "speedup_median" in r else "")
        Console().print(table)
        Console().print(f"pack: {out['pack']['seconds']:.1f} s for {out['source_bytes'] / 1e9:.2f} GB "
                        f"({out['pack_mbps']:.0f} MB/s written, verify included)")
    return out


def main(argv: Sequence[str] | None = None) -> int:  # pragma: no cover - via tools.cli
    return _command.run_one("bench-pack", add_parser, argv)
