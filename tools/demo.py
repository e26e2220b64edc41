"""``iosched demo``: the main job on an embedded default.

1. Builds once, in the cache folder, a real safetensors checkpoint shaped like the bundled
   trace's model (its layers and experts, Hugging Face tensor names), with each expert
   scaled down (hidden and intermediate sizes divided by :data:`SCALE`) so the whole run
   takes well under a minute on two cores.
2. Drops the checkpoint from the page cache (``posix_fadvise(DONTNEED)``) so the first
   reads go to the disk, as they would on a cold engine.
3. Replays the bundled real routing trace through :class:`iosched.ExpertStore` as an engine
   would: per token, per layer, lease the routed experts together (``acquire_many``), compute
   on them (``tools/compute.py``: each expert's SwiGLU MLP on its own tensors with numpy, in a
   worker thread; ``--compute sleep:MS`` emulates it), release.
4. Does the same, each pass cold, with ``lru`` and with the hand-written arm
   (``tools/handwritten.py``: an LRU dict of bytes and 8 threads of ``os.pread``) on the same
   trace and budget, arms interleaved per round, because a policy is only worth its CPU if it
   beats what the engine's author would write instead.
5. Prints tokens/s, hit rate, felt wait against read service time, bytes read, per device, then
   the arms side by side and which was fastest, said plainly when the default was not.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from iosched import ExpertKey, ExpertStore, ExpertView, RequestTally, StoreError, clock, load_index, settings
from iosched.backends import resolve

from ._replay_policies import HANDWRITTEN
from .compute import DEFAULT_AWAITS, DEFAULT_COMPUTE_ON, NUMPY, Compute, ComputeSpec
from .synth import write_safetensors_moe
from .trace import PHASE_DECODE, RouteTrace, load_bundled_trace

# Qwen3-30B-A3B's expert shape (config.json: hidden_size 2048, moe_intermediate_size 768),
# used for every bundled trace so the demo's experts keep a real model's aspect ratio.
REAL_HIDDEN, REAL_INTERMEDIATE = 2048, 768
SCALE = 16
"""Divides the real expert dimensions by default: 128 x 48 bf16 experts are 36 KiB, 226 MB for
48 x 128.  Small enough for CI, but a miss then costs tens of microseconds, far less than a
real expert's: ``--scale 2`` (1024 x 384 bf16, 2.25 MiB an expert, the size of the traces'
Q4_K_M experts) makes misses cost what they cost in a real engine (14.5 GB for qwen's shape)."""
CHECKPOINT_VERSION = 1
"""Bump when the demo checkpoint's contents change, so old caches are not reused."""
SPARSE_VERSION = 2
"""The same for its sparse twin (2: the demo's own files, dense tensors and shards included,
written by ``write_safetensors_moe``; 1 was a writer of the critical-path replay's own)."""


@dataclass(frozen=True)
class DemoConfig:
    trace: str = "qwen"
    budget_cycles: float = 4.0
    compute_ms: float | None = None
    """The older spelling of ``compute=sleep:MS`` (``--compute-ms``); ``None``: ``compute``."""
    compute: ComputeSpec = NUMPY
    """The engine's compute per layer (``tools/compute.py``): real numpy by default."""
    compute_on: str = DEFAULT_COMPUTE_ON
    awaits: str = DEFAULT_AWAITS
    """What the engine awaits before computing on a layer (``tools/compute.py``, ``AWAITS``)."""
    compare: tuple[str, ...] = ("lru", HANDWRITTEN)
    """Arms run beside ``policy`` on the same trace and budget (``--compare``)."""
    rounds: int = 1
    """Rounds of every arm, interleaved (medians reported)."""
    backend: str = "auto"
    policy: str = "default"
    cold: bool = True
    max_tokens: int | None = None
    scale: int = SCALE
    """Divides the real expert dimensions (see :data:`SCALE`)."""
    telemetry: str | None = None
    """A file for the store's per-token JSON lines (``docs/telemetry.md``): the first arm's,
    last round."""

    def compute_spec(self) -> ComputeSpec:
        return self.compute if self.compute_ms is None else ComputeSpec("sleep", self.compute_ms / 1e3)


def cache_dir() -> Path:
    configured = str(settings.get("cache_dir"))
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "iosched"


def demo_checkpoint(trace: RouteTrace, folder: Path | None = None, scale: int = SCALE,
                    sparse: bool = False) -> Path:
    """The demo checkpoint for ``trace``, built on first use (atomically: build, then rename),
    its experts ``scale`` times smaller than Qwen3-30B-A3B's in each dimension.  ``sparse``:
    the same files with their data left as holes (``write_safetensors_moe(sparse=True)``), in
    a folder of its own, for the critical-path replay, which never reads them."""
    if isinstance(scale, bool) or not isinstance(scale, int) or not 1 <= scale <= 64:
        raise StoreError(f"--scale must be an integer from 1 to 64, got {scale!r}")
    hidden, inter = REAL_HIDDEN // scale, REAL_INTERMEDIATE // scale
    kind = f"sparse-v{SPARSE_VERSION}" if sparse else f"demo-v{CHECKPOINT_VERSION}"
    name = f"{kind}-{trace.arch}-{len(trace.layers)}x{trace.n_expert}-{hidden}x{inter}"
    target = (folder or cache_dir()) / name
    if (target / ".complete").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f"{name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    write_safetensors_moe(
        tmp, n_layers=len(trace.layers), n_experts=trace.n_expert, hidden=hidden,
        intermediate=inter, dtype="bfloat16", n_shards=4, seed=0, sparse=sparse,
    )
    (tmp / ".complete").write_text(f"{trace.source}\n")
    try:
        os.rename(tmp, target)
    except OSError:  # another process built it first
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def drop_from_page_cache(paths: tuple[str, ...]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


@dataclass
class DemoResult:
    trace: str
    checkpoint: str
    tokens: int
    prefill_batches: int
    decode_seconds: float
    tokens_per_s: float
    budget_bytes: int
    td_bytes: int
    stats: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        s = self.stats
        return {
            "trace": self.trace, "checkpoint": self.checkpoint, "tokens": self.tokens,
            "decode_seconds": self.decode_seconds, "tokens_per_s": self.tokens_per_s,
            "td_bytes": self.td_bytes,
            "hit_rate": s["hits"] / s["requests"] if s["requests"] else 0.0,
            "budget_cycles": self.budget_bytes / self.td_bytes,
            "decode_felt_wait_per_token_ms": 1e3 * s["decode_felt_wait_s"] / max(self.tokens, 1),
            **{key: value for key, value in s.items() if key not in ("td_bytes", "budget_cycles")},
        }


@dataclass
class EngineRun:
    """What :func:`drive_engine` measured over one pass of a trace through an open store."""

    tokens: int
    """Decode tokens replayed."""
    prefill_batches: int
    decode_seconds: float
    """Wall time from the first decode token to the end of the pass."""
    decode_felt_wait_s: float
    """The store's felt wait accumulated from the first decode token on."""
    decode_requests: int
    decode_hits: int
    """Decode requests that found their expert resident or loading (a store hit or a
    single-flight join), counted per batch from the store's counters."""
    requests: int
    hits: int
    """Every request, prefill included, and those of them that were hits (hit or join)."""
    requested_bytes: int
    hit_bytes: int
    decode_compute_s: float = 0.0
    """Time the compute itself took from the first decode token on (``Compute.seconds``)."""
    token_felt_s: list[float] = field(default_factory=list)
    """Felt wait of each decode token (from one token boundary to the next), in order."""
    decode_cpu_s: float = 0.0
    """CPU time of the engine loop's thread (the event loop's: the store, its policy and this
    loop; the compute too where it runs on the loop) from the first decode token on."""


class EngineStore(Protocol):
    """What :func:`drive_engine` calls on a store: :class:`iosched.ExpertStore`, or the
    hand-written arm (``tools/handwritten.py``), so both run the same engine loop."""

    def acquire_many(self, keys: Iterable[ExpertKey]) -> AbstractAsyncContextManager[list[ExpertView]]: ...

    # and, on an iosched store, ``acquire_as_ready`` (``lease_and_compute`` looks for it)

    @property
    def request_tally(self) -> RequestTally: ...

    def token_boundary(self) -> None: ...

    def end_turn(self) -> int: ...

    def observe_routing(self, layer: int, experts: Any) -> None: ...

    def expect(self, layer: int, probabilities: Any) -> int: ...

    def stats(self) -> Mapping[str, Any]: ...


class SyntheticLookahead:
    """An engine's next-layer predictor of stated ``recall``, made from the trace's *true*
    next routing plus noise: labelled synthetic wherever it is reported (the issue asks for
    one to test ``ExpertStore.expect`` with; a real engine applies the next layer's router to
    the hidden state, Colibri: 71.6-73.6 % recall of the true top-8).

    For the next batch's ``k`` true experts it predicts ``k``: each true one kept with
    probability ``recall``, else replaced by an expert drawn from the others; the predicted
    ones get probability ``recall``, the rest the mass left, ``k (1 - recall) / (E - k)``, so
    the probabilities are calibrated.  Seeded: the same run predicts the same."""

    def __init__(self, recall: float, n_expert: int, seed: int = 0) -> None:
        if not 0.0 <= recall <= 1.0:
            raise StoreError(f"--lookahead-recall must be from 0 to 1, got {recall!r}")
        self.recall, self.n_expert = recall, n_expert
        self._rng = np.random.default_rng(seed)
        self.predicted = self.correct = 0

    def probabilities(self, true_experts: Any) -> Any:
        """The prediction for a batch whose true experts are ``true_experts`` (cheap: about
        15 µs, so that the engine loop's own time stays an engine's, not the predictor's)."""
        truth = [int(e) for e in true_experts]
        k, n = len(truth), self.n_expert
        kept = [e for e, draw in zip(truth, self._rng.random(k).tolist(), strict=True) if draw < self.recall]
        picks, truth_set = set(kept), set(truth)
        while len(picks) < min(k, n):
            c = int(self._rng.integers(n))
            if c not in truth_set and c not in picks or len(truth_set) >= n:
                picks.add(c)
        rest = k * (1.0 - self.recall) / max(n - k, 1)
        probs = np.full(n, rest)
        probs[list(picks)] = self.recall
        self.predicted += k
        self.correct += len(kept)
        return probs


def other_ms_per_token(run: EngineRun) -> float:
    """Decode wall time a token spent neither awaiting ``acquire_many`` nor computing: the
    engine loop's own Python and whatever else ran on the event loop before the engine's
    coroutine resumed (the store's batch-end work, its read completions, its policy)."""
    if not run.tokens:
        return 0.0
    return 1e3 * (run.decode_seconds - run.decode_felt_wait_s - run.decode_compute_s) / run.tokens


def rows_per_expert(keys: list[int], rows: npt.NDArray[np.integer[Any]] | None) -> list[int]:
    """The tokens each of a batch's experts ``keys`` computes on: the rows of the router's
    output (``rows``, padded with -1) that routed it, or one each without rows (a decode
    batch); a row picks an expert once."""
    if rows is None:
        return [1] * len(keys)
    counts: list[int] = np.bincount(rows[rows >= 0], minlength=max(keys) + 1)[keys].tolist()
    return counts


def _hit_counters(store: EngineStore) -> tuple[int, int]:
    """``(requests, hits + single-flight joins)`` so far: the store's request tally (cheap:
    ``stats()`` builds a whole snapshot, and this runs once per batch)."""
    tally = store.request_tally
    return tally.requests, tally.hits + tally.single_flight_joins


async def lease_and_compute(store: EngineStore, keys: list[ExpertKey], rows: list[int], compute: Compute,
                            before_compute: Callable[[], None] | None = None) -> tuple[int, int]:
    """One batch of the engine: lease the experts ``keys`` and run ``compute`` on them, each on
    its ``rows`` (:func:`rows_per_expert`), inside their leases; ``before_compute()`` once the
    leases are asked for, before the first compute (the engine's lookahead).  Returns the
    batch's ``(requests, hits + single-flight joins)``.

    ``compute.awaits`` says what the engine awaits: ``as-ready`` computes on each batch of
    views ``acquire_as_ready`` hands over (the resident ones first) while the others load, on a
    store that has it (a compute thread takes them there, ``in_thread``: one hand-off a
    layer); ``all`` (and the hand-written arm, which a user writes around
    ``os.pread``) awaits ``acquire_many``.  ``fresh`` tells a compute model how many of the
    views it computes on were just read (misses; a join of a prefetch in flight counts as at
    hand, as ``_hit_counters`` counts it)."""
    r0, h0 = _hit_counters(store)
    as_ready = getattr(store, "acquire_as_ready", None) if compute.awaits == "as-ready" else None
    if as_ready is None:
        async with store.acquire_many(keys) as views:
            r1, h1 = _hit_counters(store)
            if before_compute is not None:
                before_compute()
            await compute.layer(views, rows, fresh=(r1 - r0) - (h1 - h0))
        return r1 - r0, h1 - h0
    rows_of = dict(zip(keys, rows, strict=True))
    tally0 = store.request_tally
    async with as_ready(keys) as arrivals:
        tally1 = store.request_tally
        at_hand = tally1.hits - tally0.hits  # the first batch: resident on entry
        misses = tally1.misses - tally0.misses
        requests = tally1.requests - tally0.requests
        found = at_hand + tally1.single_flight_joins - tally0.single_flight_joins
        if before_compute is not None:
            before_compute()
        if compute.in_thread:  # the compute thread takes each batch as it lands
            await compute.arrivals(arrivals.in_thread(), rows_of)
            return requests, found
        async for views in arrivals:
            resident = min(len(views), at_hand)
            fresh = min(len(views) - resident, misses)
            at_hand -= resident
            misses -= fresh
            await compute.layer(views, [rows_of[v.key] for v in views], fresh=fresh, share=len(views) / len(keys))
    return requests, found


async def drive_engine(store: EngineStore, trace: RouteTrace, compute: Compute | float,
                       max_tokens: int | None = None, on_token: Callable[[], None] | None = None,
                       expert_bytes: dict[int, int] | None = None,
                       decode_start: float | None = None,
                       layer_map: dict[int, int] | None = None, routing: bool = True,
                       lookahead: SyntheticLookahead | None = None) -> EngineRun:
    """Replay ``trace`` through ``store`` as an engine would: per batch (a prefill layer, or
    one decode token's layer) lease the routed experts together with ``acquire_many``, run
    ``compute`` on them (``tools/compute.py``: each expert's MLP on the rows the batch routed
    to it, one in decode; a number: an emulated compute sleep of that many seconds), release;
    ``token_boundary()`` before each
    decode token, ``end_turn()`` where a prefill follows decode (the conversation's next
    turn).  Stops before decode token ``max_tokens``.  ``on_token`` is called once per
    decode token (progress bars); ``expert_bytes`` (per trace layer) weighs the byte counts,
    the trace's header sizes when omitted.  ``decode_start`` is the clock reading decode time
    counts from when the trace has no decode token (default: now).  ``layer_map`` renames the
    trace's layers to the checkpoint's (identity when omitted).  ``routing``: hand each
    prompt batch's per-token router output to ``observe_routing`` first, as an engine can
    (``False``: the store sees the keys only).  ``lookahead``: before computing each decode
    layer, hand the store its predicted probabilities for the next decode batch's layer
    (``expect``), as an engine with a next-layer predictor does."""
    if not isinstance(compute, Compute):
        compute = Compute(ComputeSpec("sleep", float(compute)))
    total = trace.n_decode_tokens() if max_tokens is None else min(max_tokens, trace.n_decode_tokens())
    sizes = trace.expert_bytes if expert_bytes is None else expert_bytes
    token, tokens, prefill_batches = -1, 0, 0
    decode_felt_start = 0.0
    compute_start = compute.seconds
    if decode_start is None:
        decode_start = clock.now()
    token_felt: list[float] = []
    felt_mark = 0.0
    cpu_start = time.thread_time() - compute.off_clock_cpu_s
    dec_req = dec_hits = all_req = all_hits = req_bytes = hit_bytes = 0
    was_decode = False
    batches = list(trace.batches())
    for batch, (phase, tok, layer, experts) in enumerate(batches):
        decode = phase == PHASE_DECODE
        if was_decode and not decode:
            store.end_turn()  # a prefill after decode: the next turn of the conversation
        was_decode = decode
        if decode and tok != token:
            if tokens == total:
                break
            felt_now = store.request_tally.felt_wait_s
            if token < 0:
                decode_start = clock.now()
                cpu_start = time.thread_time() - compute.off_clock_cpu_s
                decode_felt_start = felt_now
                compute_start = compute.seconds
            else:
                token_felt.append(felt_now - felt_mark)
            felt_mark = felt_now
            store.token_boundary()
            token = tok
            tokens += 1
            if on_token is not None:
                on_token()
        elif not decode:
            prefill_batches += 1
        ckpt_layer = layer if layer_map is None else layer_map[layer]
        rows = trace.routing.get(batch)
        if routing and rows is not None:  # a prompt's rows: what its router chose, per token
            store.observe_routing(ckpt_layer, rows)
        keys = experts.tolist()
        per_expert = rows_per_expert(keys, rows)
        expect: Callable[[], None] | None = None
        if lookahead is not None and decode and batch + 1 < len(batches):
            nphase, _, nlayer, nexperts = batches[batch + 1]
            if nphase == PHASE_DECODE:
                def expect(layer: int = nlayer if layer_map is None else layer_map[nlayer],
                           nexperts: Any = nexperts, lookahead: SyntheticLookahead = lookahead) -> None:
                    store.expect(layer, lookahead.probabilities(nexperts))
        n, h = await lease_and_compute(store, [(ckpt_layer, e) for e in keys], per_expert, compute, expect)
        all_req += n
        all_hits += h
        req_bytes += n * sizes[layer]
        hit_bytes += h * sizes[layer]
        if decode:
            dec_req += n
            dec_hits += h
    decode_seconds = clock.now() - decode_start
    decode_cpu = time.thread_time() - compute.off_clock_cpu_s - cpu_start
    if tokens:
        token_felt.append(store.request_tally.felt_wait_s - felt_mark)
    return EngineRun(
        tokens=tokens, prefill_batches=prefill_batches, decode_seconds=decode_seconds,
        decode_felt_wait_s=store.stats()["felt_wait_s"] - decode_felt_start,
        decode_requests=dec_req, decode_hits=dec_hits, requests=all_req, hits=all_hits,
        requested_bytes=req_bytes, hit_bytes=hit_bytes,
        decode_compute_s=compute.seconds - compute_start, token_felt_s=token_felt,
        decode_cpu_s=decode_cpu,
    )


async def _run_arm(config: DemoConfig, arm: str, trace: RouteTrace, folder: Path, index: Any,
                   budget: int, on_token: Callable[[], None] | None,
                   telemetry: str | None) -> tuple[EngineRun, dict[str, Any], Compute]:
    """One cold pass of the trace through one arm: an iosched policy, or ``handwritten``."""
    from .handwritten import HandwrittenEngineStore

    compute = Compute(config.compute_spec(), config.compute_on, config.awaits)
    if config.cold:
        drop_from_page_cache(index.files)
    decode_start = time.perf_counter()
    try:
        if arm == HANDWRITTEN:
            direct = resolve(config.backend, index.files)[0] in ("odirect", "uring")
            hand = HandwrittenEngineStore(index, budget, drop_behind=direct)
            try:
                run = await drive_engine(hand, trace, compute, config.max_tokens, on_token,
                                         decode_start=decode_start)
                stats = hand.stats()
            finally:
                hand.close()
        else:
            async with await ExpertStore.open(folder, budget_bytes=budget, backend=config.backend,
                                              policy=arm, experts_per_token=trace.k,
                                              telemetry=telemetry) as store:
                run = await drive_engine(store, trace, compute, config.max_tokens, on_token,
                                         decode_start=decode_start)
                while store.stats()["loading"]:  # the last batch's prefetches land before the summary
                    await asyncio.sleep(0.001)
                stats = store.stats()
    finally:
        compute.close()
    stats["decode_felt_wait_s"] = run.decode_felt_wait_s
    return run, stats, compute


def _arm_summary(arm: str, runs: list[tuple[EngineRun, dict[str, Any], Compute]]) -> dict[str, Any]:
    """An arm's medians over its rounds (each round's tokens/s kept too)."""
    tps = [r.tokens / r.decode_seconds if r.decode_seconds else 0.0 for r, _, _ in runs]
    run, stats, compute = runs[len(runs) // 2]
    return {
        "arm": arm,
        "tokens_per_s": statistics.median(tps),
        "tokens_per_s_rounds": tps,
        "decode_felt_wait_per_token_ms": statistics.median(
            1e3 * r.decode_felt_wait_s / max(r.tokens, 1) for r, _, _ in runs),
        "compute_ms_per_token": statistics.median(
            1e3 * r.decode_compute_s / max(r.tokens, 1) for r, _, _ in runs),
        "other_ms_per_token": statistics.median(other_ms_per_token(r) for r, _, _ in runs),
        "decode_hit_rate": run.decode_hits / run.decode_requests if run.decode_requests else 0.0,
        "hit_rate": run.hits / run.requests if run.requests else 0.0,
        "bytes_read": statistics.median(s["bytes_read"] for _, s, _ in runs),
        "backend": stats["backend"],
        **compute.describe(),
    }


def verdict(main: str, arms: list[dict[str, Any]]) -> str:
    """One sentence: which arm was fastest and by how much, said plainly when ``main`` was not."""
    if len(arms) < 2:
        return f"{main} alone (no arm to compare with)"
    by = {a["arm"]: a["tokens_per_s"] for a in arms}
    best = max(by, key=lambda name: by[name])
    ratios = ", ".join(f"{by[main] / by[a]:.2f}x {a}" for a in by if a != main and by[a])
    if best == main:
        runner = max((a for a in by if a != main), key=lambda name: by[name])
        return f"{main} is fastest here, {100 * (by[main] / by[runner] - 1):.0f} % ahead of {runner} ({ratios})"
    return (f"{main} does not win here: {best} is fastest, {100 * (by[best] / by[main] - 1):.0f} % "
            f"ahead of {main} ({main}: {ratios})")


async def run_demo(config: DemoConfig, progress: Any = None) -> DemoResult:
    """Build (once) and replay, each arm (``config.policy`` then ``config.compare``) on the same
    trace and budget, arms interleaved within each of ``config.rounds`` rounds, each pass cold;
    ``progress`` is a rich Progress or ``None``.  The result's store fields are the first
    arm's (its median round); ``arms`` holds every arm's medians and ``verdict`` says who won."""
    trace = load_bundled_trace(config.trace)
    folder = await asyncio.to_thread(demo_checkpoint, trace, None, config.scale)
    index = await asyncio.to_thread(load_index, folder)
    td = trace.k * sum(index.expert_bytes_by_layer().values())
    budget = int(config.budget_cycles * td)
    arms = [config.policy, *(a for a in config.compare if a != config.policy)]
    total = trace.n_decode_tokens() if config.max_tokens is None else min(config.max_tokens, trace.n_decode_tokens())
    task = (progress.add_task("decoding", total=total * len(arms) * config.rounds)
            if progress is not None else None)
    on_token = (lambda: progress.advance(task)) if task is not None else None
    runs: dict[str, list[tuple[EngineRun, dict[str, Any], Compute]]] = {a: [] for a in arms}
    for r in range(config.rounds):
        for arm in arms:
            telemetry = config.telemetry if arm == config.policy and r == config.rounds - 1 else None
            runs[arm].append(await _run_arm(config, arm, trace, folder, index, budget, on_token, telemetry))
    summaries = [_arm_summary(arm, runs[arm]) for arm in arms]
    main_runs = sorted(runs[config.policy], key=lambda x: x[0].tokens / x[0].decode_seconds
                       if x[0].decode_seconds else 0.0)
    run, stats, _ = main_runs[len(main_runs) // 2]
    stats = {**stats, "arms": summaries, "verdict": verdict(config.policy, summaries),
             "rounds": config.rounds, **main_runs[0][2].describe()}
    return DemoResult(
        trace=(f"{config.trace} ({Path(trace.model).name}, {len(trace.layers)} layers x "
               f"{trace.n_expert} experts, k={trace.k})"),
        checkpoint=str(folder), tokens=run.tokens, prefill_batches=run.prefill_batches,
        decode_seconds=run.decode_seconds,
        tokens_per_s=run.tokens / run.decode_seconds if run.decode_seconds else 0.0,
        budget_bytes=budget, td_bytes=td, stats=stats,
    )
