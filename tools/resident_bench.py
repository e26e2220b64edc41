"""``iosched replay TRACE --resident``: the fully resident case, every arm token by token.

When the budget holds the whole checkpoint nothing misses, and what differs between two
policies is their CPU beside the engine's compute: a percent or two of a token.  Separate
runs cannot show that on a machine whose speed drifts by more between seconds (the first
version of ``--resident`` ran the arms one after the other: the ratios of one cell spread
over 0.67-1.23x on the 2-core VM, docs/benchmarks.md).  So here every arm is open at once,
each with the whole checkpoint loaded (:func:`engine_replay.load_everything`), and the
trace is played *group by group*, a group being one decode token (all its layers) or one
prompt batch: each group runs on every arm in turn, the arms' order changing from one group to
the next, so neighbouring tokens of different arms share the machine's speed of that moment.
Decode tokens are timed, each on its own (from its first ``acquire_many`` to the end of its
last layer's compute); the paired ratio of an arm is the median over tokens of its token time
against the first arm's on the same token.

The engine is the demo's (``tools/demo.py``): ``acquire_many`` per batch, real numpy compute
on the experts' own tensors inside the lease (``tools/compute.py``), ``token_boundary`` per
decode token, ``end_turn`` where a prompt follows decode, the prompt's router rows to
``observe_routing``.  The hand-written arm (``handwritten``) is loaded the same way.  The
interleaving itself (arms, their clocks, the settling after each group) is
``tools/paired_bench.py``'s, which runs the cold case the same way (``--paired``).
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from iosched import StoreError, load_index

from . import demo, engine_replay
from ._replay_policies import HANDWRITTEN
from .compute import DEFAULT_AWAITS, DEFAULT_COMPUTE_ON, NUMPY, ComputeSpec
from .paired_bench import interleave
from .trace import RouteTrace


async def replay_resident(trace: RouteTrace, label: str, cycles: float | None, policies: Sequence[str], *,
                          compute: ComputeSpec | None = None, compute_on: str = DEFAULT_COMPUTE_ON,
                          awaits: str = DEFAULT_AWAITS,
                          backend: str = "auto", max_tokens: int | None = None,
                          folder: Path | None = None, scale: int = demo.SCALE,
                          on_run: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every arm of ``policies`` (iosched policies, or ``handwritten``) fully resident, the
    trace's groups played on each in turn (see the module's docstring).  ``cycles``: the
    budget in token cycles, which must hold the checkpoint (a StoreError naming the cycles
    that would); ``None``: the checkpoint's bytes exactly."""
    engine_replay.reject_offline(policies, "with real I/O")
    if len(set(policies)) != len(policies) or len(policies) < 2:
        raise StoreError("--resident compares arms token by token: give two or more distinct "
                         "policies (the first is the reference of the paired ratios)")
    spec = compute or NUMPY
    ckpt = await asyncio.to_thread(demo.demo_checkpoint, trace, folder, scale)
    index = await asyncio.to_thread(load_index, ckpt)
    layer_map, _, td = engine_replay.map_layers(trace, label, ckpt, index)
    if cycles is None:
        budget = engine_replay.checkpoint_bytes(index)
        cycles = budget / td
    else:
        budget = max(1, int(cycles * td))
        engine_replay.require_holds(budget, cycles, index, ckpt, td)
    arms, stats, describe = await interleave(
        trace, [(ckpt, index)] * len(policies), policies, budget, spec=spec, compute_on=compute_on, awaits=awaits,
        backend=backend,
        max_tokens=max_tokens, layer_map=layer_map, load=True, cold=False, on_run=on_run)
    ref = arms[0].times
    rows = []
    for arm in arms:
        ts, s = arm.times, stats[arm.name]
        ratios = [a / b for a, b in zip(ts, ref, strict=True) if b > 0]
        rows.append({
            "policy": arm.name, "cycles": float(cycles), "budget_bytes": budget, "requests": arm.requests,
            "decode_hit": arm.hits / arm.requests if arm.requests else 1.0,
            "byte_hit": arm.hits / arm.requests if arm.requests else 1.0,  # the demo's experts: one size
            "tokens": len(ts),
            "tokens_per_s": len(ts) / sum(ts) if ts else 0.0,
            "token_ms_p50": 1e3 * statistics.median(ts) if ts else None,
            "paired_time_vs_first": statistics.median(ratios) if ratios else None,
            "paired_tokens_per_s_vs_first": (1.0 / statistics.median(ratios)) if ratios else None,
            "felt_wait_per_token_ms": 1e3 * arm.felt_s / max(len(ts), 1),
            "store_misses_after_load": None if arm.name == HANDWRITTEN else s["misses"] - len(index.experts),
            "policy_verdict": s.get("policy_verdict"),
            "backend": s["backend"],
        })
    return {"trace": label, "mode": "resident", "reference": policies[0], "k": trace.k, "td_bytes": td,
            "checkpoint": str(ckpt), "compute": spec.label, "compute_on": compute_on, "engine_awaits": awaits,
            "backend": backend, "tokens": len(ref), "results": rows, "resident": True,
            **describe}


def resident_table(out: dict[str, Any]) -> Any:
    from rich.console import Group as RichGroup
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"iosched replay {out['trace']} --resident (every arm fully resident, "
                        f"played token by token; compute {out['compute']} on {out['compute_on']})")
    for col in ("policy", "tokens/s", "token ms p50", f"tokens/s vs {out['reference']} (paired)",
                "felt ms/token"):
        table.add_column(col, justify="left" if col == "policy" else "right", no_wrap=True)
    for r in out["results"]:
        paired = r["paired_tokens_per_s_vs_first"]
        table.add_row(r["policy"], f"{r['tokens_per_s']:.2f}", f"{r['token_ms_p50']:.2f}",
                      "-" if paired is None else f"{paired:.3f}x", f"{r['felt_wait_per_token_ms']:.3f}")
    note = (f"{out['tokens']} decode tokens per arm; paired: the median over tokens of the first "
            f"arm's token time over this arm's on the same token; {out['checkpoint']}")
    return RichGroup(table, Text(note, style="dim"))
