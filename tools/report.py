"""Human-readable tables for the tools' results (rich)."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def demo_table(r: dict[str, Any]) -> Group:
    summary = Table(title="iosched demo", show_header=False)
    summary.add_column(style="bold")
    summary.add_column(justify="right")
    rows = [
        ("trace", r["trace"]),
        ("decode tokens", f"{r['tokens']}"),
        ("tokens/s", f"{r['tokens_per_s']:.1f}"),
        ("budget", f"{_mb(r['budget_bytes'])} ({r['budget_cycles']:.1f} token cycles of {_mb(r['td_bytes'])})"),
        ("requests", f"{r['requests']:,}"),
        ("hit rate", f"{100 * r['hit_rate']:.1f} %  ({r['hits']:,} hits, {r['misses']:,} misses, "
                     f"{r['single_flight_joins']:,} joins)"),
        ("felt wait", f"{r['felt_wait_s']:.3f} s  ({r['decode_felt_wait_per_token_ms']:.2f} ms per decode token)"),
        ("read service time", f"{r['service_s']:.3f} s (summed over reads, which overlap)"),
        ("bytes read", _mb(r["bytes_read"])),
        ("evictions", f"{r['evictions']:,}"),
        ("backend / policy / loop", f"{r['backend']} / {r['policy']} / {r['loop']}"),
    ]
    for name, value in rows:
        summary.add_row(name, value)
    devices = Table(title="per device")
    for col in ("device", "reads", "bytes", "errors", "in flight"):
        devices.add_column(col, justify="right" if col != "device" else "left")
    for name, d in r["per_device"].items():
        devices.add_row(name, f"{d['reads']:,}", _mb(d["bytes"]), str(d["errors"]), str(d["in_flight"]))
    return Group(summary, devices)
