"""``iosched replay``: replay a routing trace through the residency code, without I/O.

Why it exists: a residency policy is chosen on hit ratios over real MoE routing, and those
numbers are only worth something if they come from the very objects the store runs.  So the
simulation drives a :class:`~iosched.residency.ResidencyTable` with a policy from
:func:`~iosched.residency.make_policy`, request by request, exactly as the store does on ``acquire``
(there is no second copy of any policy):

    entry = table.get(key); hit = entry is not None
    table.policy.on_request(key, nbytes, hit)
    on a miss:  e = table.reserve(key, nbytes); table.publish(e)
                if e.transient: table.remove(e)      # not admitted: served transiently

Nothing is leased in a simulation, so ``reserve`` always finds room; an expert larger than
the whole budget is a miss that caches nothing.  ``--batch-leases`` holds each batch as the
store does instead (its hits leased before its misses reserve, its loads until the batch's
end), so that the hit ratios are the store's (:func:`drive`).  ``table.check()`` re-checks every
invariant at the end of each run.  The statistics (hits, bytes) are this driver's, not the
policies'.

The request sequence and the metrics are the shared traces' README's (``tools/trace.py``
builds the sequence): the whole sequence, prefill included, shapes the cache; ``decode_hit``
is hits / requests over decode requests, ``byte_hit`` hit bytes / requested bytes over all
requests.  Budgets are given in token cycles, TD = k x sum of the layers' expert_bytes.

``--policy belady`` is the offline reference (``residency/alternatives/belady.py``): it needs the future,
so the store and the policy registry cannot build it; this tool builds it from the trace.
Two policies are experimental, kept only for docs/tried-and-dropped.md's negative results and
accepted only with ``--experimental``: ``belady-bypass``, the same rule with "OPT with
bypass" admission, and ``lfu-incache``, the in-cache LFU (libCacheSim's); their result rows
carry ``"experimental": true`` (``tools/_replay_policies.py``).

``--compare-libcachesim`` replays the same sequence (keys ``layer * n_expert + expert``, sizes
the layer's expert_bytes, cache size = the budget in bytes) through libCacheSim's own
implementations, rows named ``lcs:<algorithm>``; hits are taken from each ``get`` and the
ratios computed by this driver, so both arms are measured the same way.

Without ``--simulate`` the trace is replayed with real reads against a checkpoint built to its
shape (``tools/engine_replay.py``).  ``--simulate --train A`` seeds each policy with trace A
before measuring it on TRACE (or ``--eval B``, which must be TRACE), reported beside a cold arm:
the *seeded* arm replays A through a policy at the evaluation budget exactly as the simulation
does, then evicts every entry through the table (so the policy is told of each removal and the
invariants hold) and replays TRACE through a fresh ``ResidencyTable`` around the *same* policy
object: what the policy learned (LFU's kept frequencies) survives, the resident set does not.
The *cold* arm is the plain simulation of TRACE.  Rows carry ``"arm": "seeded"`` or ``"cold"``
and only TRACE's requests are counted, so a pre-warmed policy is never compared with a cold
baseline unawares.  Both traces must have the same shape (MoE layers and experts per layer).
Belady has nothing to learn: rejected.

TRACE is either format: a ``route_trace v1`` CSV (``tools/trace.py``) or the ``call row layer
expert:gate ...`` text that engines emit (``tools/calltrace.py``), told apart by the first line;
the text may carry no sizes, so ``--expert-bytes N`` gives one expert's size for it (else 1 MiB
is assumed, and the output says ``sizes_assumed``).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import importlib
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from iosched import BudgetError, InvariantError, StoreError, settings
from iosched.residency import POLICIES, Capability, Entry, Key, ModelShape, Policy, ResidencyTable, bind, make_policy
from iosched.residency.alternatives.belady import NEVER, BeladyPolicy, next_uses

from . import _command
from ._progress import run_progress
from ._replay_policies import EXPERIMENTAL, HANDWRITTEN, OFFLINE, VARIANTS
from .calltrace import DEFAULT_EXPERT_BYTES, is_call_line, load_call_trace_text
from .compute import add_compute_arguments, parse_compute_model
from .critical_path import DEFAULT_DRIVE_LATENCY_US, DEFAULT_DRIVE_MBPS
from .trace import (
    PHASE_DECODE,
    RouteTrace,
    TraceError,
    bundled_trace_names,
    load_bundled_trace,
    load_route_trace_text,
    read_trace_text,
    trace_error,
)

DEFAULT_CYCLES = "0.5,1,2,4,8"
DEFAULT_POLICIES = "lru,lfu,default,belady"

LIBCACHESIM_ALGOS: tuple[str, ...] = ("LRU", "LFU", "ARC", "S3FIFO", "Sieve", "WTinyLFU", "LHD",
                                      "GDSF", "LeCaR", "Belady")
"""libCacheSim classes replayed by ``--compare-libcachesim`` (``Belady`` gets each request's
next access time, as its oracle traces carry)."""

_INT64_MAX = (1 << 63) - 1

LEASES_WITHOUT_LIBCACHESIM = ("--batch-leases does not combine with --compare-libcachesim: libCacheSim's "
                              "caches have no leases, so its rows would replay another sequence")
"""Said by :func:`replay` and, before libCacheSim is imported, by the command."""

SIZES_ASSUMED_NOTE = (f"expert sizes assumed ({DEFAULT_EXPERT_BYTES // 2**20} MiB each: the trace "
                      "gives none; --expert-bytes sets them), so bytes and budgets are nominal")


# ---------------------------------------------------------------------------------------------
# the request sequence


@dataclass(frozen=True)
class Requests:
    """A trace's request sequence as plain Python lists (the replay loop's fastest form)."""

    keys: list[tuple[int, int]]
    """``(layer, expert)``: the store's keys."""
    ids: list[int]
    """``layer * n_expert + expert``: libCacheSim's integer object ids."""
    sizes: list[int]
    """Bytes of each request: its layer's expert_bytes from the header."""
    decode: list[bool]
    """Whether each request belongs to the decode phase."""
    batch_end: list[bool]
    """Whether each request is the last of its batch (one layer of one token, or one prefill
    layer): where an engine's ``acquire_many`` returns and the driver asks for prefetches."""
    shape: ModelShape
    """The model's shape from the trace's header, for policies that use it."""
    key_bytes: dict[tuple[int, int], int]
    """Bytes of every (layer, expert) of the model (its layer's expert_bytes), prefetches included."""
    routing: dict[int, tuple[int, npt.NDArray[np.int64]]] = field(default_factory=dict)
    """By the index of a batch's first request: ``(layer, rows)``, the router's output of a
    batch of several tokens (``RouteTrace.routing``), which the driver hands to a policy's
    ``on_routing`` as the store's ``observe_routing`` does; empty for a keys-only replay."""

    @classmethod
    def of(cls, trace: RouteTrace, routing: bool = True) -> Requests:
        """``routing=False``: the policies see the keys only (``--keys-only``)."""
        layers = trace.req_layer.tolist()
        experts = trace.req_expert.tolist()
        batch = trace.req_batch.tolist()
        starts: dict[int, tuple[int, npt.NDArray[np.int64]]] = {}
        if routing and trace.routing:  # as on_routing takes them, converted once for every run
            first = np.flatnonzero(np.diff(trace.req_batch, prepend=-1)).tolist()
            starts = {first[b]: (layers[first[b]], rows.astype(np.int64))
                      for b, rows in trace.routing.items()}
        return cls(
            routing=starts,
            keys=list(zip(layers, experts, strict=True)),
            ids=[ly * trace.n_expert + ex for ly, ex in zip(layers, experts, strict=True)],
            sizes=trace.req_bytes.tolist(),
            decode=(trace.req_phase == PHASE_DECODE).tolist(),
            batch_end=[a != b for a, b in zip(batch, batch[1:] + [-1], strict=True)],
            shape=shape_of(trace),
            key_bytes={(layer, e): nbytes for layer, nbytes in trace.expert_bytes.items()
                       for e in range(trace.n_expert)},
        )

    def __len__(self) -> int:
        return len(self.keys)


