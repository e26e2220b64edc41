"""Turning a flat list of expert tensors into a validated :class:`CheckpointIndex`.

The format readers (``_safetensors_index``, ``_gguf_index``) only know where each expert
tensor sits in its file; everything that is the same for every format lives here, so a new
layout gets every check by calling :func:`build_index` (and :func:`parse_id`,
:func:`check_tensor_count` while it reads):

* bounds: every tensor must lie inside its file, because the store reads the byte range
  blindly and a short read would only surface much later, as a ``ReadError``;
* overlaps: two expert tensors sharing bytes mean a corrupt header, never a valid layout;
* sizes: an expert tensor holds at least one byte (a zero-byte one is malformed: it would let
  a header claim any number of experts for free);
* one tensor per (expert, canonical name), so an engine can look tensors up by role;
* complete experts: every expert of a layer holds the same tensors (names, dtypes, shapes),
  and every MoE layer the same names, so an expert missing a projection is refused by name
  rather than served short;
* the expert grid: the experts of every MoE layer are exactly ``0..E-1``, the same ``E`` in
  every layer, at most :data:`MAX_EXPERTS_PER_LAYER`, and equal to the expert count the
  metadata states (``config.json``, GGUF ``{arch}.expert_count``) when it states one; so the
  per-layer arrays a policy builds (sized by the largest id + 1) are sized by experts that
  exist, never by an id a header claims;
* counts: at most :data:`MAX_EXPERT_TENSORS` expert tensors, and ids below
  :data:`MAX_LAYERS` / :data:`MAX_EXPERTS_PER_LAYER` (checked on the digits, before ``int``);
* coalescing: byte-adjacent tensors of one file become one :class:`Extent`, that is one
  read request, which is what makes a whole expert a single large read on disk.

Coalescing is strict (``prev.offset + prev.length == next.offset``): bridging a gap would
read padding bytes the buffer layout has no place for.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from iosched._errors import CheckpointError
from iosched._layout import (
    CheckpointIndex,
    DerivedTensor,
    ExpertKey,
    ExpertLayout,
    Extent,
    GgmlType,
    SkippedTensors,
    TensorSpec,
)

from ._untrusted import quote

EXPECTED_NAMES = (
    "model.layers.{L}.{mlp,block_sparse_moe,feed_forward,ffn,mixer}.experts.{E}.{gate_proj,up_proj,down_proj,"
    "w1,w2,w3}.weight, fused [E, ...] tensors model.layers.{L}.mlp.experts.{gate_up_proj,down_proj} "
    "(safetensors; docs/formats.md lists every layout) or blk.{L}.ffn_{gate,up,gate_up,down}_exps.weight (GGUF)"
)
"""Shown when a checkpoint holds no expert tensor at all."""

MAX_LAYERS = 16384
"""Layer ids run below this: 2**14, over 100x the deepest released model (Llama 3.1 405B, 126
layers; the deepest MoE, Qwen3-235B-A22B, has 94)."""
MAX_EXPERTS_PER_LAYER = 16384
"""Experts per MoE layer, at most: 2**14, 32x the most of any released MoE (Qwen3-Next-80B-A3B,
512; Kimi K2 has 384, DeepSeek-V3 256). It bounds what a header can claim for one layer (a GGUF
merged tensor's expert axis) and the per-layer arrays of the policies."""
MAX_EXPERT_TENSORS = 1 << 20
"""Expert tensors in one checkpoint, at most: 2**20, 5x the most of any released checkpoint
(Kimi K2 Thinking in INT4: 60 MoE layers x 384 experts x 3 projections x 3 tensors = 207,360).
Each costs about a kilobyte of index, so this caps the index near 1 GB whatever the files claim."""


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
    ggml_type: GgmlType | None = None
    """The GGML type of a GGUF tensor."""
    derived: tuple[DerivedTensor, ...] = ()
    """Zero-copy views of this tensor the expert's view also exposes (``parent`` is ``name``)."""


@dataclass(frozen=True)
class IndexNotes:
    """What a format reader says about a checkpoint besides its expert tensors (all optional):
    the metadata's counts and where they came from, what it skipped, its warnings."""

    experts_per_token: int | None = None
    k_source: str = ""
    k_by_layer: Mapping[int, int] | None = None
    n_experts: int | None = None
    e_source: str = ""
    skipped: tuple[SkippedTensors, ...] = ()
    notes: tuple[str, ...] = ()
    architecture: str = ""


def parse_id(digits: str, kind: str, path: object, tensor: str) -> int:
    """The layer (``kind="layer"``) or expert id spelt by the ASCII ``digits`` of a tensor
    name; a :class:`CheckpointError` naming ``path`` and the tensor when it is not below
    :data:`MAX_LAYERS` / :data:`MAX_EXPERTS_PER_LAYER`. The length is checked before ``int``
    runs, so a name with thousands of digits costs nothing (and raises no ``ValueError``)."""
    if len(digits) < 5 and digits.isascii() and digits.isdigit():  # below 10**4: every real id
        return int(digits)
    limit = MAX_LAYERS if kind == "layer" else MAX_EXPERTS_PER_LAYER
    if not digits.isascii() or not digits.isdigit():
        raise CheckpointError(f"{path}: tensor {quote(tensor)}: {kind} id is not a decimal number")
    if len(digits) > len(str(limit)) or int(digits) >= limit:
        raise CheckpointError(
            f"{path}: tensor {quote(tensor)}: {kind} id {quote(digits)} is out of range "
            f"(at most {limit - 1})")
    return int(digits)


def check_tensor_count(count: int, where: object) -> None:
    """Raise once a reader has found more than :data:`MAX_EXPERT_TENSORS` expert tensors
    (called as it goes, so a hostile checkpoint is refused before it costs the memory)."""
    if count > MAX_EXPERT_TENSORS:
        raise CheckpointError(
            f"{where}: more than {MAX_EXPERT_TENSORS} expert tensors; no real checkpoint has this many")


def build_index(
    fmt: str,
    root: str,
    raws: Iterable[RawExpertTensor],
    experts_per_token: int | None = None,
    k_source: str = "",
    n_experts: int | None = None,
    e_source: str = "",
    *,
    notes: IndexNotes | None = None,
) -> CheckpointIndex:
    """Validate ``raws`` and lay them out per expert.

    ``experts_per_token`` is k as the checkpoint's metadata states it (``k_source`` names the
    file and key, for the error): more than the experts per layer is a
    :class:`CheckpointError`, since a token cannot be routed to more experts than there are.
    ``n_experts`` is the experts per layer the metadata states (``e_source`` likewise): the
    checkpoint's layers must hold exactly that many.

    ``files`` holds only the files with at least one expert tensor, in sorted order, so
    file indices are stable for a given checkpoint. Raises :class:`CheckpointError` on an
    empty list, a tensor past the end of its file or of no bytes, overlapping tensors, two
    tensors of one expert with the same canonical name, or an expert grid that is not
    ``0..E-1`` in every layer (module docstring).
    """
    if notes is not None:  # the readers' newer spelling: everything in one record
        experts_per_token, k_source = notes.experts_per_token, notes.k_source
        n_experts, e_source = notes.n_experts, notes.e_source
    raws = list(raws)
    if not raws:
        found = ""
        if notes is not None and notes.skipped:
            found = "; found instead: " + "; ".join(
                f"{s.count} {s.kind} tensors (e.g. {quote(s.example)}): {s.reason}" for s in notes.skipped)
        raise CheckpointError(f"no expert tensors found in {root}; expected names like {EXPECTED_NAMES}{found}")
    check_tensor_count(len(raws), root)
    files = tuple(sorted({r.path for r in raws}))
    file_index = {path: i for i, path in enumerate(files)}
    file_sizes = tuple(_file_size(path) for path in files)
    _check_bytes(raws, file_sizes, file_index)

    by_key: dict[ExpertKey, list[RawExpertTensor]] = {}
    for r in raws:
        by_key.setdefault((r.layer, r.expert), []).append(r)
    fewest = check_expert_grid(by_key, root, n_experts, e_source)
    check_complete_experts(by_key, root)
    k_by_layer = notes.k_by_layer if notes is not None else None
    if k_by_layer is not None:
        experts_per_token = _check_k_by_layer(by_key, k_by_layer, k_source or root)
    if experts_per_token is not None and experts_per_token > fewest:
        raise CheckpointError(
            f"{k_source or root}: experts per token is {experts_per_token}, more than {fewest} "
            "experts, the fewest in any layer of the checkpoint")
    experts = {key: _layout_expert(key, by_key[key], file_index) for key in sorted(by_key)}
    return CheckpointIndex(
        format=fmt, root=root, files=files, file_sizes=file_sizes, experts=experts,
        experts_per_token=experts_per_token, k_source=k_source if experts_per_token is not None else "",
        k_by_layer=k_by_layer,
        skipped=notes.skipped if notes is not None else (),
        notes=notes.notes if notes is not None else (),
        architecture=notes.architecture if notes is not None else "",
    )


def _check_k_by_layer(by_key: dict[ExpertKey, list[RawExpertTensor]], k_by_layer: Mapping[int, int],
                      where: str) -> int:
    """The largest k of a per-layer list, after checking each MoE layer's k against its experts
    (a layer the list leaves out, or a k above that layer's count, is an error)."""
    counts: dict[int, int] = {}
    for layer, _ in by_key:
        counts[layer] = counts.get(layer, 0) + 1
    for layer in sorted(counts):
        k = k_by_layer.get(layer)
        if k is None:
            raise CheckpointError(f"{where}: gives experts per token per layer but not for MoE layer {layer}")
        if k > counts[layer]:
            raise CheckpointError(f"{where}: experts per token of layer {layer} is {k}, more than its "
                                  f"{counts[layer]} experts")
    return max(k_by_layer[layer] for layer in counts)


def check_complete_experts(by_key: dict[ExpertKey, list[RawExpertTensor]], root: str) -> None:
    """Every expert of a layer holds the same tensors (canonical names, dtypes, shapes) and every
    MoE layer the same names; otherwise a :class:`CheckpointError` naming the expert, the
    missing or disagreeing tensor and a file holding it."""
    first_of_layer: dict[int, tuple[ExpertKey, dict[str, RawExpertTensor]]] = {}
    model_names: tuple[int, frozenset[str]] | None = None
    for key in sorted(by_key):
        tensors = {r.name: r for r in by_key[key]}
        ref = first_of_layer.get(key[0])
        if ref is None:
            first_of_layer[key[0]] = (key, tensors)
            names = frozenset(tensors)
            if model_names is None:
                model_names = (key[0], names)
            elif names != model_names[1]:
                other = model_names[0]
                odd = sorted(names ^ model_names[1])
                r0 = next(iter(tensors.values()))
                raise CheckpointError(
                    f"{root}: the experts of layer {key[0]} hold {_names(names)} but those of layer {other} "
                    f"hold {_names(model_names[1])} (differ in {_names(odd)}; e.g. {quote(r0.source_name)} "
                    f"in {r0.path}): every MoE layer's experts must hold the same tensors")
            continue
        ref_key, ref_tensors = ref
        for name, r in ref_tensors.items():
            mine = tensors.get(name)
            if mine is None:
                raise CheckpointError(
                    f"{root}: expert (layer {key[0]}, expert {key[1]}) has no {quote(name)} tensor, which "
                    f"expert {ref_key[1]} of its layer has ({quote(r.source_name)} in {r.path}): an "
                    "incomplete expert cannot be served")
            if mine.shape != r.shape or mine.dtype != r.dtype or mine.ggml_type != r.ggml_type:
                raise CheckpointError(
                    f"{mine.path}: tensor {quote(mine.source_name)} is {_kind(mine)} but "
                    f"{quote(r.source_name)} of the same layer is {_kind(r)}: the experts of a layer "
                    "must agree")
        extra = sorted(set(tensors) - set(ref_tensors))
        if extra:
            r = tensors[extra[0]]
            raise CheckpointError(
                f"{root}: expert (layer {key[0]}, expert {key[1]}) has a {quote(extra[0])} tensor "
                f"({quote(r.source_name)} in {r.path}) that expert {ref_key[1]} of its layer lacks")


def _names(names: Iterable[str]) -> str:
    return ", ".join(quote(n) for n in sorted(names))


def _kind(r: RawExpertTensor) -> str:
    t = f" ({r.ggml_type.name})" if r.ggml_type is not None else ""
    return f"{r.dtype}{list(r.shape)}{t}"


def _check_bytes(raws: list[RawExpertTensor], file_sizes: tuple[int, ...], file_index: dict[str, int]) -> None:
    """Every tensor holds bytes, inside its file, sharing none with another."""
    ranges_by_file: dict[str, list[tuple[int, int, str]]] = {path: [] for path in file_index}
    for r in raws:
        if r.nbytes <= 0:
            raise CheckpointError(
                f"{r.path}: expert tensor {quote(r.source_name)} holds no bytes (shape {quote(r.shape)}); "
                "a zero-size expert tensor is malformed")
        check_in_file(r.path, file_sizes[file_index[r.path]], r.source_name, r.offset, r.nbytes)
        ranges_by_file[r.path].append((r.offset, r.nbytes, r.source_name))
    for path, ranges in ranges_by_file.items():
        check_no_overlap(path, ranges)


def check_expert_grid(
    by_key: dict[ExpertKey, list[RawExpertTensor]], root: str, n_experts: int | None, e_source: str
) -> int:
    """The fewest experts any MoE layer holds, after checking that every layer ``l`` holds
    exactly experts ``0..E_l-1`` (no holes: a policy's arrays, sized by the largest id + 1, are
    then sized by experts that exist) and, when the metadata states the model's expert count
    ``n_experts`` (``e_source``), that no layer holds more and the largest layer holds exactly
    that many.  Layers may hold different counts (an uneven model); the message names the layer
    and a file holding its tensors."""
    ids: dict[int, list[int]] = {}
    for layer, expert in by_key:
        ids.setdefault(layer, []).append(expert)
    counts: dict[int, int] = {}
    for layer in sorted(ids):
        present = sorted(ids[layer])
        where = by_key[(layer, present[-1])][0].path
        if present[-1] != len(present) - 1:
            missing = next(i for i, e in enumerate(present) if i != e)
            raise CheckpointError(
                f"{root}: layer {layer} has {len(present)} experts, ids up to {present[-1]} (in {where}), "
                f"but no expert {missing}; the experts of a layer must be 0..E-1 without holes")
        counts[layer] = len(present)
        if n_experts is not None and len(present) > n_experts:
            raise CheckpointError(f"{root}: layer {layer} has {len(present)} experts (in {where}), but "
                                  f"{e_source} says {n_experts}: no layer may hold more")
    most = max(counts.values())
    if n_experts is not None and most != n_experts:
        layer = max(counts, key=lambda lay: counts[lay])
        raise CheckpointError(f"{root}: the largest layer ({layer}) has {most} experts, but {e_source} says "
                              f"{n_experts}")
    return min(counts.values())


def check_in_file(path: str, file_size: int, tensor: str, offset: int, nbytes: int) -> None:
    """Raise unless ``[offset, offset + nbytes)`` lies inside a file of ``file_size`` bytes."""
    if offset < 0 or nbytes < 0:
        raise CheckpointError(
            f"{path}: tensor {quote(tensor)} has a negative offset or size ({offset}, {nbytes})"
        )
    if offset + nbytes > file_size:
        raise CheckpointError(
            f"{path}: tensor {quote(tensor)} extends past end of file: bytes [{offset}, "
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
                f"{path}: tensors {quote(furthest_name)} and {quote(name)} overlap (the first ends at "
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
                f"expert (layer {key[0]}, expert {key[1]}) has two {quote(r.name)} tensors: "
                f"{quote(other.source_name)} in {other.path} and {quote(r.source_name)} in {r.path}"
            )
        seen[r.name] = r

    ordered = sorted(raws, key=lambda r: (file_index[r.path], r.offset, r.nbytes, r.name))
    tensors: list[TensorSpec] = []
    extents: list[Extent] = []
    derived: list[DerivedTensor] = []
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
                ggml_type=r.ggml_type,
            )
        )
        derived.extend(d for d in r.derived if d.name not in seen)
        last = extents[-1] if extents else None
        if last is not None and last.file == f and last.offset + last.length == r.offset:
            extents[-1] = Extent(file=f, offset=last.offset, length=last.length + r.nbytes)
        else:
            extents.append(Extent(file=f, offset=r.offset, length=r.nbytes))
        pos += r.nbytes
    return ExpertLayout(key=key, tensors=tuple(tensors), extents=tuple(extents), nbytes=pos,
                        derived=tuple(derived))


def _file_size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError as exc:
        raise CheckpointError(f"cannot stat checkpoint file {path}: {exc}") from exc
