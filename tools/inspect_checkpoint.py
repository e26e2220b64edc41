"""``iosched inspect PATH``: what iosched finds in a checkpoint, before a store is opened on it.

An engine's first question about a model on disk is whether iosched reads it the way the engine
means it: how many layers and experts, how large an expert is, how many reads a miss costs, what
one expert's tensors are (names, dtypes, GGML types, shapes), k and where it came from, and
what was left out on purpose (dense layers, shared experts, routers, MTP layers, vision towers)
and why.  Everything comes from :func:`iosched.load_index` (headers only: no tensor byte is
read), so inspecting a 200 GB checkpoint costs a few header reads.  A checkpoint iosched
refuses is reported by the same :class:`~iosched.CheckpointError` ``open`` would raise
(exit status 2).

Warnings name what costs an engine time: an expert spread over several extents (a miss is that
many reads; ``iosched pack`` makes it one) and a checkpoint that does not state k (the default
policy needs it: pass ``experts_per_token``).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any

from iosched import CheckpointIndex, ExpertLayout, load_index

from . import _command


def add_parser(sub: _command.SubParsers[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("inspect", help="what iosched finds in a checkpoint: experts, tensors, k, what it skips")
    p.add_argument("path", help="a checkpoint folder or file (.safetensors / .gguf)")
    p.add_argument("--layer", type=_command.non_negative_int, default=None,
                   help="show this layer's expert 0 (default: the first MoE layer)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=cmd)


def cmd(args: argparse.Namespace) -> dict[str, Any]:
    index = load_index(args.path)
    report = describe(index, args.layer)
    if not args.json:
        print(render(report))
    return report


def describe(index: CheckpointIndex, layer: int | None = None) -> dict[str, Any]:
    """The report as a JSON-ready dict (``render`` prints it for people)."""
    layers = index.layers()
    if layer is not None and layer not in layers:
        raise _command.UsageError(f"--layer {layer}: the checkpoint's MoE layers are {_ranges(layers)}")
    by_layer: dict[int, list[ExpertLayout]] = {}
    for (lay, _), layout in sorted(index.experts.items()):
        by_layer.setdefault(lay, []).append(layout)
    counts = {lay: len(v) for lay, v in by_layer.items()}
    nbytes = [lay.nbytes for lay in index.experts.values()]
    extents = [len(lay.extents) for lay in index.experts.values()]
    shown = by_layer[layer if layer is not None else layers[0]][0]
    warnings = list(index.notes)
    most_extents = max(extents)
    if most_extents > 1:
        warnings.append(
            f"an expert is up to {most_extents} extents on disk, so a miss costs up to {most_extents} reads; "
            "`iosched pack` writes a copy in which every expert is one aligned extent")
    if index.experts_per_token is None:
        warnings.append("the checkpoint does not state k (experts per token): the default policy needs it, "
                        "pass ExpertStore.open(experts_per_token=...)")
    return {
        "path": index.root,
        "format": index.format,
        "architecture": index.architecture or None,
        "files": len(index.files),
        "file_bytes": sum(index.file_sizes),
        "moe_layers": len(layers),
        "layers": _ranges(layers),
        "experts_per_layer": index.experts_per_layer(),
        "uneven_layers": {str(k): v for k, v in counts.items() if v != index.experts_per_layer()},
        "experts": len(index.experts),
        "expert_bytes": {"min": min(nbytes), "max": max(nbytes), "total": sum(nbytes)},
        "extents_per_expert": {"min": min(extents), "max": most_extents},
        "experts_per_token": index.experts_per_token,
        "k_source": index.k_source or None,
        "k_by_layer": ({str(k): v for k, v in sorted(index.k_by_layer.items())}
                       if index.k_by_layer is not None else None),
        "expert": _expert(index, shown),
        "skipped": [
            {"kind": s.kind, "count": s.count, "reason": s.reason, "example": s.example} for s in index.skipped
        ],
        "warnings": warnings,
    }


def _expert(index: CheckpointIndex, layout: ExpertLayout) -> dict[str, Any]:
    tensors = []
    for t in layout.tensors:
        g = t.ggml_type
        tensors.append({
            "name": t.name, "source_name": t.source_name, "dtype": str(t.dtype), "shape": list(t.shape),
            "bytes": t.nbytes, "ggml_type": g.name if g is not None else None,
            "ggml_block_size": g.block_size if g is not None else None,
            "ggml_type_size": g.type_size if g is not None else None,
            "file": os.path.basename(index.files[t.file]), "offset": t.offset,
        })
    types = layout.ggml_types
    derived = [{"name": d.name, "of": d.parent, "axis": d.axis, "slice": [d.start, d.stop, d.step],
                "ggml_type": types[d.name].name if d.name in types else None}
               for d in layout.derived]
    return {"layer": layout.key[0], "expert": layout.key[1], "bytes": layout.nbytes,
            "extents": len(layout.extents), "tensors": tensors, "views": derived}


def _ranges(values: Sequence[int]) -> str:
    """``0-3,5,7-9`` for sorted integers."""
    out: list[str] = []
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        out.append(str(values[i]) if i == j else f"{values[i]}-{values[j]}")
        i = j + 1
    return ",".join(out)


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.2f} {unit}"
    return f"{n} B"


def render(r: dict[str, Any]) -> str:
    """The report for people: a few aligned lines and a table of one expert's tensors."""
    eb, ex = r["expert_bytes"], r["extents_per_expert"]
    k = "not stated" if r["experts_per_token"] is None else f"{r['experts_per_token']} (from {r['k_source']})"
    lines = [
        f"{r['path']}: {r['format']}" + (f", architecture {r['architecture']}" if r["architecture"] else ""),
        f"  files         {r['files']} holding experts, {_size(r['file_bytes'])}",
        f"  MoE layers    {r['moe_layers']} (layers {r['layers']})",
        f"  experts       {r['experts_per_layer']} per layer, {r['experts']} in all"
        + (f"; uneven: {r['uneven_layers']}" if r["uneven_layers"] else ""),
        f"  expert size   {_size(eb['min'])}" + (f" to {_size(eb['max'])}" if eb["max"] != eb["min"] else "")
        + f", {_size(eb['total'])} in all",
        f"  reads/expert  {ex['min']}" + (f" to {ex['max']}" if ex["max"] != ex["min"] else "") + " extents",
        f"  k             {k}",
    ]
    if r["k_by_layer"]:
        lines.append(f"  k by layer    {r['k_by_layer']}")
    e = r["expert"]
    lines.append(f"  expert ({e['layer']}, {e['expert']}): {_size(e['bytes'])} in {e['extents']} extent(s)")
    header = ("name", "dtype", "ggml", "shape", "bytes", "source tensor")
    rows = [(t["name"], t["dtype"], t["ggml_type"] or "-", "x".join(map(str, t["shape"])), str(t["bytes"]),
             t["source_name"]) for t in e["tensors"]]
    for v in e["views"]:
        start, stop, step = v["slice"]
        rows.append((v["name"], "view", v["ggml_type"] or "-", f"{v['of']}[axis {v['axis']}: {start}:{stop}:{step}]",
                     "0", "(zero-copy view)"))
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        lines.append("    " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    if r["skipped"]:
        lines.append("  skipped")
        for s in r["skipped"]:
            lines.append(f"    {s['kind']:<14} {s['count']:>5} tensors  {s['reason']} (e.g. {s['example']})")
    for w in r["warnings"]:
        lines.append(f"  warning: {w}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:  # pragma: no cover - via tools.cli
    return _command.run_one("inspect", add_parser, argv)
