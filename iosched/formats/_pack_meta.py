"""What a packed checkpoint (``iosched pack``) says in its safetensors ``__metadata__``.

A packed copy of a GGUF file is a safetensors checkpoint: its quantized tensors are stored as
``U8`` of the shape the GGUF index gives them (rows, bytes per row), so their views are the
same bytes with the same dtype and shape. What a safetensors header cannot say, the GGML type
and the model's shape of each such tensor, goes into ``__metadata__`` (string to string, the
only place the format leaves for it), one key per tensor:

* ``iosched.ggml.<tensor name>`` -> ``{"type": "Q8_0", "shape": [768, 2048]}``: the
  ``gguf.GGMLQuantizationType`` member name and the shape in elements, outermost first;
* ``iosched.derived.<tensor name>`` -> ``[{"name", "axis", "start", "stop", "step"}, ...]``:
  the zero-copy views (:class:`~iosched._layout.DerivedTensor`) the source's reader added;
* ``iosched.pack.version`` (``"1"``), ``iosched.pack.align``, ``iosched.pack.source_format``,
  and, when the source stated them, ``iosched.architecture``, ``iosched.experts_per_token``
  (k), ``iosched.k_by_layer`` (JSON ``{"layer": k}``) and ``iosched.expert_count`` (E), in
  every shard.

:func:`apply_pack_metadata` puts this back on a :class:`~iosched._layout.CheckpointIndex` that
the safetensors reader built from the same files, so the packed copy's views carry the same
``ggml_types`` and derived tensors as the source's, and the index the same k. Without the
version key it returns the index unchanged: an ordinary checkpoint costs one dictionary lookup.

It lives apart from ``_pack`` (the writer) so that the index loader can import it without
importing the writer, which imports the loader. The metadata is untrusted input like the rest
of the header: every value is parsed with a small cap and checked against the tensor it
describes (its bytes and shape must be what the GGML type makes of the stated shape), and a
value that fails is a :class:`CheckpointError` naming the file and the tensor.
"""

from __future__ import annotations

import dataclasses
import math
import os
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from iosched._errors import CheckpointError
from iosched._layout import CheckpointIndex, DerivedTensor, ExpertLayout, GgmlType, TensorSpec

from ._index_build import MAX_EXPERTS_PER_LAYER
from ._untrusted import parse_json, quote, regular_file_size

VERSION_KEY = "iosched.pack.version"
VERSION = "1"
ALIGN_KEY = "iosched.pack.align"
SOURCE_FORMAT_KEY = "iosched.pack.source_format"
GGML_PREFIX = "iosched.ggml."
DERIVED_PREFIX = "iosched.derived."
ARCH_KEY = "iosched.architecture"
K_KEY = "iosched.experts_per_token"
K_BY_LAYER_KEY = "iosched.k_by_layer"
E_KEY = "iosched.expert_count"
PAD_PREFIX = "iosched.pad."
"""Names of the padding tensors that fill the gaps between aligned experts (all zero bytes)."""

MAX_VALUE_CHARS = 64 * 1024
"""Cap on one metadata value parsed as JSON: a GGML entry is under 100 characters, a derived
list under 300, a per-layer k table of 16,384 layers under 200 KB... so 64 KiB for the
per-tensor values; ``iosched.k_by_layer`` gets :data:`MAX_TABLE_CHARS`."""
MAX_TABLE_CHARS = 1 << 20
MAX_SAFETENSORS_HEADER = 100 * 1000 * 1000
"""The safetensors library's own cap on a header (as ``_safetensors_index.MAX_HEADER_BYTES``)."""


def read_metadata(path: str | os.PathLike[str]) -> dict[str, str]:
    """The ``iosched.*`` entries of the ``__metadata__`` of the safetensors file ``path`` (an
    empty dict when it has none). The header is read with the safetensors library's cap; a
    header that does not mention :data:`VERSION_KEY` is not parsed at all."""
    p = Path(os.fspath(path))
    size = regular_file_size(p, "safetensors file")
    try:
        with open(p, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return {}
            (n,) = struct.unpack("<Q", head)
            if n > MAX_SAFETENSORS_HEADER or 8 + n > size:
                raise CheckpointError(f"{p}: not a safetensors file (header length prefix out of range)")
            blob = f.read(n)
    except OSError as exc:
        raise CheckpointError(f"cannot read safetensors file {p}: {exc.strerror or exc}") from None
    if VERSION_KEY.encode() not in blob:
        return {}
    header = parse_json(blob, p, "corrupt safetensors header")
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict):
        return {}
    out: dict[str, str] = {}
    for key, value in meta.items():
        if not key.startswith("iosched."):
            continue
        if not isinstance(value, str):
            raise CheckpointError(f"{p}: __metadata__ key {quote(key)} is {quote(value)}, not a string")
        out[key] = value
    return out


