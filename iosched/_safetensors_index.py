"""Finding expert tensors in safetensors shards, from their headers alone.

A safetensors file is ``u64 little-endian N`` + ``N`` bytes of JSON + the data section; each
tensor's ``data_offsets`` ``[begin, end)`` are relative to the data section, which starts at
byte ``8 + N``. We parse the header ourselves instead of calling ``safetensors.safe_open``:
we need byte offsets, which the library does not expose, and we must never map or load the
tensors, which can be hundreds of gigabytes.

Every header is validated in full (shape against byte size, bounds, overlaps), not just its
expert entries: a header that lies about one tensor cannot be trusted about the others.

Data types: ``BF16`` maps to ``ml_dtypes.bfloat16`` and ``F8_E4M3``/``F8_E5M2`` to the
``ml_dtypes`` float8 types (``ml_dtypes`` is a dependency); should it be missing they map to
``np.uint16`` / ``np.uint8`` of the same width, so the bytes (and the buffer layout) are
identical and the caller reinterprets them. Any other unknown dtype on an expert tensor is a
:class:`CheckpointError`; on a non-expert tensor it is tolerated (we never read it).
"""

from __future__ import annotations

import importlib
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from iosched._errors import CheckpointError
from iosched._index_build import RawExpertTensor, check_in_file, check_no_overlap, check_tensor_count, parse_id
from iosched._untrusted import (
    MAX_CONFIG_JSON_BYTES,
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
EXPERTS_PER_TOKEN_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_top_k", "top_k")
"""Keys of ``config.json`` that name k, the experts routed per token, most specific first:
``num_experts_per_tok`` (Qwen-MoE, Mixtral, DeepSeek, OLMoE ...), then the rarer spellings.
``top_k`` comes last because it is also a generation parameter; a value larger than the
checkpoint's experts per layer is rejected by ``build_index``."""
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
"""Keys of ``config.json`` that name E, the (routed) experts per MoE layer: ``num_experts``
(Qwen-MoE, OLMoE, Jamba), ``num_local_experts`` (Mixtral, Llama 4, PhiMoE), ``n_routed_experts``
(DeepSeek, GLM-4.5). When one is given every layer must hold exactly that many."""
MAX_HEADER_BYTES = 100 * 1000 * 1000
"""The same cap the safetensors library applies; a larger length is a corrupt file. Parsing a
header costs at most ~26 bytes of memory per header byte (:mod:`iosched._untrusted`), so at
most ~2.6 GB at this cap, and only for a file at least that large."""
MAX_DIMS = 32
"""Dimensions of one tensor, at most: numpy 1.x's limit (NPY_MAXDIMS), since a tensor becomes
a numpy view; real tensors have at most 5."""

_EXPERT_RE = re.compile(r"(?:.*\.)?layers\.([0-9]+)\.(?:mlp|block_sparse_moe)\.experts\.([0-9]+)\.(.+)")
_CANONICAL = {
    "gate_proj.weight": "gate_proj",
    "up_proj.weight": "up_proj",
    "down_proj.weight": "down_proj",
    # Mixtral: w1 is the gate, w3 the up projection, w2 the down projection.
    "w1.weight": "gate_proj",
    "w3.weight": "up_proj",
    "w2.weight": "down_proj",
}

_ITEMSIZE = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "C64": 8,
}  # fmt: skip


def _numpy_dtypes() -> dict[str, np.dtype[Any]]:
    out: dict[str, np.dtype[Any]] = {
        "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
        "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"),
        "I8": np.dtype("i1"), "U64": np.dtype("<u8"), "U32": np.dtype("<u4"),
        "U16": np.dtype("<u2"), "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
        "C64": np.dtype("<c8"),
        "BF16": np.dtype("<u2"), "F8_E4M3": np.dtype("u1"), "F8_E5M2": np.dtype("u1"),
    }  # fmt: skip
    try:  # a dependency (pyproject.toml); raw bits of the same width if it is missing
        ml_dtypes: Any = importlib.import_module("ml_dtypes")
    except ImportError:
        return out
    out["BF16"] = np.dtype(ml_dtypes.bfloat16)
    out["F8_E4M3"] = np.dtype(ml_dtypes.float8_e4m3fn)
    out["F8_E5M2"] = np.dtype(ml_dtypes.float8_e5m2)
    return out


NUMPY_DTYPES = _numpy_dtypes()
"""safetensors dtype string -> numpy dtype (see the module docstring for BF16/F8)."""


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
    ``names`` is the folder's listing (:func:`~iosched._untrusted.list_folder`) when the caller
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
    """Expert tensors of a folder of shards.

    With an index json its ``weight_map`` is authoritative: only the shards it names are
    read, each must be a plain relative name inside the folder
    (:func:`~iosched._untrusted.confined_name`) and exist, and each tensor it lists must be in
    that shard's header. Without one, every ``*.safetensors`` file of the folder is read
    (sorted; a directory listing only yields names inside it), and a tensor name may occur
    only once.
    """
    names = list_folder(folder)
    index_json = find_index_json(folder, names)
    if index_json is not None:
        return _index_with_weight_map(folder, index_json)
    raws: list[RawExpertTensor] = []
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
            raw = _expert_tensor(shard, entry, abspath)
            if raw is not None:
                raws.append(raw)
        check_tensor_count(len(raws), folder)
    return raws


