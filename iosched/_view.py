"""What an engine holds while leased: zero-copy, read-only numpy views of the store's buffer."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import numpy as np
import numpy.typing as npt

from ._layout import ExpertKey, ExpertLayout


class ExpertView:
    """The bytes of one expert, valid while its lease is held.

    ``data`` is the expert's tensors' bytes in on-disk order (``uint8``); ``tensors`` maps each
    canonical tensor name to a typed, shaped view of the same memory.  Both are read-only,
    and both point into a buffer the store recycles once the lease ends and the expert is
    evicted: copy what you need to keep.
    """

    __slots__ = ("key", "data", "tensors")

    def __init__(
        self,
        key: ExpertKey,
        data: npt.NDArray[np.uint8],
        tensors: Mapping[str, npt.NDArray[np.generic]],
    ) -> None:
        self.key = key
        self.data = data
        self.tensors = tensors

    @classmethod
    def over(cls, layout: ExpertLayout, buffer: memoryview) -> ExpertView:
        """Views of ``layout`` over ``buffer`` (the extents back to back), made read-only."""
        ro = buffer.toreadonly()
        data = np.frombuffer(ro, dtype=np.uint8, count=layout.nbytes)
        tensors = {
            t.name: np.frombuffer(
                ro, dtype=t.dtype, count=t.nbytes // t.dtype.itemsize, offset=t.buf_offset
            ).reshape(t.shape)
            for t in layout.tensors
        }
        return cls(layout.key, data, MappingProxyType(tensors))

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}={v.dtype}{list(v.shape)}" for k, v in self.tensors.items())
        return f"ExpertView({self.key!r}, {self.data.nbytes} bytes, {shapes})"
