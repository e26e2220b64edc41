"""A GGUF file's header (metadata and tensor infos), read with bounded memory and time.

Layout (GGUF v2/v3, the versions ``gguf.GGUFReader`` reads): magic ``GGUF``, ``u32`` version,
``u64`` tensor count, ``u64`` key/value count; the key/values (a string key, a ``u32`` value
type, the value); the tensor infos (a string name, ``u32`` dimension count, that many ``u64``
dimensions innermost first, ``u32`` GGML type, ``u64`` offset); then, aligned to
``general.alignment`` (default 32), the data section the offsets count from. A string is a
``u64`` length and its bytes; an array a ``u32`` item type, a ``u64`` count and the items. All
little-endian, unless the version reads as ``0`` in its low half, which marks a big-endian file
(as the reader detects it).

Why not ``gguf.GGUFReader``: it trusts the counts a file claims. An array that claims 2**40
scalars loops 2**40 times past the end of the file (its slices of a memory map come back empty
rather than failing), appending a numpy view per element, so ``open`` never returns and memory
grows without bound; even on a real file it builds a numpy view per array element (a 262k-token
vocabulary is over a million objects). This walker keeps nothing it does not need: it skips
every value but the few keys asked for, each array of scalars in one step, checks every length
against the bytes left before taking it, and reads the file in 1 MiB chunks (no memory map
outlives it, or exists). It still uses the ``gguf`` package for what the format means: the
value types, the GGML tensor types and their block sizes (``GGML_QUANT_SIZES``), and it gives
each tensor the numpy dtype and shape the reader gives it.

Bounds, each a :class:`~iosched._errors.CheckpointError` naming the file: at most
:data:`MAX_TENSORS` tensors and :data:`MAX_KVS` keys (checked on the counts, before any is
read); a header of at most :data:`MAX_HEADER_BYTES`; arrays nested at most
:data:`MAX_ARRAY_NESTING` deep; at most :data:`GGML_MAX_DIMS` dimensions. Work is linear in the
header's bytes (every loop step consumes at least 8 of them), memory linear in the tensor count.
Until the magic has matched, no message quotes a value read from the file.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from iosched._errors import CheckpointError
from iosched._layout import GgmlType

from ._index_build import check_in_file, check_no_overlap
from ._untrusted import quote, regular_file_size

MAX_HEADER_BYTES = 256 * 1024 * 1024
"""Cap on the metadata and tensor infos: 256 MiB, over 10x the largest we know of (a
262,144-token vocabulary with scores and types, about 10 MB; tensor infos are ~60 bytes each)."""
MAX_TENSORS = 1 << 16
"""Tensors in one GGUF file, at most: 65,536, over 50x DeepSeek-V3's (about 1,100, experts merged)."""
MAX_KVS = 1 << 16
"""Metadata keys, at most: 65,536; real files have under a hundred."""
MAX_ARRAY_NESTING = 8
"""Arrays of arrays nest at most this deep (real files never nest)."""
GGML_MAX_DIMS = 4
"""Dimensions of one tensor, at most: ggml's GGML_MAX_DIMS (llama.cpp refuses more)."""
_CHUNK = 1 << 20
_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
"""What ``gguf.GGUFReader`` reads (``READER_SUPPORTED_VERSIONS``)."""
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
"""GGUF value type -> struct format (``gguf.GGUFValueType``: 8 is STRING, 9 is ARRAY)."""
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_NUMERIC = {"F16": "f2", "F32": "f4", "F64": "f8", "I8": "i1", "I16": "i2", "I32": "i4", "I64": "i8"}
"""GGML types the reader returns as numbers; every other type is bytes (``uint8``)."""
_WANTED_SUFFIXES = (".expert_used_count", ".expert_count", ".block_count", ".nextn_predict_layers",
                    ".leading_dense_block_count")
_WANTED = ("general.architecture", "general.alignment", "split.no", "split.count", "split.tensors.count")
"""The keys the index reads (``gguf.Keys``): the architecture and the data alignment; a split
set's ``split.*`` (``gguf.Keys.Split``); per architecture, the expert counts, the blocks, the
NextN/MTP blocks at the end and the dense blocks at the start."""


@dataclass(frozen=True)
class GgufTensor:
    """A tensor of the file as the reader would give it: numpy dtype and shape (outermost
    first; for types the reader returns as bytes, the last axis counts bytes), size in bytes,
    absolute offset, and its GGML type (``gguf.GGMLQuantizationType`` name, block size and
    block bytes from ``gguf.GGML_QUANT_SIZES``)."""

    name: str
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    n_bytes: int
    data_offset: int
    ggml_type: GgmlType


@dataclass(frozen=True)
class GgufHeader:
    tensors: list[GgufTensor]
    values: dict[str, object]
    """The scalar values of the keys in :data:`_WANTED` and of every key ending in one of
    :data:`_WANTED_SUFFIXES`; an array there is a description string (``"an array of N
    items"``), never its items."""