def config_counts(folder: Path) -> tuple[tuple[int | None, str], tuple[int | None, str]]:
    """``((k, where), (E, where))`` from the folder's ``config.json``: k, the experts routed
    per token (:data:`EXPERTS_PER_TOKEN_KEYS`), and E, the experts per layer
    (:data:`EXPERT_COUNT_KEYS`), each with the file and key it came from (for messages).

    Looks at the top level, then at ``text_config`` (multimodal MoE configs nest the language
    model's there). ``(None, "")`` for a number the file does not state (no ``config.json``, or
    no such key); a file over :data:`~iosched._untrusted.MAX_CONFIG_JSON_BYTES`, one
    that is not a JSON object, or a key whose value is not a positive integer, is a
    :class:`CheckpointError` naming the file and the key.
    """
    path = folder / CONFIG_JSON
    if not os.path.isfile(path):  # as before: a folder, a FIFO or a broken link is no config
        return (None, ""), (None, "")
    doc = parse_json(read_capped(path, MAX_CONFIG_JSON_BYTES, "config.json"), path, "malformed config.json")
    if not isinstance(doc, dict):
        raise CheckpointError(
            f"{path}: malformed config.json: a JSON {type(doc).__name__}, not an object "
            f"(looking for key {EXPERTS_PER_TOKEN_KEYS[0]!r})"
        )
    scopes: list[tuple[str, dict[str, Any]]] = [("", doc)]
    nested = doc.get("text_config")
    if isinstance(nested, dict):
        scopes.append(("text_config.", nested))
    k = _config_number(path, scopes, EXPERTS_PER_TOKEN_KEYS, "experts routed per token")
    return k, _config_number(path, scopes, EXPERT_COUNT_KEYS, "experts per layer")


def experts_per_token_from_config(folder: Path) -> tuple[int | None, str]:
    """k from the folder's ``config.json``, and where it came from (:func:`config_counts`)."""
    return config_counts(folder)[0]


def _config_number(
    path: Path, scopes: list[tuple[str, dict[str, Any]]], keys: tuple[str, ...], meaning: str
) -> tuple[int | None, str]:
    """The first of ``keys`` found in ``scopes``, checked to be a positive integer."""
    for prefix, scope in scopes:
        for key in keys:
            if key not in scope:
                continue
            value = scope[key]
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise CheckpointError(
                    f"{path}: malformed config.json: key {prefix + key!r} is {quote(value)}, "
                    f"not a positive integer ({meaning})"
                )
            return value, f"{path} key {prefix + key!r}"
    return None, ""


def index_file(path: Path) -> list[RawExpertTensor]:
    """Expert tensors of a single ``.safetensors`` file."""
    abspath = os.path.abspath(path)
    raws = (_expert_tensor(path, entry, abspath) for entry in read_header(path))
    return [r for r in raws if r is not None]


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


def _expert_tensor(path: Path, entry: HeaderEntry, abspath: str = "") -> RawExpertTensor | None:
    """The entry as an expert tensor, or ``None`` for a non-expert tensor (``abspath``:
    ``os.path.abspath(path)``, when the caller has it)."""
    m = _EXPERT_RE.fullmatch(entry.name)
    if m is None:
        return None
    dtype = NUMPY_DTYPES.get(entry.dtype)
    if dtype is None:
        known = ", ".join(sorted(NUMPY_DTYPES))
        raise CheckpointError(
            f"{path}: tensor {quote(entry.name)} has unsupported dtype {quote(entry.dtype)} "
            f"(supported: {known})"
        )
    suffix = m.group(3)
    return RawExpertTensor(
        layer=parse_id(m.group(1), "layer", path, entry.name),
        expert=parse_id(m.group(2), "expert", path, entry.name),
        name=_CANONICAL.get(suffix, suffix),
        source_name=entry.name,
        dtype=dtype,
        shape=entry.shape,
        path=abspath or os.path.abspath(path),
        offset=entry.offset,
        nbytes=entry.nbytes,
    )


def _index_with_weight_map(folder: Path, index_json: Path) -> list[RawExpertTensor]:
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
    raws: list[RawExpertTensor] = []
    for tensor, shard_name in weight_map.items():
        entry = headers[shard_name].get(tensor)
        if entry is None:
            raise CheckpointError(
                f"tensor {quote(tensor)} is listed in {index_json} as being in {quote(shard_name)}, "
                f"but {folder / shard_name} has no such tensor"
            )
        shard, abspath = shards[shard_name]
        raw = _expert_tensor(shard, entry, abspath)
        if raw is not None:
            raws.append(raw)
    check_tensor_count(len(raws), index_json)
    return raws
