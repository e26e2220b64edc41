"""Finding expert tensors in safetensors shards, from their headers alone.

A safetensors file is ``u64 little-endian N`` + ``N`` bytes of JSON + the data section; each
tensor's ``data_offsets`` ``[begin, end)`` are relative to the data section, which starts at
byte ``8 + N``. We parse the header ourselves instead of calling ``safetensors.safe_open``:
we need byte offsets, which the library does not expose, and we must never map or load the
tensors, which can be hundreds of gigabytes.

Every header is validated in full (shape against byte size, bounds, overlaps), not just its
expert entries: a header that lies about one tensor cannot be trusted about the others.

Which tensors are experts is read from their names by the tables of :mod:`iosched.formats._hf_names`
(per-expert ``...experts.<E>.<suffix>`` under any of the MoE blocks transformers writes, and
fused tensors holding every expert on their first axis, sliced here into one contiguous
extent per expert, with zero-copy ``gate_proj``/``up_proj`` views where the split is known);
what ``config.json`` says (k, E, the architecture, the layer count) by
:mod:`iosched.formats._hf_config`.  What is left out on purpose (dense MLPs, shared experts, routers,
MTP layers, towers, attention experts, experts under an unknown block) is counted in
``IndexNotes.skipped``, so a checkpoint with no expert tensors is refused saying what it holds.

Data types: ``BF16`` maps to ``ml_dtypes.bfloat16`` and ``F8_E4M3``/``F8_E5M2``/``F8_E8M0``
to the ``ml_dtypes`` float8 types (``float8_e8m0fnu``: the MXFP4 scales of gpt-oss;
``ml_dtypes`` is a dependency); should it be missing they map to
``np.uint16`` / ``np.uint8`` of the same width, so the bytes (and the buffer layout) are
identical and the caller reinterprets them. Any other unknown dtype on an expert tensor is a
:class:`CheckpointError`; on a non-expert tensor it is tolerated (we never read it).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from iosched._errors import CheckpointError
from iosched._layout import CheckpointIndex, DerivedTensor, SkippedTensors

from . import _hf_names
from ._hf_config import ConfigFacts, read_config
from ._hf_names import (
    CANONICAL,
    DOWN_OF,
    EXPERT_BLOCKS,
    GATE_UP_NAMES,
    Parsed,
    parse,
    split_convention,
    stack_kind,
)
from ._index_build import (
    MAX_EXPERTS_PER_LAYER,
    MAX_LAYERS,
    IndexNotes,
    RawExpertTensor,
    build_index,
    check_in_file,
    check_no_overlap,
    check_tensor_count,
    parse_id,
)
from ._untrusted import (
    MAX_INDEX_JSON_BYTES,
    confined_name,
    list_folder,
    parse_json,
    quote,
    read_capped,
    regular_file_size,
)

INDEX_JSON = "model.safetensors.index.json"
CONFIG_JSON = "config.json"
EXPERTS_PER_TOKEN_KEYS = _hf_names.EXPERTS_PER_TOKEN_KEYS
EXPERT_COUNT_KEYS = _hf_names.EXPERT_COUNT_KEYS
MAX_HEADER_BYTES = 100 * 1000 * 1000
"""The same cap the safetensors library applies; a larger length is a corrupt file. Parsing a
header costs at most ~26 bytes of memory per header byte (:mod:`iosched.formats._untrusted`), so at
most ~2.6 GB at this cap, and only for a file at least that large."""
MAX_DIMS = 32
"""Dimensions of one tensor, at most: numpy 1.x's limit (NPY_MAXDIMS), since a tensor becomes
a numpy view; real tensors have at most 5."""

_ITEMSIZE = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "C64": 8,
}  # fmt: skip


@functools.cache
def numpy_dtypes() -> dict[str, np.dtype[Any]]:
    """safetensors dtype string -> numpy dtype (see the module docstring for BF16/F8). Made at
    the first index built, not at import: ``ml_dtypes``' extension takes 0.6 s to load, which
    every ``import iosched`` paid."""
    out: dict[str, np.dtype[Any]] = {
        "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
        "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"),
        "I8": np.dtype("i1"), "U64": np.dtype("<u8"), "U32": np.dtype("<u4"),
        "U16": np.dtype("<u2"), "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
        "C64": np.dtype("<c8"),
        "BF16": np.dtype("<u2"), "F8_E4M3": np.dtype("u1"), "F8_E5M2": np.dtype("u1"),
        "F8_E8M0": np.dtype("u1"),
    }  # fmt: skip
    try:  # a dependency (pyproject.toml); raw bits of the same width if it is missing
        ml_dtypes: Any = importlib.import_module("ml_dtypes")
    except ImportError:
        return out
    out["BF16"] = np.dtype(ml_dtypes.bfloat16)
    out["F8_E4M3"] = np.dtype(ml_dtypes.float8_e4m3fn)
    out["F8_E5M2"] = np.dtype(ml_dtypes.float8_e5m2)
    out["F8_E8M0"] = np.dtype(ml_dtypes.float8_e8m0fnu)  # MXFP4 scales (gpt-oss)
    return out


@dataclass(frozen=True)
class HeaderEntry:
    """One tensor of a safetensors header, with absolute byte offsets."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def find_index_json(folder: Path, names: list[str] | None = None) -> Path | None:
    """The folder's ``*.safetensors.index.json``: ``model.safetensors.index.json`` if present,
    else the only one; ``None`` when there is none. Several candidates are ambiguous.
    ``names`` is the folder's listing (:func:`~iosched.formats._untrusted.list_folder`) when the caller
    has it."""
    names = list_folder(folder) if names is None else names
    if INDEX_JSON in names:
        return folder / INDEX_JSON
    candidates = [name for name in names if name.endswith(".safetensors.index.json")]
    if len(candidates) > 1:
        shown = ", ".join(candidates)
        raise CheckpointError(f"{folder}: several safetensors index files ({shown}); expected one")
    return folder / candidates[0] if candidates else None


