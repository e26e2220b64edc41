"""``iosched replay --plot FILE.png``: the replay's result rows as curves over the budget.

A table of policies x budgets is read cell by cell; the question people bring to it (where
does a policy overtake another, how fast does each approach the offline optimum, what does it
cost in bytes) is a question about curves.  Left panel: decode hit % against the budget in
token cycles (log2 axis: the budgets double); right panel: what the hits cost, GB moved (demand
misses plus prefetches) in the simulation, felt wait per decode token with real I/O.  Our
policies are solid lines, libCacheSim's (``lcs:``) thin dotted ones, Belady dashed black.
"""

from __future__ import annotations

from typing import Any

__all__ = ["plot_replay"]


def _series(rows: list[dict[str, Any]], key: str) -> dict[str, list[tuple[float, float]]]:
    out: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        value = r.get(key)
        if value is not None:
            out.setdefault(str(r["policy"]), []).append((float(r["cycles"]), float(value)))
    return {name: sorted(points) for name, points in out.items()}


def plot_replay(out: dict[str, Any], path: str) -> None:
    """Write ``out`` (what ``iosched replay --json`` prints, simulated or real) to ``path``."""
    from matplotlib.figure import Figure

    rows: list[dict[str, Any]] = out["results"]
    real = out.get("mode") == "real"
    hits = {name: [(c, 100 * v) for c, v in pts] for name, pts in _series(rows, "decode_hit").items()}
    if real:
        cost, cost_label = _series(rows, "felt_wait_per_token_ms"), "felt wait per decode token (ms)"
    else:
        cost = {name: [(c, v / 1e9) for c, v in pts] for name, pts in _series(rows, "moved_bytes").items()}
        cost_label = "GB moved (demand misses + prefetches)"
    fig = Figure(figsize=(13.5, 4.6), layout="constrained")
    ax_hit, ax_cost = fig.subplots(1, 2)
    ours = [name for name in hits if not name.startswith("lcs:") and name != "belady"]
    for i, name in enumerate(sorted(hits, key=lambda n: (n.startswith("lcs:"), n == "belady", n))):
        if name == "belady":
            style: dict[str, Any] = {"color": "black", "ls": "--", "lw": 1.5}
        elif name.startswith("lcs:"):
            style = {"ls": ":", "lw": 1.0, "alpha": 0.8, "color": f"C{(len(ours) + i) % 10}"}
        else:
            style = {"marker": "o", "lw": 2.0, "color": f"C{i % 10}"}
        for ax, series in ((ax_hit, hits), (ax_cost, cost)):
            points = series.get(name)
            if points:
                ax.plot([c for c, _ in points], [v for _, v in points], label=name, **style)
    cycles = sorted({float(r["cycles"]) for r in rows})
    for ax, ylabel in ((ax_hit, "decode hit %"), (ax_cost, cost_label)):
        ax.set_xscale("log", base=2)
        ax.set_xticks(cycles, [f"{c:g}" for c in cycles])
        ax.set_xlabel("budget (token cycles)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    ax_hit.set_ylim(0, 100)
    ax_cost.set_ylim(bottom=0)
    handles, labels = ax_hit.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right upper", fontsize="small")
    what = "real reads" if real else "simulated"
    fig.suptitle(f"iosched replay {out['trace']} ({what}; k={out['k']}, "
                 f"TD={int(out['td_bytes']) / 2**20:.1f} MiB)")
    fig.savefig(path, dpi=110)