def shape_of(trace: RouteTrace) -> ModelShape:
    """What the trace's header says of the model, as a structure-aware policy takes it."""
    return ModelShape(layers=tuple(trace.layers), n_expert=trace.n_expert,
                      experts_per_token=trace.k, expert_bytes=dict(trace.expert_bytes))


def load_trace(spec: str, expert_bytes: int | None = None) -> RouteTrace:
    """A trace file (``.gz`` read via gzip) or the name of a bundled trace.

    The file's first non-blank line tells the format: ``# route_trace ...`` is a
    ``route_trace v1`` CSV, otherwise it is a call trace (``tools/calltrace.py``) whose first
    line that is not a comment must look like ``<call> <row> <layer> <expert>:<gate>``.
    ``expert_bytes`` (``--expert-bytes``) is one expert's size for a call trace without
    ``# layer=`` lines; a CSV's header always gives sizes, so with a CSV it is an error.
    """
    if os.path.exists(spec) or os.sep in spec or spec.endswith((".csv", ".gz")):
        source, text = read_trace_text(spec)
        if _sniff(source, text) == "csv":
            _no_expert_bytes(source, expert_bytes)
            return load_route_trace_text(text, source)
        return load_call_trace_text(text, source, expert_bytes)
    names = bundled_trace_names()
    if spec in names:
        _no_expert_bytes(spec, expert_bytes)
        return load_bundled_trace(spec)
    raise TraceError(f"{spec}: no such trace file, and no bundled trace of that name "
                     f"(bundled: {', '.join(names) if names else 'none'})")


def _no_expert_bytes(source: str, expert_bytes: int | None) -> None:
    if expert_bytes is not None:
        raise TraceError(f"{source}: --expert-bytes applies to call traces only; this is a "
                         "route_trace v1 CSV, whose header gives every layer's expert_bytes")


def _sniff(source: str, text: str) -> str:
    """``"csv"`` or ``"call"``: which parser reads ``text`` (see :func:`load_trace`)."""
    lines = [line.strip() for line in text.split("\n")]
    if next((line for line in lines if line), "").startswith("# route_trace"):
        return "csv"
    for lineno, line in enumerate(lines, 1):
        if line and not line.startswith("#"):
            if is_call_line(line):
                return "call"
            raise trace_error(source, lineno, "neither trace format matched: not a "
                              "route_trace v1 CSV (first line '# route_trace v1') nor a call "
                              f"trace (lines '<call> <row> <layer> <expert>:<gate> ...'); got "
                              f"{line[:80]!r}")
    return "call"  # blank or comments only: the call parser reports the empty trace


def policy_names(experimental: bool = False) -> list[str]:
    """The names ``--policy`` accepts: the registry's and the offline reference, and with
    ``experimental`` (``--experimental``) the experimental ones too."""
    names = set(POLICIES) | set(OFFLINE) | set(VARIANTS)
    return sorted(names if experimental else names - EXPERIMENTAL)