def index_folder(folder: Path) -> list[RawExpertTensor]:
    """Expert tensors of a folder of shards (:func:`read_folder`); when there is none, the
    :class:`CheckpointError` of ``build_index`` that says what the folder holds instead."""
    raws, notes = read_folder(folder)
    if not raws:
        build_index("safetensors", os.path.abspath(folder), raws, notes=notes)
    return raws


def load_folder(folder: Path, root: str | None = None) -> CheckpointIndex:
    """The validated index of a folder of shards, with everything :func:`read_folder` notes
    (k per layer, skipped tensors, architecture) carried into it."""
    raws, notes = read_folder(folder)
    return build_index("safetensors", root or os.path.abspath(folder), raws, notes=notes)


def load_file(path: Path, root: str | None = None) -> CheckpointIndex:
    """The validated index of a single ``.safetensors`` file (no ``config.json``: a lone file
    may be one shard of anything, so neither k nor E is known)."""
    raws, notes = _assemble(_file_entries(path), ConfigFacts(), path)
    return build_index("safetensors", root or os.path.abspath(path), raws, notes=notes)


def read_folder(folder: Path) -> tuple[list[RawExpertTensor], IndexNotes]:
    """Expert tensors of a folder of shards, and what the folder says besides (``config.json``).

    With an index json its ``weight_map`` is authoritative: only the shards it names are
    read, each must be a plain relative name inside the folder
    (:func:`~iosched.formats._untrusted.confined_name`) and exist, and each tensor it lists must be in
    that shard's header. Without one, every ``*.safetensors`` file of the folder is read
    (sorted; a directory listing only yields names inside it), and a tensor name may occur
    only once.
    """
    facts = read_config(folder)
    names = list_folder(folder)
    index_json = find_index_json(folder, names)
    return _assemble(_folder_entries(folder, names, index_json), facts, index_json or folder)


def tensor_entries(source: Path) -> list[tuple[Path, HeaderEntry]]:
    """Every tensor of a safetensors file or folder of shards, with the shard holding it,
    chosen as :func:`read_folder` chooses (the ``weight_map`` when there is one): what
    ``iosched pack`` copies besides the experts."""
    if source.is_file():
        return [(shard, entry) for shard, _, entry in _file_entries(source)]
    names = list_folder(source)
    entries = _folder_entries(source, names, find_index_json(source, names))
    return [(shard, entry) for shard, _, entry in entries]


