"""Packing a checkpoint so that every expert is one aligned read (``iosched pack``).

Why: an expert of a GGUF file is three slices of three merged tensors (gate, up, down), far
apart in the file, so loading it is three reads; a safetensors shard may order its tensors
by name, so an expert's projections need not be adjacent either. Serving systems that stream
experts from SSDs lay them out again first, one block per (layer, expert) starting at a
4096-byte boundary (SGLang's SSD expert pack does this), so that an expert is one request that
O_DIRECT can issue without bounce buffers. :func:`pack_checkpoint` writes such a copy as an
ordinary safetensors checkpoint, which every safetensors reader opens and iosched indexes
with one extent per expert.

Layout of the destination (a folder): ``model.safetensors``, or shards
``model-0000i-of-0000n.safetensors`` of at most ``max_shard_bytes`` each with a
``model.safetensors.index.json``, and the source's ``config.json`` when it has one. In each
shard:

* the JSON header is padded with trailing spaces (which the format allows) so that the data
  section starts at a multiple of ``align``;
* the tensors that are not experts come first, byte for byte and dtype kept, ordered by
  element size (largest first, as the safetensors writer does) so each starts aligned to it;
* then the experts in (layer, expert) order, each one extent starting at a multiple of
  ``align``, its tensors back to back in the source's buffer order (so ``view.data`` is the
  same bytes); safetensors readers refuse a data section with holes, so each gap is a
  padding tensor ``iosched.pad.N`` (``U8``, zeros);
* expert tensors keep their name when it is one iosched's safetensors reader already
  understands (``model.layers.L.mlp.experts.E.gate_proj.weight``, Mixtral's ``w1``...), and
  are named ``model.layers.L.mlp.experts.E.{gate_proj,up_proj,down_proj}.weight`` otherwise
  (another role ``R`` as ``model.layers.L.mlp.experts.E.R``);
* GGUF tensors keep their bytes: F16/F32 (and the other numeric types) as that dtype, every
  other GGML type as ``U8`` of the shape the GGUF index gives (rows, bytes per row), with the
  GGML type and the model's shape in ``__metadata__`` (:mod:`iosched.formats._pack_meta`); a GGUF's
  tensors that are not experts are copied the same way under their GGUF names, while its
  key/value metadata (tokenizer, hyperparameters) is not carried, beyond the architecture
  and the expert counts.

Safety: nothing is written outside a temporary folder beside the destination until the copy
has been written, flushed to disk and verified; then one ``rename`` publishes it
(:class:`iosched._atomic.StagedFolder`). An existing
destination is never replaced (an empty folder excepted), nor one inside the source. The
verification re-indexes the copy with :func:`~iosched.formats._checkpoint.load_index`, checks every
expert is one extent at an aligned offset holding the same tensors (names, dtypes, shapes,
GGML types, derived views), compares its bytes with the source's extents, and reads every
tensor back through ``safetensors.safe_open`` against the source.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import struct
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from iosched._atomic import StagedFolder
from iosched._errors import CheckpointError, StoreError
from iosched._layout import CheckpointIndex, ExpertKey, ExpertLayout, GgmlType

from . import _pack_meta as meta
from ._checkpoint import load_index
from ._gguf_header import read_header as read_gguf_header
from ._hf_names import parse as parse_hf_name
from ._safetensors_index import (
    _ITEMSIZE,
    CONFIG_JSON,
    INDEX_JSON,
    HeaderEntry,
    tensor_entries,
)
from ._untrusted import quote

__all__ = ["DEFAULT_ALIGN", "DEFAULT_SHARD_BYTES", "ExpertMove", "PackError", "PackReport", "Placement",
           "pack_checkpoint"]

DEFAULT_ALIGN = 4096
"""The logical block size of NVMe drives and the page size: an O_DIRECT read must start on it."""
MIN_ALIGN = 8
"""The safetensors format's own alignment of the data section (its writer pads the header to 8)."""
MAX_ALIGN = 1 << 30
"""1 GiB, the largest huge page; a larger alignment only wastes space."""
DEFAULT_SHARD_BYTES = 4 << 30
"""Data bytes per shard, at most (an expert or tensor larger than this gets a shard of its own):
4 GiB, under the 5 GB that Hugging Face Hub checkpoints are usually cut into (transformers 4's
``save_pretrained`` default; 5 writes 50 GB shards), so a copy keeps to files that tools for
the Hub handle."""
_CHUNK = 8 << 20
"""Bytes per copy or compare step: large enough to stream at disk speed, small enough to keep
memory flat whatever the tensor."""
_ROLE_NAMES = ("gate_proj", "up_proj", "down_proj")
_SLICE_RE = re.compile(r"(.+)\[[0-9]+\]")
"""A reader's name for one expert's slice of a merged tensor: ``blk.0.ffn_up_exps.weight[3]``."""
_NUMERIC = {"f2": "F16", "f4": "F32", "f8": "F64", "i1": "I8", "i2": "I16", "i4": "I32", "i8": "I64",
            "u1": "U8", "u2": "U16", "u4": "U32", "u8": "U64", "b1": "BOOL"}
