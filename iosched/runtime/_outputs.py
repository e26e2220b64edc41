"""Files the store writes for the user (``telemetry=``, ``history=``): never one that is not ours.

Operators type these paths by hand, next to checkpoints they must not damage.  So, before the
store opens anything (no descriptor, no thread, no ring exists yet when one is refused), each
path must be:

* a file path, not a directory, in a folder that exists and that we may write in;
* outside every checkpoint folder (the source's and each mirror's), and, for a checkpoint
  given as a file, not that file; once the index is read, not any of its files either (a
  Hugging Face snapshot's shards are links into ``../../blobs``: the blob counts as the shard);
* absent, or one of our own files: a telemetry file of iosched (its first line is one of our
  records) is replaced, and a history file is loaded (one that does not load is refused,
  ``iosched/runtime/_usage.py``); any other existing file is refused.

Every refusal is a :class:`StoreError` naming the argument, the path and the rule.  Writes go
to a temporary file beside the target, renamed over it when complete (telemetry at
``close()``, history at ``close()``), so a crash never leaves a half-written file under the
name the user gave, and the lines written so far stay in the temporary file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

from iosched._errors import StoreError


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def check_output_path(what: str, path: str | os.PathLike[str], checkpoints: Iterable[str]) -> str:
    """``path`` (the ``what=`` argument) as an absolute path, if the rules of the module
    docstring allow writing it beside the checkpoints ``checkpoints`` (folders or files, the
    source and its mirrors); a :class:`StoreError` naming the rule it breaks."""
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise StoreError(f"{what} must be a file path, got {path!r}")
    given = os.path.abspath(os.fspath(path))
    real = os.path.realpath(given)
    if os.path.isdir(real):
        raise StoreError(f"{what}={path}: is a directory; give a file path")
    folder = os.path.dirname(real)
    if not os.path.isdir(folder):
        raise StoreError(f"{what}={path}: its folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise StoreError(f"{what}={path}: cannot write in {folder} (permission denied)")
    for checkpoint in checkpoints:
        root = os.path.realpath(checkpoint)
        if (os.path.isdir(root) and _inside(real, root)) or real == root:
            raise StoreError(f"{what}={path}: is inside the checkpoint {checkpoint}; iosched never "
                             "writes into a checkpoint: give a path outside it")
    return given


def check_not_a_checkpoint_file(what: str, path: str, files: Iterable[str]) -> None:
    """Refuse ``path`` when it is (resolves to) one of the checkpoint's files ``files``."""
    real = os.path.realpath(path)
    for file in files:
        if os.path.realpath(file) == real:
            raise StoreError(f"{what}={path}: is the checkpoint's file {file}; give another path")


def is_telemetry_file(path: str) -> bool:
    """Whether ``path`` holds iosched telemetry: its first line a record of ours (a JSON
    object with ``token`` and ``end``).  Reads at most one line of 64 KiB."""
    try:
        with open(path, "rb") as f:
            first = f.readline(1 << 16)
    except OSError:
        return False
    try:
        record = json.loads(first)
    except (ValueError, RecursionError):
        return False
    return isinstance(record, dict) and "token" in record and "end" in record


def check_telemetry_target(path: str, given: object) -> None:
    """An existing file at ``path`` must be iosched telemetry (it is then replaced)."""
    if os.path.lexists(path) and not (os.path.isfile(path) and is_telemetry_file(path)):
        raise StoreError(f"telemetry={given}: {path} exists and is not an iosched telemetry file; "
                         "iosched never overwrites a file that is not its own: give another path")


def temporary_beside(path: str) -> str:
    """The temporary file a write of ``path`` goes to before it is renamed into place."""
    folder, name = os.path.split(path)
    return os.path.join(folder, f".{name}.iosched-{os.getpid()}.tmp")
