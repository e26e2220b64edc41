"""Finding expert slices in a GGUF file.

GGUF stores each layer's experts merged: ``blk.{L}.ffn_{gate,up,down}_exps.weight`` is one
tensor whose outermost axis (the first numpy axis, the last GGML dimension) is the expert.
Expert ``E`` of such a tensor is therefore one contiguous slice of ``n_bytes // n_expert``
bytes at ``data_offset + E * n_bytes // n_expert``; this holds for quantized types too,
whose blocks never straddle rows.

The header is read by :mod:`iosched._gguf_header` (bounded work, no memory map; it says why
not ``gguf.GGUFReader``). A merged tensor's expert axis is a count the header claims, so
before it is expanded into one entry per expert it must fit: between 1 and
:data:`~iosched._index_build.MAX_EXPERTS_PER_LAYER` experts, each of at least one byte, the
whole inside the file (checked by the header reader) and within
:data:`~iosched._index_build.MAX_EXPERT_TENSORS` in all.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from iosched._errors import CheckpointError
from iosched._gguf_header import GgufTensor, read_header
from iosched._index_build import (
    MAX_EXPERTS_PER_LAYER,
    RawExpertTensor,
    check_tensor_count,
    parse_id,
)
from iosched._untrusted import quote

_EXPERT_RE = re.compile(r"blk\.([0-9]+)\.ffn_(gate|up|down)_exps\.(.+)")


@dataclass(frozen=True)
class GgufFound:
    """What a GGUF file says about its experts."""

    raws: list[RawExpertTensor]
    experts_per_token: int | None
    """k, ``{arch}.expert_used_count`` (``None`` when the file does not say)."""
    k_source: str
    expert_count: int | None
    """E, ``{arch}.expert_count`` (``None`` when the file does not say)."""
    e_source: str


def read_gguf(path: Path) -> GgufFound:
    """Expert slices of the merged ``*_exps`` tensors of the GGUF file ``path``, and the
    experts per token and per layer its metadata states.

    Canonical names: ``.weight`` of ``ffn_gate_exps`` -> ``gate_proj`` (likewise up, down);
    another suffix ``S`` -> ``gate_proj.S``. Raises :class:`CheckpointError` naming the file
    when its header is malformed, a metadata count is not a positive integer, or a merged
    tensor does not split into its experts (module docstring).
    """
    header = read_header(path)
    abspath = os.path.abspath(path)
    raws: list[RawExpertTensor] = []
    for t in header.tensors:
        m = _EXPERT_RE.fullmatch(t.name)
        if m is None:
            continue
        layer, role, suffix = parse_id(m.group(1), "layer", path, t.name), m.group(2), m.group(3)
        name = f"{role}_proj" if suffix == "weight" else f"{role}_proj.{suffix}"
        per = _expert_bytes(path, t)
        check_tensor_count(len(raws) + t.shape[0], path)
        raws.extend(
            RawExpertTensor(
                layer=layer, expert=expert, name=name, source_name=f"{t.name}[{expert}]", dtype=t.dtype,
                shape=t.shape[1:], path=abspath, offset=t.data_offset + expert * per, nbytes=per,
            )
            for expert in range(t.shape[0])
        )
    arch = header.values.get("general.architecture")
    if not isinstance(arch, str):  # no architecture: the file states neither count
        return GgufFound(raws, None, "", None, "")
    k_key, e_key = f"{arch}.expert_used_count", f"{arch}.expert_count"
    k = _count(path, k_key, header.values.get(k_key), "experts routed per token")
    e = _count(path, e_key, header.values.get(e_key), "experts per layer")
    return GgufFound(raws, k, f"{path} key {quote(k_key)}", e, f"{path} key {quote(e_key)}")


def _expert_bytes(path: Path, t: GgufTensor) -> int:
    """The bytes of one expert of the merged tensor ``t``, after checking that its expert
    axis is a count it can hold (at least one byte per expert) and under the cap."""
    if not t.shape or t.shape[0] == 0:
        raise CheckpointError(f"{path}: merged expert tensor {quote(t.name)} has no expert axis")
    n_expert = t.shape[0]
    if n_expert > MAX_EXPERTS_PER_LAYER:
        raise CheckpointError(
            f"{path}: merged expert tensor {quote(t.name)} claims {n_expert} experts, more than "
            f"the {MAX_EXPERTS_PER_LAYER} a layer may have")
    per, rest = divmod(t.n_bytes, n_expert)
    if per == 0:
        raise CheckpointError(
            f"{path}: merged expert tensor {quote(t.name)} of {t.n_bytes} bytes claims {n_expert} "
            "experts of no bytes; a zero-size expert tensor is malformed")
    if rest or math.prod(t.shape[1:]) * t.dtype.itemsize != per:
        raise CheckpointError(
            f"{path}: merged expert tensor {quote(t.name)} of {t.n_bytes} bytes and shape "
            f"{t.shape} does not split into {n_expert} equal experts"
        )
    return per


def _count(path: Path, key: str, value: object, meaning: str) -> int | None:
    """A metadata count: ``None`` when absent, else a positive integer or an error naming it."""
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise CheckpointError(
            f"{path}: malformed GGUF metadata: key {quote(key)} is {quote(value)}, not a positive "
            f"integer ({meaning})"
        )
    return value