def parse_policies(text: str, experimental: bool = False, real: bool = False) -> list[str]:
    """The policies of a ``--policy`` list, each known and named once; an experimental one
    only with ``experimental`` (``--experimental``); ``handwritten`` (the hand-written arm,
    ``tools/handwritten.py``) with real I/O only (``real``)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise StoreError(f"--policy: empty list {text!r}")
    known = policy_names(experimental)
    for name in names:
        if name == HANDWRITTEN:
            if not real:
                raise StoreError("policy 'handwritten' is the real-I/O replay's hand-written arm "
                                 "(an LRU of bytes and 8 threads of pread); drop --simulate")
            continue
        if name in EXPERIMENTAL and not experimental:
            raise StoreError(f"policy {name!r} is experimental (kept for docs/tried-and-dropped.md's negative "
                             "results); --experimental accepts it")
        if name not in known:
            raise StoreError(f"unknown policy {name!r}; choose one of {', '.join(known)}")
    if len(set(names)) != len(names):
        raise StoreError(f"--policy {text!r} names a policy twice")
    return names


def parse_cycles(text: str) -> list[float]:
    out: list[float] = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        try:
            value = float(item)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value > 0):
            raise StoreError(f"--cycles: {item!r} is not a positive number of token cycles")
        out.append(value)
    if not out:
        raise StoreError(f"--cycles: empty list {text!r}")
    return out


def budget_for(trace: RouteTrace, cycles: float) -> int:
    """The budget in bytes for ``cycles`` token cycles (rounded down, at least one byte)."""
    return max(1, int(cycles * trace.td_bytes))


# ---------------------------------------------------------------------------------------------
# one run


def takes_prefetch_width(name: str) -> bool:
    """Whether ``--prefetch-width`` applies to the policy named ``name``: the prefetching ones,
    which declare ``Capability.BATCHES`` (the store's own rule, ``iosched/runtime/_store.py``)."""
    return name in POLICIES and Capability.BATCHES in make_policy(name).capabilities


def build_policy(name: str, reqs: Requests, budget: int, prefetch_width: int | None = None) -> Policy:
    """A fresh policy: from the registry, or an offline one built from the sequence; a
    policy that takes the model's shape gets it (as the store gives it its checkpoint's).
    ``prefetch_width`` applies to the prefetching policies and is ignored by the others."""
    if name in OFFLINE:
        keys: list[Key] = list(reqs.keys)
        return BeladyPolicy(keys, bypass_budget=budget if OFFLINE[name] else None)
    if takes_prefetch_width(name):
        return make_policy(name, prefetch_width=prefetch_width)
    return VARIANTS[name]() if name in VARIANTS else make_policy(name)


def build_table(policy: Policy, reqs: Requests, budget: int) -> ResidencyTable:
    """The table a run drives: the policy bound to it (its declared capabilities checked),
    given the trace's shape when it declares ``Capability.SHAPE`` (as the store gives it its
    checkpoint's), with the transient slot :func:`transient_bytes_for` sizes."""
    return ResidencyTable(budget, policy, transient_bytes=transient_bytes_for(policy, reqs, budget),
                          shape=reqs.shape)


def transient_bytes_for(policy: Policy, reqs: Requests, budget: int) -> int:
    """The transient slot a policy's table gets: none for a policy that admits every miss
    (LRU, LFU, Belady: their numbers are those of a slot-less table), and for one that may
    reject (``Capability.REJECTS``) one layer's batch of the largest experts, ``k x
    max(expert bytes)``, with ``k`` the trace's experts per token and layer (the longest run
    of one layer's requests in decode, where each token asks each layer for its k experts),
    capped at half the budget so the main region keeps the other half."""
    if Capability.REJECTS not in policy.capabilities or not reqs.sizes:
        return 0
    k = run = 1
    prev: int | None = None
    for (layer, _), dec in zip(reqs.keys, reqs.decode, strict=True):
        run = run + 1 if dec and layer == prev else 1
        prev = layer if dec else None
        k = max(k, run)
    return min(k * max(reqs.sizes), budget // 2)


def _row(policy: str, cycles: float, budget: int, reqs: Requests, hit_flags: list[bool],
         seconds: float) -> dict[str, Any]:
    """The driver's statistics of one run, from one hit flag per request."""
    hits = dec_req = dec_hits = hit_bytes = 0
    for hit, size, dec in zip(hit_flags, reqs.sizes, reqs.decode, strict=True):
        if dec:
            dec_req += 1
            dec_hits += hit
        if hit:
            hits += 1
            hit_bytes += size
    total_bytes = sum(reqs.sizes)
    return {
        "policy": policy,
        "cycles": float(cycles),
        "budget_bytes": budget,
        "requests": len(reqs),
        "decode_hit": dec_hits / dec_req if dec_req else 0.0,
        "byte_hit": hit_bytes / total_bytes if total_bytes else 0.0,
        "hits": hits,
        "decode_requests": dec_req,
        "decode_hits": dec_hits,
        "hit_bytes": hit_bytes,
        "requested_bytes": total_bytes,
        "seconds": seconds,
    }


@dataclass
class Drive:
    """What one pass of a request sequence through a table did (the driver's statistics)."""

    flags: list[bool]
    """Hit or not, per request."""
    oversize: int = 0
    miss_bytes: int = 0
    prefetch_issued: int = 0
    prefetch_bytes: int = 0
    prefetch_used: int = 0
    prefetch_wasted: int = 0
    prefetch_refused_budget: int = 0
    no_room: int = 0
    """Misses that found no room beside the batch's leases (``batch_leases``): served
    transiently, as the store's acquire would once a lease ended."""

    def fields(self) -> dict[str, int]:
        """The counters as a result row's keys, with ``moved_bytes`` (misses plus prefetches)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "flags"}
        out["moved_bytes"] = self.miss_bytes + self.prefetch_bytes
        return out


def drive(table: ResidencyTable, reqs: Requests, *, token_budget_bytes: int | None = None,
          check_every: int = 0, batch_leases: bool = False) -> Drive:
    """Replay ``reqs`` through ``table`` as the store drives it (the one replay driver).

    Per request: a hit when resident or loading; on a miss a reservation (an expert larger
    than the whole budget is a miss that caches nothing), published at once (virtual time),
    dropped at once when not admitted.  After the last request of each batch a policy with
    ``end_batch`` is told the batch is complete and names the experts it wants loaded ahead;
    each one not in the table is reserved speculatively (the policy's eviction guard may
    refuse) and published at once: a load takes no time here, and an expert that is loading
    counts as a hit anyway.  Then a policy with ``prepare`` precomputes for the next batch,
    as the store lets it while the engine computes.  ``token_budget_bytes`` caps the bytes
    prefetched per token, as the store's setting of that name does (``None``: no cap beyond
    the policy's own).
    ``check_every``: also re-check the table's invariants every that many requests (tests).

    ``batch_leases``: hold each batch as the store's ``acquire_many`` and ``acquire_as_ready``
    do: its resident experts are leased before its first miss reserves (so its misses never
    evict them), each load is leased once published, transient ones included, and the leases
    end after the batch's end work (the engine computes meanwhile).  The hit ratios are then
    the store's: on qwen at one token cycle ``lru`` holds 37.7 % of the decode requests this
    way, as the critical path's real store does, against 27.5 % request by request, where a
    batch's misses evict the experts it just hit.  The policy hears a batch's hits first, then
    its misses, each in the trace's order, as the store tells it; ``belady`` hears them in the
    trace's order (its cursor follows the sequence; within a batch the order does not change
    which key is used farthest ahead).  A miss that finds no room beside the leases is served
    transiently (``no_room``).
    """
    out = Drive(flags=[])
    unused: set[Key] = set()

    def on_evict(entry: Entry) -> None:
        if entry.key in unused:
            unused.discard(entry.key)
            out.prefetch_wasted += 1

    previous = table.set_on_evict(on_evict)
    policy, hooks = table.policy, table.hooks
    on_request = policy.on_request
    end_batch, prepare = hooks.end_batch, hooks.prepare
    first_layer = reqs.shape.layers[0] if reqs.shape.layers else None
    token_prefetch = 0
    get, reserve, publish, remove = table.get, table.reserve, table.publish, table.remove
    on_routing = hooks.on_routing
    routing = reqs.routing if on_routing is not None else {}
    keys, sizes, batch_end = reqs.keys, reqs.sizes, reqs.batch_end
    n = len(keys)
    flags: list[bool] = [False] * n
    out.flags = flags
    in_trace_order = not batch_leases or isinstance(policy, BeladyPolicy)  # (its cursor: see above)
    held: dict[Key, Entry] = {}  # the batch's leases (batch_leases)
    done = 0
    try:
        first = 0
        while first < n:
            last = first
            while last < n - 1 and not batch_end[last]:
                last += 1
            if first in routing and on_routing is not None:  # the engine knows its router's output first
                on_routing(*routing[first])
            if keys[first][0] == first_layer:
                token_prefetch = 0  # a new token (or the prefill) starts at the first layer
            order: Sequence[int] = range(first, last + 1)
            if batch_leases:  # the batch's resident experts, leased before any miss reserves
                at_hand: list[int] = []
                missed: list[int] = []
                for j in order:
                    resident = get(keys[j])
                    if resident is not None and keys[j] not in held:
                        table.lease(resident)
                        held[keys[j]] = resident
                    (at_hand if resident is not None else missed).append(j)
                if not in_trace_order:
                    order = at_hand + missed  # the store tells the policy its hits first
            for i in order:
                key, nbytes = keys[i], sizes[i]
                hit = get(key) is not None
                flags[i] = hit
                on_request(key, nbytes, hit)
                if hit:
                    if key in unused:
                        unused.discard(key)
                        out.prefetch_used += 1
                else:
                    out.miss_bytes += nbytes
                    try:
                        entry = reserve(key, nbytes)
                    except BudgetError:
                        out.oversize += 1
                    else:
                        if entry is None:
                            if not batch_leases:
                                raise InvariantError(f"reserve of {key!r} found no room, but nothing is "
                                                     "leased or loading in a simulation")
                            out.no_room += 1  # the batch's leases hold the budget
                        else:
                            publish(entry)
                            if batch_leases:
                                table.lease(entry)
                                held[key] = entry
                            elif entry.transient:
                                remove(entry)
                done += 1
                if check_every and done % check_every == 0:
                    table.check()
            if end_batch is not None:
                wanted: list[tuple[Key, int]] = []
                planned = token_prefetch
                for want in end_batch() or ():  # None: no batch-end work (the policy retired)
                    size = reqs.key_bytes[want]  # type: ignore[index]
                    if get(want) is not None:
                        continue
                    if token_budget_bytes is not None and planned + size > token_budget_bytes:
                        out.prefetch_refused_budget += 1
                        continue
                    planned += size
                    wanted.append((want, size))
                for (want, size), e in zip(wanted, table.reserve_speculative_many(wanted), strict=True):
                    if e is None:
                        continue
                    publish(e)
                    unused.add(want)
                    out.prefetch_issued += 1
                    out.prefetch_bytes += size
                    token_prefetch += size
                if prepare is not None:
                    prepare()  # as the store does, once the batch's prefetches are out
            if held:  # the engine computed on the batch: its leases end
                for entry in held.values():
                    if table.release(entry) and entry.transient:
                        remove(entry)
                held.clear()
            first = last + 1
    finally:
        table.set_on_evict(previous)
    table.check()
    return out


def simulate(reqs: Requests, policy_name: str, cycles: float, budget: int, *,
             check_every: int = 0, token_budget_bytes: int | None = None,
             prefetch_width: int | None = None, batch_leases: bool = False) -> dict[str, Any]:
    """Replay ``reqs`` through ``ResidencyTable(budget, policy)`` with :func:`drive`; the
    row of the contract's ``results``, with the driver's statistics."""
    t0 = time.perf_counter()
    policy = build_policy(policy_name, reqs, budget, prefetch_width)
    table = build_table(policy, reqs, budget)
    run = drive(table, reqs, token_budget_bytes=token_budget_bytes, check_every=check_every,
                batch_leases=batch_leases)
    if isinstance(policy, BeladyPolicy) and not policy.finished:
        raise InvariantError(f"Belady saw {policy.cursor} of {len(reqs)} requests")
    row = _row(policy_name, cycles, budget, reqs, run.flags, time.perf_counter() - t0)
    if table.hooks.stateful is not None:
        row["policy_state"] = table.hooks.stateful.state.as_dict()
    row.update(admissions=table.admissions, rejections=table.rejections,
               evictions=table.evictions, resident_bytes=table.used_bytes,
               resident_experts=len(table), prefetch_refused_guard=table.refused_prefetches,
               **run.fields())
    if prefetch_width is not None and takes_prefetch_width(policy_name):
        row["prefetch_width"] = prefetch_width
    if token_budget_bytes is not None:
        row["token_budget_bytes"] = token_budget_bytes
    if policy_name in EXPERIMENTAL:
        row["experimental"] = True
    return row


def libcachesim_module() -> Any:
    """The installed libcachesim (untyped: imported dynamically), or a StoreError saying how."""
    try:
        return importlib.import_module("libcachesim")
    except ImportError as exc:
        raise StoreError(f"--compare-libcachesim needs libcachesim ({exc}); "
                         "pip install libcachesim") from None


@contextlib.contextmanager
def _c_stdout_to_stderr() -> Iterator[None]:
    """Send what C code prints to stdout to stderr instead, while the block runs.

    libCacheSim prints warnings with ``printf`` (e.g. WTinyLFU's "CBF ... has too few
    counters" for small caches), which would break "exactly one JSON object on stdout".
    """
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no fd 1 at all: nothing to protect
        yield
        return
    libc: Any = None
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        pass
    try:
        os.dup2(2, 1)
        yield
    finally:
        if libc is not None:
            libc.fflush(None)  # C stdio buffers: out to the redirected fd, not after it
        os.dup2(saved, 1)
        os.close(saved)


def simulate_libcachesim(reqs: Requests, algo: str, cycles: float, budget: int,
                         nxt: list[int] | None = None) -> dict[str, Any]:
    """Replay ``reqs`` through libCacheSim's ``algo`` with a cache of ``budget`` bytes."""
    lcs = libcachesim_module()
    if algo == "Belady" and nxt is None:
        nxt = next_uses(list(reqs.ids))
    t0 = time.perf_counter()
    flags: list[bool] = []
    with _c_stdout_to_stderr():
        cache = getattr(lcs, algo)(budget)
        req = lcs.Request()
        get = cache.get
        if nxt is not None and algo == "Belady":
            for oid, size, nu in zip(reqs.ids, reqs.sizes, nxt, strict=True):
                req.obj_id = oid
                req.obj_size = size
                req.next_access_vtime = _INT64_MAX if nu == NEVER else nu
                flags.append(bool(get(req)))
        else:
            for oid, size in zip(reqs.ids, reqs.sizes, strict=True):
                req.obj_id = oid
                req.obj_size = size
                flags.append(bool(get(req)))
    row = _row(f"lcs:{algo}", cycles, budget, reqs, flags, time.perf_counter() - t0)
    row["resident_bytes"] = int(cache.get_occupied_byte())
    row["resident_experts"] = int(cache.get_n_obj())
    row["moved_bytes"] = row["miss_bytes"] = sum(
        size for size, hit in zip(reqs.sizes, flags, strict=True) if not hit)
    return row


# ---------------------------------------------------------------------------------------------
# a sweep


def replay(trace: RouteTrace, label: str, cycles: Sequence[float], policies: Sequence[str],
           compare_libcachesim: bool = False,
           on_run: Callable[[str], None] | None = None, *,
           prefetch_width: int | None = None,
           token_budget_cycles: float | None = None, routing: bool = True,
           batch_leases: bool = False) -> dict[str, Any]:
    """Every policy (then every libCacheSim algorithm) at every budget; the contract's object.

    ``on_run(label)`` is called before each run (progress bars).  ``prefetch_width`` goes to
    the prefetching policies; ``token_budget_cycles`` caps prefetched bytes per token, in
    token cycles.  ``routing=False``: the policies see the request keys only, not the router's
    output of the prompt's batches (``--keys-only``).  ``batch_leases``: each batch held as
    the store holds it (:func:`drive`; ``--batch-leases``); libCacheSim has no leases, so not
    with ``compare_libcachesim``.
    """
    if batch_leases and compare_libcachesim:
        raise StoreError(LEASES_WITHOUT_LIBCACHESIM)
    token_budget = None if token_budget_cycles is None else int(token_budget_cycles * trace.td_bytes)
    reqs = Requests.of(trace, routing)
    lcs_version: str | None = None
    if compare_libcachesim:
        lcs_version = str(getattr(libcachesim_module(), "__version__", "unknown"))
    results: list[dict[str, Any]] = []
    for name in policies:
        for c in cycles:
            if on_run is not None:
                on_run(f"{name} @ {c:g} cycles")
            results.append(simulate(reqs, name, c, budget_for(trace, c), token_budget_bytes=token_budget,
                                    prefetch_width=prefetch_width, batch_leases=batch_leases))
    if compare_libcachesim:
        nxt = next_uses(list(reqs.ids))
        for algo in LIBCACHESIM_ALGOS:
            for c in cycles:
                if on_run is not None:
                    on_run(f"lcs:{algo} @ {c:g} cycles")
                results.append(simulate_libcachesim(reqs, algo, c, budget_for(trace, c), nxt))
    out: dict[str, Any] = {
        "trace": label,
        "k": trace.k,
        "td_bytes": trace.td_bytes,
        "results": results,
        "source": trace.source,
        "model": trace.model,
        "arch": trace.arch,
        "requests": len(reqs),
        "decode_requests": sum(reqs.decode),
        "distinct_experts": len(set(reqs.keys)),
        "sizes_assumed": trace.sizes_assumed,
        "routing": bool(reqs.routing),
        "batch_leases": batch_leases,
    }
    if lcs_version is not None:
        out["libcachesim_version"] = lcs_version
    return out


# ---------------------------------------------------------------------------------------------
# train / eval (simulation)


def check_same_shape(train: RouteTrace, train_label: str, ev: RouteTrace, eval_label: str) -> None:
    if train.layers != ev.layers or train.n_expert != ev.n_expert:
        raise StoreError(
            f"--train {train_label} ({len(train.layers)} MoE layers x {train.n_expert} experts) "
            f"and --eval {eval_label} ({len(ev.layers)} MoE layers x {ev.n_expert} experts) "
            "have different shapes; a policy learns keys (layer, expert) of one model")


def simulate_seeded(train: Requests, ev: Requests, policy_name: str, cycles: float,
                    budget: int, prefetch_width: int | None = None,
                    batch_leases: bool = False) -> dict[str, Any]:
    """The seeded arm: ``policy_name`` learns from ``train``, then is measured on ``ev``
    (both replays holding each batch as the store does with ``batch_leases``)."""
    if policy_name in OFFLINE:
        raise StoreError(f"--policy {policy_name} is an offline reference with nothing to "
                         "learn; --train does not apply to it")
    t0 = time.perf_counter()
    policy: Policy = build_policy(policy_name, ev, budget, prefetch_width)
    warm = build_table(policy, ev, budget)
    drive(warm, train, batch_leases=batch_leases)
    warm.evict_all()  # through the table: the policy hears of every removal
    warm.check()
    if len(warm):
        raise InvariantError("entries left after evict_all in a simulation")
    if warm.hooks.history is not None:
        # A policy that keeps a usage history is seeded the way the store seeds it: a fresh
        # policy loads what the trained one saved (decayed by half, with its pins), shaped
        # first, and bound to its table after.
        learned = warm.hooks.history.history()
        policy = build_policy(policy_name, ev, budget, prefetch_width)
        fresh = bind(policy)
        if fresh.set_shape is not None:
            fresh.set_shape(ev.shape)
        if fresh.history is not None:
            fresh.history.load_history(learned, "--train")
    table = build_table(policy, ev, budget)
    run = drive(table, ev, batch_leases=batch_leases)
    row = _row(policy_name, cycles, budget, ev, run.flags, time.perf_counter() - t0)
    row.update(arm="seeded", train_requests=len(train), admissions=table.admissions,
               rejections=table.rejections, evictions=table.evictions,
               resident_bytes=table.used_bytes, resident_experts=len(table),
               prefetch_refused_guard=table.refused_prefetches, **run.fields())
    if policy_name in EXPERIMENTAL:
        row["experimental"] = True
    return row


def train_eval(train: RouteTrace, train_label: str, ev: RouteTrace, eval_label: str,
               cycles: Sequence[float], policies: Sequence[str],
               on_run: Callable[[str], None] | None = None, *,
               prefetch_width: int | None = None, routing: bool = True,
               batch_leases: bool = False) -> dict[str, Any]:
    """Seeded and cold arms of every policy at every budget (budgets in ``ev``'s TD);
    ``routing=False``: the policies see the keys only (``--keys-only``); ``batch_leases``:
    every replay holds each batch as the store does (:func:`drive`)."""
    for name in policies:
        if name in OFFLINE:
            raise StoreError(f"--policy {name} is an offline reference with nothing to learn; "
                             "--train does not apply to it")
    check_same_shape(train, train_label, ev, eval_label)
    treqs, ereqs = Requests.of(train, routing), Requests.of(ev, routing)
    results: list[dict[str, Any]] = []
    for name in policies:
        for c in cycles:
            budget = budget_for(ev, c)
            if on_run is not None:
                on_run(f"{name} @ {c:g} cycles, seeded")
            results.append(simulate_seeded(treqs, ereqs, name, c, budget, prefetch_width, batch_leases))
            if on_run is not None:
                on_run(f"{name} @ {c:g} cycles, cold")
            row = simulate(ereqs, name, c, budget, prefetch_width=prefetch_width, batch_leases=batch_leases)
            row["arm"] = "cold"
            results.append(row)
    return {
        "trace": eval_label,
        "mode": "train_eval",
        "train": train_label,
        "eval": eval_label,
        "k": ev.k,
        "td_bytes": ev.td_bytes,
        "results": results,
        "source": ev.source,
        "model": ev.model,
        "arch": ev.arch,
        "requests": len(ereqs),
        "decode_requests": sum(ereqs.decode),
        "train_requests": len(treqs),
        "routing": routing,
        "batch_leases": batch_leases,
    }


def train_eval_table(out: dict[str, Any]) -> Any:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    cycles: list[float] = []
    rows: dict[tuple[str, str], dict[float, dict[str, Any]]] = {}
    for r in out["results"]:
        if r["cycles"] not in cycles:
            cycles.append(r["cycles"])
        rows.setdefault((r["policy"], r["arm"]), {})[r["cycles"]] = r
    table = Table(title=f"iosched replay: trained on {out['train']}, measured on {out['eval']}: "
                        "decode hit % / byte hit % per budget (token cycles)")
    table.add_column("policy", no_wrap=True)
    table.add_column("arm", no_wrap=True)
    for c in cycles:
        table.add_column(f"{c:g} TD", justify="right")
    for (name, arm), by_c in rows.items():
        cells = [f"{100 * by_c[c]['decode_hit']:.1f} / {100 * by_c[c]['byte_hit']:.1f}"
                 if c in by_c else "-" for c in cycles]
        table.add_row(f"{name} (experimental)" if name in EXPERIMENTAL else name, arm, *cells)
    note = (f"seeded: the policy first replayed {out['train']} ({out['train_requests']} requests), "
            f"then its resident set was emptied; cold: a fresh policy. Only {out['eval']}'s "
            f"{out['requests']} requests are counted.")
    if out.get("batch_leases"):
        note += " Both arms held each batch as the store does (--batch-leases)."
    return Group(table, Text(note, style="dim"))


# ---------------------------------------------------------------------------------------------
# the command


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``iosched replay`` on ``sub`` (``tools/cli.py``'s subparsers)."""
    p = sub.add_parser("replay", help="replay a routing trace through the residency policies "
                                      "(real reads; --simulate: no I/O)",
                       description=__doc__.splitlines()[0] if __doc__ else None)
    _add_arguments(p)
    p.set_defaults(func=cmd_replay)


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", metavar="TRACE",
                   help="a route_trace v1 CSV or a 'call row layer expert:gate ...' text trace "
                        "(.gz read via gzip), or a bundled trace: qwen, gemma")
    p.add_argument("--simulate", action="store_true",
                   help="replay through the residency table in virtual time, without I/O "
                        "(default: real reads against a checkpoint built to the trace's shape)")
    p.add_argument("--batch-leases", action="store_true",
                   help="with --simulate: hold each batch as the store does (its resident experts "
                        "leased before its misses evict, its loads until its end), so the hit "
                        "ratios are the store's (default: request by request, the traces' "
                        "README's semantics)")
    p.add_argument("--critical-path", action="store_true",
                   help="with --simulate: run the real store on virtual time, a modelled drive "
                        "and modelled compute, and report tokens/s, felt wait p50/p99, bytes, "
                        "prefetch precision and CPU per token (tools/critical_path.py)")
    p.add_argument("--drive-mbps", type=_command.positive_float, default=None, metavar="MB/S",
                   help=f"critical path: the modelled drive's bandwidth (default "
                        f"{DEFAULT_DRIVE_MBPS:g}, or --drive's probe)")
    p.add_argument("--drive-latency-us", type=_command.non_negative_float, default=None, metavar="US",
                   help=f"critical path: the modelled drive's per-request latency (default "
                        f"{DEFAULT_DRIVE_LATENCY_US:g}, or --drive's probe)")
    p.add_argument("--drive-burst-ms", type=_command.non_negative_float, default=0.0, metavar="MS",
                   help="critical path: model the drive as a rate limit (a token bucket of MS ms of "
                        "credit, --drive-mbps) in front of reads of --drive-latency-us each, as a cloud "
                        "volume or --throttle-mbps is (default 0: a drive's own transfer pipe)")
    p.add_argument("--drive", default=None, metavar="FILE.json",
                   help="critical path: the drive model from `iosched topology PATH --probe --json` "
                        "written to FILE.json (its depth-qd MB/s and depth-1 latency; with "
                        "--drive-burst-ms, its whole depth-1 read time behind the rate limit)")
    p.add_argument("--compute-model", type=parse_compute_model, default=None,
                   metavar="calibrate|const:MS|linear:MS,MS_PER_MIB,MS_PER_MIB_ROW",
                   help="critical path: a layer's modelled compute (default calibrate: the real "
                        "numpy compute measured here on the checkpoint's expert shape)")
    p.add_argument("--cpu", choices=("measured", "free"), default="measured",
                   help="critical path: charge the store's and the policy's real CPU time to the "
                        "virtual clock (measured, default) or not (free: same inputs, same numbers)")
    p.add_argument("--read-cpu-us", type=_command.non_negative_float, default=None, metavar="US",
                   help="critical path: the event loop's CPU per read a real backend costs beyond the "
                        "model (default: measured with --backend, odirect unless given, on --drive's "
                        "probe file; 0 without --drive)")
    p.add_argument("--throttle-mbps", type=_command.positive_float, default=None, metavar="MB/S",
                   help="real I/O: pace the store's reads to this bandwidth (a token bucket in front of "
                        "the real backend), so that a drive whose speed drifts reads at a known one "
                        "(validating the critical-path replay; the hand-written arm is not paced)")
    p.add_argument("--lookahead-recall", type=_command.non_negative_float, default=None, metavar="R",
                   help="real I/O and critical path: the engine hands the store (ExpertStore.expect) a "
                        "SYNTHETIC next-layer prediction of recall R (0-1), made from the trace's true "
                        "next routing plus noise, before each decode layer's compute")
    p.add_argument("--queue-depth", type=_command.positive_int, default=None, metavar="N",
                   help="critical path: the store's queue_depth (default the store's)")
    p.add_argument("--cycles", default=DEFAULT_CYCLES,
                   help=f"budgets in token cycles, comma list (default {DEFAULT_CYCLES})")
    p.add_argument("--policy", default=DEFAULT_POLICIES,
                   help=f"policies, comma list (default {DEFAULT_POLICIES}); "
                        f"one of {', '.join(policy_names())}; "
                        f"experimental, with --experimental: {', '.join(sorted(EXPERIMENTAL))}")
    p.add_argument("--experimental", action="store_true",
                   help="also accept the experimental policies (" + ", ".join(sorted(EXPERIMENTAL))
                        + "), kept only for the negative results in docs/tried-and-dropped.md; their "
                        'result rows carry "experimental": true')
    p.add_argument("--compare-libcachesim", action="store_true",
                   help="also replay through libCacheSim's " + ", ".join(LIBCACHESIM_ALGOS)
                        + " (rows lcs:NAME)")
    p.add_argument("--prefetch-width", type=_command.non_negative_int, default=None, metavar="N",
                   help="experts the moe/default policy may propose per batch (default: k, one "
                        "batch's worth; 0: no prefetch, eviction only)")
    p.add_argument("--token-budget", type=_command.non_negative_float, default=None, metavar="CYCLES",
                   help="with --simulate: cap on the bytes prefetched per token, in token cycles "
                        "(default: none beyond the policy's own width)")
    p.add_argument("--train", metavar="A", default=None,
                   help="with --simulate: seed each policy with trace A (a file or bundled name) "
                        "before measuring it on TRACE; seeded and cold arms are reported apart")
    p.add_argument("--eval", metavar="B", default=None,
                   help="the trace measured with --train (default and must-match: TRACE)")
    p.add_argument("--expert-bytes", type=_command.positive_int, default=None, metavar="N",
                   help="bytes of one expert, for a call trace whose header has no '# layer=' "
                        "lines (default: 1 MiB, reported as sizes_assumed); an error with a "
                        "route_trace v1 CSV, whose header gives the sizes")
    add_compute_arguments(p, prefix="real I/O: ", default=None)
    p.add_argument("--backend", default="auto", help="real I/O: the store's backend (default auto)")
    p.add_argument("--tokens", type=_command.positive_int, default=None,
                   help="real I/O: stop after this many decode tokens")
    p.add_argument("--scale", type=_command.positive_int, default=16,
                   help="real I/O: experts this many times smaller than Qwen3-30B-A3B's in each "
                        "dimension (default 16, 36 KiB; 2 gives 2.25 MiB, a real Q4 expert's size)")
    p.add_argument("--auto-budget", action="store_true",
                   help='real I/O: one more run per policy with budget_bytes="auto", which opens at '
                        "auto_start_cycles and grows while the felt wait a larger budget would have "
                        "saved exceeds the memory-stall time (its row: the budget it ended with)")
    p.add_argument("--resident", action="store_true",
                   help="real I/O: the fully resident case: every arm open at once with the whole "
                        "checkpoint loaded (budget: one --cycles value that holds it, or by default "
                        "the checkpoint's bytes), the trace played token by token on each arm in "
                        "turn; reports tokens/s and the paired ratio against the first --policy "
                        "(tools/resident_bench.py)")
    p.add_argument("--paired", action="store_true",
                   help="real I/O: cold runs of every arm at once, the trace played token by token on "
                        "each arm in turn (the order through every permutation, each arm settled "
                        "after its token), so the "
                        "arms share the drive's speed of the moment; reports tokens/s and the paired "
                        "ratio against the first --policy, per --cycles value (tools/paired_bench.py)")
    p.add_argument("--copies", action="store_true",
                   help="real I/O, with --paired: each arm reads its own copy of the checkpoint (made "
                        "once beside it), for a drive whose host caches it; by default every arm "
                        "reads the one checkpoint (tools/paired_bench.py says why)")
    p.add_argument("--warm", action="store_true",
                   help="real I/O: do not drop the checkpoint from the page cache before each run")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="also draw decode hit %% and its cost (GB moved; felt wait with real I/O) "
                        "against the budget, a curve per policy (matplotlib)")
    p.add_argument("--keys-only", action="store_true",
                   help="the policies see the request keys only, not the router's per-token output "
                        "of the prompt's batches (which an engine passes to observe_routing)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def _print_table(table: Any) -> None:
    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, 140))
    console.print(table)


