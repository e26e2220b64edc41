"""Leaf: a file or a folder published whole, by one rename over its target.

The one way iosched replaces what a reader may be looking at (the manifest, a packed copy,
and the fault injection's replaced shard): the new file or folder is made beside its target,
in the same folder (so the rename stays on one filesystem and is atomic), written, fsynced,
renamed over the target with ``os.replace``, and the folder's entry fsynced.  On any failure
the temporary is removed.  Invariants: a reader sees the old target or the new one, never half
of one; a failed write leaves nothing behind; nothing is ever written into the target in
place.  Whether a target may be replaced at all is the caller's decision, taken before.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from types import TracebackType
from typing import BinaryIO


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Staged:
    """A temporary beside ``target``: published by :meth:`publish`, or at the end of a
    ``with`` block left normally; removed when the block is left by an exception."""

    path: str
    """The temporary's path, in the target's folder."""

    def __init__(self, target: str | os.PathLike[str]) -> None:
        self.target = os.path.abspath(os.fspath(target))
        self.published = False

    def _sync(self) -> None:
        raise NotImplementedError

    def _remove(self) -> None:
        raise NotImplementedError

    def publish(self) -> None:
        """Fsync what was written, rename it over the target, fsync the target's folder."""
        self._sync()
        os.replace(self.path, self.target)
        self.published = True
        _fsync_path(os.path.dirname(self.target))

    def discard(self) -> None:
        """Remove the temporary, if it was not published."""
        if not self.published:
            self._remove()

    def __enter__(self) -> _Staged:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is not None:
            self.discard()
            return
        try:
            if not self.published:
                self.publish()
        except BaseException:
            self.discard()
            raise


class StagedFile(_Staged):
    """A new file beside ``target`` (``tempfile.mkstemp``: readable by its owner only), open
    for writing as :attr:`file`.  Creating it raises ``OSError`` when the folder refuses."""

    def __init__(self, target: str | os.PathLike[str], *, prefix: str, suffix: str = "") -> None:
        super().__init__(target)
        fd, self.path = tempfile.mkstemp(dir=os.path.dirname(self.target), prefix=prefix, suffix=suffix)
        self.file: BinaryIO = os.fdopen(fd, "wb")

    def __enter__(self) -> StagedFile:
        return self

    def _sync(self) -> None:
        with self.file:
            self.file.flush()
            os.fsync(self.file.fileno())

    def _remove(self) -> None:
        self.file.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class StagedFolder(_Staged):
    """A new, empty folder beside ``target`` (``tempfile.mkdtemp``), to be filled at
    :attr:`path`; its rename replaces an empty folder and refuses any other.  Creating it
    raises ``OSError`` when the folder refuses."""

    def __init__(self, target: str | os.PathLike[str], *, prefix: str) -> None:
        super().__init__(target)
        self.path = tempfile.mkdtemp(dir=os.path.dirname(self.target), prefix=prefix)

    def __enter__(self) -> StagedFolder:
        return self

    def _sync(self) -> None:
        for folder, _, files in os.walk(self.path):
            for name in files:
                _fsync_path(os.path.join(folder, name))
            _fsync_path(folder)

    def _remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def write_atomically(target: str | os.PathLike[str], data: bytes, *, prefix: str, suffix: str = "") -> None:
    """Replace ``target`` by a file holding ``data`` (module docstring)."""
    with StagedFile(target, prefix=prefix, suffix=suffix) as staged:
        staged.file.write(data)
