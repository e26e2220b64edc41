"""Turning a flat list of expert tensors into a validated :class:`CheckpointIndex`.

The format readers (``_safetensors_index``, ``_gguf_index``) only know where each expert
tensor sits in its file; everything that is the same for every format lives here:

* bounds: every tensor must lie inside its file, because the store reads the byte range
  blindly and a short read would only surface much later, as a ``ReadError``;
* overlaps: two expert tensors sharing bytes mean a corrupt header, never a valid layout;
* one tensor per (expert, canonical name), so an engine can look tensors up by role;
* coalescing: byte-adjacent tensors of one file become one :class:`Extent`, that is one
  read request, which is what makes a whole expert a single large read on disk.

Coalescing is strict (``prev.offset + prev.length == next.offset``): bridging a gap would
read padding bytes the buffer layout has no place for.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from iosched._errors import CheckpointError
from iosched._layout import CheckpointIndex, ExpertKey, ExpertLayout, Extent, TensorSpec

EXPECTED_NAMES = (
    "model.layers.{L}.mlp.experts.{E}.{gate_proj,up_proj,down_proj}.weight, "
    "model.layers.{L}.block_sparse_moe.experts.{E}.{w1,w2,w3}.weight (safetensors) or "
    "blk.{L}.ffn_{gate,up,down}_exps.weight (GGUF)"
)
"""Shown when a checkpoint holds no expert tensor at all."""


@dataclass(frozen=True)
class RawExpertTensor:
    """One expert tensor as a format reader found it, before layout.

    ``path`` is absolute; ``offset`` is absolute in that file; ``nbytes`` equals
    ``prod(shape) * dtype.itemsize`` (the readers check this against the header).
    """

    layer: int
    expert: int
    name: str
    """Canonical name (``gate_proj``, ``up_proj``, ``down_proj`` or the kept suffix)."""
    source_name: str
    """The tensor's name in the checkpoint."""
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    path: str
    offset: int
    nbytes: int


def build_index(
    fmt: str,
    root: str,
    raws: Iterable[RawExpertTensor],
    experts_per_token: int | None = None,
    k_source: str = "",
) -> CheckpointIndex:
    """Validate ``raws`` and lay them out per expert.

    ``experts_per_token`` is k as the checkpoint's metadata states it (``k_source`` names the
    file and key, for the error): more than the experts of the largest layer is a
    :class:`CheckpointError`, since a token cannot be routed to more experts than there are.

    ``files`` holds only the files with at least one expert tensor, in sorted order, so
    file indices are stable for a given checkpoint. Raises :class:`CheckpointError` on an
    empty list, a tensor past the end of its file, overlapping tensors, or two tensors of one
    expert with the same canonical name.
    """
    raws = list(raws)
    if not raws:
        raise CheckpointError(f"no expert tensors found in {root}; expected names like {EXPECTED_NAMES}")

    files = tuple(sorted({r.path for r in raws}))
    file_index = {path: i for i, path in enumerate(files)}
    file_sizes = tuple(_file_size(path) for path in files)

    ranges_by_file: dict[str, list[tuple[int, int, str]]] = {path: [] for path in files}
    for r in raws:
        check_in_file(r.path, file_sizes[file_index[r.path]], r.source_name, r.offset, r.nbytes)
        ranges_by_file[r.path].append((r.offset, r.nbytes, r.source_name))
    for path, ranges in ranges_by_file.items():
        check_no_overlap(path, ranges)

    by_key: dict[ExpertKey, list[RawExpertTensor]] = {}
    for r in raws:
        by_key.setdefault((r.layer, r.expert), []).append(r)

    experts: dict[ExpertKey, ExpertLayout] = {}
    for key in sorted(by_key):
        experts[key] = _layout_expert(key, by_key[key], file_index)
    if experts_per_token is not None:
        per_layer: dict[int, int] = {}
        for layer, _ in experts:
            per_layer[layer] = per_layer.get(layer, 0) + 1
        most = max(per_layer.values())
        if experts_per_token > most:
            raise CheckpointError(
                f"{k_source or root}: experts per token is {experts_per_token}, but no layer "
                f"of the checkpoint has more than {most} experts"
            )
    return CheckpointIndex(
        format=fmt, root=root, files=files, file_sizes=file_sizes, experts=experts,
        experts_per_token=experts_per_token,
    )


def check_in_file(path: str, file_size: int, tensor: str, offset: int, nbytes: int) -> None:
    """Raise unless ``[offset, offset + nbytes)`` lies inside a file of ``file_size`` bytes."""
    if offset < 0 or nbytes < 0:
        raise CheckpointError(
            f"{path}: tensor {tensor!r} has a negative offset or size ({offset}, {nbytes})"
        )
    if offset + nbytes > file_size:
        raise CheckpointError(
            f"{path}: tensor {tensor!r} extends past end of file: bytes [{offset}, "
            f"{offset + nbytes}) but the file is {file_size} bytes (truncated?)"
        )


def check_no_overlap(path: str, ranges: list[tuple[int, int, str]]) -> None:
    """Raise if two of ``(offset, nbytes, tensor name)`` in one file share a byte.

    Empty tensors occupy no bytes and never overlap anything.
    """
    ordered = sorted((r for r in ranges if r[1] > 0), key=lambda r: (r[0], r[0] + r[1], r[2]))
    furthest_end = -1
    furthest_name = ""
    for offset, nbytes, name in ordered:
        if offset < furthest_end:
            raise CheckpointError(
                f"{path}: tensors {furthest_name!r} and {name!r} overlap (the first ends at "
                f"byte {furthest_end}, the second starts at byte {offset})"
            )
        if offset + nbytes > furthest_end:
            furthest_end, furthest_name = offset + nbytes, name


def _layout_expert(
    key: ExpertKey, raws: list[RawExpertTensor], file_index: dict[str, int]
) -> ExpertLayout:
    """Order one expert's tensors on disk, coalesce adjacent ones, assign buffer offsets."""
    seen: dict[str, RawExpertTensor] = {}
    for r in raws:
        other = seen.get(r.name)
        if other is not None:
            raise CheckpointError(
                f"expert (layer {key[0]}, expert {key[1]}) has two {r.name!r} tensors: "
                f"{other.source_name!r} in {other.path} and {r.source_name!r} in {r.path}"
            )
        seen[r.name] = r

    ordered = sorted(raws, key=lambda r: (file_index[r.path], r.offset, r.nbytes, r.name))
    tensors: list[TensorSpec] = []
    extents: list[Extent] = []
    pos = 0
    for r in ordered:
        f = file_index[r.path]
        tensors.append(
            TensorSpec(
                name=r.name,
                dtype=r.dtype,
                shape=r.shape,
                file=f,
                offset=r.offset,
                nbytes=r.nbytes,
                buf_offset=pos,
                source_name=r.source_name,
            )
        )
        if r.nbytes == 0:  # nothing to read; a zero-length extent would be a wasted request
            continue
        last = extents[-1] if extents else None
        if last is not None and last.file == f and last.offset + last.length == r.offset:
            extents[-1] = Extent(file=f, offset=last.offset, length=last.length + r.nbytes)
        else:
            extents.append(Extent(file=f, offset=r.offset, length=r.nbytes))
        pos += r.nbytes
    return ExpertLayout(key=key, tensors=tuple(tensors), extents=tuple(extents), nbytes=pos)


def _file_size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError as exc:
        raise CheckpointError(f"cannot stat checkpoint file {path}: {exc}") from exc
