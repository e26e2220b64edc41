"""``iosched replay TRACE --paired``: cold real-I/O runs of every arm, interleaved token by token.

Why: separate cold runs of two policies cannot resolve a few percent on a disk whose speed
swings 2-4x between minutes.  Six rounds of the real-I/O replay, arms rotated, gave single-run
ratios of 0.76-3.41x for one pair of policies, and the arm's place in the round moved the
median by about 4 % (docs/benchmarks.md, "Paired cold runs: `iosched replay --paired`").  Here
every arm is open at once, each on its own store (empty: a cold start, with the checkpoint
dropped from the page cache once before), and the trace is played *group by group* (a decode
token, all its layers, or one prompt batch), each group on every arm in turn, the arms' order
changing from group to group through every permutation (:func:`play_orders`), as ``--resident``
does (``tools/resident_bench.py``).  Neighbouring tokens of different arms then share the
drive's speed of that moment, and the paired ratio (the median over tokens of the reference
arm's token time over this arm's) cancels the drift.

What keeps the arms apart:

- **Nothing in flight crosses into another arm's time.**  After its group, an arm is
  *settled* (:meth:`iosched.ExpertStore.settle`: the batch-end work runs, every load and
  prefetch finishes) and the wait is part of its token's time.  In a run of its own, the
  prefetch a token's last layer starts would overlap the next token's first layer; here it
  is waited for at the token's end, so a prefetching arm is charged slightly more than it
  would be alone (conservative for prefetching).
- **Each arm's clock runs only while it plays** (:class:`ArmClock`, the store's clock through
  :func:`iosched.clock.use`): a policy that times its tokens (``default``'s trial) sees its
  own tokens, not the others' in between.
- **One checkpoint for all, by default; copies on request.**  A VM's disk may be a file on a
  host that caches it: a 1 MiB O_DIRECT read of a region not read for hours ran at 120 MiB/s,
  the same read again at 870 MiB/s (depth 1, 200 reads).  Arms sharing
  the files read part of each other's misses from the host's memory, which shrinks the
  differences between their read paths (not in anyone's favour: the order changes).  With
  ``copies`` each arm reads its own copy (:func:`arm_copies`), but the copies are not alike
  either: three made together read at 160, 125 and 285 MiB/s an hour later (400 random
  576 KiB reads, interleaved), the host keeping more of the last one, and that
  speed belongs to one arm for the whole run.  So copies are for a drive without such a
  cache, and the one shared checkpoint is the default here.
- **Memory**: each arm has the budget; the hand-written arm drops its reads from the page cache
  behind it where the stores read O_DIRECT (as in the real-I/O replay), so the page cache
  does not serve one arm what another read.

The engine is the demo's, as in ``--resident``: ``acquire_many`` per batch, real numpy compute
on the experts' own tensors inside the lease, ``token_boundary`` per decode token, ``end_turn``
where a prompt follows decode, the prompt's router rows to ``observe_routing``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import shutil
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from iosched import CheckpointIndex, ExpertStore, StoreError, clock, load_index
from iosched.backends import resolve

from . import demo, engine_replay
from ._replay_policies import HANDWRITTEN
from .compute import DEFAULT_AWAITS, DEFAULT_COMPUTE_ON, NUMPY, Compute, ComputeSpec
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


async def play_group(store: Any, trace: RouteTrace, group: Group, decode: bool, after_decode: bool,
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
        await demo.lease_and_compute(store, [(ckpt_layer, e) for e in keys], demo.rows_per_expert(keys, rows),
                                     compute)


def arm_copies(ckpt: Path, n: int) -> list[Path]:
    """``n`` byte-identical copies of the checkpoint folder ``ckpt``, beside it as
    ``NAME.copy1`` ... ``NAME.copyN``: built once (copied under a temporary name, marked
    complete, renamed) and reused while they hold a file of the same size for each of its.
    Only folders of that name, made here, are ever replaced; ``ckpt`` is only read."""
    sizes = {f.name: f.stat().st_size for f in ckpt.iterdir() if f.is_file() and f.name != ".complete"}
    out = []
    for k in range(1, n + 1):
        dest = ckpt.parent / f"{ckpt.name}.copy{k}"
        if (dest / ".complete").exists() and all(
                (dest / name).is_file() and (dest / name).stat().st_size == size for name, size in sizes.items()):
            out.append(dest)
            continue
        tmp = ckpt.parent / f"{ckpt.name}.copy{k}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        for name in sizes:
            shutil.copyfile(ckpt / name, tmp / name)
        (tmp / ".complete").write_text(f"a copy of {ckpt}\n")
        shutil.rmtree(dest, ignore_errors=True)  # a stale copy of this function's making
        os.rename(tmp, dest)
        out.append(dest)
    return out


def play_orders(n: int) -> list[tuple[int, ...]]:
    """The arms' orders, one per group in turn: every permutation of ``n`` arms (up to 4), else
    the ``n`` rotations.  Rotations alone let each arm always follow the same arm twice in
    three groups, and an arm's reads help the next one's on a drive whose host caches them
    (module docstring); all permutations have each arm follow each other equally often."""
    if n <= 4:
        return list(itertools.permutations(range(n)))
    return [tuple((r + i) % n for i in range(n)) for r in range(n)]


class ArmClock:
    """A clock that runs only while its arm plays: ``time.perf_counter`` less the time the arm
    spent paused.  Invariant: it never goes backwards (paused, it stands still)."""

    def __init__(self) -> None:
        self._paused_s = 0.0
        self._paused_at: float | None = None

    def now(self) -> float:
        t = self._paused_at if self._paused_at is not None else time.perf_counter()
        return t - self._paused_s

    def pause(self) -> None:
        if self._paused_at is None:
            self._paused_at = time.perf_counter()

    def resume(self) -> None:
        if self._paused_at is not None:
            self._paused_s += time.perf_counter() - self._paused_at
            self._paused_at = None


class Arm:
    """One arm: its store (or the hand-written engine), its clock, and what it measured."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.store: Any = None
        self.clock = ArmClock()
        self.times: list[float] = []
        self.felt_s = 0.0
        self.compute_s = 0.0
        """The engine's compute in this arm's decode tokens (``Compute.seconds``: the numpy
        work itself, in its thread or on the loop), so that a store slowing the compute beside
        it shows apart from the wait it saves."""
        self.loop_cpu_s = 0.0
        """The event loop thread's CPU in this arm's decode tokens (``time.thread_time``)."""
        self.requests = self.hits = 0

    @contextlib.contextmanager
    def playing(self) -> Any:
        self.clock.resume()
        try:
            with clock.use(self.clock.now):
                yield
        finally:
            self.clock.pause()