class _Cursor:
    """Forward reads of a file's header through a 1 MiB window, each length checked against
    the file's size and :data:`MAX_HEADER_BYTES` before anything is read."""

    def __init__(self, f: IO[bytes], path: Path, size: int, endian: str = "<") -> None:
        self._f, self._path, self._size = f, path, size
        self._buf, self._off, self._base = b"", 0, 0
        self.endian = endian

    @property
    def pos(self) -> int:
        return self._base + self._off

    def _check(self, n: int) -> None:
        end = self.pos + n
        if end > self._size:
            raise CheckpointError(f"{self._path}: GGUF header cut short: it runs past the end of "
                                  f"the file ({self._size} bytes)")
        if end > MAX_HEADER_BYTES:
            raise CheckpointError(f"{self._path}: GGUF header larger than {MAX_HEADER_BYTES} bytes")

    def take(self, n: int) -> bytes:
        self._check(n)
        if self._off + n > len(self._buf):
            rest = self._buf[self._off:]
            more = self._f.read(max(_CHUNK, n - len(rest)))
            self._base, self._buf, self._off = self.pos, rest + more, 0
            if len(self._buf) < n:
                raise CheckpointError(f"{self._path}: GGUF header cut short (the file shrank while it was read)")
        out = self._buf[self._off:self._off + n]
        self._off += n
        return out

    def skip(self, n: int) -> None:
        self._check(n)
        if self._off + n <= len(self._buf):
            self._off += n
            return
        target = self.pos + n
        self._f.seek(target)
        self._base, self._buf, self._off = target, b"", 0

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(self.endian + fmt, self.take(struct.calcsize(fmt)))[0]

    def text(self, what: str) -> str:
        raw = self.take(self.unpack("Q"))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise CheckpointError(f"{self._path}: malformed GGUF header: {what} at byte "
                                  f"{self.pos - len(raw)} is not valid UTF-8") from None


