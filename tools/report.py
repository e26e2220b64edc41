"""Human-readable tables for the tools' results (rich)."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text


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
    if r.get("policy_verdict"):  # what the policy's own measurements concluded (coact's trial)
        rows.append(("policy verdict", str(r["policy_verdict"])))
    for name, value in rows:
        summary.add_row(name, value)
    devices = Table(title="per device")
    for col in ("device", "reads", "bytes", "errors", "in flight"):
        devices.add_column(col, justify="right" if col != "device" else "left")
    for name, d in r["per_device"].items():
        devices.add_row(name, f"{d['reads']:,}", _mb(d["bytes"]), str(d["errors"]), str(d["in_flight"]))
    arms = r.get("arms") or []
    if len(arms) < 2:
        return Group(summary, devices)
    where = f" on a {r['compute_on']}" if r.get("compute_on") else ""
    side = Table(title=f"side by side: same trace, same budget, compute {r.get('compute', '?')}{where}, "
                       f"median of {r.get('rounds', 1)} interleaved round(s), each cold",
                 caption="felt, compute, other: ms per decode token (other: neither awaited nor computed)")
    for col in ("arm", "tokens/s", "felt", "compute", "other", "decode hit %", "bytes read"):
        side.add_column(col, justify="left" if col == "arm" else "right", no_wrap=True)
    for a in arms:
        side.add_row(a["arm"], f"{a['tokens_per_s']:.1f}", f"{a['decode_felt_wait_per_token_ms']:.2f}",
                     f"{a['compute_ms_per_token']:.2f}", f"{a['other_ms_per_token']:.2f}",
                     f"{100 * a['decode_hit_rate']:.1f}",
                     _mb(a["bytes_read"]))
    return Group(summary, devices, side, Text(r["verdict"], style="bold"))
