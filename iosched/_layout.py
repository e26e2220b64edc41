"""What a checkpoint index is: where each expert's bytes live, and how they are typed.

Invariants (checked by the index builders in ``_checkpoint``):

* ``ExpertLayout.tensors`` are in on-disk order, that is by (file, offset);
* ``ExpertLayout.extents`` cover exactly the tensors' bytes, in the same order, with
  byte-adjacent tensors of one file coalesced into one extent (one read request);
* ``TensorSpec.buf_offset`` is where the tensor starts in the expert's buffer, which holds
  the extents back to back, so ``buf_offset`` runs from 0 to ``nbytes`` without gaps;
* every extent lies inside its file (``offset + length <= file size``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np

ExpertKey = tuple[int, int]
"""(layer, expert)."""


@dataclass(frozen=True)
class GgmlType:
    """A GGUF tensor's GGML type: what an engine needs to decode its bytes (``Q4_K``: blocks
    of 256 values in 144 bytes).  ``name`` is ``gguf.GGMLQuantizationType``'s member name;
    ``block_size`` values are stored in ``type_size`` bytes (``gguf.GGML_QUANT_SIZES``)."""

    name: str
    block_size: int
    type_size: int


@dataclass(frozen=True)
class DerivedTensor:
    """A zero-copy view of another tensor of the same expert: ``tensors[name]`` is
    ``tensors[parent][..., start:stop:step, ...]`` on ``axis``.  Fused checkpoints hold
    ``gate_up_proj``; its halves (or, interleaved, its even and odd columns) are the
    ``gate_proj`` and ``up_proj`` an engine may look up by role without a copy."""

    name: str
    parent: str
    axis: int
    start: int
    stop: int
    step: int = 1


@dataclass(frozen=True)
class SkippedTensors:
    """Tensors the index left out on purpose, one line per kind (``iosched inspect``)."""

    kind: str
    """``dense``, ``shared_expert``, ``router``, ``mtp``, ``tower`` (vision/audio), ``other``..."""
    reason: str
    count: int
    example: str
    """One of the tensors' names in the checkpoint."""


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of an expert: its canonical name, type, shape and place on disk."""

    name: str
    """Canonical role: ``gate_proj``, ``up_proj``, ``down_proj`` (other tensors keep their suffix)."""
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    file: int
    """Index into ``CheckpointIndex.files``."""
    offset: int
    """Absolute byte offset in the file."""
    nbytes: int
    buf_offset: int
    """Where the tensor starts inside the expert's buffer."""
    source_name: str = ""
    """The tensor's name in the checkpoint (for error messages)."""
    ggml_type: GgmlType | None = None
    """The GGML type of a GGUF tensor (``None`` for safetensors)."""


@dataclass(frozen=True)
class Extent:
    """One read request: ``length`` bytes at ``offset`` of file ``file``."""

    file: int
    offset: int
    length: int


@dataclass(frozen=True)
class ExpertLayout:
    key: ExpertKey
    tensors: tuple[TensorSpec, ...]
    extents: tuple[Extent, ...]
    nbytes: int
    derived: tuple[DerivedTensor, ...] = ()
    """Zero-copy views of ``tensors`` the view also exposes (fused ``gate_up_proj`` halves)."""
    ggml_types: Mapping[str, GgmlType] = field(default_factory=lambda: MappingProxyType({}),
                                               compare=False, repr=False)
    """Tensor name -> GGML type, for the GGUF tensors and the derived views of them (a half of
    a fused tensor has its parent's type; built once, shared by every view)."""

    def __post_init__(self) -> None:
        if not self.ggml_types:
            types = {t.name: t.ggml_type for t in self.tensors if t.ggml_type is not None}
            types.update({d.name: types[d.parent] for d in self.derived if d.parent in types})
            if types:
                object.__setattr__(self, "ggml_types", MappingProxyType(types))


@dataclass(frozen=True)
class CheckpointIndex:
    format: str
    """``"safetensors"`` or ``"gguf"``."""
    root: str
    """The folder or file the index was built from."""
    files: tuple[str, ...]
    """Absolute paths of the files holding expert bytes."""
    file_sizes: tuple[int, ...]
    experts: Mapping[ExpertKey, ExpertLayout] = field(repr=False)
    experts_per_token: int | None = None
    """Experts routed per token in each MoE layer (k), from the checkpoint's own metadata:
    ``config.json`` beside safetensors shards, ``{arch}.expert_used_count`` in GGUF; ``None``
    when the checkpoint does not say. ``ExpertStore.open(experts_per_token=...)`` overrides it.
    With a per-layer k (``k_by_layer``) it is the largest."""
    k_source: str = ""
    """Where ``experts_per_token`` came from (file and key), for ``iosched inspect``."""
    k_by_layer: Mapping[int, int] | None = None
    """k of each MoE layer when the metadata states it per layer (a list), else ``None``."""
    skipped: tuple[SkippedTensors, ...] = ()
    """What the reader left out on purpose (dense layers, shared experts, routers, MTP ...)."""
    notes: tuple[str, ...] = ()
    """Warnings and remarks about the checkpoint (an ``mmproj`` file ignored ...)."""
    architecture: str = ""
    """``config.json``'s ``model_type`` or GGUF ``general.architecture``, when stated."""

    def layers(self) -> list[int]:
        return sorted({layer for layer, _ in self.experts})

    def experts_per_layer(self) -> int:
        """E, the most experts a MoE layer holds (``load_index`` checks that every layer ``l``
        holds experts ``0..E_l-1``; in all but uneven models every ``E_l`` is E)."""
        return max(self._experts_by_layer().values(), default=0)

    def fewest_experts_per_layer(self) -> int:
        """The fewest experts any MoE layer holds: the most a token may route (k) there."""
        return min(self._experts_by_layer().values(), default=0)

    def _experts_by_layer(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for layer, _ in self.experts:
            counts[layer] = counts.get(layer, 0) + 1
        return counts

    def expert_bytes_by_layer(self) -> dict[int, int]:
        """The largest expert of each layer, in bytes."""
        out: dict[int, int] = {}
        for (layer, _), lay in self.experts.items():
            out[layer] = max(out.get(layer, 0), lay.nbytes)
        return out
