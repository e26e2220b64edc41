"""``iosched replay TRACE --resident``: the fully resident case, every arm token by token.

When the budget holds the whole checkpoint nothing misses, and what differs between two
policies is their CPU beside the engine's compute: a percent or two of a token.  Separate
runs cannot show that on a machine whose speed drifts by more between seconds (the first
version of ``--resident`` ran the arms one after the other: the ratios of one cell spread
over 0.67-1.23x on the 2-core VM, docs/benchmarks.md).  So here every arm is open at once,
each with the whole checkpoint loaded (:func:`engine_replay.load_everything`), and the
trace is played *group by group*, a group being one decode token (all its layers) or one
prompt batch: each group runs on every arm in turn, the arms' order rotated from one group to
the next, so neighbouring tokens of different arms share the machine's speed of that moment.
Decode tokens are timed, each on its own (from its first ``acquire_many`` to the end of its
last layer's compute); the paired ratio of an arm is the median over tokens of its token time
against the first arm's on the same token.

The engine is the demo's (``tools/demo.py``): ``acquire_many`` per batch, real numpy compute
on the experts' own tensors inside the lease (``tools/compute.py``), ``token_boundary`` per
decode token, ``end_turn`` where a prompt follows decode, the prompt's router rows to
``observe_routing``.  The hand-written arm (``handwritten``) is loaded the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from iosched import ExpertStore, StoreError, load_index

from . import demo, engine_replay
from ._replay_policies import HANDWRITTEN
from .compute import DEFAULT_COMPUTE_ON, NUMPY, Compute, ComputeSpec
from .handwritten import HandwrittenEngineStore
from .trace import PHASE_DECODE, RouteTrace

Group = list[tuple[int, int, np.ndarray]]
"""One token's (or one prompt batch's) batches: ``(phase, layer, experts)`` each."""


def groups_of(trace: RouteTrace, max_tokens: int | None) -> list[tuple[bool, Group]]:
    """The trace cut into groups, in order: ``(is_decode, batches)``; a decode group is one
    token's layers, a prompt group one batch.  Stops before decode token ``max_tokens``."""
    out: list[tuple[bool, Group]] = []
    token, tokens = None, 0
    for phase, tok, layer, experts in trace.batches():
        decode = phase == PHASE_DECODE
        if decode and out and out[-1][0] and tok == token:
            out[-1][1].append((phase, layer, experts))
            continue
        if decode:
            if max_tokens is not None and tokens == max_tokens:
                break
            tokens += 1
            token = tok
        out.append((decode, [(phase, layer, experts)]))
    return out


async def _play(store: Any, trace: RouteTrace, group: Group, decode: bool, after_decode: bool,
                compute: Compute, layer_map: dict[int, int], first_batch: int) -> None:
    """One group on one arm, as ``demo.drive_engine`` plays a batch."""
    if after_decode and not decode:
        store.end_turn()
    if decode:
        store.token_boundary()
    for i, (_, layer, experts) in enumerate(group):
        ckpt_layer = layer_map[layer]
        rows = trace.routing.get(first_batch + i)
        if rows is not None:
            store.observe_routing(ckpt_layer, rows)
        keys = experts.tolist()
        async with store.acquire_many([(ckpt_layer, e) for e in keys]) as views:
            await compute.layer(views, demo.rows_per_expert(keys, rows))


async def replay_resident(trace: RouteTrace, label: str, cycles: float | None, policies: Sequence[str], *,
                          compute: ComputeSpec | None = None, compute_on: str = DEFAULT_COMPUTE_ON,
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
    groups = groups_of(trace, max_tokens)
    starts, n = [], 0
    for _, g in groups:
        starts.append(n)
        n += len(g)
    engine = Compute(spec, compute_on)
    times: dict[str, list[float]] = {name: [] for name in policies}
    felt: dict[str, float] = {}
    async with contextlib.AsyncExitStack() as stack:
        arms: dict[str, Any] = {}
        for name in policies:
            if on_run is not None:
                on_run(f"{name}: loading the checkpoint")
            if name == HANDWRITTEN:
                hand = HandwrittenEngineStore(index, budget, drop_behind=False)
                stack.callback(hand.close)
                arms[name] = hand
            else:
                arms[name] = await stack.enter_async_context(await ExpertStore.open(
                    ckpt, budget_bytes=budget, backend=backend, policy=name, experts_per_token=trace.k))
            await engine_replay.load_everything(arms[name], index)
        stack.callback(engine.close)
        if on_run is not None:
            on_run(f"{len(groups)} groups on {len(policies)} arms")
        tally0 = {name: arm.request_tally for name, arm in arms.items()}
        was_decode = False
        turn = 0
        for gi, (decode, group) in enumerate(groups):
            order = list(policies[turn % len(policies):]) + list(policies[:turn % len(policies)])
            turn += 1
            for name in order:
                t0 = time.perf_counter()
                await _play(arms[name], trace, group, decode, was_decode, engine, layer_map, starts[gi])
                if decode:
                    times[name].append(time.perf_counter() - t0)
            was_decode = decode
        played: dict[str, tuple[int, int]] = {}
        for name, arm in arms.items():
            tally = arm.request_tally
            felt[name] = tally.felt_wait_s - tally0[name].felt_wait_s
            played[name] = (tally.requests - tally0[name].requests, tally.hits - tally0[name].hits)
        stats = {name: arm.stats() for name, arm in arms.items()}
    ref = policies[0]
    rows = []
    for name in policies:
        ts = times[name]
        ratios = [a / b for a, b in zip(ts, times[ref], strict=True) if b > 0]
        s = stats[name]
        requests, hits = played[name]
        rows.append({
            "policy": name, "cycles": float(cycles), "budget_bytes": budget, "requests": requests,
            "decode_hit": hits / requests if requests else 1.0,
            "byte_hit": hits / requests if requests else 1.0,  # the demo's experts: one size
            "tokens": len(ts),
            "tokens_per_s": len(ts) / sum(ts) if ts else 0.0,
            "token_ms_p50": 1e3 * statistics.median(ts) if ts else None,
            "paired_time_vs_first": statistics.median(ratios) if ratios else None,
            "paired_tokens_per_s_vs_first": (1.0 / statistics.median(ratios)) if ratios else None,
            "felt_wait_per_token_ms": 1e3 * felt[name] / max(len(ts), 1),
            "store_misses_after_load": None if name == HANDWRITTEN else s["misses"] - len(index.experts),
            "policy_verdict": s.get("policy_verdict"),
            "backend": s["backend"],
        })
    return {"trace": label, "mode": "resident", "reference": ref, "k": trace.k, "td_bytes": td,
            "checkpoint": str(ckpt), "compute": spec.label, "compute_on": compute_on,
            "backend": backend, "tokens": len(times[ref]), "results": rows, "resident": True,
            **engine.describe()}


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
