"""Parse ``route_trace v1`` MoE routing traces into the request sequence an engine produces.

Why this module exists: every cache/prefetch policy in this project is compared by replaying
recorded routing, and a comparison is only meaningful if everybody replays the *same*
request sequence. The sequence is defined in the shared traces' README (its source is
named in ``tools/data/README.md``; the rules are restated below); this module is the single
implementation of that definition, so policies,
benchmarks and tests cannot drift apart on details such as "is a prefill repeat a request?".

Format (``route_trace v1``)::

    # route_trace v1
    # model=<path> arch=<arch> n_layer=<L> n_expert=<E> n_expert_used=<k>
    # layer=<l> expert_bytes=<bytes> dense_bytes=<bytes>      (one line per MoE layer)
    turn,phase,step,layer,slot,expert,weight,residency,expert_bytes
    0,0,0,0,0,79,0.425021,0,4336640
    ...

One row per routed expert per (step, layer); ``phase`` 0 = prefill, 1 = decode; ``slot`` is
the rank in the top-k. The ``residency`` and ``expert_bytes`` *columns* describe the
recording engine's own cache (what it hit, what it charged) and are deliberately **not**
used to build the sequence: they are only checked to be integers. The size of a request is
the ``expert_bytes`` of its layer from the ``# layer=`` header lines.

Request sequence (README, "Replay semantics"), for each turn in ascending order:

* prefill: one batch per layer, layers ascending; inside a batch the rows sorted by
  (step, slot), each distinct expert once, first occurrence kept;
* decode: for each step in order, one batch per layer ascending; inside a batch the rows
  sorted by slot, each distinct expert once.

The README describes a single turn. When ``turn`` takes several values (a multi-turn chat
recorded in one file) each turn is replayed in ascending turn order as "prefill of the turn,
then decode of the turn": that is the order in which an engine serving the conversation
would issue the requests. Decode token indices (``req_token``) run over all turns,
0..T-1, so a token index identifies one decode step of the whole trace.

Parsing errors raise :class:`TraceError` (a :class:`~iosched.StoreError`) whose
message names the file and the 1-based line number, so a bad trace can be fixed by hand.

The other input format, the ``call row layer expert:gate ...`` text that engines emit, is
read by ``tools/calltrace.py`` into the same :class:`RouteTrace` with the same sequence
rules; it shares this module's header vocabulary and helpers (:func:`header_kv`,
:func:`header_int`, :func:`read_trace_text`, :func:`trace_error`).
"""

from __future__ import annotations

import gzip
import itertools
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path

import numpy as np
import numpy.typing as npt

from iosched import StoreError

__all__ = [
    "PHASE_DECODE",
    "PHASE_PREFILL",
    "RouteTrace",
    "TraceError",
    "bundled_trace_names",
    "bundled_trace_path",
    "header_int",
    "header_kv",
    "load_bundled_trace",
    "load_route_trace",
    "load_route_trace_text",
    "read_trace_text",
    "trace_error",
]

PHASE_PREFILL = 0
PHASE_DECODE = 1

_VERSION_LINE = "# route_trace v1"
_COLUMNS = ("turn", "phase", "step", "layer", "slot", "expert", "weight", "residency",
            "expert_bytes")
_BUNDLED_SUFFIX = ".route.csv.gz"
# Splits "k1=v1 k2=v2 ..." on the whitespace *before* each "key=", so a value (the model
# path) may itself contain spaces.
_KV_SPLIT = re.compile(r"\s+(?=[A-Za-z_][A-Za-z0-9_]*=)")
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

I32 = npt.NDArray[np.int32]
I8 = npt.NDArray[np.int8]
I64 = npt.NDArray[np.int64]


class TraceError(StoreError):
    """A routing trace is missing or malformed; the message names the file and the line."""


def trace_error(source: str, lineno: int | None, what: str) -> TraceError:
    """A :class:`TraceError` whose message starts ``source:lineno: `` (``source: `` when the
    line is unknown): the form every trace parser in ``tools`` reports in."""
    where = f"{source}:{lineno}" if lineno is not None else source
    return TraceError(f"{where}: {what}")