"""numpy kind+size -> safetensors dtype, for GGUF tensors (which are little-endian here)."""


class PackError(StoreError):
    """The destination cannot be written (it exists, lies inside the source, the alignment is
    not a power of two...), or the copy did not verify; nothing was published."""


ProgressFn = Callable[[str, int, int], None]
"""``progress(phase, done_bytes, total_bytes)``; ``phase`` is ``"copy"`` or ``"verify"``."""


@dataclass(frozen=True)
class Placement:
    """Bytes ``offset .. offset + length`` of ``file`` (a name relative to its checkpoint)."""

    file: str
    offset: int
    length: int

    def as_dict(self) -> dict[str, Any]:
        return {"file": self.file, "offset": self.offset, "length": self.length}


@dataclass(frozen=True)
class ExpertMove:
    """Where an expert's bytes were (one placement per read) and where they are now (one)."""

    key: ExpertKey
    before: tuple[Placement, ...]
    after: Placement


@dataclass(frozen=True)
class PackReport:
    """What :func:`pack_checkpoint` did."""

    source: str
    dest: str
    source_format: str
    align: int
    files: tuple[str, ...]
    """The destination's files, relative to ``dest``."""
    experts: int
    expert_bytes: int
    other_tensors: int
    """Tensors that are not experts, copied as they are."""
    other_bytes: int
    padding_bytes: int
    """Zero bytes between experts (and before the first), to align them."""
    bytes_written: int
    """Every byte of the destination's safetensors files, headers included."""
    moves: tuple[ExpertMove, ...] = field(repr=False)
    notes: tuple[str, ...]
    write_seconds: float
    verify_seconds: float
    seconds: float
    verified: bool

    @property
    def extents_before(self) -> int:
        return sum(len(m.before) for m in self.moves)

    @property
    def extents_after(self) -> int:
        return len(self.moves)

    def as_dict(self) -> dict[str, Any]:
        """The report as JSON-ready values (``iosched pack --json``)."""
        n = max(1, self.experts)
        return {
            "source": self.source, "dest": self.dest, "source_format": self.source_format, "align": self.align,
            "files": list(self.files), "experts": self.experts, "expert_bytes": self.expert_bytes,
            "other_tensors": self.other_tensors, "other_bytes": self.other_bytes,
            "padding_bytes": self.padding_bytes, "bytes_written": self.bytes_written,
            "extents_before": self.extents_before, "extents_after": self.extents_after,
            "reads_per_expert_before": self.extents_before / n, "reads_per_expert_after": self.extents_after / n,
            "experts_detail": [{"layer": m.key[0], "expert": m.key[1], "before": [p.as_dict() for p in m.before],
                                "after": m.after.as_dict()} for m in self.moves],
            "notes": list(self.notes), "write_seconds": self.write_seconds,
            "verify_seconds": self.verify_seconds, "seconds": self.seconds, "verified": self.verified,
        }  # fmt: skip


# ------------------------------------------------------------------------------------ the plan


