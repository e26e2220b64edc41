"""Mirrors: byte-identical copies of the checkpoint on other drives, found and checked.

A mirror is a folder laid out like the primary (or, for a single-file checkpoint, a copy of
that file or a folder holding a file of the same name).  A mirror's copy of a shard is accepted
only if its size and its header bytes (everything before the shard's first expert tensor: the
safetensors JSON header, the GGUF metadata and tensor infos) equal the primary's; otherwise
``open`` fails with a :class:`MirrorError` naming the mirror's file.  A mirror missing some
shards (a partial mirror) serves the ones it has.  Expert bytes themselves are not compared:
reading the whole checkpoint twice at open would cost minutes on real models.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from iosched._errors import StoreError
from iosched._layout import CheckpointIndex

HEADER_CAP = 64 << 20
"""At most this many leading bytes are compared (GGUF metadata with a vocabulary is a few MB)."""


class MirrorError(StoreError):
    """A mirror is missing or does not match its primary; the message names the mirror's file."""


def header_ends(index: CheckpointIndex) -> list[int]:
    """Per checkpoint file, where its header ends: its first expert byte (at most
    :data:`HEADER_CAP`).  The bytes before it identify the file (the manifest hashes them)."""
    ends = [size for size in index.file_sizes]
    for layout in index.experts.values():
        for ext in layout.extents:
            ends[ext.file] = min(ends[ext.file], ext.offset)
    return [min(end, HEADER_CAP) for end in ends]


def _same_prefix(a: str, b: str, n: int) -> bool:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while n > 0:
            chunk = min(n, 1 << 20)
            if fa.read(chunk) != fb.read(chunk):
                return False
            n -= chunk
    return True


def find_replicas(index: CheckpointIndex, mirrors: Sequence[str | os.PathLike[str]]) -> list[list[str]]:
    """Per checkpoint file, its copies: the primary first, then each mirror's that matches."""
    replicas = [[path] for path in index.files]
    if not mirrors:
        return replicas
    ends = header_ends(index)
    root_is_file = os.path.isfile(index.root)
    for mirror in mirrors:
        mroot = os.path.abspath(os.fspath(mirror))
        if not os.path.exists(mroot):
            raise MirrorError(f"mirror {mroot} does not exist")
        found = 0
        for i, primary in enumerate(index.files):
            if root_is_file:
                copy = mroot if os.path.isfile(mroot) else os.path.join(mroot, os.path.basename(primary))
            else:
                copy = os.path.join(mroot, os.path.relpath(primary, index.root))
            if not os.path.isfile(copy):
                continue  # a partial mirror serves what it has
            size = os.path.getsize(copy)
            if size != index.file_sizes[i]:
                raise MirrorError(
                    f"mirror file {copy} is {size} bytes, its primary {primary} {index.file_sizes[i]}"
                )
            if not _same_prefix(primary, copy, ends[i]):
                raise MirrorError(
                    f"mirror file {copy} does not match its primary {primary}: the first "
                    f"{ends[i]} bytes (the header) differ"
                )
            if os.path.samefile(primary, copy):
                raise MirrorError(f"mirror file {copy} is the primary itself, not a copy")
            replicas[i].append(copy)
            found += 1
        if found == 0:
            raise MirrorError(f"mirror {mroot} holds none of the checkpoint's files")
    return replicas