def _cmd_train_eval(args: argparse.Namespace) -> dict[str, Any]:
    if not args.simulate:
        raise StoreError("--train needs --simulate (the seeded real-I/O replay is not built)")
    if args.compare_libcachesim:
        raise StoreError("--train does not combine with --compare-libcachesim")
    if args.eval is not None and args.eval != args.trace:
        raise StoreError(f"--eval {args.eval} and TRACE {args.trace} name different traces; "
                         "the measured trace is TRACE (--eval may repeat it)")
    cycles = parse_cycles(args.cycles)
    policies = parse_policies(args.policy, getattr(args, "experimental", False))
    train, ev = load_trace(args.train, args.expert_bytes), load_trace(args.trace, args.expert_bytes)
    with run_progress("replay", 2 * len(policies) * len(cycles)) as on_run:
        out = train_eval(train, args.train, ev, args.trace, cycles, policies, on_run,
                         prefetch_width=args.prefetch_width, routing=not getattr(args, "keys_only", False),
                         batch_leases=getattr(args, "batch_leases", False))
    out["sizes_assumed"] = train.sizes_assumed or ev.sizes_assumed
    if not args.json:
        _print_table(train_eval_table(out))
        if out["sizes_assumed"]:
            _print_note(SIZES_ASSUMED_NOTE)
    return out