def _folder_entries(folder: Path, names: list[str], index_json: Path | None) -> list[Located]:
    return _weight_map_entries(folder, index_json) if index_json is not None else _listing_entries(folder, names)


def config_counts(folder: Path) -> tuple[tuple[int | None, str], tuple[int | None, str]]:
    """``((k, where), (E, where))`` from the folder's ``config.json`` (:mod:`iosched.formats._hf_config`):
    k, the experts routed per token (the largest, when it is given per layer), and E, the
    experts per layer, each with the file and key it came from (for messages); ``(None, "")``
    for a number the file does not state."""
    facts = read_config(folder)
    return (facts.k, facts.k_source), (facts.n_experts, facts.e_source)


def experts_per_token_from_config(folder: Path) -> tuple[int | None, str]:
    """k from the folder's ``config.json``, and where it came from (:func:`config_counts`)."""
    return config_counts(folder)[0]


def index_file(path: Path) -> list[RawExpertTensor]:
    """Expert tensors of a single ``.safetensors`` file."""
    return _assemble(_file_entries(path), ConfigFacts(), path)[0]


def read_header(path: Path) -> list[HeaderEntry]:
    """Parse and validate the header of ``path``; raises :class:`CheckpointError` naming it.

    Checks: ``path`` is a regular file; the length prefix fits in the file and under
    :data:`MAX_HEADER_BYTES`; the JSON is an object of well-formed entries; a known dtype's
    byte size equals ``prod(shape) * itemsize``; every tensor lies inside the file; no two
    tensors overlap. Until the header has parsed as a JSON object the file is not accepted as
    a safetensors file, and no message quotes a value read from it (sizes of the file only).
    """
    size = regular_file_size(path, "safetensors file")
    if size < 8:
        raise CheckpointError(
            f"{path}: {size} bytes is too short to be a safetensors file (no 8-byte header length)"
        )
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise CheckpointError(
                    f"{path}: not a safetensors file (header length prefix out of range: the file "
                    f"is {size} bytes, a header at most {MAX_HEADER_BYTES})"
                )
            blob = f.read(n)
    except (OSError, struct.error) as exc:
        raise CheckpointError(f"cannot read safetensors file {path}: {exc}") from exc
    if len(blob) != n:
        raise CheckpointError(f"{path}: header cut short (the file shrank while it was read)")
    header = parse_json(blob, path, "corrupt safetensors header")
    if not isinstance(header, dict):
        raise CheckpointError(
            f"{path}: corrupt safetensors header: a JSON {type(header).__name__}, not an object"
        )

    data_start = 8 + n
    entries = [
        _parse_entry(path, name, value, data_start)
        for name, value in header.items()
        if name != "__metadata__"
    ]
    for e in entries:
        check_in_file(str(path), size, e.name, e.offset, e.nbytes)
    check_no_overlap(str(path), [(e.offset, e.nbytes, e.name) for e in entries])
    return entries


def _parse_entry(path: Path, name: str, value: object, data_start: int) -> HeaderEntry:
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: corrupt safetensors header: tensor {quote(name)}: {what}")

    if not isinstance(value, dict):
        raise bad(f"entry is a JSON {type(value).__name__}, not an object")
    dtype, shape, offsets = value.get("dtype"), value.get("shape"), value.get("data_offsets")
    if not isinstance(dtype, str):
        raise bad(f"dtype {quote(dtype)} is not a string")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_is_count(d) for d in shape):
        raise bad(f"shape {quote(shape)} is not a list of at most {MAX_DIMS} non-negative integers")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_count(o) for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise bad(f"data_offsets {quote(offsets)} is not [begin, end] with 0 <= begin <= end")
    begin, end = int(offsets[0]), int(offsets[1])
    itemsize = _ITEMSIZE.get(dtype)
    if itemsize is not None:
        expected = _shape_bytes(shape, itemsize)
        if end - begin != expected:
            needs = "more than 2**64" if expected is None else str(expected)
            raise bad(
                f"data_offsets [{begin}, {end}) hold {end - begin} bytes but shape {quote(shape)} "
                f"of {dtype} needs {needs}"
            )
    return HeaderEntry(
        name=name, dtype=dtype, shape=tuple(shape), offset=data_start + begin, nbytes=end - begin
    )