Interleaved = tuple[list["Arm"], dict[str, dict[str, Any]], dict[str, Any]]
"""What :func:`interleave` returns: the arms, each one's final ``stats()``, the compute's
description."""


async def interleave(trace: RouteTrace, checkpoints: Sequence[tuple[Path, CheckpointIndex]],
                     policies: Sequence[str], budget: int, *, spec: ComputeSpec, compute_on: str,
                     awaits: str = DEFAULT_AWAITS,
                     backend: str, max_tokens: int | None, layer_map: dict[int, int], load: bool,
                     cold: bool, on_run: Callable[[str], None] | None = None) -> Interleaved:
    """Every arm of ``policies`` at ``budget``, arm ``i`` on the checkpoint ``checkpoints[i]``
    (its folder and its index, loaded once by the caller), the trace's groups played on each
    in turn, the arms' order changing per group (:func:`play_orders`).  ``load``: each arm
    first loads the whole checkpoint (the fully resident case); ``cold``: the checkpoints
    leave the page cache before the arms open.  Returns the arms, each one's final
    ``stats()``, and the compute's description."""
    if len(checkpoints) != len(policies):
        raise StoreError(f"{len(policies)} arms need as many checkpoints, got {len(checkpoints)}")
    if cold:
        for _, index in dict(checkpoints).items():
            await asyncio.to_thread(demo.drop_from_page_cache, index.files)
    direct = resolve(backend, checkpoints[0][1].files)[0] in ("odirect", "uring")
    groups = groups_of(trace, max_tokens)
    starts, n = [], 0
    for _, g in groups:
        starts.append(n)
        n += len(g)
    engine = Compute(spec, compute_on, awaits)
    arms = [Arm(name) for name in policies]
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(engine.close)
        for arm, (folder, index) in zip(arms, checkpoints, strict=True):
            if on_run is not None:
                on_run(f"{arm.name}: {'loading the checkpoint' if load else 'opening'}")
            with arm.playing():
                if arm.name == HANDWRITTEN:
                    hand = HandwrittenEngineStore(index, budget, drop_behind=direct and not load)
                    stack.callback(hand.close)
                    arm.store = hand
                else:
                    arm.store = await stack.enter_async_context(await ExpertStore.open(
                        folder, budget_bytes=budget, backend=backend, policy=arm.name,
                        experts_per_token=trace.k))
                if load:
                    await engine_replay.load_everything(arm.store, index)
        if on_run is not None:
            on_run(f"{len(groups)} groups on {len(arms)} arms")
        orders = play_orders(len(arms))
        was_decode = False
        for gi, (decode, group) in enumerate(groups):
            for arm in (arms[i] for i in orders[gi % len(orders)]):
                with arm.playing():
                    before = arm.store.request_tally
                    computed = engine.seconds
                    c0 = time.thread_time()
                    t0 = time.perf_counter()
                    await play_group(arm.store, trace, group, decode, was_decode, engine, layer_map, starts[gi])
                    await arm.store.settle()
                    dt = time.perf_counter() - t0
                    if decode:
                        after = arm.store.request_tally
                        arm.times.append(dt)
                        arm.felt_s += after.felt_wait_s - before.felt_wait_s
                        arm.compute_s += engine.seconds - computed
                        arm.loop_cpu_s += time.thread_time() - c0
                        arm.requests += after.requests - before.requests
                        arm.hits += after.hits - before.hits
            was_decode = decode
        stats: dict[str, dict[str, Any]] = {}
        for arm in arms:
            with arm.playing():
                stats[arm.name] = arm.store.stats()
        describe = engine.describe()
    return arms, stats, describe