def _print_note(text: str) -> None:
    from rich.console import Console
    from rich.text import Text

    Console().print(Text(text, style="dim"))


def _refuse_interleaved(args: argparse.Namespace, mode: str, *more: tuple[str, bool]) -> None:
    """The flags the interleaved real-I/O replays (``--resident``, ``--paired``) cannot run
    with, after ``more`` of the mode's own (``(flag, given)``): a StoreError naming the first
    one given."""
    for flag, given in (*more,
                        ("--auto-budget", getattr(args, "auto_budget", False)),
                        ("--throttle-mbps", getattr(args, "throttle_mbps", None) is not None),
                        ("--lookahead-recall", getattr(args, "lookahead_recall", None) is not None),
                        ("--compute-ms", args.compute_ms is not None),
                        ("--compare-libcachesim", args.compare_libcachesim)):
        if given:
            raise StoreError(f"{flag} does not combine with {mode}")


def _cmd_resident(args: argparse.Namespace) -> dict[str, Any]:
    from . import _runner, resident_bench

    _refuse_interleaved(args, "--resident (nothing is read there)")
    cycles: float | None = None
    if args.cycles != DEFAULT_CYCLES:
        values = parse_cycles(args.cycles)
        if len(values) != 1:
            raise StoreError("--resident runs one budget: give one --cycles value, or none (the "
                             "checkpoint's bytes)")
        cycles = values[0]
    policies = parse_policies(args.policy, getattr(args, "experimental", False), real=True)
    trace = load_trace(args.trace, args.expert_bytes)
    with run_progress("replay --resident", 1 + len(policies)) as on_run:
        out: dict[str, Any] = _runner.run(lambda: resident_bench.replay_resident(
            trace, args.trace, cycles, policies, compute=args.compute, compute_on=args.compute_on,
            awaits=args.engine_awaits,
            backend=args.backend, max_tokens=args.tokens, scale=args.scale, on_run=on_run))
    if not args.json:
        _print_table(resident_bench.resident_table(out))
    return out