def header_kv(source: str, lineno: int, body: str) -> dict[str, str]:
    """The ``key=value`` pairs of a header comment's body (the text after ``#``).

    A value runs to the whitespace before the next ``key=``, so it may contain spaces (a
    model path). A part without ``=`` or a key given twice is a :class:`TraceError` at
    ``source:lineno``.
    """
    out: dict[str, str] = {}
    for part in _KV_SPLIT.split(body.strip()):
        key, sep, value = part.partition("=")
        if not sep or not _KEY.fullmatch(key):
            raise trace_error(source, lineno,
                              f"malformed header: expected key=value, got {part!r}")
        if key in out:
            raise trace_error(source, lineno, f"malformed header: key {key!r} given twice")
        out[key] = value.strip()
    return out


def header_int(source: str, lineno: int, kv: dict[str, str], key: str, minimum: int) -> int:
    """``kv[key]`` as an integer of at least ``minimum``, else a :class:`TraceError`."""
    if key not in kv:
        raise trace_error(source, lineno, f"malformed header: missing {key}=")
    try:
        value = int(kv[key])
    except ValueError:
        raise trace_error(source, lineno, f"malformed header: {key}={kv[key]!r} is not an "
                                          "integer") from None
    if value < minimum:
        raise trace_error(source, lineno, f"malformed header: {key}={value} is below {minimum}")
    return value


@dataclass(frozen=True, eq=False)
class RouteTrace:
    """A parsed routing trace: header facts plus the replay request sequence.

    The request sequence is stored as parallel, read-only numpy arrays with one entry per
    request, already in replay order (see the module docstring), because a replay loop over
    ~40k requests wants vectorised access and no per-request Python objects. Arrays are
    read-only so that a trace shared between policies under comparison cannot be altered by
    one of them. ``eq=False``: numpy arrays have no single truth value, compare fields.
    """

    source: str
    """The path (or the name given to :func:`load_route_trace_text`) the trace came from."""
    model: str
    arch: str
    n_layer: int
    """Layers of the model (MoE or not); MoE layers are ``layers``."""
    n_expert: int
    """Routed experts per MoE layer; experts are 0..n_expert-1."""
    k: int
    """Experts routed per token per layer (``n_expert_used``)."""
    expert_bytes: dict[int, int]
    """Bytes of one routed expert, per MoE layer, from the ``# layer=`` header lines."""
    dense_bytes: dict[int, int]
    """Bytes of the layer's non-expert weights, per MoE layer (0 when the header omits it)."""
    layers: tuple[int, ...]
    """MoE layers (those with a ``# layer=`` line), ascending."""
    turns: tuple[int, ...]
    """Distinct ``turn`` values present, ascending; the sequence replays them in this order."""
    n_rows: int
    """Data rows in the file (routed (token, layer, slot) triples, repeats included)."""
    req_layer: I32
    req_expert: I32
    req_phase: I8
    """0 prefill, 1 decode."""
    req_batch: I32
    """Index of the batch the request belongs to, 0.. increasing along the sequence. A batch
    is what an engine asks for at once: one prefill layer, or one (decode token, layer)."""
    req_token: I32
    """-1 for prefill, else the decode token index 0..T-1 (decode steps in replay order,
    counted across all turns)."""
    req_turn: I32
    """The ``turn`` value of the request."""
    routing: dict[int, I32] = field(default_factory=dict)
    """The router's output of every batch of more than one token, by batch index: row ``t`` is
    the batch's ``t``-th token (in step order), its experts in slot order, padded with -1.
    The request sequence keeps only each batch's distinct experts; this is what an engine
    also knows about a prompt (which experts went together in one token), and what it passes
    to ``ExpertStore.observe_routing``.  Read-only arrays."""
    sizes_assumed: bool = False
    """True when the trace gave no expert sizes and nobody else did either, so every
    ``expert_bytes`` is a uniform default (a call trace without ``# layer=`` lines, read
    without ``expert_bytes=``): byte figures then describe that assumption, not the model.
    A ``route_trace v1`` CSV always gives its sizes."""

    @property
    def td_bytes(self) -> int:
        """One token cycle TD = k x sum of expert_bytes over MoE layers: the bytes one token
        routes. Budgets in the comparisons are expressed in multiples of it."""
        return self.k * sum(self.expert_bytes.values())

    @property
    def n_requests(self) -> int:
        return int(self.req_layer.shape[0])

    @property
    def n_batches(self) -> int:
        return int(self.req_batch[-1]) + 1 if self.req_batch.size else 0

    @property
    def req_bytes(self) -> I64:
        """Bytes of each request (its layer's expert_bytes), for byte-weighted hit rates."""
        table = np.zeros(self.n_layer, dtype=np.int64)
        for layer, nbytes in self.expert_bytes.items():
            table[layer] = nbytes
        out: I64 = table[self.req_layer]
        return out

    def n_decode_tokens(self) -> int:
        """Number of decode steps (tokens generated) over all turns."""
        if not self.req_token.size:
            return 0
        return int(self.req_token.max()) + 1

    def batches(self) -> Iterator[tuple[int, int, int, I32]]:
        """Yield ``(phase, token, layer, experts)`` per batch in replay order.

        ``token`` is -1 for prefill. ``experts`` is a read-only view into ``req_expert``: the
        distinct experts of the batch in request order. This is the shape of an engine's
        loop (one call per layer per token), so a replay can drive a policy exactly as an
        engine would.
        """
        if not self.req_batch.size:
            return
        starts = np.flatnonzero(np.diff(self.req_batch)) + 1
        bounds = np.concatenate(([0], starts, [self.req_batch.size])).tolist()
        phases = self.req_phase.tolist()
        tokens = self.req_token.tolist()
        layers = self.req_layer.tolist()
        for lo, hi in itertools.pairwise(bounds):
            yield phases[lo], tokens[lo], layers[lo], self.req_expert[lo:hi]