def _shape_bytes(shape: list[int], itemsize: int) -> int | None:
    """``prod(shape) * itemsize``, or ``None`` once it passes 2**64 bytes (no file holds that
    many; a hostile shape of huge dimensions would otherwise cost a product of millions of
    digits)."""
    if 0 in shape:
        return 0
    n = itemsize
    for d in shape:
        n *= d
        if n > 1 << 64:
            return None
    return n


def _is_count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


Located = tuple[Path, str, HeaderEntry]
"""A tensor as a shard's header states it: the shard, its absolute path, the entry."""

SKIP_REASONS = {
    "dense": "dense MLP tensors (of a layer without experts): not routed, so not streamed",
    "shared_expert": "shared experts run for every token: not routed, so not streamed",
    "router": "routers, gates and their biases run for every token, before any expert",
    "mtp": "multi-token-prediction layers (an mtp.* stack, or a layer numbered at or past config.json's "
           "layer count) serve speculative decoding, not the model's forward pass",
    "tower": "a vision/audio tower's experts: the language model's experts are the ones indexed",
    "attention_experts": "mixture-of-attention experts (JetMoe): attention heads, not MLP experts",
    "other": "tensors under an experts module that belong to no single expert (a shared norm or bias)",
}
"""Why each kind of tensor the index leaves out is left out (``IndexNotes.skipped``)."""


def _file_entries(path: Path) -> list[Located]:
    abspath = os.path.abspath(path)
    return [(path, abspath, entry) for entry in read_header(path)]


def _listing_entries(folder: Path, names: list[str]) -> list[Located]:
    out: list[Located] = []
    where: dict[str, Path] = {}
    for shard in (folder / name for name in names if name.endswith(".safetensors")):
        abspath = os.path.abspath(shard)
        for entry in read_header(shard):
            first = where.setdefault(entry.name, shard)
            if first != shard:
                raise CheckpointError(
                    f"tensor {quote(entry.name)} is in both {first} and {shard}; add a "
                    f"{INDEX_JSON} to say which one counts"
                )
            out.append((shard, abspath, entry))
    return out


def _weight_map_entries(folder: Path, index_json: Path) -> list[Located]:
    doc = parse_json(read_capped(index_json, MAX_INDEX_JSON_BYTES, "safetensors index"), index_json,
                     "safetensors index")
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(f"{index_json}: no 'weight_map' object of tensor name -> shard file")
    first_entry: dict[str, str] = {}  # shard name -> the first tensor naming it (for the message)
    for tensor, shard_name in weight_map.items():
        first_entry.setdefault(shard_name, tensor)
    for shard_name, tensor in first_entry.items():  # every name first: nothing outside is opened
        confined_name(shard_name, index_json, tensor)

    headers: dict[str, dict[str, HeaderEntry]] = {}
    for shard_name in sorted(first_entry):
        shard = folder / shard_name
        try:
            os.stat(shard)  # follows links: a broken one is missing too
        except FileNotFoundError:
            raise CheckpointError(
                f"shard {quote(shard_name)} named in {index_json} is missing (looked for {shard})"
            ) from None
        except OSError as exc:
            raise CheckpointError(
                f"cannot look at shard {quote(shard_name)} named in {index_json}: {exc.strerror or exc}"
            ) from None
        headers[shard_name] = {e.name: e for e in read_header(shard)}

    shards = {name: (folder / name, os.path.abspath(folder / name)) for name in headers}
    out: list[Located] = []
    for tensor, shard_name in weight_map.items():
        entry = headers[shard_name].get(tensor)
        if entry is None:
            raise CheckpointError(
                f"tensor {quote(tensor)} is listed in {index_json} as being in {quote(shard_name)}, "
                f"but {folder / shard_name} has no such tensor"
            )
        shard, abspath = shards[shard_name]
        out.append((shard, abspath, entry))
    return out


@dataclass(slots=True)
class _Candidate:
    parsed: Parsed
    layer: int
    shard: Path
    abspath: str
    entry: HeaderEntry