def _cmd_paired(args: argparse.Namespace) -> dict[str, Any]:
    from . import _runner, paired_bench

    _refuse_interleaved(args, "--paired", ("--resident", getattr(args, "resident", False)),
                        ("--keys-only", getattr(args, "keys_only", False)))
    cycles = parse_cycles(args.cycles)
    policies = parse_policies(args.policy, getattr(args, "experimental", False), real=True)
    trace = load_trace(args.trace, args.expert_bytes)
    width = (contextlib.nullcontext() if args.prefetch_width is None
             else settings.override(prefetch_width=args.prefetch_width))
    with run_progress("replay --paired", 1 + len(cycles) * (2 + len(policies))) as on_run, width:
        out: dict[str, Any] = _runner.run(lambda: paired_bench.replay_paired(
            trace, args.trace, cycles, policies, compute=args.compute, compute_on=args.compute_on,
            awaits=args.engine_awaits,
            backend=args.backend, max_tokens=args.tokens, cold=not args.warm, scale=args.scale,
            copies=args.copies, on_run=on_run))
    if not args.json:
        _print_table(paired_bench.paired_table(out))
    return out


def _cmd_real(args: argparse.Namespace) -> dict[str, Any]:
    from . import _runner, engine_replay

    if getattr(args, "paired", False):
        return _cmd_paired(args)
    if getattr(args, "copies", False):
        raise StoreError("--copies goes with --paired (the other replays run one arm at a time)")
    if getattr(args, "resident", False):
        return _cmd_resident(args)
    if args.compare_libcachesim:
        raise StoreError("--compare-libcachesim needs --simulate")
    cycles = parse_cycles(args.cycles)
    policies = parse_policies(args.policy, getattr(args, "experimental", False), real=True)
    engine_replay.reject_offline(policies, "with real I/O")
    if args.tokens is not None and args.tokens <= 0:
        raise StoreError("--tokens must be positive")
    trace = load_trace(args.trace, args.expert_bytes)
    width = (contextlib.nullcontext() if args.prefetch_width is None
             else settings.override(prefetch_width=args.prefetch_width))
    runs = len(policies) * (len(cycles) + int(getattr(args, "auto_budget", False)))
    with run_progress("replay", runs) as on_run, width:
        out: dict[str, Any] = _runner.run(lambda: engine_replay.replay_real(
            trace, args.trace, cycles, policies, compute_ms=args.compute_ms,
            compute=args.compute, compute_on=args.compute_on, awaits=args.engine_awaits,
            backend=args.backend, max_tokens=args.tokens, cold=not args.warm, scale=args.scale,
            on_run=on_run, auto=getattr(args, "auto_budget", False),
            routing=not getattr(args, "keys_only", False),
            lookahead_recall=getattr(args, "lookahead_recall", None),
            throttle_mbps=getattr(args, "throttle_mbps", None)))
    if not args.json:
        _print_table(engine_replay.real_table(out))
    return out


