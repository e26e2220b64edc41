"""Finding expert slices in a GGUF file.

GGUF stores each layer's experts merged: ``blk.{L}.ffn_{gate,up,down}_exps.weight`` is one
tensor whose outermost axis (the first numpy axis, the last GGML dimension) is the expert.
Expert ``E`` of such a tensor is therefore one contiguous slice of ``n_bytes // n_expert``
bytes at ``data_offset + E * n_bytes // n_expert``; this holds for quantized types too,
whose blocks never straddle rows.

The ``gguf`` package parses the header; we keep only plain numbers from it. Its reader
memory-maps the whole file, and the map must not outlive indexing (a store that indexes a
300 GB file and then reads it with ``O_DIRECT`` has no use for it), so nothing that refers to
the reader survives :func:`_tensor_table`, not even an exception traceback.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from iosched._errors import CheckpointError
from iosched._index_build import RawExpertTensor

_EXPERT_RE = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.(.+)")


@dataclass(frozen=True)
class _GgufTensor:
    """A GGUF tensor reduced to numbers: nothing here refers to the reader's memory map."""

    name: str
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    """Numpy order (outermost first); for quantized types the last axis counts bytes."""
    n_bytes: int
    data_offset: int


def read_gguf(path: Path) -> tuple[list[RawExpertTensor], int | None]:
    """Expert slices, and k (experts routed per token: ``{arch}.expert_used_count``, or
    ``None`` when the file does not say), of of the merged ``*_exps`` tensors of the GGUF file ``path``.

    Canonical names: ``.weight`` of ``ffn_gate_exps`` -> ``gate_proj`` (likewise up, down);
    another suffix ``S`` -> ``gate_proj.S``. Raises :class:`CheckpointError` naming the file
    when the reader rejects it or a merged tensor does not split evenly into its experts.
    """
    abspath = os.path.abspath(path)
    raws: list[RawExpertTensor] = []
    table, k = _tensor_table(path)
    for t in table:
        m = _EXPERT_RE.fullmatch(t.name)
        if m is None:
            continue
        layer, role, suffix = int(m.group(1)), m.group(2), m.group(3)
        name = f"{role}_proj" if suffix == "weight" else f"{role}_proj.{suffix}"
        if not t.shape or t.shape[0] == 0:
            raise CheckpointError(f"{path}: merged expert tensor {t.name!r} has no expert axis")
        n_expert = t.shape[0]
        per, rest = divmod(t.n_bytes, n_expert)
        shape = t.shape[1:]
        if rest or math.prod(shape) * t.dtype.itemsize != per:
            raise CheckpointError(
                f"{path}: merged expert tensor {t.name!r} of {t.n_bytes} bytes and shape "
                f"{t.shape} does not split into {n_expert} equal experts"
            )
        for expert in range(n_expert):
            raws.append(
                RawExpertTensor(
                    layer=layer,
                    expert=expert,
                    name=name,
                    source_name=f"{t.name}[{expert}]",
                    dtype=t.dtype,
                    shape=shape,
                    path=abspath,
                    offset=t.data_offset + expert * per,
                    nbytes=per,
                )
            )
    return raws, k


def _tensor_table(path: Path) -> tuple[list[_GgufTensor], int | None]:
    """Every tensor of the file as plain numbers, and ``{arch}.expert_used_count``; the
    reader is gone when this returns.

    Errors are re-raised outside the ``except`` block on purpose: a chained exception keeps
    the failing frames alive, and with them the reader's memory map.
    """
    import gguf  # deferred: importing gguf costs ~0.1 s and only GGUF checkpoints need it

    failure = ""
    table: list[_GgufTensor] = []
    k_key, k_value = "", None
    reader = None
    try:
        reader = gguf.GGUFReader(path, "r")
        table = [_plain(t) for t in reader.tensors]
        k_key, k_value = _expert_used_count(reader)
    except Exception as exc:
        failure = f"{type(exc).__name__}: {exc}"
    reader = None  # drop the memory map now, and keep it out of the traceback below
    if failure:
        raise CheckpointError(f"{path}: not a readable GGUF file: {failure}")
    if k_value is None:
        return table, None
    if not isinstance(k_value, int) or isinstance(k_value, bool) or k_value < 1:
        raise CheckpointError(
            f"{path}: malformed GGUF metadata: key {k_key!r} is {k_value!r}, not a positive "
            "integer (experts routed per token)"
        )
    return table, k_value


def _expert_used_count(reader: Any) -> tuple[str, object]:
    """``("{arch}.expert_used_count", value)`` as a plain Python value (``None`` if absent)."""
    arch_field = reader.fields.get("general.architecture")
    if arch_field is None:
        return "", None
    key = f"{arch_field.contents()}.expert_used_count"
    field = reader.fields.get(key)
    if field is None:
        return key, None
    value = field.contents()
    return key, value if isinstance(value, (int, float, str, list)) else repr(value)


def _plain(t: Any) -> _GgufTensor:
    return _GgufTensor(
        name=str(t.name),
        dtype=np.dtype(t.data.dtype),
        shape=tuple(int(d) for d in t.data.shape),
        n_bytes=int(t.n_bytes),
        data_offset=int(t.data_offset),
    )
