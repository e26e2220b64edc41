"""What an engine holds while leased: zero-copy, read-only numpy views of the store's buffer."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import numpy as np
import numpy.typing as npt

from iosched._layout import ExpertKey, ExpertLayout, GgmlType


class ExpertView:
    """The bytes of one expert, zero-copy and read-only.

    ``data`` is the expert's tensors' bytes in on-disk order (``uint8``); ``tensors`` maps each
    canonical tensor name to a typed, shaped view of the same memory (each tensor array is a
    view of ``data``).  The lease is what keeps the expert *resident*: while it is held the
    expert cannot be evicted, so another acquire of it is a hit.

    **A view never shows another expert's bytes**, also kept past its lease: ``data``, a
    ``tensors[...]`` array, and anything numpy or ``memoryview`` derives from them (slices,
    reshapes, ``.T``, ``memoryview(arr)``, ``torch.from_numpy``) keep the buffer they point
    into from being reused while they live.  On a buffer of the store's own (every backend but
    ``mmap``'s zero-copy maps), a buffer still referenced when its expert is evicted is
    *retired*: set aside, outside ``budget_bytes``, and taken back only once the last such
    reference died (``stats()["retired_bytes"]``); an ``mmap`` view points into the file's own
    mapping at the expert's own offset, which holds nothing else.  What a kept view costs is
    memory: the budget bounds resident experts, and bytes an engine keeps referenced past their
    lease are the engine's.  Copy what you keep for long (``np.array(view.data)``), and do not
    keep raw addresses (``arr.ctypes.data``): an address is no reference.

    ``ggml_types`` maps each GGUF tensor's name to its :class:`GgmlType` (a quantized tensor
    comes back as its raw bytes, ``uint8`` with the last axis counting bytes; the type says how
    to decode them); it is empty for safetensors checkpoints.  ``layout`` is where the bytes
    came from (files, offsets, extents).
    """

    __slots__ = ("key", "data", "tensors", "layout")

    def __init__(
        self,
        key: ExpertKey,
        data: npt.NDArray[np.uint8],
        tensors: Mapping[str, npt.NDArray[np.generic]],
        layout: ExpertLayout | None = None,
    ) -> None:
        self.key = key
        self.data = data
        self.tensors = tensors
        self.layout = layout

    @property
    def ggml_types(self) -> Mapping[str, GgmlType]:
        """Tensor name -> GGML type (GGUF tensors only; see the class docstring)."""
        return self.layout.ggml_types if self.layout is not None else MappingProxyType({})

    @classmethod
    def over(cls, layout: ExpertLayout, buffer: memoryview) -> ExpertView:
        """Views of ``layout`` over ``buffer`` (the extents back to back), made read-only.

        The tensors are views of ``data`` (slices of it, retyped: their ``base`` is ``data``),
        so every array handed out, and every one derived from them, holds ``data`` alive: the
        store watches that one array to learn when a view kept past its lease is gone
        (``iosched/runtime/_slab.py``, ``RetiredSlabs``).  Slicing and ``.view`` cost 0.5 µs a tensor
        against ``np.frombuffer``'s 0.9 µs (measured, 256 x 256 float16)."""
        data = np.frombuffer(buffer.toreadonly(), dtype=np.uint8, count=layout.nbytes)
        tensors = {}
        for t in layout.tensors:
            end = t.buf_offset + t.nbytes // t.dtype.itemsize * t.dtype.itemsize
            tensors[t.name] = data[t.buf_offset:end].view(t.dtype).reshape(t.shape)
        for d in layout.derived:
            parent = tensors[d.parent]
            index = (slice(None),) * d.axis + (slice(d.start, d.stop, d.step),)
            tensors[d.name] = parent[index]
        return cls(layout.key, data, MappingProxyType(tensors), layout)

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}={v.dtype}{list(v.shape)}" for k, v in self.tensors.items())
        return f"ExpertView({self.key!r}, {self.data.nbytes} bytes, {shapes})"