def _cmd_critical_path(args: argparse.Namespace) -> dict[str, Any]:
    from . import critical_path

    if args.compare_libcachesim:
        raise StoreError("--compare-libcachesim compares hit rates: drop --critical-path")
    if args.token_budget is not None:
        raise StoreError("--token-budget is the hit-rate replay's; the critical path runs the store's own pacing")
    cycles = parse_cycles(args.cycles)
    policies = parse_policies(args.policy, getattr(args, "experimental", False), real=True)
    trace = load_trace(args.trace, args.expert_bytes)
    bandwidth, latency = DEFAULT_DRIVE_MBPS * 1e6, DEFAULT_DRIVE_LATENCY_US / 1e6
    facts = None
    if args.drive is not None:
        bandwidth, latency, facts = critical_path.drive_from_probe(args.drive, rate_limited=args.drive_burst_ms > 0)
    if args.drive_mbps is not None:
        bandwidth = args.drive_mbps * 1e6
    if args.drive_latency_us is not None:
        latency = args.drive_latency_us / 1e6
    width = (contextlib.nullcontext() if args.prefetch_width is None
             else settings.override(prefetch_width=args.prefetch_width))
    with run_progress("replay", len(policies) * len(cycles)) as on_run, width:
        out = critical_path.replay_critical_path(
            trace, args.trace, cycles, policies, compute_model=args.compute_model, bandwidth=bandwidth,
            latency=latency, drive_facts=facts, queue_depth=args.queue_depth, charge_cpu=args.cpu == "measured",
            max_tokens=args.tokens, scale=args.scale, on_run=on_run,
            routing=not getattr(args, "keys_only", False), compute_on=args.compute_on,
            awaits=args.engine_awaits,
            read_cpu=None if args.read_cpu_us is None else args.read_cpu_us / 1e6,
            backend="odirect" if args.backend == "auto" else args.backend,
            lookahead_recall=args.lookahead_recall, burst=args.drive_burst_ms / 1e3)
    if not args.json:
        _print_table(critical_path.critical_table(out))
    return out