class _Skips:
    """Skipped tensors counted by (kind, reason), each with its first name."""

    def __init__(self) -> None:
        self.seen: dict[tuple[str, str], list[Any]] = {}

    def add(self, kind: str, name: str, reason: str = "") -> None:
        slot = self.seen.setdefault((kind, reason or SKIP_REASONS[kind]), [0, name])
        slot[0] += 1

    def records(self) -> tuple[SkippedTensors, ...]:
        return tuple(SkippedTensors(kind=k, reason=r, count=c, example=ex) for (k, r), (c, ex) in self.seen.items())


def _unsupported_reason(p: Parsed, entry: HeaderEntry) -> str:
    known = ", ".join(repr(b) for b in EXPERT_BLOCKS if b)
    what = ("per-expert tensors" if p.expert
            else f"fused {len(entry.shape)}-D expert tensors (e.g. shape {list(entry.shape)})")
    return f"{what} under unsupported block name {quote(p.block)} (known: {known}, or none)"


def _assemble(entries: list[Located], facts: ConfigFacts, where: object) -> tuple[list[RawExpertTensor], IndexNotes]:
    """The expert tensors among ``entries`` (:mod:`iosched.formats._hf_names` reads the names), and
    the :class:`IndexNotes` that say what else was found.

    Stacks: experts of an ``mtp`` stack, or of a layer numbered at or past ``config.json``'s
    layer count, are multi-token-prediction layers, left out; a vision/audio tower's experts are
    left out when a language model's exist (and indexed when they are the only experts).  An
    encoder-decoder (NLLB-MoE, SwitchTransformers) has experts in two stacks: the encoder's
    layers keep their numbers and the decoder's follow them (decoder layer ``l`` is layer
    ``n_enc + l``, ``n_enc`` the encoder's layer count as its tensor names show it), so the
    two never collide; the mapping is in ``IndexNotes.notes``.  Experts under any other two
    stacks are refused by name (which one would an engine mean?).
    """
    skips = _Skips()
    notes: list[str] = []
    most_layer: dict[str, int] = {}
    found: list[_Candidate] = []
    for shard, abspath, entry in entries:
        p = parse(entry.name)
        if p is None:
            continue
        layer = parse_id(p.layer, "layer", shard, entry.name)
        if layer > most_layer.get(p.stack, -1):
            most_layer[p.stack] = layer
        if p.what == "none":
            continue
        if p.what == "dense" and len(entry.shape) == 3:  # Step 3.7's fused experts (_hf_names)
            p = dataclasses.replace(p, what="fused")
        kind = stack_kind(p.stack)
        if kind == "language" and facts.n_layers is not None and layer >= facts.n_layers and not _enc_dec(p.stack):
            kind = "mtp"
        if kind == "mtp":
            skips.add("mtp", entry.name)
        elif p.what in ("expert", "fused"):
            found.append(_Candidate(p, layer, shard, abspath, entry))
        elif p.what == "unsupported_block":
            skips.add(p.what, entry.name, _unsupported_reason(p, entry))
        elif kind == "language":
            skips.add(p.what, entry.name)
        check_tensor_count(len(found), where)

    offsets = _stack_offsets(found, most_layer, skips, notes, where)
    raws: list[RawExpertTensor] = []
    fused: dict[tuple[str, int, str], list[_Candidate]] = {}
    for c in found:
        offset = offsets.get(c.parsed.stack)
        if offset is None:
            continue
        if c.parsed.what == "fused":
            fused.setdefault((c.parsed.stack, c.layer, c.parsed.block), []).append(c)
            continue
        suffix = c.parsed.suffix
        raws.append(RawExpertTensor(
            layer=_layer_id(offset, c), expert=parse_id(c.parsed.expert, "expert", c.shard, c.entry.name),
            name=CANONICAL.get(suffix, suffix), source_name=c.entry.name, dtype=_dtype(c.shard, c.entry),
            shape=c.entry.shape, path=c.abspath, offset=c.entry.offset, nbytes=c.entry.nbytes))
    for (stack, _, _), group in sorted(fused.items(), key=lambda kv: kv[0]):
        raws.extend(_slice_fused(group, offsets[stack], facts, notes, where, len(raws)))
    if fused:
        example = next(iter(fused.values()))[0].entry
        notes.append(f"{sum(len(g) for g in fused.values())} fused expert tensors sliced per expert along "
                     f"their first axis (e.g. {quote(example.name)} {list(example.shape)})")
    return raws, IndexNotes(
        experts_per_token=facts.k, k_source=facts.k_source, k_by_layer=facts.k_by_layer,
        n_experts=facts.n_experts, e_source=facts.e_source, skipped=skips.records(), notes=tuple(notes),
        architecture=facts.architectures[0] if facts.architectures else "")