def paired_rows(arms: Sequence[Arm], stats: dict[str, dict[str, Any]], cycles: float,
                budget: int) -> list[dict[str, Any]]:
    """One row per arm: tokens/s over its decode tokens, the token's p50, and the paired ratio
    against the first arm (the median over tokens, and its quartiles)."""
    ref = arms[0].times
    rows = []
    for arm in arms:
        ts, s = arm.times, stats[arm.name]
        ratios = sorted(b / a for a, b in zip(ts, ref, strict=True) if a > 0)
        q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [None, None, None]
        rows.append({
            "policy": arm.name, "cycles": float(cycles), "budget_bytes": budget,
            "tokens": len(ts),
            "tokens_per_s": len(ts) / sum(ts) if ts else 0.0,
            "token_ms_p50": 1e3 * statistics.median(ts) if ts else None,
            "paired_tokens_per_s_vs_first": statistics.median(ratios) if ratios else None,
            "paired_q1": q[0], "paired_q3": q[2],
            "paired_time_vs_first": (1.0 / statistics.median(ratios)) if ratios else None,
            "decode_requests": arm.requests,
            "decode_hit": arm.hits / arm.requests if arm.requests else 0.0,
            "felt_wait_per_token_ms": 1e3 * arm.felt_s / max(len(ts), 1),
            "compute_ms_per_token": 1e3 * arm.compute_s / max(len(ts), 1),
            "loop_cpu_ms_per_token": 1e3 * arm.loop_cpu_s / max(len(ts), 1),
            "bytes_read": s["bytes_read"],
            "prefetch_issued": s.get("prefetch_issued"),
            "prefetch_used": s.get("prefetch_used"),
            "policy_verdict": s.get("policy_verdict"),
            "backend": s["backend"],
            "token_ms": [round(1e3 * t, 3) for t in ts],
        })
    return rows