def pack_metadata(files: Iterable[str]) -> dict[str, str]:
    """The ``iosched.*`` metadata of every file, merged; a key two files give different
    values is a :class:`CheckpointError` naming both."""
    merged: dict[str, str] = {}
    where: dict[str, str] = {}
    for path in files:
        for key, value in read_metadata(path).items():
            if key in merged and merged[key] != value:
                raise CheckpointError(
                    f"{path}: __metadata__ key {quote(key)} is {quote(value)}, but {where[key]} says "
                    f"{quote(merged[key])}")
            merged.setdefault(key, value)
            where.setdefault(key, path)
    return merged


def ggml_entry(ggml_type: GgmlType, shape: tuple[int, ...]) -> str:
    """The ``iosched.ggml.*`` value for a tensor of ``ggml_type`` and model shape ``shape``."""
    return f'{{"type": "{ggml_type.name}", "shape": [{", ".join(str(d) for d in shape)}]}}'


def derived_entry(derived: Iterable[DerivedTensor]) -> str:
    """The ``iosched.derived.*`` value for ``derived``."""
    import json

    return json.dumps([dataclasses.asdict(d) for d in derived])


def ggml_type_named(name: str) -> GgmlType | None:
    """The :class:`GgmlType` of a ``gguf.GGMLQuantizationType`` member name, ``None`` if unknown."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    member = GGMLQuantizationType.__members__.get(name)
    if member is None or member not in GGML_QUANT_SIZES:
        return None
    block, type_size = GGML_QUANT_SIZES[member]
    return GgmlType(name=name, block_size=int(block), type_size=int(type_size))


def apply_pack_metadata(index: CheckpointIndex, metadata: Mapping[str, str]) -> CheckpointIndex:
    """``index`` with what ``metadata`` (:func:`pack_metadata` of its files) says: GGML types
    on the tensors, derived tensors on the experts, and k, E and the architecture where the
    index has none of its own (a ``config.json`` beside the shards wins). ``index`` itself when
    the metadata is not a packed checkpoint's. Applying it twice gives what applying it once
    does."""
    version = metadata.get(VERSION_KEY)
    if version is None:
        return index
    first = index.files[0] if index.files else index.root
    if version != VERSION:
        raise CheckpointError(f"{first}: packed checkpoint of version {quote(version)}; this iosched "
                              f"reads version {VERSION}")
    experts: dict[tuple[int, int], ExpertLayout] = {}
    for key, lay in index.experts.items():
        experts[key] = _enrich_layout(index, lay, metadata)
    changes: dict[str, Any] = {"experts": MappingProxyType(experts)}
    arch = metadata.get(ARCH_KEY)
    if arch is not None and not index.architecture:
        changes["architecture"] = arch[:200]
    if index.experts_per_token is None:
        k = _positive(metadata, K_KEY, first)
        if k is not None:
            if k > index.fewest_experts_per_layer():
                raise CheckpointError(f"{first}: __metadata__ key {K_KEY!r} says {k} experts per token, more "
                                      f"than the {index.fewest_experts_per_layer()} of a layer")
            changes["experts_per_token"] = k
            changes["k_source"] = f"{first} __metadata__ key {K_KEY!r}"
            table = _k_by_layer(metadata, first, set(index.layers()))
            if table is not None:
                changes["k_by_layer"] = MappingProxyType(table)
    e = _positive(metadata, E_KEY, first)
    if e is not None and e != index.experts_per_layer():
        raise CheckpointError(f"{first}: __metadata__ key {E_KEY!r} says {e} experts per layer, but the "
                              f"tensors hold {index.experts_per_layer()}")
    return dataclasses.replace(index, **changes)


def _enrich_layout(index: CheckpointIndex, lay: ExpertLayout, metadata: Mapping[str, str]) -> ExpertLayout:
    tensors: list[TensorSpec] = []
    derived = list(lay.derived)
    for spec in lay.tensors:
        path = index.files[spec.file]
        raw = metadata.get(GGML_PREFIX + spec.source_name)
        if raw is not None:
            spec = dataclasses.replace(spec, ggml_type=_ggml(path, spec, raw))
        tensors.append(spec)
        raw = metadata.get(DERIVED_PREFIX + spec.source_name)
        if raw is not None:  # those already there (applied before, or the reader's own) once only
            derived.extend(d for d in _derived(path, spec, raw, {t.name for t in lay.tensors}) if d not in derived)
    names = [t.name for t in lay.tensors] + [d.name for d in derived]
    if len(set(names)) != len(names):
        raise CheckpointError(f"{index.files[lay.tensors[0].file]}: expert {lay.key}: a derived tensor in "
                              "__metadata__ repeats the name of another tensor")
    return ExpertLayout(key=lay.key, tensors=tuple(tensors), extents=lay.extents, nbytes=lay.nbytes,
                        derived=tuple(derived))


def _value(path: str, spec: TensorSpec, prefix: str, raw: str) -> object:
    if len(raw) > MAX_VALUE_CHARS:
        raise CheckpointError(f"{path}: __metadata__ key {quote(prefix + spec.source_name)} holds "
                              f"{len(raw)} characters, more than {MAX_VALUE_CHARS}")
    return parse_json(raw.encode(), Path(path), f"__metadata__ key {quote(prefix + spec.source_name)}")


def _ggml(path: str, spec: TensorSpec, raw: str) -> GgmlType:
    """The GGML type ``raw`` states for ``spec``, checked against its bytes and shape."""
    doc = _value(path, spec, GGML_PREFIX, raw)

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: tensor {quote(spec.source_name)}: __metadata__ GGML entry {what}")

    if not isinstance(doc, dict) or not isinstance(doc.get("type"), str) or not isinstance(doc.get("shape"), list):
        raise bad('is not {"type": str, "shape": [int, ...]}')
    ggml_type = ggml_type_named(doc["type"])
    if ggml_type is None:
        raise bad(f"names unknown GGML type {quote(doc['type'])}")
    shape = doc["shape"]
    if len(shape) > 4 or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape):
        raise bad(f"shape {quote(shape)} is not 0 to 4 positive integers")
    block, size = ggml_type.block_size, ggml_type.type_size
    if not shape:  # one value per expert (Gemma 4's ffn_down_exps.scale): a scalar of a plain type
        if block != 1 or spec.nbytes != size or spec.shape != ():
            raise bad(f"says a {ggml_type.name} scalar, but the tensor is {spec.dtype} of shape "
                      f"{list(spec.shape)} ({spec.nbytes} bytes)")
        return ggml_type
    if shape[-1] % block:
        raise bad(f"shape {quote(shape)}: rows of {shape[-1]} are not whole {ggml_type.name} blocks of {block}")
    as_bytes = (*shape[:-1], shape[-1] // block * size)
    nbytes = math.prod(shape) // block * size
    typed = block == 1 and spec.dtype.itemsize == size and tuple(shape) == spec.shape
    raw_bytes = spec.dtype.itemsize == 1 and as_bytes == spec.shape
    if nbytes != spec.nbytes or not (typed or raw_bytes):
        raise bad(f"says {ggml_type.name} of shape {quote(shape)} ({nbytes} bytes), but the tensor is "
                  f"{spec.dtype} of shape {list(spec.shape)} ({spec.nbytes} bytes)")
    return ggml_type


def _derived(path: str, spec: TensorSpec, raw: str, names: set[str]) -> list[DerivedTensor]:
    doc = _value(path, spec, DERIVED_PREFIX, raw)

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: tensor {quote(spec.source_name)}: __metadata__ derived entry {what}")

    if not isinstance(doc, list):
        raise bad("is not a list")
    out = []
    for item in doc:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or item.get("parent") != spec.name:
            raise bad(f"item {quote(item)} is not an object with a name and parent {quote(spec.name)}")
        nums = [item.get(k) for k in ("axis", "start", "stop", "step")]
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in nums):
            raise bad(f"item {quote(item['name'])}: axis, start, stop and step are not integers")
        axis, start, stop, step = (int(n) for n in nums)  # type: ignore[arg-type]
        if not (0 <= axis < len(spec.shape) and 0 <= start <= stop <= spec.shape[axis] and step >= 1):
            raise bad(f"item {quote(item['name'])}: [{start}:{stop}:{step}] on axis {axis} is outside the "
                      f"tensor's shape {list(spec.shape)}")
        if item["name"] in names:
            raise bad(f"item {quote(item['name'])} has the name of a stored tensor")
        out.append(DerivedTensor(name=item["name"], parent=spec.name, axis=axis, start=start, stop=stop, step=step))
    return out


def _positive(metadata: Mapping[str, str], key: str, where: str) -> int | None:
    raw = metadata.get(key)
    if raw is None:
        return None
    if not (raw.isascii() and raw.isdigit() and len(raw) < 7 and int(raw) > 0):
        raise CheckpointError(f"{where}: __metadata__ key {key!r} is {quote(raw)}, not a positive integer")
    return int(raw)


def _k_by_layer(metadata: Mapping[str, str], where: str, layers: set[int]) -> dict[int, int] | None:
    raw = metadata.get(K_BY_LAYER_KEY)
    if raw is None:
        return None
    if len(raw) > MAX_TABLE_CHARS:
        raise CheckpointError(f"{where}: __metadata__ key {K_BY_LAYER_KEY!r} is over {MAX_TABLE_CHARS} characters")
    doc = parse_json(raw.encode(), Path(where), f"__metadata__ key {K_BY_LAYER_KEY!r}")
    if not isinstance(doc, dict):
        raise CheckpointError(f"{where}: __metadata__ key {K_BY_LAYER_KEY!r} is not a JSON object")
    table: dict[int, int] = {}
    for layer, k in doc.items():
        if not (layer.isascii() and layer.isdigit() and len(layer) < 6 and int(layer) in layers
                and isinstance(k, int) and not isinstance(k, bool) and 0 < k <= MAX_EXPERTS_PER_LAYER):
            raise CheckpointError(f"{where}: __metadata__ key {K_BY_LAYER_KEY!r}: entry {quote(layer)}: "
                                  f"{quote(k)} is not a positive k of a MoE layer")
        table[int(layer)] = k
    return table