def load_route_trace(path: str | os.PathLike[str]) -> RouteTrace:
    """Read and parse a ``route_trace v1`` file; a name ending in ``.gz`` is read via gzip.

    I/O and decoding failures are reported as :class:`TraceError` too, so a caller handles
    one exception type for "this trace cannot be used".
    """
    source, text = read_trace_text(path)
    return load_route_trace_text(text, source)


def read_trace_text(path: str | os.PathLike[str]) -> tuple[str, str]:
    """``(source, text)`` of a trace file of either format; a name ending in ``.gz`` is read
    via gzip. A file that cannot be read or decoded is a :class:`TraceError` naming it."""
    source = os.fspath(path)
    try:
        if source.endswith(".gz"):
            with gzip.open(source, "rt", encoding="utf-8", newline="") as fh:
                text = fh.read()
        else:
            with open(source, encoding="utf-8", newline="") as fh:
                text = fh.read()
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise trace_error(source, None, f"cannot read trace: {exc}") from exc
    return source, text


def load_route_trace_text(text: str, source: str) -> RouteTrace:
    """Parse trace text already in memory; ``source`` names it in error messages."""
    return _Parser(text, source).parse()


def bundled_trace_names() -> list[str]:
    """Names of the traces shipped as package data in ``tools/data`` (e.g. ``qwen``)."""
    data = files("iosched.tools") / "data"
    if not data.is_dir():
        return []
    return sorted(p.name[: -len(_BUNDLED_SUFFIX)] for p in data.iterdir()
                  if p.name.endswith(_BUNDLED_SUFFIX))


def bundled_trace_path(name: str = "qwen") -> Path:
    """Path of a bundled trace, so tests and demos run without the shared trace folder."""
    available = bundled_trace_names()
    if name not in available:
        raise TraceError(f"no bundled trace named {name!r}; available: "
                         f"{', '.join(available) if available else '(none)'}")
    res = files("iosched.tools") / "data" / f"{name}{_BUNDLED_SUFFIX}"
    return res if isinstance(res, Path) else Path(str(res))


def load_bundled_trace(name: str = "qwen") -> RouteTrace:
    """Parse a bundled trace (see :func:`bundled_trace_path`)."""
    return load_route_trace(bundled_trace_path(name))


def read_only_i32(x: npt.ArrayLike) -> I32:
    out = np.ascontiguousarray(x, dtype=np.int32)
    out.setflags(write=False)
    return out


def read_only_i8(x: npt.ArrayLike) -> I8:
    out = np.ascontiguousarray(x, dtype=np.int8)
    out.setflags(write=False)
    return out