def _enc_dec(stack: str) -> bool:
    return stack.endswith(("encoder.", "decoder.")) or stack in ("encoder.", "decoder.")


def _layer_id(offset: int, c: _Candidate) -> int:
    layer = offset + c.layer
    if layer >= MAX_LAYERS:
        raise CheckpointError(f"{c.shard}: tensor {quote(c.entry.name)}: layer {layer} (decoder layers "
                              f"follow the encoder's) is out of range (at most {MAX_LAYERS - 1})")
    return layer


def _stack_offsets(found: list[_Candidate], most_layer: dict[str, int], skips: _Skips, notes: list[str],
                   where: object) -> dict[str, int]:
    """Stack prefix -> the number its layer ids are offset by, for the stacks indexed (see
    :func:`_assemble`); tower candidates of a model with language experts are recorded skipped."""
    language = sorted({c.parsed.stack for c in found if stack_kind(c.parsed.stack) == "language"})
    towers = sorted({c.parsed.stack for c in found if stack_kind(c.parsed.stack) == "tower"})
    if language:
        for c in found:
            if stack_kind(c.parsed.stack) == "tower":
                skips.add("tower", c.entry.name)
    else:
        language = towers
        if towers:
            notes.append(f"only a tower's experts were found ({', '.join(quote(t) for t in towers[:4])}): indexed")
    if len(language) <= 1:
        return {s: 0 for s in language}
    if len(language) == 2:
        decoder, encoder = language  # sorted: "...decoder." < "...encoder."
        if encoder.endswith("encoder.") and decoder.endswith("decoder.") and (
                encoder[: -len("encoder.")] == decoder[: -len("decoder.")]):
            shift = most_layer[encoder] + 1
            notes.append(f"encoder-decoder: {quote(encoder + '*')} layers keep their numbers, "
                         f"{quote(decoder + '*')} layer l is layer {shift} + l")
            return {encoder: 0, decoder: shift}
    examples = ", ".join(quote(next(c.entry.name for c in found if c.parsed.stack == s)) for s in language)
    raise CheckpointError(
        f"{where}: expert tensors under {len(language)} model stacks ({examples}); an index serves one "
        "model's experts (an encoder-decoder's encoder and decoder are the one pair it numbers apart)")


def _dtype(shard: Path, entry: HeaderEntry) -> np.dtype[Any]:
    dtypes = numpy_dtypes()
    dtype = dtypes.get(entry.dtype)
    if dtype is None:
        known = ", ".join(sorted(dtypes))
        raise CheckpointError(
            f"{shard}: tensor {quote(entry.name)} has unsupported dtype {quote(entry.dtype)} "
            f"(supported: {known})"
        )
    return dtype