def _check_prefetch_args(args: argparse.Namespace) -> None:
    if args.prefetch_width is not None and args.prefetch_width < 0:
        raise StoreError(f"--prefetch-width must be 0 or more, got {args.prefetch_width}")
    tb = args.token_budget
    if tb is not None and not (math.isfinite(tb) and tb >= 0):
        raise StoreError(f"--token-budget must be a non-negative number of token cycles, got {tb}")
    if tb is not None and not args.simulate:
        raise StoreError("--token-budget applies to --simulate (the real-I/O replay has the store's "
                         "own token_budget_bytes)")
    if getattr(args, "auto_budget", False) and args.simulate:
        raise StoreError('--auto-budget needs real I/O (drop --simulate): budget_bytes="auto" grows '
                         "on the felt wait the store measures")


def cmd_replay(args: argparse.Namespace) -> dict[str, Any]:
    """The ``replay`` subcommand; returns the JSON object (with ``"plot"``: the file drawn)."""
    _check_prefetch_args(args)
    plot = getattr(args, "plot", None)
    if plot is not None:
        if not plot.lower().endswith(".png"):
            raise StoreError(f"--plot {plot}: expected a .png path")
        if getattr(args, "train", None) is not None:
            raise StoreError("--plot draws budgets as curves; --train's two arms are a table only")
        try:
            importlib.import_module("matplotlib")
        except ImportError as exc:
            raise StoreError(f"--plot needs matplotlib ({exc}); pip install 'iosched[plot]'") from None
    out = _cmd_replay(args)
    if plot is not None:
        from .replay_plot import plot_replay

        try:
            plot_replay(out, plot)
        except OSError as exc:
            raise StoreError(f"--plot {plot}: cannot write it: {exc}") from exc
        out["plot"] = plot
        if not args.json:
            _print_note(f"plot: {plot}")
    return out


def _cmd_replay(args: argparse.Namespace) -> dict[str, Any]:
    args.expert_bytes = getattr(args, "expert_bytes", None)
    if args.expert_bytes is not None and args.expert_bytes < 1:
        raise StoreError(f"--expert-bytes must be a positive number of bytes, got {args.expert_bytes}")
    _check_batch_leases(args)
    if getattr(args, "train", None) is not None:
        return _cmd_train_eval(args)
    if getattr(args, "eval", None) is not None:
        raise StoreError("--eval needs --train (the trace the policies learn from)")
    if not args.simulate:
        if getattr(args, "critical_path", False):
            raise StoreError("--critical-path needs --simulate (it is the virtual-time replay of the store)")
        return _cmd_real(args)
    if getattr(args, "paired", False):
        raise StoreError("--paired is the real-I/O replay's (drop --simulate): the simulation "
                         "has no drive whose speed drifts")
    if getattr(args, "resident", False):
        raise StoreError("--resident is the real-I/O replay's (drop --simulate): the simulation "
                         "gives the fully resident case a budget that holds the trace")
    if getattr(args, "critical_path", False):
        return _cmd_critical_path(args)
    cycles = parse_cycles(args.cycles)
    policies = parse_policies(args.policy, getattr(args, "experimental", False))
    if args.compare_libcachesim:
        libcachesim_module()  # fail before the trace is parsed
    trace = load_trace(args.trace, args.expert_bytes)

    runs = (len(policies) + (len(LIBCACHESIM_ALGOS) if args.compare_libcachesim else 0)) * len(cycles)
    with run_progress("replay", runs) as on_run:
        out = replay(trace, args.trace, cycles, policies, args.compare_libcachesim, on_run,
                     prefetch_width=args.prefetch_width, token_budget_cycles=args.token_budget,
                     routing=not getattr(args, "keys_only", False),
                     batch_leases=getattr(args, "batch_leases", False))
    if not args.json:
        _print_table(result_table(out))
    return out


def _check_batch_leases(args: argparse.Namespace) -> None:
    """``--batch-leases`` is the hit-rate simulation's: a StoreError naming what it does not
    combine with."""
    if not getattr(args, "batch_leases", False):
        return
    if not args.simulate:
        raise StoreError("--batch-leases needs --simulate: the real-I/O replay runs the store, "
                         "which holds its batches so already")
    if getattr(args, "critical_path", False):
        raise StoreError("--batch-leases does not combine with --critical-path: it runs the "
                         "store, whose batches are held so already")
    if args.compare_libcachesim:  # before libcachesim_module() asks for an install
        raise StoreError(LEASES_WITHOUT_LIBCACHESIM)


def _cell(r: dict[str, Any]) -> str:
    cell = f"{100 * r['decode_hit']:.1f} / {100 * r['byte_hit']:.1f}"
    if "moved_bytes" in r:
        cell += f" · {r['moved_bytes'] / 1e9:.0f} GB"
    return cell


def result_table(out: dict[str, Any]) -> Any:
    """A rich table: one row per policy, ``decode hit % / byte hit % · GB moved`` per budget."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    cycles: list[float] = []
    rows: dict[str, dict[float, dict[str, Any]]] = {}
    for r in out["results"]:
        if r["cycles"] not in cycles:
            cycles.append(r["cycles"])
        rows.setdefault(r["policy"], {})[r["cycles"]] = r
    table = Table(title=f"iosched replay {out['trace']}: decode hit % / byte hit % · GB moved "
                        "(misses + prefetches) per budget (token cycles)")
    table.add_column("policy", no_wrap=True)
    for c in cycles:
        table.add_column(f"{c:g} TD", justify="right")
    for name, by_c in rows.items():
        cells = [_cell(by_c[c]) if c in by_c else "-" for c in cycles]
        table.add_row(f"{name} (experimental)" if name in EXPERIMENTAL else name, *cells)
    note = (f"{out['model'] or out['source']}: k={out['k']}, TD={out['td_bytes'] / 2**20:.1f} MiB, "
            f"{out['requests']} requests ({out['decode_requests']} decode), "
            f"{out['distinct_experts']} distinct experts")
    if out.get("routing") is False:
        note += "; the policies saw no router rows (--keys-only, or no batch of several tokens)"
    if out.get("batch_leases"):
        no_room = sum(r.get("no_room", 0) for r in out["results"])
        note += ("; each batch held as the store holds it (--batch-leases: its hits leased before "
                 "its misses evict), so these are the store's hit ratios"
                 + (f"; {no_room} misses found no room beside a batch's leases" if no_room else ""))
    if out.get("sizes_assumed"):
        note += f"; {SIZES_ASSUMED_NOTE}"
    return Group(table, Text(note, style="dim"))


def main(argv: Sequence[str] | None = None) -> int:
    """``iosched replay`` on its own (tests, ``python -m iosched.tools.replay``); ``argv`` excludes
    ``replay``.  The command line's own entry point runs it, with its conventions."""
    return _command.run_one("replay", add_parser, argv)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