async def replay_paired(trace: RouteTrace, label: str, cycles: Sequence[float], policies: Sequence[str], *,
                        compute: ComputeSpec | None = None, compute_on: str = DEFAULT_COMPUTE_ON,
                        awaits: str = DEFAULT_AWAITS, backend: str = "auto", max_tokens: int | None = None,
                        cold: bool = True,
                        folder: Path | None = None, scale: int = demo.SCALE, copies: bool = False,
                        on_run: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every arm of ``policies`` (iosched policies, or ``handwritten``), cold, interleaved
    token by token (the module's docstring), once per budget in ``cycles``.  ``copies``: each
    arm reads its own copy of the checkpoint (:func:`arm_copies`, made together, so that the
    host holds them alike); ``False``: all read the one checkpoint."""
    engine_replay.reject_offline(policies, "with real I/O")
    if len(set(policies)) != len(policies) or len(policies) < 2:
        raise StoreError("--paired compares arms token by token: give two or more distinct "
                         "policies (the first is the reference of the paired ratios)")
    if max_tokens is not None and max_tokens <= 0:
        raise StoreError("--tokens must be positive")
    spec = compute or NUMPY
    ckpt = await asyncio.to_thread(demo.demo_checkpoint, trace, folder, scale)
    index = await asyncio.to_thread(load_index, ckpt)
    layer_map, _, td = engine_replay.map_layers(trace, label, ckpt, index)
    checkpoints = [(ckpt, index)] * len(policies)
    if copies:  # every arm on a copy, the copies made together: the same state on the host
        if on_run is not None:
            on_run(f"{len(policies)} copies of the checkpoint (once)")
        checkpoints = [(f, await asyncio.to_thread(load_index, f))
                       for f in await asyncio.to_thread(arm_copies, ckpt, len(policies))]
    rows: list[dict[str, Any]] = []
    describe: dict[str, Any] = {}
    for c in cycles:
        budget = max(1, int(c * td))
        if on_run is not None:
            on_run(f"{c:g} token cycles")
        arms, stats, describe = await interleave(
            trace, checkpoints, policies, budget, spec=spec, compute_on=compute_on, awaits=awaits, backend=backend,
            max_tokens=max_tokens, layer_map=layer_map, load=False, cold=cold, on_run=on_run)
        rows.extend(paired_rows(arms, stats, c, budget))
    return {"trace": label, "mode": "paired", "reference": policies[0], "k": trace.k, "td_bytes": td,
            "checkpoint": str(ckpt), "compute": spec.label, "compute_on": compute_on,
            "engine_awaits": awaits, "backend": backend, "cold": cold, "paired": True,
            "copies": [str(f) for f, _ in checkpoints],
            "tokens": rows[0]["tokens"] if rows else 0, "results": rows, **describe}


def paired_table(out: dict[str, Any]) -> Any:
    from rich.console import Group as RichGroup
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"iosched replay {out['trace']} --paired (cold, every arm played token by "
                        f"token; compute {out['compute']} on {out['compute_on']})")
    for col in ("policy", "cycles", "tokens/s", "token ms p50", f"tokens/s vs {out['reference']} (paired)",
                "quartiles", "decode hit %", "felt ms/token", "MB read"):
        table.add_column(col, justify="left" if col == "policy" else "right", no_wrap=True)
    for r in out["results"]:
        paired = r["paired_tokens_per_s_vs_first"]
        quart = ("-" if r["paired_q1"] is None else f"{r['paired_q1']:.3f}-{r['paired_q3']:.3f}")
        table.add_row(r["policy"], f"{r['cycles']:g}", f"{r['tokens_per_s']:.2f}", f"{r['token_ms_p50']:.1f}",
                      "-" if paired is None else f"{paired:.3f}x", quart, f"{100 * r['decode_hit']:.1f}",
                      f"{r['felt_wait_per_token_ms']:.1f}", f"{r['bytes_read'] / 1e6:.0f}")
    note = (f"{out['tokens']} decode tokens per arm; paired: the median over tokens of the first "
            f"arm's token time over this arm's on the same token (each arm settled after its "
            f"token: its reads in flight are waited for and charged to it); {out['checkpoint']}")
    return RichGroup(table, Text(note, style="dim"))