class _Parser:
    """One-shot parser; kept as a class only to share ``source`` and the line list."""

    def __init__(self, text: str, source: str) -> None:
        self.source = source
        # splitlines() would also split on \x0b, \x1c, ... and shift line numbers.
        self.lines = text.replace("\r\n", "\n").split("\n")

    def err(self, lineno: int | None, what: str) -> TraceError:
        return trace_error(self.source, lineno, what)

    # -- header ------------------------------------------------------------------------

    def _kv(self, lineno: int, body: str) -> dict[str, str]:
        return header_kv(self.source, lineno, body)

    def _int(self, lineno: int, kv: dict[str, str], key: str, minimum: int) -> int:
        return header_int(self.source, lineno, kv, key, minimum)

    def parse(self) -> RouteTrace:
        lines = self.lines
        i = 0
        while i < len(lines) and not lines[i].strip():
            i += 1
        if i == len(lines):
            raise self.err(1, f"empty trace: missing version line {_VERSION_LINE!r}")
        first = lines[i].strip()
        if first != _VERSION_LINE:
            if first.startswith("# route_trace"):
                raise self.err(i + 1, f"unknown trace version {first!r}; "
                                      f"this parser reads {_VERSION_LINE!r}")
            raise self.err(i + 1, f"missing version line {_VERSION_LINE!r}, got {first[:80]!r}")
        i += 1

        model_kv: dict[str, str] | None = None
        model_line = 0
        expert_bytes: dict[int, int] = {}
        dense_bytes: dict[int, int] = {}
        layer_lines: list[tuple[int, int]] = []  # (line, layer) for range checks later
        column_line = 0
        while i < len(lines):
            raw = lines[i].strip()
            lineno = i + 1
            i += 1
            if not raw:
                continue
            if not raw.startswith("#"):
                column_line = lineno
                break
            body = raw[1:].strip()
            if body.startswith("model="):
                if model_kv is not None:
                    raise self.err(lineno, f"malformed header: second model line "
                                           f"(first at line {model_line})")
                model_kv = self._kv(lineno, body)
                model_line = lineno
            elif body.startswith("layer="):
                kv = self._kv(lineno, body)
                layer = self._int(lineno, kv, "layer", 0)
                if layer in expert_bytes:
                    raise self.err(lineno, f"malformed header: layer {layer} given twice")
                expert_bytes[layer] = self._int(lineno, kv, "expert_bytes", 1)
                dense_bytes[layer] = (self._int(lineno, kv, "dense_bytes", 0)
                                      if "dense_bytes" in kv else 0)
                layer_lines.append((lineno, layer))
            else:
                raise self.err(lineno, f"malformed header: unrecognised line {raw[:80]!r} "
                                       "(expected '# model=...' or '# layer=...')")
        if model_kv is None:
            raise self.err(column_line or len(lines),
                           "malformed header: missing '# model=... arch=... n_layer=... "
                           "n_expert=... n_expert_used=...' line")
        n_layer = self._int(model_line, model_kv, "n_layer", 1)
        n_expert = self._int(model_line, model_kv, "n_expert", 1)
        k = self._int(model_line, model_kv, "n_expert_used", 1)
        if k > n_expert:
            raise self.err(model_line, f"malformed header: n_expert_used={k} exceeds "
                                       f"n_expert={n_expert}")
        for lineno, layer in layer_lines:
            if layer >= n_layer:
                raise self.err(lineno, f"malformed header: layer={layer} out of range "
                                       f"(n_layer={n_layer})")
        if not expert_bytes:
            raise self.err(column_line or len(lines),
                           "missing expert_bytes: no '# layer=<l> expert_bytes=<b>' lines")
        if not column_line:
            raise self.err(len(lines), "malformed header: missing the column line "
                                       f"{','.join(_COLUMNS)!r}")
        columns = [c.strip() for c in lines[column_line - 1].strip().split(",")]
        if columns != list(_COLUMNS):
            raise self.err(column_line, f"malformed header: column line is {','.join(columns)!r}"
                                        f", expected {','.join(_COLUMNS)!r}")

        rows, linenos = self._rows(column_line)
        if not rows:
            raise self.err(column_line, "empty trace: no data rows after the column line")
        return self._build(rows, linenos, model_kv, n_layer, n_expert, k, expert_bytes,
                           dense_bytes)

    # -- rows ----------------------------------------------------------------------------

    def _rows(self, column_line: int) -> tuple[list[tuple[int, ...]], list[int]]:
        """Integer fields (turn, phase, step, layer, slot, expert) of each data row.

        A plain loop of str.split and int() takes ~0.1 s for 45k rows, well within budget,
        and, unlike a bulk numpy load, knows the line of every bad field.
        """
        rows: list[tuple[int, ...]] = []
        linenos: list[int] = []
        ncol = len(_COLUMNS)
        lines = self.lines
        for idx in range(column_line, len(lines)):
            line = lines[idx]
            if not line or line.isspace():
                continue
            fields = line.split(",")
            if len(fields) != ncol:
                if line.lstrip().startswith("#"):
                    raise self.err(idx + 1, "header line after the column line")
                raise self.err(idx + 1, f"row has {len(fields)} fields, expected {ncol}")
            try:
                t, ph, st, ly, sl, ex = (int(f) for f in fields[:6])
                int(fields[7])
                int(fields[8])
            except ValueError:
                raise self._bad_field(idx + 1, fields) from None
            w = fields[6].strip()
            if w.lower() != "nan":
                try:
                    float(w)
                except ValueError:
                    raise self.err(idx + 1, f"weight {w!r} is not a number") from None
            rows.append((t, ph, st, ly, sl, ex))
            linenos.append(idx + 1)
        return rows, linenos

    @staticmethod
    def _routing(batch: I64, phase: I64, step: I64, slot: I64, expert: I64, k: int) -> dict[int, I32]:
        """:attr:`RouteTrace.routing` from the rows in replay order (prefill batches are the
        only ones of several tokens: a decode batch is one step)."""
        out: dict[int, I32] = {}
        pre = np.flatnonzero(phase == PHASE_PREFILL)
        if not pre.size:
            return out
        b = batch[pre]
        bounds = np.concatenate(([0], np.flatnonzero(np.diff(b)) + 1, [b.size])).tolist()
        for lo, hi in itertools.pairwise(bounds):
            rows = pre[lo:hi]
            steps, token = np.unique(step[rows], return_inverse=True)
            if steps.size < 2:
                continue
            table = np.full((steps.size, k), -1, dtype=np.int32)
            table[token, slot[rows]] = expert[rows]
            table.setflags(write=False)
            out[int(batch[rows[0]])] = table
        return out

    def _bad_field(self, lineno: int, fields: list[str]) -> TraceError:
        for name, value in zip(_COLUMNS, fields, strict=False):
            if name == "weight":
                continue
            try:
                int(value)
            except ValueError:
                return self.err(lineno, f"{name} {value.strip()!r} is not an integer")
        return self.err(lineno, "non-integer field")  # pragma: no cover - defensive

    def _build(self, rows: list[tuple[int, ...]], linenos: list[int],
               model_kv: dict[str, str], n_layer: int, n_expert: int, k: int,
               expert_bytes: dict[int, int], dense_bytes: dict[int, int]) -> RouteTrace:
        try:
            a = np.array(rows, dtype=np.int64)
        except OverflowError:
            j = next(j for j, r in enumerate(rows) if any(abs(v) >= 2**63 for v in r))
            raise self.err(linenos[j], "integer field too large") from None
        lines = np.array(linenos, dtype=np.int64)
        turn, phase, step, layer, slot, expert = (a[:, c] for c in range(6))

        def check(bad: npt.NDArray[np.bool_], what: str) -> None:
            if bad.any():
                j = int(np.flatnonzero(bad)[0])
                r = rows[j]
                raise self.err(int(lines[j]), what.format(turn=r[0], phase=r[1], step=r[2],
                                                          layer=r[3], slot=r[4], expert=r[5]))

        check(turn < 0, "turn {turn} is negative")
        check((phase != PHASE_PREFILL) & (phase != PHASE_DECODE),
              "phase {phase} is neither 0 (prefill) nor 1 (decode)")
        check(step < 0, "step {step} is negative")
        check((layer < 0) | (layer >= n_layer),
              f"layer {{layer}} out of range (n_layer={n_layer})")
        has_bytes = np.zeros(n_layer, dtype=bool)
        has_bytes[list(expert_bytes)] = True
        check(~has_bytes[np.clip(layer, 0, n_layer - 1)],
              "layer {layer} is not a MoE layer of the header: missing expert_bytes "
              "('# layer={layer} expert_bytes=...' line)")
        check((slot < 0) | (slot >= k), f"slot {{slot}} out of range (k={k})")
        check((expert < 0) | (expert >= n_expert),
              f"expert {{expert}} out of range (n_expert={n_expert})")

        # Replay order. Prefill: (turn, 0, layer, step, slot); decode: (turn, 1, step,
        # layer, slot). np.lexsort sorts by its *last* key first and is stable.
        is_pre = phase == PHASE_PREFILL
        major = np.where(is_pre, layer, step)
        minor = np.where(is_pre, step, layer)
        order = np.lexsort((slot, minor, major, phase, turn))
        s_turn, s_phase, s_major, s_minor, s_slot = (x[order] for x in
                                                      (turn, phase, major, minor, slot))
        s_step, s_layer, s_expert, s_lines = (x[order] for x in (step, layer, expert, lines))

        same_row = ((s_turn[1:] == s_turn[:-1]) & (s_phase[1:] == s_phase[:-1])
                    & (s_major[1:] == s_major[:-1]) & (s_minor[1:] == s_minor[:-1])
                    & (s_slot[1:] == s_slot[:-1]))
        if same_row.any():
            j = int(np.flatnonzero(same_row)[0])
            first, second = sorted((int(s_lines[j]), int(s_lines[j + 1])))
            raise self.err(second, f"duplicate row for turn {s_turn[j]} phase {s_phase[j]} "
                                   f"step {s_step[j]} layer {s_layer[j]} slot {s_slot[j]} "
                                   f"(first at line {first})")

        # Batch boundaries: a prefill batch is (turn, layer); a decode batch is
        # (turn, step, layer). Prefill rows get minor=-1 so their steps do not split it.
        b_minor = np.where(s_phase == PHASE_PREFILL, -1, s_minor)
        new_batch = np.ones(s_turn.size, dtype=bool)
        new_batch[1:] = ((s_turn[1:] != s_turn[:-1]) | (s_phase[1:] != s_phase[:-1])
                         | (s_major[1:] != s_major[:-1]) | (b_minor[1:] != b_minor[:-1]))
        batch = np.cumsum(new_batch) - 1

        # Each distinct expert once per batch, first occurrence (in sorted order) kept:
        # np.unique's return_index gives the first index of each value.
        _, first_idx = np.unique(batch * n_expert + s_expert, return_index=True)
        keep = np.sort(first_idx)

        # Decode token index: rank of (turn, step) among decode steps in replay order.
        is_dec = s_phase == PHASE_DECODE
        new_token = np.zeros(s_turn.size, dtype=bool)
        dec_idx = np.flatnonzero(is_dec)
        if dec_idx.size:
            dt, ds = s_turn[dec_idx], s_step[dec_idx]
            starts = np.ones(dec_idx.size, dtype=bool)
            starts[1:] = (dt[1:] != dt[:-1]) | (ds[1:] != ds[:-1])
            new_token[dec_idx] = starts
        token = np.where(is_dec, np.cumsum(new_token) - 1, -1)

        # Renumber batches densely after dedup (no batch becomes empty: its first row is
        # always kept, but renumbering keeps the invariant explicit).
        k_batch = batch[keep]
        nb = np.ones(k_batch.size, dtype=bool)
        nb[1:] = k_batch[1:] != k_batch[:-1]

        layers = tuple(sorted(expert_bytes))
        return RouteTrace(
            routing=self._routing(batch, s_phase, s_step, s_slot, s_expert, k),
            source=self.source,
            model=model_kv.get("model", ""),
            arch=model_kv.get("arch", ""),
            n_layer=n_layer,
            n_expert=n_expert,
            k=k,
            expert_bytes={ly: expert_bytes[ly] for ly in layers},
            dense_bytes={ly: dense_bytes[ly] for ly in layers},
            layers=layers,
            turns=tuple(int(t) for t in np.unique(turn)),
            n_rows=len(rows),
            req_layer=read_only_i32(s_layer[keep]),
            req_expert=read_only_i32(s_expert[keep]),
            req_phase=read_only_i8(s_phase[keep]),
            req_batch=read_only_i32(np.cumsum(nb) - 1),
            req_token=read_only_i32(token[keep]),
            req_turn=read_only_i32(s_turn[keep]),
        )
