"""Read (and write) the ``call row layer expert:gate ...`` routing trace text.

Why: engines that stream experts log their routing as they run, one text line per routed
row (the ROUTE_TRACE text), not as ``route_trace v1`` CSV. Reading that text into the same
:class:`~iosched.tools.trace.RouteTrace`, with the same request-sequence rules, lets ``iosched
replay`` judge a policy on those engines' traces without a conversion step that could drift.

Format: each non-blank line is ``<call> <row> <layer> <expert>:<gate> <expert>:<gate> ...``,
whitespace-separated. ``call`` advances once per MoE layer call and never goes back; ``row``
is the token's position in that call's batch; the ``expert:gate`` pairs are the row's routed
experts in selection (slot) order, ``gate`` any float (``nan`` too). The rows of one
contiguous ``(call, layer)`` group are one batch (what the engine asked for at once). A new
forward starts where a group's layer does not rise above the previous group's (the layer
index wraps, or the same layer comes again with another call).

The text carries no phase, so it is inferred per forward: a forward with a batch of more than
one row is prefill (a prompt, or a chunk of one), a forward of one-row batches is decode.
Batched decode of several sequences therefore reads as prefill, and a one-token prompt as
decode. A new turn starts at a prefill forward that follows a decode forward (turn 0 first).

Request sequence, as ``tools/trace.py``'s for the CSV: per batch in file order, rows in row
order, experts in slot order, each distinct expert once per batch (first occurrence kept);
prefill requests have token -1, decode forwards are tokens 0, 1, ... over the whole trace.
The same routing written in both formats gives the same sequence.

Header facts: optional comment lines at the top in the CSV's vocabulary, ``# model=<path>
arch=<arch> n_layer=<L> n_expert=<E> n_expert_used=<k>`` (any of its keys may be left out)
and ``# layer=<l> expert_bytes=<b> [dense_bytes=<b>]``; any other ``#`` line is a comment.
What the header leaves out is derived: n_layer = max layer + 1, n_expert = max expert + 1,
k = most experts on one line, MoE layers = the layers routed. Expert sizes come from the
``# layer=`` lines (which must then cover every routed layer), else from the caller's
``expert_bytes`` (``--expert-bytes``), else a uniform 1 MiB, and the trace says
``sizes_assumed``: byte figures then describe the assumption, not the model.

Errors are :class:`~iosched.tools.trace.TraceError` naming ``file:line``.
"""

from __future__ import annotations

import itertools
import os
import re
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from .trace import (
    PHASE_DECODE,
    PHASE_PREFILL,
    RouteTrace,
    TraceError,
    header_int,
    header_kv,
    read_only_i8,
    read_only_i32,
    read_trace_text,
    trace_error,
)

__all__ = ["DEFAULT_EXPERT_BYTES", "format_call_trace", "is_call_line", "load_call_trace",
           "load_call_trace_text"]

DEFAULT_EXPERT_BYTES = 1 << 20
"""Bytes assumed for every expert when neither the trace nor the caller gives sizes."""

_CALL_LINE = re.compile(r"\s*[+-]?\d+\s+[+-]?\d+\s+[+-]?\d+\s+[+-]?\d+:")
_INDEX_LIMIT = 1 << 20  # no model has this many layers or experts; bounds derived tables
_SHAPE = "<call> <row> <layer> <expert>:<gate> ..."


def is_call_line(line: str) -> bool:
    """Whether ``line`` starts like a call-trace data line (``int int int int:...``)."""
    return _CALL_LINE.match(line) is not None


def load_call_trace(path: str | os.PathLike[str], expert_bytes: int | None = None) -> RouteTrace:
    """Read and parse a call trace file (``.gz`` read via gzip); see the module docstring."""
    source, text = read_trace_text(path)
    return load_call_trace_text(text, source, expert_bytes)