def _slice_fused(group: list[_Candidate], offset: int, facts: ConfigFacts, notes: list[str], where: object,
                 count: int) -> list[RawExpertTensor]:
    """The per-expert slices of one layer's fused tensors (every expert on axis 0, so expert
    ``e`` of a tensor of ``nbytes`` is the contiguous ``nbytes / E`` bytes at ``e * nbytes / E``).

    The tensors of one layer must agree on E, and E must be what ``config.json`` states;
    otherwise a :class:`CheckpointError` names the shard and the tensor."""
    first = group[0]
    experts = first.entry.shape[0] if first.entry.shape else 0
    for c in group:
        _dtype(c.shard, c.entry)
        shape = c.entry.shape
        if not shape or shape[0] < 1 or shape[0] >= MAX_EXPERTS_PER_LAYER:
            raise CheckpointError(
                f"{c.shard}: fused expert tensor {quote(c.entry.name)} has shape {list(shape)}: its first axis "
                f"must count the experts (1 to {MAX_EXPERTS_PER_LAYER - 1})")
        if shape[0] != experts:
            raise CheckpointError(
                f"{c.shard}: fused expert tensor {quote(c.entry.name)} {list(shape)} holds {shape[0]} experts but "
                f"{quote(first.entry.name)} {list(first.entry.shape)} of the same layer holds {experts}")
    if facts.n_experts is not None and experts != facts.n_experts:
        raise CheckpointError(
            f"{first.shard}: fused expert tensor {quote(first.entry.name)} {list(first.entry.shape)} holds {experts} "
            f"experts but {facts.e_source} says {facts.n_experts}")
    check_tensor_count(count + experts * len(group), where)
    derived = _derived(group, facts, notes)
    out: list[RawExpertTensor] = []
    for c in group:
        per = c.entry.nbytes // experts
        name = CANONICAL.get(c.parsed.suffix, c.parsed.suffix)
        layer = _layer_id(offset, c)
        dtype = _dtype(c.shard, c.entry)
        for e in range(experts):
            out.append(RawExpertTensor(
                layer=layer, expert=e, name=name, source_name=f"{c.entry.name}[{e}]", dtype=dtype,
                shape=c.entry.shape[1:], path=c.abspath, offset=c.entry.offset + e * per, nbytes=per,
                derived=derived.get(c.parsed.suffix, ())))
    return out


def _derived(group: list[_Candidate], facts: ConfigFacts, notes: list[str]) -> dict[str, tuple[DerivedTensor, ...]]:
    """Zero-copy ``gate_proj``/``up_proj`` views of a fused gate+up tensor, where its split is
    known (:func:`~iosched.formats._hf_names.split_convention`): the 2I axis is the one its partner
    down projection does not share (``[H, 2I]`` with down ``[I, H]``: ``x @ W`` as gpt-oss and
    Llama 4 store it; ``[2I, H]`` with down ``[H, I]``: ``F.linear``'s), never guessed from
    sizes alone (``H == 2I`` is common in small models).  A fused bias ``<name>_bias`` gets
    ``gate_proj_bias``/``up_proj_bias`` the same way."""
    shapes = {c.parsed.suffix: c.entry.shape[1:] for c in group}
    out: dict[str, tuple[DerivedTensor, ...]] = {}
    for c in group:
        name = c.parsed.suffix
        down = shapes.get(DOWN_OF.get(name, ""))
        if name not in GATE_UP_NAMES or down is None:
            continue
        convention = split_convention(facts.architectures, name)
        gu = shapes[name]
        if not convention:
            arch = facts.architectures[0] if facts.architectures else "unknown"
            note = f"fused {quote(name)} kept whole: the gate/up split of architecture {quote(arch)} is not known"
            if note not in notes:
                notes.append(note)
            continue
        if len(gu) != 2 or len(down) != 2:
            continue
        if gu[1] == 2 * down[0] and gu[0] == down[1]:
            axis, two_i = 1, gu[1]
        elif gu[0] == 2 * down[1] and gu[1] == down[0]:
            axis, two_i = 0, gu[0]
        else:
            note = (f"fused {quote(name)} kept whole: its shape {list(gu)} does not match its down "
                    f"projection's {list(down)}")
            if note not in notes:
                notes.append(note)
            continue
        parts = _split(convention, two_i)
        out[name] = tuple(DerivedTensor(role, name, axis, *span) for role, span in parts)
        bias = name + "_bias"
        if bias in shapes and shapes[bias] == (two_i,):
            out[bias] = tuple(DerivedTensor(role + "_bias", bias, 0, *span) for role, span in parts)
    return out


def _split(convention: str, two_i: int) -> list[tuple[str, tuple[int, int, int]]]:
    half = two_i // 2
    if convention == "interleaved":
        return [("gate_proj", (0, two_i, 2)), ("up_proj", (1, two_i, 2))]
    return [("gate_proj", (0, half, 1)), ("up_proj", (half, two_i, 1))]