@dataclass(frozen=True)
class _Tensor:
    """One tensor of a destination file; ``begin`` counts from its data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    nbytes: int
    source: tuple[tuple[str, int, int], ...]
    """(path, offset, length) of its bytes in the source, back to back; ``()`` for padding."""


@dataclass
class _Unit:
    """Bytes written in one go: one tensor, a padding run, or a whole expert."""

    begin: int
    nbytes: int
    source: tuple[tuple[str, int, int], ...]
    tensors: list[_Tensor]
    key: ExpertKey | None = None


@dataclass
class _Shard:
    units: list[_Unit] = field(default_factory=list)
    metadata: dict[str, str] = field(default_factory=dict)
    size: int = 0
    name: str = ""
    head: int = 0
    """Bytes of the length prefix and header: where the data section starts."""

    def tensors(self) -> Iterator[_Tensor]:
        for unit in self.units:
            yield from unit.tensors


@dataclass
class _Plan:
    shards: list[_Shard]
    ggml: dict[ExpertKey, dict[str, GgmlType]]
    """The GGML types each expert's view must carry."""
    other_tensors: int = 0
    other_bytes: int = 0
    padding_bytes: int = 0
    pads: int = 0
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Other:
    """A tensor that is not an expert, to copy as it is."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    path: str
    offset: int
    nbytes: int
    itemsize: int
    ggml: str | None
    """Its ``iosched.ggml.*`` metadata value, if any."""


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def _check_args(align: int, max_shard_bytes: int) -> None:
    if not isinstance(align, int) or isinstance(align, bool) or not MIN_ALIGN <= align <= MAX_ALIGN \
            or align & (align - 1):
        raise PackError(f"align={align!r} is not a power of two between {MIN_ALIGN} and {MAX_ALIGN} bytes")
    if not isinstance(max_shard_bytes, int) or isinstance(max_shard_bytes, bool) or max_shard_bytes < 1:
        raise PackError(f"max_shard_bytes={max_shard_bytes!r} is not a positive number of bytes")


def _source_tensors(index: CheckpointIndex) -> dict[str, tuple[Path, HeaderEntry]]:
    """Every tensor of a safetensors source by name, with its shard (the reader's own choice:
    the ``weight_map`` when there is one)."""
    return {entry.name: (shard, entry) for shard, entry in tensor_entries(Path(index.root))}


def _gguf_types(path: Path) -> tuple[dict[str, tuple[GgmlType, tuple[int, ...]]], bool]:
    """Each tensor's GGML type and model shape (outermost first) by name, and whether the file
    is big-endian, from the bounded header reader (``load_index`` has accepted the header just
    before).  The reader's shape counts bytes on its last axis for a quantized type; the model's
    counts values: ``bytes / type_size * block_size``."""
    out: dict[str, tuple[GgmlType, tuple[int, ...]]] = {}
    big_endian = False
    for t in read_gguf_header(path).tensors:
        g = t.ggml_type
        shape = t.shape
        if t.dtype == np.dtype(np.uint8) and g.name not in ("I8", "U8") and shape:
            shape = (*shape[:-1], shape[-1] // g.type_size * g.block_size)
        big_endian = big_endian or t.dtype.byteorder == ">"
        out[t.name] = (g, shape)
    return out, big_endian


def _keeps_names(index: CheckpointIndex) -> bool:
    """Whether every expert tensor of ``index`` may keep its name in the copy: a per-expert
    safetensors name whose layer and expert are the index's own (iosched's reader then maps it
    back to the same key and role). Fused slices (``name[e]``) and renumbered stacks (an
    encoder-decoder's decoder layers) are renamed, all of them, so the copy has one stack."""
    if index.format != "safetensors":
        return False
    for lay in index.experts.values():
        for spec in lay.tensors:
            p = parse_hf_name(spec.source_name)
            if p is None or p.what != "expert" or (int(p.layer), int(p.expert)) != lay.key:
                return False
    return True


def _dst_name(keep: bool, key: ExpertKey, name: str, source_name: str) -> str:
    """The destination's name for expert ``key``'s tensor ``name`` (module docstring)."""
    if keep:
        return source_name
    suffix = f"{name}.weight" if name in _ROLE_NAMES else name
    return f"model.layers.{key[0]}.mlp.experts.{key[1]}.{suffix}"


def _gguf_others(index: CheckpointIndex, expert_bases: set[str]
                 ) -> tuple[list[_Other], str, dict[str, tuple[GgmlType, tuple[int, ...]]]]:
    """The tensors of a GGUF checkpoint (every shard of a split set) that are not experts, each
    with its GGML type and model shape for the metadata; ``general.architecture``; every
    tensor's GGML type and model shape by name."""
    others: list[_Other] = []
    architecture = ""
    types: dict[str, tuple[GgmlType, tuple[int, ...]]] = {}
    for path in map(Path, index.files):
        ggml_of, big_endian = _gguf_types(path)
        types.update(ggml_of)
        if big_endian:
            raise CheckpointError(f"{path}: a big-endian GGUF file: safetensors holds little-endian tensors only "
                                  "(convert it with gguf-convert-endian first)")
        header = read_gguf_header(path)
        arch = header.values.get("general.architecture")
        if isinstance(arch, str) and not architecture:
            architecture = arch
        for gt in header.tensors:
            if gt.name in expert_bases:
                continue
            kind = _NUMERIC.get(f"{gt.dtype.kind}{gt.dtype.itemsize}")
            if kind is None:
                raise CheckpointError(f"{path}: tensor {quote(gt.name)} has numpy dtype {gt.dtype}, which "
                                      "safetensors cannot hold")
            ggml, shape = ggml_of[gt.name]
            others.append(_Other(gt.name, kind, gt.shape, str(path), gt.data_offset, gt.n_bytes, gt.dtype.itemsize,
                                 meta.ggml_entry(ggml, shape)))
    return others, architecture, types


def _plan(index: CheckpointIndex, align: int, max_shard_bytes: int, src_meta: Mapping[str, str]) -> _Plan:
    """Where every byte of the destination comes from."""
    others: list[_Other] = []
    ggml_of: dict[str, tuple[GgmlType, tuple[int, ...]]] = {}
    dtype_of: dict[str, str] = {}
    plan = _Plan(shards=[], ggml={})
    architecture = index.architecture
    expert_sources = {s.source_name for lay in index.experts.values() for s in lay.tensors}
    expert_bases = expert_sources | {m.group(1) for m in map(_SLICE_RE.fullmatch, expert_sources) if m}
    if index.format == "gguf":
        gguf_others, arch, ggml_of = _gguf_others(index, expert_bases)
        others.extend(gguf_others)
        architecture = architecture or arch
    elif index.format == "safetensors":
        tensors = _source_tensors(index)
        for name, (file, entry) in tensors.items():
            dtype_of[name] = entry.dtype
            if name in expert_bases or name.startswith(meta.PAD_PREFIX):
                continue
            others.append(_Other(name, entry.dtype, entry.shape, os.path.abspath(file), entry.offset, entry.nbytes,
                                 _ITEMSIZE.get(entry.dtype, 1), src_meta.get(meta.GGML_PREFIX + name)))
    else:
        raise CheckpointError(f"{index.root}: cannot pack a checkpoint of format {quote(index.format)}")
    order = {path: i for i, path in enumerate(sorted({o.path for o in others}))}
    others.sort(key=lambda o: (order[o.path], o.offset))
    others.sort(key=lambda o: -min(8, o.itemsize))  # stable: each element size stays in file order

    common = {meta.VERSION_KEY: meta.VERSION, meta.ALIGN_KEY: str(align), "format": "pt",
              meta.SOURCE_FORMAT_KEY: src_meta.get(meta.SOURCE_FORMAT_KEY, index.format)}
    if architecture:
        common[meta.ARCH_KEY] = architecture
    if index.experts_per_token is not None:
        common[meta.K_KEY] = str(index.experts_per_token)
    if index.k_by_layer:
        common[meta.K_BY_LAYER_KEY] = json.dumps({str(k): v for k, v in sorted(index.k_by_layer.items())})
    common[meta.E_KEY] = str(index.experts_per_layer())

    shard = _Shard()
    plan.shards.append(shard)

    def room(nbytes: int, at: int) -> _Shard:
        nonlocal shard
        if shard.size and at + nbytes > max_shard_bytes:
            shard = _Shard()
            plan.shards.append(shard)
        return shard

    names: set[str] = set()

    def add(tensor: _Tensor) -> None:
        if tensor.name in names:
            raise CheckpointError(f"{index.root}: two tensors would be named {quote(tensor.name)} in the packed copy")
        names.add(tensor.name)

    for o in others:
        s = room(o.nbytes, _round_up(shard.size, min(8, o.itemsize)))
        begin = s.size  # element sizes descend: already aligned to this one
        t = _Tensor(o.name, o.dtype, o.shape, begin, o.nbytes, ((o.path, o.offset, o.nbytes),))
        add(t)
        s.units.append(_Unit(begin, o.nbytes, t.source, [t]))
        s.size += o.nbytes
        if o.ggml is not None:
            s.metadata[meta.GGML_PREFIX + o.name] = o.ggml
        plan.other_tensors += 1
        plan.other_bytes += o.nbytes

    keep = _keeps_names(index)
    for key in sorted(index.experts):
        lay = index.experts[key]
        s = room(lay.nbytes, _round_up(shard.size, align))
        begin = _round_up(s.size, align)
        if begin > s.size:
            t = _Tensor(f"{meta.PAD_PREFIX}{plan.pads}", "U8", (begin - s.size,), s.size, begin - s.size, ())
            add(t)
            plan.pads += 1
            plan.padding_bytes += begin - s.size
            s.units.append(_Unit(s.size, begin - s.size, (), [t]))
        unit = _Unit(begin, lay.nbytes, tuple((index.files[e.file], e.offset, e.length) for e in lay.extents), [],
                     key)
        plan.ggml[key] = _expert_tensors(index, lay, unit, s, dtype_of, ggml_of, src_meta, keep)
        for t in unit.tensors:
            add(t)
        s.units.append(unit)
        s.size = begin + lay.nbytes

    n = len(plan.shards)
    for i, s in enumerate(plan.shards):
        s.name = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        s.metadata.update(common)
    if index.format == "gguf":
        plan.notes.append("GGUF key/value metadata (tokenizer, hyperparameters) is not carried; the tensors that "
                          "are not experts are copied under their GGUF names, GGML types in __metadata__")
    return plan


def _expert_tensors(index: CheckpointIndex, lay: ExpertLayout, unit: _Unit, shard: _Shard,
                    dtype_of: Mapping[str, str], ggml_of: Mapping[str, tuple[GgmlType, tuple[int, ...]]],
                    src_meta: Mapping[str, str], keep: bool) -> dict[str, GgmlType]:
    """Fill ``unit.tensors`` (and the shard's metadata) for expert ``lay``; its GGML types."""
    types: dict[str, GgmlType] = {}
    for spec in lay.tensors:
        name = _dst_name(keep, lay.key, spec.name, spec.source_name)
        m = _SLICE_RE.fullmatch(spec.source_name)
        base = m.group(1) if m else spec.source_name
        if index.format == "gguf":
            kind = _NUMERIC.get(f"{spec.dtype.kind}{spec.dtype.itemsize}")
            ggml, shape = ggml_of[base]
            shard.metadata[meta.GGML_PREFIX + name] = meta.ggml_entry(ggml, shape[1:])
            types[spec.name] = ggml
        else:
            kind = dtype_of.get(base)
            if spec.ggml_type is not None:
                stated = src_meta.get(meta.GGML_PREFIX + spec.source_name)
                shard.metadata[meta.GGML_PREFIX + name] = stated or meta.ggml_entry(
                    spec.ggml_type, _model_shape(spec.shape, spec.dtype.itemsize, spec.ggml_type))
                types[spec.name] = spec.ggml_type
        if kind is None:
            raise CheckpointError(f"{index.files[spec.file]}: tensor {quote(spec.source_name)} has numpy dtype "
                                  f"{spec.dtype}, which safetensors cannot hold")
        source = tuple(_slice_source(index, lay, spec.buf_offset, spec.nbytes))
        unit.tensors.append(_Tensor(name, kind, spec.shape, unit.begin + spec.buf_offset, spec.nbytes, source))
        derived = [d for d in lay.derived if d.parent == spec.name]
        if derived:
            shard.metadata[meta.DERIVED_PREFIX + name] = meta.derived_entry(derived)
    return types


def _model_shape(shape: tuple[int, ...], itemsize: int, ggml: GgmlType) -> tuple[int, ...]:
    """The shape in elements of a tensor of ``ggml`` type stored as ``shape``: itself when it
    is typed (F16 as float16), else bytes per row turned back into values per row."""
    if itemsize == ggml.type_size and ggml.block_size == 1 or not shape:
        return shape
    return (*shape[:-1], shape[-1] // ggml.type_size * ggml.block_size)


def _slice_source(index: CheckpointIndex, lay: ExpertLayout, at: int, nbytes: int) -> Iterator[tuple[str, int, int]]:
    """Where bytes ``at .. at + nbytes`` of the expert's buffer are in the source."""
    pos = 0
    for e in lay.extents:
        lo, hi = max(at, pos), min(at + nbytes, pos + e.length)
        if lo < hi:
            yield index.files[e.file], e.offset + lo - pos, hi - lo
        pos += e.length


# ----------------------------------------------------------------------------------- the copy


class _Files:
    """Read-only descriptors of the source files, opened once each."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}

    def read(self, path: str, offset: int, length: int) -> bytes:
        fd = self._fds.get(path)
        if fd is None:
            try:
                fd = self._fds[path] = os.open(path, os.O_RDONLY)
            except OSError as exc:
                raise CheckpointError(f"cannot open {path}: {exc.strerror or exc}") from None
        try:
            data = os.pread(fd, length, offset)
        except OSError as exc:
            raise CheckpointError(f"cannot read {path} at byte {offset}: {exc.strerror or exc}") from None
        if len(data) != length:
            raise CheckpointError(f"{path}: {len(data)} of {length} bytes at byte {offset}: the file shrank "
                                  "while it was packed")
        return data

    def chunks(self, source: Iterable[tuple[str, int, int]]) -> Iterator[bytes]:
        for path, offset, length in source:
            for at in range(0, length, _CHUNK):
                yield self.read(path, offset + at, min(_CHUNK, length - at))

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


@contextmanager
def _files() -> Iterator[_Files]:
    files = _Files()
    try:
        yield files
    finally:
        files.close()


def _header(shard: _Shard, align: int) -> bytes:
    """The shard's length prefix and JSON header, padded with spaces to end on ``align``."""
    doc: dict[str, Any] = {t.name: {"dtype": t.dtype, "shape": list(t.shape),
                                    "data_offsets": [t.begin, t.begin + t.nbytes]} for t in shard.tensors()}
    doc["__metadata__"] = dict(sorted(shard.metadata.items()))
    blob = json.dumps(doc, separators=(",", ":")).encode()
    n = _round_up(8 + len(blob), align) - 8
    return struct.pack("<Q", n) + blob + b" " * (n - len(blob))


def _write(plan: _Plan, folder: Path, align: int, progress: ProgressFn | None) -> int:
    """Write every shard into ``folder``; the bytes written."""
    total = sum(s.size for s in plan.shards)
    done = written = 0
    zeros = bytes(min(_CHUNK, align))
    with _files() as src:
        for shard in plan.shards:
            path = folder / shard.name
            with open(path, "xb") as out:
                head = _header(shard, align)
                shard.head = len(head)
                out.write(head)
                for unit in shard.units:
                    if out.tell() != len(head) + unit.begin:  # the plan is back to back: a bug if not
                        raise PackError(f"{path}: internal error: unit at {out.tell()}, planned at "
                                        f"{len(head) + unit.begin}")
                    if unit.source:
                        for chunk in src.chunks(unit.source):
                            out.write(chunk)
                    else:
                        for at in range(0, unit.nbytes, len(zeros)):
                            out.write(zeros[:min(len(zeros), unit.nbytes - at)])
                    done += unit.nbytes
                    if progress is not None:
                        progress("copy", done, total)
                out.flush()
                os.fsync(out.fileno())
                written += out.tell()
    if len(plan.shards) > 1:
        weight_map = {t.name: s.name for s in plan.shards for t in s.tensors()}
        doc = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        _write_small(folder / INDEX_JSON, (json.dumps(doc, indent=2) + "\n").encode())
    return written


def _write_small(path: Path, data: bytes) -> None:
    with open(path, "xb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())


# --------------------------------------------------------------------------------- the checks


def _verify(plan: _Plan, index: CheckpointIndex, folder: Path, align: int, progress: ProgressFn | None) -> None:
    """Raise :class:`PackError` unless ``folder`` holds what the plan says, byte for byte
    (module docstring, "Safety")."""
    from safetensors import safe_open

    got = load_index(folder)
    got = meta.apply_pack_metadata(got, meta.pack_metadata(got.files))
    if set(got.experts) != set(index.experts):
        missing = sorted(set(index.experts) - set(got.experts))[:3]
        raise PackError(f"{folder}: the packed copy indexes {len(got.experts)} experts, the source "
                        f"{len(index.experts)} (missing: {missing})")
    total = sum(s.size for s in plan.shards)
    done = 0
    with _files() as src, _files() as dst:
        for shard in plan.shards:
            path = folder / shard.name
            with safe_open(str(path), framework="numpy") as f:
                if set(f.keys()) != {t.name for t in shard.tensors()}:
                    raise PackError(f"{path}: safe_open lists other tensors than were written")
                for unit in shard.units:
                    if unit.key is None:
                        (t,) = unit.tensors
                        _compare_tensor(f, path, t, functools.partial(src.chunks, t.source) if t.source else None,
                                        _stored(dst, path, shard.head, t))
                    else:
                        data = _check_expert(index, got, plan, unit, path, align, src, dst)
                        for t in unit.tensors:
                            at = t.begin - unit.begin
                            _compare_tensor(f, path, t, functools.partial(iter, [data[at:at + t.nbytes]]),
                                            _stored(dst, path, shard.head, t))
                    done += unit.nbytes
                    if progress is not None:
                        progress("verify", done, total)


def _stored(dst: _Files, path: Path, head: int, t: _Tensor) -> Callable[[], Iterator[bytes]]:
    """The bytes of ``t`` where the header of ``path`` puts them, read when called."""
    return lambda: dst.chunks([(str(path), head + t.begin, t.nbytes)])


def _check_expert(index: CheckpointIndex, got: CheckpointIndex, plan: _Plan, unit: _Unit, path: Path, align: int,
                  src: _Files, dst: _Files) -> bytes:
    """Check the packed expert's layout and bytes against the source's; its bytes."""
    key = unit.key
    if key is None:
        raise PackError(f"{path}: internal error: a tensor checked as an expert")
    a, b = index.experts[key], got.experts[key]

    def bad(what: str) -> PackError:
        return PackError(f"{path}: expert {key} of the packed copy {what}")

    if len(b.extents) != 1:
        raise bad(f"is {len(b.extents)} extents, not one")
    (ext,) = b.extents
    start = ext.offset - unit.begin
    if ext.offset % align or os.path.basename(got.files[ext.file]) != path.name or start % align:
        raise bad(f"is at byte {ext.offset} of {got.files[ext.file]}, not at byte {unit.begin} of the data "
                  f"section of {path} aligned to {align}")

    def specs(lay: ExpertLayout) -> list[tuple[Any, ...]]:
        return [(t.name, t.dtype, t.shape, t.buf_offset, t.nbytes) for t in lay.tensors]

    if specs(a) != specs(b) or a.derived != b.derived:
        raise bad(f"holds tensors {specs(b)}, the source {specs(a)}")
    want = dict(plan.ggml[key])  # the stored tensors' types; a derived view has its parent's
    want.update({d.name: want[d.parent] for d in b.derived if d.parent in want})
    if dict(b.ggml_types) != want or (a.ggml_types and dict(a.ggml_types) != want):
        raise bad(f"has GGML types {dict(b.ggml_types)}, the source {want}")
    data = dst.read(got.files[ext.file], ext.offset, ext.length)
    if data != b"".join(src.chunks(unit.source)):
        raise bad("differs from the source's bytes")
    return data


def _compare_tensor(f: Any, path: Path, t: _Tensor, expected: Callable[[], Iterator[bytes]] | None,
                    raw: Callable[[], Iterator[bytes]]) -> None:
    """``safe_open``'s reading of ``t`` against ``expected`` (chunks of its bytes; ``None``:
    zeros), by rows so that a large tensor is never held whole. A dtype that safetensors'
    numpy reader cannot return (one numpy has no type for, say) is compared as the bytes
    ``raw()`` reads where the header puts the tensor, after safe_open has accepted the header."""
    try:
        _compare_read(f, path, t, expected() if expected else None, None)
    except (TypeError, ValueError, AttributeError):  # no numpy type for this dtype (F8_E8M0...)
        _compare_read(f, path, t, expected() if expected else None, raw())


def _compare_read(f: Any, path: Path, t: _Tensor, expected: Iterator[bytes] | None,
                  raw: Iterator[bytes] | None) -> None:
    sl = f.get_slice(t.name)
    if sl.get_dtype() != t.dtype or tuple(sl.get_shape()) != t.shape:
        raise PackError(f"{path}: safe_open reads tensor {quote(t.name)} as {sl.get_dtype()} {sl.get_shape()}, "
                        f"written as {t.dtype} {list(t.shape)}")
    if raw is not None:
        mine: Iterator[bytes] = raw
    elif not t.shape or t.shape[0] == 0 or t.nbytes <= _CHUNK:
        mine = iter([np.ascontiguousarray(f.get_tensor(t.name)).tobytes()])
    else:
        step = max(1, _CHUNK // max(1, t.nbytes // t.shape[0]))
        mine = (np.ascontiguousarray(sl[i:i + step]).tobytes() for i in range(0, t.shape[0], step))
    theirs = expected if expected is not None else (bytes(min(_CHUNK, t.nbytes - at))
                                                    for at in range(0, t.nbytes, _CHUNK))
    if not _same(mine, theirs):
        raise PackError(f"{path}: tensor {quote(t.name)} read back through safe_open differs from the source")


def _same(a: Iterator[bytes], b: Iterator[bytes]) -> bool:
    """Whether two streams of chunks (cut anywhere) spell the same bytes."""
    left = right = b""
    while True:
        if not left:
            left = next(a, b"")
        if not right:
            right = next(b, b"")
        if not left or not right:
            return not left and not right and next(a, b"") == b"" and next(b, b"") == b""
        n = min(len(left), len(right))
        if left[:n] != right[:n]:
            return False
        left, right = left[n:], right[n:]


# ------------------------------------------------------------------------------ the entry point


def _check_dest(index: CheckpointIndex, dest: Path) -> None:
    if not dest.parent.is_dir():
        raise PackError(f"cannot pack into {dest}: its parent folder {dest.parent} does not exist")
    if os.path.lexists(dest):
        if dest.is_symlink() or not dest.is_dir():
            raise PackError(f"{dest} exists and is not a folder; iosched pack never overwrites: choose another "
                            "destination")
        if os.listdir(dest):
            raise PackError(f"{dest} exists and is not empty; iosched pack never overwrites: remove it or choose "
                            "another destination")
    root = Path(index.root).resolve()
    real = dest.resolve()
    if real == root or (root.is_dir() and root in real.parents):
        raise PackError(f"{dest} is inside the source {index.root}; pack into a folder outside it")


def pack_checkpoint(source: str | os.PathLike[str], dest: str | os.PathLike[str], align: int = DEFAULT_ALIGN,
                    progress: ProgressFn | None = None, *, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                    verify: bool = True) -> PackReport:
    """Write a copy of the checkpoint ``source`` (anything :func:`~iosched.load_index` opens)
    into the new folder ``dest`` in which every expert is one extent starting at a multiple of
    ``align`` bytes (module docstring); return what was done.

    ``align``: a power of two from 8 to 2**30 (default 4096). ``progress(phase, done, total)``
    is called as bytes are copied (``"copy"``) and checked (``"verify"``). ``verify=False``
    skips the read-back (``verified`` is then false). Raises :class:`CheckpointError` for a
    source that cannot be read and :class:`PackError` for a destination that cannot be written
    or a copy that did not verify; either way ``dest`` is left as it was.
    """
    t0 = time.perf_counter()
    _check_args(align, max_shard_bytes)
    index = load_index(source)
    src_meta: dict[str, str] = {}
    if index.format == "safetensors":
        src_meta = meta.pack_metadata(index.files)
        index = meta.apply_pack_metadata(index, src_meta)
    dest_path = Path(os.path.abspath(os.fspath(dest)))
    _check_dest(index, dest_path)
    plan = _plan(index, align, max_shard_bytes, src_meta)
    with StagedFolder(dest_path, prefix=f".{dest_path.name}.pack-") as staged:  # removed on any failure
        tmp = Path(staged.path)
        written = _write(plan, tmp, align, progress)
        root = Path(index.root)
        config = root / CONFIG_JSON
        if root.is_dir() and config.is_file():
            shutil.copyfile(config, tmp / CONFIG_JSON)
        t1 = time.perf_counter()
        if verify:
            _verify(plan, index, tmp, align, progress)
        t2 = time.perf_counter()
        try:
            staged.publish()  # replaces an empty folder; refuses anything else
        except OSError as exc:
            raise PackError(f"cannot publish the packed copy as {dest_path}: {exc.strerror or exc} (was it "
                            "created meanwhile?)") from None
    src_root = root if root.is_dir() else root.parent
    moves = []
    for shard in plan.shards:
        for unit in shard.units:
            if unit.key is not None:
                lay = index.experts[unit.key]
                before = tuple(Placement(os.path.relpath(index.files[e.file], src_root), e.offset, e.length)
                               for e in lay.extents)
                moves.append(ExpertMove(unit.key, before, Placement(shard.name, shard.head + unit.begin, unit.nbytes)))
    moves.sort(key=lambda m: m.key)
    return PackReport(
        source=index.root, dest=str(dest_path), source_format=index.format, align=align,
        files=tuple(s.name for s in plan.shards), experts=len(moves),
        expert_bytes=sum(m.after.length for m in moves), other_tensors=plan.other_tensors,
        other_bytes=plan.other_bytes, padding_bytes=plan.padding_bytes, bytes_written=written, moves=tuple(moves),
        notes=tuple(plan.notes), write_seconds=t1 - t0, verify_seconds=t2 - t1,
        seconds=time.perf_counter() - t0, verified=verify,
    )