def load_call_trace_text(text: str, source: str, expert_bytes: int | None = None) -> RouteTrace:
    """Parse call-trace text already in memory; ``source`` names it in error messages.
    ``expert_bytes``: the uniform size of one expert when the header has no ``# layer=``
    lines (with them it is an error: the two would disagree)."""
    if expert_bytes is not None and expert_bytes < 1:
        raise trace_error(source, None, f"expert_bytes={expert_bytes} is not a positive "
                                        "number of bytes")
    return _Reader(text, source).read(expert_bytes)


def _rows_table(rows: list[list[int]], k: int) -> npt.NDArray[np.int32]:
    """A group's rows as :attr:`RouteTrace.routing` keeps them: one row per token, experts in
    slot order, padded with -1; read-only."""
    table = np.full((len(rows), k), -1, dtype=np.int32)
    for t, experts in enumerate(rows):
        table[t, :len(experts)] = experts
    table.setflags(write=False)
    return table


@dataclass
class _Group:
    """One contiguous ``(call, layer)`` group: one batch."""

    call: int
    layer: int
    rows: dict[int, tuple[int, list[int]]] = field(default_factory=dict)
    """row number -> (its line, its experts in slot order)"""


class _Reader:
    def __init__(self, text: str, source: str) -> None:
        self.source = source
        self.lines = text.replace("\r\n", "\n").split("\n")
        self.model: dict[str, str] = {}
        self.model_line = 0
        self.sizes: dict[int, tuple[int, int, int]] = {}  # layer -> (expert, dense, line)
        self.n_layer: int | None = None
        self.n_expert: int | None = None
        self.k: int | None = None

    def err(self, lineno: int | None, what: str) -> TraceError:
        return trace_error(self.source, lineno, what)

    def _header(self, lineno: int, body: str) -> None:
        kv = header_kv(self.source, lineno, body)
        if body.startswith("model="):
            if self.model_line:
                raise self.err(lineno, "malformed header: second model line "
                                       f"(first at line {self.model_line})")
            self.model, self.model_line = kv, lineno
            return
        layer = header_int(self.source, lineno, kv, "layer", 0)
        if layer in self.sizes:
            raise self.err(lineno, f"malformed header: layer {layer} given twice")
        dense = header_int(self.source, lineno, kv, "dense_bytes", 0) if "dense_bytes" in kv else 0
        self.sizes[layer] = (header_int(self.source, lineno, kv, "expert_bytes", 1), dense, lineno)

    def _close_header(self) -> None:
        kv, line = self.model, self.model_line
        ints = {key: header_int(self.source, line, kv, key, 1) if key in kv else None
                for key in ("n_layer", "n_expert", "n_expert_used")}
        self.n_layer, self.n_expert, self.k = ints["n_layer"], ints["n_expert"], ints["n_expert_used"]
        if self.k is not None and self.n_expert is not None and self.k > self.n_expert:
            raise self.err(line, f"malformed header: n_expert_used={self.k} exceeds "
                                 f"n_expert={self.n_expert}")
        for layer, (_, _, lineno) in self.sizes.items():
            if self.n_layer is not None and layer >= self.n_layer:
                raise self.err(lineno, f"malformed header: layer={layer} out of range "
                                       f"(n_layer={self.n_layer})")

    def _index(self, lineno: int, name: str, text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise self.err(lineno, f"{name} {text!r} is not an integer") from None
        if value < 0:
            raise self.err(lineno, f"{name} {value} is negative")
        return value

    def _in_range(self, lineno: int, name: str, value: int, header: int | None) -> None:
        if header is not None and value >= header:
            raise self.err(lineno, f"{name} {value} out of range (n_{name}={header})")
        if value >= _INDEX_LIMIT:
            raise self.err(lineno, f"{name} {value} out of range (no header n_{name}=, and "
                                   f"{_INDEX_LIMIT} or more is no model's)")

    def _experts(self, lineno: int, pairs: list[str]) -> list[int]:
        experts: list[int] = []
        for pair in pairs:
            ex, sep, gate = pair.partition(":")
            if not sep:
                raise self.err(lineno, f"bad expert:gate field {pair!r}: no ':'")
            try:
                e = int(ex)
                float(gate)
            except ValueError:
                raise self.err(lineno, f"bad expert:gate field {pair!r}: expected an integer "
                                       "expert and a float gate") from None
            if e < 0:
                raise self.err(lineno, f"bad expert:gate field {pair!r}: expert {e} is negative")
            self._in_range(lineno, "expert", e, self.n_expert)
            if e in experts:
                raise self.err(lineno, f"expert {e} listed twice in one row")
            experts.append(e)
        if self.k is not None and len(experts) > self.k:
            raise self.err(lineno, f"row lists {len(experts)} experts, more than "
                                   f"n_expert_used={self.k}")
        return experts

    def read(self, expert_bytes: int | None) -> RouteTrace:
        forwards: list[list[_Group]] = []
        group: _Group | None = None
        first: dict[tuple[int, int], int] = {}  # (call, layer) -> its first line
        first_use: dict[int, int] = {}  # layer -> first line routing it
        prev_line = last_line = n_rows = max_row = max_expert = 0
        for idx, raw in enumerate(self.lines):
            lineno, line = idx + 1, raw.strip()
            if not line:
                continue
            if line.startswith("#"):
                body = line[1:].strip()
                if not last_line and body.startswith("route_trace"):
                    raise self.err(lineno, "this is a route_trace CSV, not a call trace "
                                           "(read it with tools.trace.load_route_trace)")
                last_line = lineno
                if body.startswith(("model=", "layer=")):
                    if group is not None:
                        raise self.err(lineno, "header line after the first data line")
                    self._header(lineno, body)
                continue
            last_line = lineno
            if group is None:
                self._close_header()
            fields = line.split()
            if len(fields) < 4:
                raise self.err(lineno, f"line has {len(fields)} fields, expected at least 4: "
                                       + _SHAPE)
            call = self._index(lineno, "call", fields[0])
            row = self._index(lineno, "row", fields[1])
            layer = self._index(lineno, "layer", fields[2])
            self._in_range(lineno, "layer", layer, self.n_layer)
            experts = self._experts(lineno, fields[3:])
            if group is not None and (group.call, group.layer) == (call, layer):
                if row in group.rows:
                    raise self.err(lineno, f"row {row} repeated in group (call {call}, layer "
                                           f"{layer}) (first at line {group.rows[row][0]})")
            else:
                if group is not None and call < group.call:
                    raise self.err(lineno, f"call {call} moves backwards (line {prev_line} has "
                                           f"call {group.call})")
                if (call, layer) in first:
                    raise self.err(lineno, f"group (call {call}, layer {layer}) reappears after "
                                           f"another group (first at line {first[call, layer]}); "
                                           "a group's rows must be contiguous")
                first[call, layer] = lineno
                if group is None or layer <= group.layer:
                    forwards.append([])
                group = _Group(call, layer)
                forwards[-1].append(group)
            group.rows[row] = (lineno, experts)
            first_use.setdefault(layer, lineno)
            prev_line = lineno
            n_rows += len(experts)
            max_row, max_expert = max(max_row, len(experts)), max(max_expert, *experts)
        if group is None:
            self._close_header()
            raise self.err(last_line or 1, f"empty trace: no data lines ({_SHAPE})")
        return self._build(forwards, first_use, n_rows, max_row, max_expert, expert_bytes)

    def _build(self, forwards: list[list[_Group]], first_use: dict[int, int], n_rows: int,
               max_row: int, max_expert: int, expert_bytes: int | None) -> RouteTrace:
        if self.sizes:
            if expert_bytes is not None:
                line = min(s[2] for s in self.sizes.values())
                raise self.err(line, "the header gives expert_bytes per layer ('# layer=' "
                                     "lines); an expert_bytes argument (--expert-bytes) would "
                                     "contradict it")
            for layer, lineno in first_use.items():
                if layer not in self.sizes:
                    raise self.err(lineno, f"layer {layer} has no '# layer={layer} "
                                           "expert_bytes=...' header line (the header gives "
                                           "sizes, so it must give every routed layer's)")
            layers = tuple(sorted(self.sizes))
            sizes = {ly: self.sizes[ly][0] for ly in layers}
            dense = {ly: self.sizes[ly][1] for ly in layers}
        else:
            layers = tuple(sorted(first_use))
            size = DEFAULT_EXPERT_BYTES if expert_bytes is None else expert_bytes
            sizes, dense = {ly: size for ly in layers}, {ly: 0 for ly in layers}

        cols: tuple[list[int], ...] = ([], [], [], [], [], [])  # layer expert phase batch token turn
        turn = token = batch = 0
        prev_decode = False
        k = self.k if self.k is not None else max_row
        routing: dict[int, npt.NDArray[np.int32]] = {}
        for fwd in forwards:
            prefill = any(len(g.rows) > 1 for g in fwd)
            if prefill and prev_decode:
                turn += 1
            phase, tok = (PHASE_PREFILL, -1) if prefill else (PHASE_DECODE, token)
            for g in fwd:
                if len(g.rows) > 1:
                    routing[batch] = _rows_table([experts for _, (_, experts) in sorted(g.rows.items())], k)
                seen: set[int] = set()
                for _, (_, experts) in sorted(g.rows.items()):
                    for e in experts:
                        if e not in seen:
                            seen.add(e)
                            for col, v in zip(cols, (g.layer, e, phase, batch, tok, turn), strict=True):
                                col.append(v)
                batch += 1
            if not prefill:
                token += 1
            prev_decode = not prefill

        return RouteTrace(
            source=self.source,
            model=self.model.get("model", ""),
            arch=self.model.get("arch", ""),
            n_layer=self.n_layer if self.n_layer is not None else max([*first_use, *layers]) + 1,
            n_expert=self.n_expert if self.n_expert is not None else max_expert + 1,
            k=k,
            routing=routing,
            expert_bytes=sizes,
            dense_bytes=dense,
            layers=layers,
            turns=tuple(range(turn + 1)),
            n_rows=n_rows,
            req_layer=read_only_i32(cols[0]),
            req_expert=read_only_i32(cols[1]),
            req_phase=read_only_i8(cols[2]),
            req_batch=read_only_i32(cols[3]),
            req_token=read_only_i32(cols[4]),
            req_turn=read_only_i32(cols[5]),
            sizes_assumed=not self.sizes and expert_bytes is None,
        )


# ---------------------------------------------------------------------------------------------
# writing


@dataclass
class _Forward:
    phase: int
    turn: int
    token: int
    batches: list[tuple[int, list[int]]]  # (layer, distinct experts in request order)
    ids: list[int] = field(default_factory=list)  # each batch's index in the trace


def _forwards(trace: RouteTrace) -> list[_Forward]:
    """The trace's batches grouped into forwards by the rule a reader applies."""
    out: list[_Forward] = []
    if not trace.req_batch.size:
        return out
    starts = np.flatnonzero(np.diff(trace.req_batch)) + 1
    bounds = np.concatenate(([0], starts, [trace.req_batch.size])).tolist()
    phase, token, layer, turn = (a.tolist() for a in (trace.req_phase, trace.req_token,
                                                      trace.req_layer, trace.req_turn))
    experts = trace.req_expert.tolist()
    for lo, hi in itertools.pairwise(bounds):
        f = out[-1] if out else None
        if (f is None or f.phase != phase[lo] or f.turn != turn[lo] or f.token != token[lo]
                or layer[lo] <= f.batches[-1][0]):
            f = _Forward(phase[lo], turn[lo], token[lo], [])
            out.append(f)
        f.batches.append((layer[lo], experts[lo:hi]))
        f.ids.append(int(trace.req_batch[lo]))
    return out


def _rows(trace: RouteTrace, f: _Forward) -> list[list[list[int]]]:
    """Rows per batch of a forward: decode one row, prefill chunks of k; a prefill forward
    must have a batch of two rows or more, else a reader would take it for decode."""
    if f.phase == PHASE_DECODE:
        return [[ex] for _, ex in f.batches]
    k = max(1, trace.k)
    rows = [_token_rows(trace.routing[b]) if b in trace.routing
            else [ex[i:i + k] for i in range(0, len(ex), k)] for b, (_, ex) in zip(f.ids, f.batches, strict=True)]
    if all(len(r) == 1 for r in rows):
        j = next((j for j, (_, ex) in enumerate(f.batches) if len(ex) > 1), None)
        if j is None:
            raise trace_error(trace.source, None, "a prefill forward routes one expert per "
                              "layer, which the call format can only read as decode")
        rows[j] = [[e] for e in f.batches[j][1]]
    return rows


def _token_rows(table: npt.NDArray[np.int32]) -> list[list[int]]:
    """A batch's router output (``RouteTrace.routing``) as rows of experts, padding dropped."""
    return [[e for e in row if e >= 0] for row in table.tolist()]


def format_call_trace(trace: RouteTrace) -> str:
    """``trace`` as call-trace text, with the header comments (per-layer ``expert_bytes``
    unless the sizes were assumed, so that reading it back assumes them again).

    One forward per prefill batch group (a turn's prefill from a CSV is one forward) and one
    per decode token. The trace keeps
    the router's rows of each batch of several tokens (``RouteTrace.routing``), written as
    they are; a batch without them is written as chunks of k of its distinct experts.  Gates
    are not kept (written ``nan``).  So this is lossless for the request sequence and the
    rows (reading the text back gives the same requests, batches, phases, tokens, turns,
    turns renumbered 0, 1, ..., and routing), not for the gates. A
    trace whose forwards or turns the format cannot mark (a forward starting at a layer
    above the previous one's last, a turn not starting with prefill after decode) is a
    :class:`~iosched.tools.trace.TraceError` rather than text that reads back otherwise.
    """
    fwds = _forwards(trace)
    for a, b in itertools.pairwise(fwds):
        if b.batches[0][0] > a.batches[-1][0]:
            raise trace_error(trace.source, None, f"a forward starting at layer "
                              f"{b.batches[0][0]} follows one ending at layer "
                              f"{a.batches[-1][0]}: the call format would join them")
        if (b.turn != a.turn) != (b.phase == PHASE_PREFILL and a.phase == PHASE_DECODE):
            raise trace_error(trace.source, None, f"turn {b.turn} after turn {a.turn}: the call "
                              "format starts a turn only at a prefill that follows decode")
    out = [f"# call trace ({_SHAPE}) written from {trace.source}; gates not kept (nan)",
           f"# model={trace.model} arch={trace.arch} n_layer={trace.n_layer} "
           f"n_expert={trace.n_expert} n_expert_used={trace.k}"]
    if trace.sizes_assumed:
        out.append("# expert sizes were assumed: no '# layer=' lines, a reader assumes them too")
    else:
        out += [f"# layer={ly} expert_bytes={trace.expert_bytes[ly]} "
                f"dense_bytes={trace.dense_bytes.get(ly, 0)}" for ly in trace.layers]
    call = 0
    for f in fwds:
        for (layer, _), rows in zip(f.batches, _rows(trace, f), strict=True):
            out += [f"{call} {r} {layer} " + " ".join(f"{e}:nan" for e in row)
                    for r, row in enumerate(rows)]
            call += 1
    return "\n".join(out) + "\n"
