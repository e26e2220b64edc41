"""``iosched topology``: the drives behind each path, their queue settings, and a topology file.

``iosched topology [PATH...] [--probe] [--qd N] [--write FILE] [--json]``

* For each PATH (default ``.``), a file or a folder (then every regular file directly in it,
  symlinks followed, as Hugging Face snapshots are), the drive holding it (mapping rules in
  ``iosched/topology/_topology.py`` and ``docs/topology.md``).  A folder whose files span several
  drives is reported as the drive holding most of its bytes; ``files`` has the breakdown.
* ``--probe``: per drive, random O_DIRECT reads of ``--bs`` from the largest file on it,
  a quarter of the budget at depth 1 and the rest at depth ``--qd``, bounded by ``--probe-mb``
  and ``--probe-seconds`` per drive.
* ``--write FILE``: a TOML topology (schema in ``iosched/topology/_topology_toml.py``): the first PATH
  is the primary checkpoint, the others its mirrors; one ``[[device]]`` per drive with
  ``weight`` = probed MB/s over the fastest drive's (1.0 each without ``--probe``) and
  ``queue_depth`` from :func:`iosched.topology.suggest_queue_depth`.

JSON: ``{"paths": {PATH: drive}, "drives": {drive: {facts..., "probe": {...} | null}},
"files": {PATH: {drive: {"files": n, "bytes": b}}}, "discovery": "pyudev" | "sysfs",
"written": FILE | null}``.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import time
from typing import Any

from iosched import StoreError
from iosched.topology import (
    DEFAULT_QUEUE_DEPTH,
    DeviceConfig,
    Discovery,
    Drive,
    Topology,
    dump_topology,
    load_topology,
    probe_drive,
    suggest_inflight_bytes,
    suggest_queue_depth,
)

from . import _command, _runner


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``iosched topology`` on ``sub`` (``tools/cli.py``'s subparsers)."""
    p = sub.add_parser("topology", help="the drives behind each path and their queue settings",
                       description="the drives behind each path, their queue settings, and a topology file")
    p.add_argument("paths", nargs="*", default=["."], metavar="PATH",
                   help="checkpoint files or folders (default: the current folder)")
    p.add_argument("--probe", action="store_true",
                   help="measure each drive with bounded random O_DIRECT reads")
    p.add_argument("--qd", type=_command.positive_int, default=DEFAULT_QUEUE_DEPTH,
                   help=f"probe queue depth, and the most --write suggests (default {DEFAULT_QUEUE_DEPTH})")
    p.add_argument("--bs", default="1M", help="probe read size (default 1M)")
    p.add_argument("--probe-mb", type=_command.positive_int, default=256,
                   help="probe: at most this many MiB per drive (default 256)")
    p.add_argument("--probe-seconds", type=_command.positive_float, default=3.0,
                   help="probe: about this long per drive (default 3)")
    p.add_argument("--write", default=None, metavar="FILE.toml",
                   help="write a topology: the first PATH is the primary, the others mirrors")
    p.add_argument("--discovery", default="auto", choices=("auto", "pyudev", "sysfs"),
                   help="how to read device facts (default: pyudev when installed)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=cmd_topology)


def _files_of(path: str) -> list[tuple[str, int]]:
    """(file, size) for a file, or for each regular file directly in a folder (sorted)."""
    try:
        if not os.path.isdir(path):
            st = os.stat(path)
            return [(path, st.st_size)]
        out = []
        for entry in sorted(os.scandir(path), key=lambda e: e.name):
            if entry.is_file(follow_symlinks=True):
                out.append((entry.path, entry.stat(follow_symlinks=True).st_size))
        return out
    except FileNotFoundError:
        raise StoreError(f"{path}: no such file or folder") from None
    except OSError as exc:
        raise StoreError(f"{path}: cannot read: {exc.strerror or exc}") from None


def topology_report(paths: list[str], *,
                    discovery: str = "auto") -> tuple[dict[str, Any], dict[str, list[tuple[str, int]]]]:
    """The JSON object without probes, and each drive's files (file, size), for probing."""
    disc = Discovery(discovery)
    drives: dict[str, Drive] = {}
    on_drive: dict[str, list[tuple[str, int]]] = {}
    by_path: dict[str, str] = {}
    files: dict[str, dict[str, dict[str, int]]] = {}
    for path in paths:
        spread: dict[str, dict[str, int]] = {}
        entries = _files_of(path)
        for file, size in entries or [(path, 0)]:  # an empty folder: the folder's own drive
            drive = disc.drive_of(file)
            drives.setdefault(drive.name, drive)
            row = spread.setdefault(drive.name, {"files": 0, "bytes": 0})
            if entries:
                row["files"] += 1
                row["bytes"] += size
                on_drive.setdefault(drive.name, []).append((file, size))
        files[path] = spread
        by_path[path] = max(spread, key=lambda name: (spread[name]["bytes"], spread[name]["files"]))
    out: dict[str, Any] = {
        "paths": by_path,
        "drives": {name: {**d.as_dict(), "probe": None} for name, d in drives.items()},
        "files": files,
        "discovery": disc.method,
        "written": None,
    }
    return out, on_drive


def _probe_all(out: dict[str, Any], on_drive: dict[str, list[tuple[str, int]]], args: argparse.Namespace,
               bs: int) -> None:
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

    max_bytes = args.probe_mb << 20
    err = Console(stderr=True)
    with Progress(TextColumn("[bold]probe {task.description}"), BarColumn(), DownloadColumn(),
                  console=err, disable=not err.is_terminal) as progress:
        for name in out["drives"]:
            files = [f for f in on_drive.get(name, []) if f[1] > 0]
            if not files:
                continue  # no non-empty file to read on it: probe stays null
            target = max(files, key=lambda f: f[1])[0]
            task = progress.add_task(name, total=max_bytes)

            def advance(n: int, task: Any = task) -> None:
                progress.advance(task, n)

            result = _runner.run(functools.partial(probe_drive, target, args.qd, bs, max_bytes,
                                                   args.probe_seconds, progress=advance))
            progress.update(task, completed=max_bytes)
            out["drives"][name]["probe"] = result


def _write(out: dict[str, Any], paths: list[str], dest: str, qd: int) -> str:
    probes = {name: d["probe"] for name, d in out["drives"].items()}
    best = max((p["mbps"] for p in probes.values() if p), default=0.0)
    devices = {}
    notes = [f"written by `iosched topology{' --probe' if best else ''} --write` on {platform.node()}, "
             f"{time.strftime('%Y-%m-%d %H:%M:%S %z')}"]
    for name, facts in out["drives"].items():
        p = probes[name]
        weight = round(p["mbps"] / best, 4) if p and best > 0 and p["mbps"] > 0 else 1.0
        depth = suggest_queue_depth(p["qd1"]["mbps"] if p else None, p["mbps"] if p else None, qd,
                                    facts["nr_requests"])
        if p:
            notes.append(f"{name}: {p['mbps']} MB/s at depth {p['qd']}, {p['qd1']['mbps']} MB/s at depth 1 "
                         f"({p['bs']}-byte random O_DIRECT reads of {p['file']}"
                         f"{'' if p['direct'] else '; O_DIRECT refused, read buffered'}"
                         f"{'; memory-backed: these are memory speeds' if facts['memory_backed'] else ''})")
        else:
            notes.append(f"{name}: not probed; queue_depth = min({qd}, nr_requests {facts['nr_requests']})")
        cap = suggest_inflight_bytes(p["qd1"]["mbps"] if p else None, p["mbps"] if p else None, qd,
                                     facts["nr_requests"], p["bs"] if p else 0)
        if cap is not None:
            notes.append(f"{name}: inflight_bytes = {depth} reads x {p['bs'] if p else 0} bytes")
        devices[name] = DeviceConfig(queue_depth=depth, weight=weight,
                                     bandwidth_mbps=float(p["mbps"]) if p and p["mbps"] > 0 else None,
                                     inflight_bytes=cap)
    topo = Topology(primary=os.path.abspath(paths[0]), mirrors=tuple(os.path.abspath(p) for p in paths[1:]),
                    devices=devices)
    dest = os.path.abspath(dest)
    tmp = f"{dest}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(dump_topology(topo, comment="\n".join(notes)))
        os.replace(tmp, dest)
    except OSError as exc:
        raise StoreError(f"{dest}: cannot write: {exc.strerror or exc}") from None
    load_topology(dest)  # what we wrote must be what the store accepts
    return dest


def _table(out: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    probed = any(d["probe"] for d in out["drives"].values())
    table = Table(title=f"drives behind each path ({out['discovery']})")
    # rotational, logical_block_size, max_sectors_kb, nr_requests, numa_node, scheduler
    for col in ("path", "drive", "kind", "rot.", "block", "max KiB", "nr_req", "NUMA", "sched",
                *(("MB/s", "MB/s qd1", "p99 ms") if probed else ())):
        table.add_column(col, justify="left" if col in ("path", "drive", "kind", "sched") else "right")

    def show(value: Any) -> str:
        return "-" if value is None else ("yes" if value is True else "no" if value is False else str(value))

    for path, spread in out["files"].items():
        for name in spread:
            d = out["drives"][name]
            label = name + (f" ({', '.join(d['members'])})" if d["members"] else "") \
                + (" [memory]" if d["memory_backed"] else "")
            p = d["probe"]
            extra = (show(p and p["mbps"]), show(p and p["qd1"]["mbps"]), show(p and p["p99_ms"])) if probed else ()
            table.add_row(path, label, d["kind"], show(d["rotational"]), show(d["logical_block_size"]),
                          show(d["max_sectors_kb"]), show(d["nr_requests"]), show(d["numa_node"]),
                          show(d["scheduler"]), *extra)
    console = Console()
    console.print(table)
    if out["written"]:
        console.print(f"wrote {out['written']}")


def cmd_topology(args: argparse.Namespace) -> dict[str, Any]:
    """The ``topology`` subcommand; returns the JSON object."""
    from .bench import parse_size

    paths: list[str] = list(args.paths) or ["."]
    if args.qd < 1 or args.probe_mb < 1 or args.probe_seconds <= 0:
        raise StoreError("--qd and --probe-mb must be positive integers, --probe-seconds positive")
    bs = parse_size(args.bs)
    out, on_drive = topology_report(paths, discovery=args.discovery)
    if args.probe:
        _probe_all(out, on_drive, args, bs)
    if args.write:
        out["written"] = _write(out, paths, args.write, args.qd)
    if not args.json:
        _table(out)
    return out
