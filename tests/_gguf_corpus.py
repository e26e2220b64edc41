"""A corpus of tiny MoE GGUF files, one per llama.cpp architecture with merged expert tensors.

The architectures are found in the ``gguf`` package itself: every ``MODEL_ARCH`` whose tensor
table (``gguf.constants.MODEL_TENSORS``) holds ``FFN_GATE_EXP``, ``FFN_UP_EXP``,
``FFN_DOWN_EXP`` or ``FFN_GATE_UP_EXP``. Each file is written by ``gguf.GGUFWriter`` with
llama.cpp's tensor names (``gguf.constants.TENSOR_NAMES``) and the architecture's metadata keys
(``{arch}.block_count``, ``.expert_count``, ``.expert_used_count``, and, where the file has
them, ``.leading_dense_block_count`` and ``.nextn_predict_layers``), holding what the table
names: the experts (separate gate/up/down, the fused ``ffn_gate_up_exps`` where the table has
it, up/down alone for non-gated models), a dense leading block, the router, the routing bias
``exp_probs_b``, shared and chunk experts, and a NextN/MTP block; gpt-oss's expert biases and
gemma4's per-expert ``ffn_down_exps.scale`` where llama.cpp loads them.

Expert types: F16; BF16 and Q8_0 by ``gguf.quants.quantize``; Q4_K and MXFP4 as random bytes of
the right block size (``gguf.GGML_QUANT_SIZES``): ``gguf.quants`` dequantizes them but cannot
quantize them, and the index only moves bytes. MXFP4 is written for gpt-oss, the one
architecture llama.cpp ships in it. Then layouts around one architecture: the alignments 8
and 4096 (32 is the default), a split set written by ``GGUFWriter(split_max_tensors=...)``
(the writer's own ``{name}-00001-of-0000N.gguf`` and ``split.*`` keys) and a model beside an
``mmproj-*.gguf``.

:func:`check_case` holds each against ``gguf.GGUFReader``: every (layer, expert) indexed,
``view.data`` and every ``view.tensors[...]`` byte-exact against the reader's tensor data
sliced per expert (in on-disk order), dtype and shape the model's (the reader's per expert,
BF16 as ``bfloat16``), the fused halves, ``view.ggml_types``, the skipped kinds, on every
backend. ``python -m tests._gguf_corpus --table`` prints the table as markdown.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import numpy.typing as npt

from iosched import ExpertStore, backends
from iosched._layout import CheckpointIndex
from iosched.formats._checkpoint import load_index

E, K = 4, 2
"""Experts per layer, routed per token."""
MOE_LAYERS = 2
TYPES = ("F16", "BF16", "Q8_0", "Q4_K")
BACKENDS = ("pread", "odirect", "mmap", "uring")


def expert_archs() -> dict[str, frozenset[Any]]:
    """Architecture name -> its tensor table, for every architecture with merged expert tensors."""
    from gguf.constants import MODEL_ARCH_NAMES, MODEL_TENSOR, MODEL_TENSORS

    merged = {MODEL_TENSOR.FFN_GATE_EXP, MODEL_TENSOR.FFN_UP_EXP, MODEL_TENSOR.FFN_DOWN_EXP,
              MODEL_TENSOR.FFN_GATE_UP_EXP}
    return {MODEL_ARCH_NAMES[arch]: frozenset(table) for arch, table in MODEL_TENSORS.items()
            if merged & set(table)}


@dataclass(frozen=True)
class Case:
    arch: str
    qtype: str
    layout: str
    """``separate`` (gate, up, down), ``fused`` (gate_up, down) or ``ungated`` (up, down)."""
    variant: str = ""
    """``""``, ``align8``, ``align4096``, ``split`` or ``mmproj``."""

    @property
    def name(self) -> str:
        return "-".join(p for p in (self.arch, self.layout, self.qtype, self.variant) if p)


@dataclass
class Written:
    """What the generator wrote: the path to open and what the index should say of it."""

    source: Path
    moe_layers: list[int]
    skipped: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def layouts(table: frozenset[Any]) -> list[str]:
    from gguf.constants import MODEL_TENSOR as T

    out: list[str] = []
    if T.FFN_GATE_EXP in table and T.FFN_UP_EXP in table:
        out.append("separate")
    if T.FFN_GATE_UP_EXP in table:
        out.append("fused")
    if T.FFN_GATE_EXP not in table and T.FFN_GATE_UP_EXP not in table:
        out.append("ungated")
    return out


def cases() -> list[Case]:
    """Every architecture x layout x type, and the layout variants around qwen3moe and gemma4."""
    out: list[Case] = []
    for arch, table in sorted(expert_archs().items()):
        for layout in layouts(table):
            types = (*TYPES, "MXFP4") if arch == "gpt-oss" else TYPES
            out.extend(Case(arch, qtype, layout) for qtype in types)
    for variant in ("align8", "align4096", "split", "mmproj"):
        out.append(Case("qwen3moe", "Q8_0", "separate", variant))
        out.append(Case("gemma4", "BF16", "fused", variant))
    return out


def _sizes(qtype: str) -> tuple[int, int]:
    """(hidden, intermediate): rows whole blocks of the type (Q4_K's are 256 values)."""
    return (256, 256) if qtype == "Q4_K" else (64, 32)


def _expert_array(rng: np.random.Generator, qtype: str, shape: tuple[int, ...]) -> tuple[npt.NDArray[Any], Any]:
    """(array to write, raw_dtype) for an expert tensor of numpy ``shape`` in ``qtype``."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quantize

    gtype = GGMLQuantizationType[qtype]
    values = rng.standard_normal(shape).astype(np.float32)
    if qtype == "F16":
        return values.astype(np.float16), None
    if qtype in ("BF16", "Q8_0"):
        return quantize(values, gtype), gtype
    block, size = GGML_QUANT_SIZES[gtype]  # no quantizer in gguf.quants: raw blocks
    raw = rng.integers(0, 256, (*shape[:-1], shape[-1] // block * size), dtype=np.uint8)
    return raw, gtype


def write_case(case: Case, folder: Path, seed: int = 0) -> Written:
    """Write ``case`` under ``folder`` with ``gguf.GGUFWriter``; what should be indexed."""
    import gguf
    from gguf.constants import MODEL_TENSOR as T
    from gguf.constants import TENSOR_NAMES

    table = expert_archs()[case.arch]
    rng = np.random.default_rng(seed)
    hidden, inter = _sizes(case.qtype)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{case.name}.gguf"
    split = case.variant == "split"
    writer = gguf.GGUFWriter(str(path), arch=case.arch, split_max_tensors=6 if split else 0)
    dense = T.FFN_DOWN in table and T.FFN_UP in table
    mtp = T.NEXTN_EH_PROJ in table
    first = 1 if dense else 0
    moe_layers = list(range(first, first + MOE_LAYERS))
    blocks = first + MOE_LAYERS + (1 if mtp else 0)
    skipped: dict[str, int] = {}

    def skip(kind: str) -> None:
        skipped[kind] = skipped.get(kind, 0) + 1

    def name(t: Any, layer: int, suffix: str = "weight") -> str:
        return f"{TENSOR_NAMES[t].format(bid=layer)}.{suffix}"

    def f16(*shape: int) -> npt.NDArray[Any]:
        return rng.standard_normal(shape).astype(np.float16)

    def f32(*shape: int) -> npt.NDArray[Any]:
        return rng.standard_normal(shape).astype(np.float32)

    writer.add_block_count(blocks)
    writer.add_embedding_length(hidden)
    writer.add_expert_feed_forward_length(inter)
    writer.add_expert_count(E)
    writer.add_expert_used_count(K)
    if dense:
        writer.add_leading_dense_block_count(first)
    if mtp:
        writer.add_nextn_predict_layers(1)
    if case.variant.startswith("align"):
        writer.add_custom_alignment(int(case.variant[5:]))
    writer.add_tensor(name(T.TOKEN_EMBD, 0).replace("blk.0.", ""), f16(16, hidden))

    def experts(layer: int) -> None:
        if case.layout == "fused":
            roles = [(T.FFN_GATE_UP_EXP, (E, 2 * inter, hidden))]
        elif case.layout == "separate":
            roles = [(T.FFN_GATE_EXP, (E, inter, hidden)), (T.FFN_UP_EXP, (E, inter, hidden))]
        else:
            roles = [(T.FFN_UP_EXP, (E, inter, hidden))]
        roles.append((T.FFN_DOWN_EXP, (E, hidden, inter)))
        for t, shape in roles:
            arr, raw = _expert_array(rng, case.qtype, shape)
            writer.add_tensor(name(t, layer), arr, raw_dtype=raw)
            if case.arch == "gpt-oss":  # llama.cpp loads ffn_{gate,up,down}_exps.bias for gpt-oss
                writer.add_tensor(name(t, layer, "bias"), f32(*shape[:2]))
        if case.arch == "gemma4":  # router.per_expert_scale: one scale a down projection
            writer.add_tensor(name(T.FFN_DOWN_EXP, layer, "scale"), f32(E))

    if dense:
        for t in (T.FFN_GATE, T.FFN_UP, T.FFN_DOWN):
            if t in table:
                writer.add_tensor(name(t, 0), f16(inter, hidden) if t != T.FFN_DOWN else f16(hidden, inter))
                skip("dense")
    for layer in moe_layers:
        writer.add_tensor(name(T.ATTN_NORM, layer), f32(hidden))
        if T.FFN_GATE_INP in table:
            writer.add_tensor(name(T.FFN_GATE_INP, layer), f32(E, hidden))
            skip("router")
        if T.FFN_EXP_PROBS_B in table:
            writer.add_tensor(name(T.FFN_EXP_PROBS_B, layer, "bias"), f32(E))
            skip("router")
        if T.FFN_NORM_EXP in table:  # arctic's norm before its MoE: per layer, not per expert
            writer.add_tensor(name(T.FFN_NORM_EXP, layer), f32(hidden))
        for t in (T.FFN_GATE_SHEXP, T.FFN_UP_SHEXP, T.FFN_DOWN_SHEXP, T.FFN_GATE_INP_SHEXP):
            if t in table:
                shape = {T.FFN_DOWN_SHEXP: (hidden, inter), T.FFN_GATE_INP_SHEXP: (hidden,)}.get(t, (inter, hidden))
                writer.add_tensor(name(t, layer), f16(*shape))
                skip("shared_expert")
        for t in (T.FFN_GATE_CHEXP, T.FFN_UP_CHEXP, T.FFN_DOWN_CHEXP):
            if t in table:
                rows_cols = (hidden, inter) if t == T.FFN_DOWN_CHEXP else (inter, hidden)
                writer.add_tensor(name(t, layer), f16(2, *rows_cols))
                skip("chunk_expert")
        experts(layer)
    if mtp:  # the last block: a NextN head with its own experts, all of it left out
        layer = blocks - 1
        before = sum(len(t) for t in writer.tensors)
        writer.add_tensor(name(T.NEXTN_EH_PROJ, layer), f16(hidden, 2 * hidden))
        writer.add_tensor(name(T.NEXTN_ENORM, layer), f32(hidden))
        experts(layer)
        after = sum(len(t) for t in writer.tensors)
        skipped["mtp"] = after - before
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    notes: list[str] = []
    source = path
    if split:
        source = folder
    if case.variant == "mmproj":
        proj = gguf.GGUFWriter(str(folder / "mmproj-model-f16.gguf"), arch="clip")
        proj.add_tensor("v.blk.0.attn_q.weight", f16(8, 8))
        proj.add_tensor("mm.0.weight", f16(8, 8))
        proj.write_header_to_file()
        proj.write_kv_data_to_file()
        proj.write_tensors_to_file()
        proj.close()
        source = folder
        notes.append("mmproj-model-f16.gguf")
    return Written(source=source, moe_layers=moe_layers, skipped=skipped, notes=notes)


# --------------------------------------------------------------------------- the check


def _shards(source: Path) -> list[Path]:
    if source.is_file():
        return [source]
    return sorted(p for p in source.glob("*.gguf") if not p.name.startswith("mmproj"))


ExpectedTensor = tuple[str, npt.NDArray[Any], str, tuple[str, int, int]]
Expected = dict[tuple[int, int], list[ExpectedTensor]]


def expected_experts(source: Path, moe_layers: Iterable[int]) -> Expected:
    """Per (layer, expert): ``(canonical name, array, GGML type name, (file, offset))`` of
    every expert tensor, from ``gguf.GGUFReader``'s data sliced per expert; BF16 retyped to
    ``bfloat16`` with the model's shape."""
    import re

    import gguf

    rx = re.compile(r"blk\.([0-9]+)\.ffn_(gate_up|gate|up|down)_exps\.(.+)")
    layers = set(moe_layers)
    out: Expected = {}
    for shard in _shards(source):
        reader = gguf.GGUFReader(shard, "r")
        for t in reader.tensors:
            m = rx.fullmatch(t.name)
            if m is None or int(m.group(1)) not in layers:
                continue
            data = np.array(t.data)  # a copy: the reader's map closes with it
            per = int(t.n_bytes) // data.shape[0]
            canon = f"{m.group(2)}_proj" + ("" if m.group(3) == "weight" else f".{m.group(3)}")
            for e in range(data.shape[0]):
                part = np.array(data[e])  # a per-expert scale stays 0-d
                if t.tensor_type == gguf.GGMLQuantizationType.BF16:
                    part = part.view(ml_dtypes.bfloat16)
                where = (os.path.abspath(shard), int(t.data_offset) + e * per, 0)
                out.setdefault((int(m.group(1)), e), []).append((canon, part, t.tensor_type.name, where))
        del reader
    return out


@dataclass
class Row:
    case: str
    arch: str
    layout: str
    qtype: str
    variant: str
    experts: int
    skipped: str
    backends: str
    result: str


async def _check_backend(source: Path, backend: str, expected: Expected) -> None:
    async with await ExpertStore.open(source, budget_bytes=4 << 20, backend=backend) as store:
        for key, tensors in expected.items():
            async with store.acquire(key) as view:
                ordered = sorted(tensors, key=lambda x: x[3])
                assert view.data.tobytes() == b"".join(a.tobytes() for _, a, _, _ in ordered), (key, backend)
                for canon, arr, gtype, _ in tensors:
                    got = view.tensors[canon]
                    assert got.dtype == arr.dtype and got.shape == arr.shape, (key, canon, got.dtype, got.shape,
                                                                              arr.dtype, arr.shape)
                    assert got.tobytes() == arr.tobytes(), (key, canon, backend)
                    assert view.ggml_types[canon].name == gtype
                    assert np.shares_memory(got, view.data) or backend == "mmap"
                fused = {c: a for c, a, _, _ in tensors if c.startswith("gate_up_proj")}
                for canon, arr in fused.items():  # llama.cpp: gate the first half of 2I, up the second
                    half = arr.shape[0] // 2
                    tail = canon[len("gate_up_proj"):]
                    if not arr.shape:
                        continue
                    for part, sl in (("gate_proj", slice(0, half)), ("up_proj", slice(half, 2 * half))):
                        got = view.tensors[part + tail]
                        assert got.tobytes() == np.ascontiguousarray(arr[sl]).tobytes(), (key, part)
                        assert got.base is not None and np.shares_memory(got, view.tensors[canon])
                        assert view.ggml_types[part + tail] == view.ggml_types[canon]


@dataclass
class Prepared:
    """A case written, indexed and checked against the reader; its row in the table."""

    case: Case
    written: Written
    expected: Expected
    row: Row


def prepare_case(case: Case, folder: Path) -> Prepared:
    """Write ``case`` in ``folder`` and hold its index against the reader (keys, counts,
    skipped kinds, notes, GGML types); the views are :func:`check_backend`'s."""
    written = write_case(case, folder)
    expected = expected_experts(written.source, written.moe_layers)
    index: CheckpointIndex = load_index(written.source)
    assert index.format == "gguf" and index.architecture == case.arch
    assert sorted(index.experts) == sorted(expected) == [(la, e) for la in written.moe_layers for e in range(E)]
    assert index.experts_per_token == K and index.experts_per_layer() == E
    got_skipped = {s.kind: s.count for s in index.skipped}
    assert got_skipped == written.skipped, (got_skipped, written.skipped)
    for note in written.notes:
        assert any(note in n for n in index.notes), index.notes
    if case.variant == "split":
        assert len(index.files) > 1
    for key, tensors in expected.items():
        lay = index.experts[key]
        assert {t.name: t.ggml_type.name for t in lay.tensors if t.ggml_type} == {c: g for c, _, g, _ in tensors}
    row = Row(case=case.name, arch=case.arch, layout=case.layout, qtype=case.qtype, variant=case.variant,
              experts=len(index.experts), skipped=", ".join(f"{k} {v}" for k, v in sorted(got_skipped.items())),
              backends="", result="ok")
    return Prepared(case, written, expected, row)


def check_backend(prepared: Prepared, backend: str) -> None:
    """Every expert of ``prepared`` through a store on ``backend``, against the reader; the
    row notes the backend (or the failure)."""
    try:
        asyncio.run(_check_backend(prepared.written.source, backend, prepared.expected))
    except Exception as exc:
        prepared.row.result = f"FAILED on {backend}: {type(exc).__name__}: {str(exc)[:300]}"
        raise
    prepared.row.backends = " ".join(b for b in (prepared.row.backends, backend) if b)


def check_case(case: Case, folder: Path, backend_names: Iterable[str] = BACKENDS) -> Row:
    """Write ``case`` in ``folder``, index it, hold it against the reader on every backend
    (one that cannot run here noted in the row with its reason)."""
    prepared = prepare_case(case, folder)
    available = backends.available()
    for name in backend_names:
        reason = available.get(name)
        if reason is not None:
            prepared.row.backends += f"; {name} skipped: {reason}"
            continue
        check_backend(prepared, name)
    return prepared.row


def markdown(rows: list[Row]) -> str:
    head = ("| arch | layout | type | variant | experts | skipped | backends | result |\n"
            "|---|---|---|---|---|---|---|---|\n")
    return head + "".join(f"| {r.arch} | {r.layout} | {r.qtype} | {r.variant or '-'} | {r.experts} | "
                          f"{r.skipped or '-'} | {r.backends} | {r.result} |\n" for r in rows)


def run_corpus(root: Path, backend_names: Iterable[str] = BACKENDS) -> list[Row]:
    """Every case under ``root``: its row, or a row saying why it failed."""
    rows = []
    names = tuple(backend_names)
    for case in cases():
        try:
            rows.append(check_case(case, root / case.name, names))
        except Exception as exc:  # the table reports every case; the test fails on any
            rows.append(Row(case.name, case.arch, case.layout, case.qtype, case.variant, 0, "", "",
                            f"FAILED: {type(exc).__name__}: {str(exc)[:300]}"))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", action="store_true", help="print the corpus table as markdown")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gguf-corpus-") as tmp:
        rows = run_corpus(Path(tmp))
    took = time.perf_counter() - start
    if args.table:
        print(markdown(rows))
    failed = [r for r in rows if r.result != "ok"]
    print(f"{len(rows)} GGUF layouts, {len(rows) - len(failed)} ok, {len(failed)} failed, {took:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