def read_header(path: Path) -> GgufHeader:
    """The tensors of ``path`` and the metadata values :class:`GgufHeader` keeps, every
    tensor checked to lie inside the file and to share no byte with another."""
    size = regular_file_size(path, "GGUF file")
    try:
        with open(path, "rb", buffering=0) as f:
            cur = _Cursor(f, path, size)
            if size < 24 or cur.take(4) != _MAGIC:
                raise CheckpointError(f"{path}: not a GGUF file (no GGUF magic and counts at its start)")
            tensor_count, kv_count = _preamble(cur, path)
            values = _read_kvs(cur, path, kv_count)
            infos = [_tensor_info(cur, path) for _ in range(tensor_count)]
    except OSError as exc:
        raise CheckpointError(f"cannot read GGUF file {path}: {exc.strerror or exc}") from None
    align = values.get("general.alignment", 32)
    if not isinstance(align, int) or isinstance(align, bool) or align < 1 or align & (align - 1):
        raise CheckpointError(f"{path}: malformed GGUF header: general.alignment {quote(align)} is "
                              "not a power of two")
    data_start = -(-cur.pos // align) * align
    tensors = [_tensor(path, *info, data_start, cur.endian) for info in infos]
    _check_names_and_bytes(path, size, tensors)
    return GgufHeader(tensors=tensors, values=values)


def _preamble(cur: _Cursor, path: Path) -> tuple[int, int]:
    """Version (and byte order) and the two counts, each within its cap."""
    raw = cur.take(4)
    version = struct.unpack("<I", raw)[0]
    if version & 0xFFFF == 0:  # as gguf.GGUFReader tells a big-endian file
        cur.endian = ">"
        version = struct.unpack(">I", raw)[0]
    if version not in _VERSIONS:
        raise CheckpointError(f"{path}: GGUF version {version} is not supported (only 2 and 3)")
    tensor_count, kv_count = cur.unpack("Q"), cur.unpack("Q")
    if tensor_count > MAX_TENSORS or kv_count > MAX_KVS:
        raise CheckpointError(
            f"{path}: malformed GGUF header: {tensor_count} tensors and {kv_count} keys claimed, "
            f"more than the {MAX_TENSORS} and {MAX_KVS} allowed")
    return tensor_count, kv_count


def _read_kvs(cur: _Cursor, path: Path, count: int) -> dict[str, object]:
    keys: set[str] = set()
    values: dict[str, object] = {}
    for _ in range(count):
        key = cur.text("a metadata key")
        if key in keys:
            raise CheckpointError(f"{path}: malformed GGUF header: key {quote(key)} appears twice")
        keys.add(key)
        vtype = cur.unpack("I")
        if key in _WANTED or key.endswith(_WANTED_SUFFIXES):
            values[key] = _value(cur, path, key, vtype)
        else:
            _skip_value(cur, path, key, vtype, 0)
    return values


def _value(cur: _Cursor, path: Path, key: str, vtype: int) -> object:
    """One wanted value: a scalar as Python, a string (1 KiB at most), an array described."""
    fmt = _SCALARS.get(vtype)
    if fmt is not None:
        value = cur.unpack(fmt)
        if key == "general.alignment" and vtype != _UINT32:  # the reader wants a u32 too
            return f"a value of type {vtype}"
        return value
    if vtype == _STRING:
        n = cur.unpack("Q")
        if n > 1024:
            cur.skip(n)
            return f"a string of {n} bytes"
        raw = cur.take(n)
        return raw.decode("utf-8", errors="replace")
    if vtype == _ARRAY:
        start = cur.pos
        _skip_value(cur, path, key, vtype, 0)
        return f"an array ({cur.pos - start} bytes)"
    raise CheckpointError(f"{path}: malformed GGUF header: key {quote(key)} has unknown value type {vtype}")


def _skip_value(cur: _Cursor, path: Path, key: str, vtype: int, depth: int) -> None:
    fmt = _SCALARS.get(vtype)
    if fmt is not None:
        cur.skip(struct.calcsize(fmt))
    elif vtype == _STRING:
        cur.skip(cur.unpack("Q"))
    elif vtype == _ARRAY:
        if depth >= MAX_ARRAY_NESTING:
            raise CheckpointError(f"{path}: malformed GGUF header: key {quote(key)} nests arrays "
                                  f"more than {MAX_ARRAY_NESTING} deep")
        itype, n = cur.unpack("I"), cur.unpack("Q")
        item = _SCALARS.get(itype)
        if item is not None:
            cur.skip(n * struct.calcsize(item))  # checked against the bytes left before it moves
            return
        if itype not in (_STRING, _ARRAY):
            raise CheckpointError(f"{path}: malformed GGUF header: key {quote(key)} is an array of "
                                  f"unknown type {itype}")
        for _ in range(n):  # each item consumes 8 bytes at least: bounded by the header's size
            _skip_value(cur, path, key, itype, depth + 1)
    else:
        raise CheckpointError(f"{path}: malformed GGUF header: key {quote(key)} has unknown value type {vtype}")


def _tensor_info(cur: _Cursor, path: Path) -> tuple[str, tuple[int, ...], int, int]:
    """(name, dimensions innermost first, GGML type, offset from the data section)."""
    name = cur.text("a tensor name")
    n_dims = cur.unpack("I")
    if n_dims > GGML_MAX_DIMS:
        raise CheckpointError(f"{path}: malformed GGUF header: tensor {quote(name)} has {n_dims} "
                              f"dimensions, more than ggml's {GGML_MAX_DIMS}")
    dims = tuple(cur.unpack("Q") for _ in range(n_dims))
    return name, dims, cur.unpack("I"), cur.unpack("Q")


def _tensor(path: Path, name: str, dims: tuple[int, ...], raw_type: int, offset: int,
            data_start: int, endian: str) -> GgufTensor:
    """The tensor's numpy dtype and shape, as ``gguf.GGUFReader`` derives them."""
    # deferred: importing gguf costs ~0.1 s and only GGUF checkpoints need it
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        ggml_type = GGMLQuantizationType(raw_type)
        block, type_size = GGML_QUANT_SIZES[ggml_type]
    except (ValueError, KeyError):
        raise CheckpointError(f"{path}: malformed GGUF header: tensor {quote(name)} has unknown "
                              f"type {raw_type}") from None
    n_elems = math.prod(dims)  # at most 4 factors below 2**64: no runaway product
    shape = tuple(reversed(dims))
    numeric = _NUMERIC.get(ggml_type.name)
    if numeric is not None:
        dtype = np.dtype(endian + numeric)
    else:
        dtype = np.dtype(np.uint8)
        if shape and shape[-1] % block:
            raise CheckpointError(f"{path}: malformed GGUF header: tensor {quote(name)} of type "
                                  f"{ggml_type.name} has rows of {shape[-1]}, not a multiple of its "
                                  f"block of {block}")
        if shape:
            shape = (*shape[:-1], shape[-1] // block * type_size)
    return GgufTensor(name=name, dtype=dtype, shape=shape, n_bytes=n_elems * type_size // block,
                      data_offset=data_start + offset,
                      ggml_type=GgmlType(ggml_type.name, block, type_size))


def _check_names_and_bytes(path: Path, size: int, tensors: list[GgufTensor]) -> None:
    """Unique names; every tensor inside the file; no two sharing a byte (as for safetensors:
    a header that lies about one tensor cannot be trusted about the others)."""
    seen: set[str] = set()
    for t in tensors:
        if t.name in seen:
            raise CheckpointError(f"{path}: malformed GGUF header: tensor {quote(t.name)} appears twice")
        seen.add(t.name)
        check_in_file(os.fspath(path), size, t.name, t.data_offset, t.n_bytes)
    check_no_overlap(os.fspath(path), [(t.data_offset, t.n_bytes, t.name) for t in tensors])
