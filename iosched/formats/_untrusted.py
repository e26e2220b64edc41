"""Reading checkpoint files as untrusted input: confined names, capped reads, bounded JSON.

A checkpoint is downloaded from somewhere; its index, config and headers are whatever that
somewhere wrote. Every format reader goes through these helpers, so each rule holds for every
layout (a new one gets it by calling them):

* **Confinement.** A file that an index names is a plain relative name inside the checkpoint
  folder (:func:`confined_name`): no absolute path, no ``..``, ``.`` or empty component, no
  backslash or NUL. Subfolders are allowed (``shards/model-00001.safetensors``): with no ``..``
  component a name stays inside the folder lexically, and the check never follows links. A
  *shard* that is a symbolic link stays allowed, wherever it points (Hugging Face cache
  snapshots link every file into ``../../blobs``): the rule is about the names the index
  writes, not about what the folder's owner linked.
* **Regular files only** (:func:`regular_file_size`): a FIFO would block ``open`` forever, a
  device (``/dev/zero``) never ends.
* **Capped reads** (:func:`read_capped`): a JSON side file is read whole, so its size is
  capped (:data:`MAX_INDEX_JSON_BYTES`, :data:`MAX_CONFIG_JSON_BYTES`) before it is read.
* **Bounded JSON** (:func:`parse_json`): every way ``json.loads`` can fail on hostile input
  (bad UTF-8, bad syntax, an integer of more than 4300 digits, nesting deeper than the
  interpreter's recursion limit) is a :class:`CheckpointError` naming the file. Its peak memory
  is at most about 26 bytes per input byte (``tracemalloc``, on the worst shape known, a list
  of empty objects ``[{},{},...]``; a real safetensors header takes about 6.5),
  so the caps on what is parsed bound it.
* **No quoting of unaccepted bytes.** Messages about a file that is not (yet) accepted as a
  checkpoint file name the file and its size, never values decoded from its bytes; values
  quoted from an accepted file go through :func:`quote`, which bounds their length.

These are small wrappers around the standard library; there is no library that applies a
checkpoint's rules, which is what they are for.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from iosched._errors import CheckpointError

__all__ = [
    "CHECKPOINT_SUFFIXES",
    "MAX_CONFIG_JSON_BYTES",
    "MAX_INDEX_JSON_BYTES",
    "QUOTE_CHARS",
    "confined_name",
    "list_folder",
    "parse_json",
    "quote",
    "read_capped",
    "regular_file_size",
]

MAX_INDEX_JSON_BYTES = 64 * 1024 * 1024
"""Cap on a ``*.safetensors.index.json``: 64 MiB, about 7x the largest we know of (DeepSeek-V3's,
8.9 MB for its 91,000 tensors); parsing it costs at most ~1.7 GB (26x, module docstring)."""
MAX_CONFIG_JSON_BYTES = 16 * 1024 * 1024
"""Cap on a ``config.json``: 16 MiB. A model's config is a few kilobytes; the largest kind we
know of carries a label table (``id2label`` of ImageNet-22k classifiers, about 1 MB)."""
CHECKPOINT_SUFFIXES = (".safetensors", ".gguf", ".json")
"""Names that matter in a checkpoint folder (shards, indexes, config): one of them that cannot
be looked at is an error, not an absence."""
QUOTE_CHARS = 80
"""At most this many characters of a value quoted from a file into a message."""


def quote(value: object) -> str:
    """``value`` for a message, in at most about :data:`QUOTE_CHARS` characters: a hostile
    file can hold a 100 MB string, which has no place in an error message. A container is
    described, never rendered (its ``repr`` could cost as much as the file); a string is cut."""
    if isinstance(value, (list, tuple, dict)):
        kind = "an object" if isinstance(value, dict) else f"a {type(value).__name__}"
        return f"{kind} of {len(value)} items"
    if isinstance(value, str) and len(value) > QUOTE_CHARS:
        return repr(value[:QUOTE_CHARS]) + f"... ({len(value)} characters)"
    text = repr(value)
    return text if len(text) <= QUOTE_CHARS else text[:QUOTE_CHARS] + "..."


def confined_name(name: object, index_file: Path, entry: str) -> str:
    """``name`` if it is a plain relative file name inside the folder, else a
    :class:`CheckpointError` naming ``index_file`` and its ``entry`` (the tensor).

    Plain: a non-empty string of ``/``-separated components, none of them empty, ``.`` or
    ``..``, with no backslash, no NUL and no leading ``/``. Purely lexical: nothing on disk is
    looked at, so a link in the folder cannot change the verdict.
    """
    def bad(why: str) -> CheckpointError:
        return CheckpointError(
            f"{index_file}: entry {quote(entry)} names file {quote(name)}, which {why}; a file "
            "named by the index must be a plain relative name inside the checkpoint folder")

    if not isinstance(name, str) or not name:
        raise bad("is not a non-empty string")
    if name.startswith("/") or os.path.isabs(name):
        raise bad("is an absolute path")
    if "\\" in name or "\x00" in name:
        raise bad("holds a backslash or a NUL character")
    parts = name.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise bad("has an empty, '.' or '..' component")
    return name


def regular_file_size(path: Path, what: str) -> int:
    """The size of ``path`` (links followed), which must be a regular file; a
    :class:`CheckpointError` naming it (as ``what``) otherwise, or when it cannot be looked at
    (permissions, a name too long, a link loop)."""
    try:
        st = os.stat(path)
    except FileNotFoundError as exc:
        raise CheckpointError(f"{what} {path} does not exist") from exc
    except OSError as exc:
        raise CheckpointError(f"cannot look at {what} {path}: {exc.strerror or exc}") from exc
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{what} {path} is not a regular file")
    return st.st_size


def read_capped(path: Path, cap: int, what: str) -> bytes:
    """The bytes of the regular file ``path``, refused (a :class:`CheckpointError` naming it)
    when it holds more than ``cap`` bytes. Reads at most one byte more than its size at open
    (``read(n)`` allocates ``n`` bytes up front, so asking for the cap would cost the cap), and
    a file that grew while it was read is refused: what was parsed is what was checked."""
    size = regular_file_size(path, what)
    if size > cap:
        raise CheckpointError(f"{what} {path} is {size} bytes, more than the {cap} bytes allowed")
    try:
        with open(path, "rb") as f:
            blob = f.read(size + 1)
    except OSError as exc:
        raise CheckpointError(f"cannot read {what} {path}: {exc.strerror or exc}") from exc
    if len(blob) > size:
        raise CheckpointError(f"{what} {path} changed size while it was read")
    return blob


def parse_json(blob: bytes, path: Path, what: str) -> object:
    """``blob`` (UTF-8 JSON) as Python values; every failure a :class:`CheckpointError`
    naming ``path`` that quotes no byte of it (positions only)."""
    try:
        text = blob.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{path}: {what}: not valid JSON (not UTF-8 at byte {exc.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: {what}: not valid JSON ({exc.msg} at character {exc.pos})") from None
    except RecursionError:
        raise CheckpointError(f"{path}: {what}: not valid JSON (nested too deeply)") from None
    except ValueError:  # int(): more digits than sys.get_int_max_str_digits() allows
        raise CheckpointError(f"{path}: {what}: not valid JSON (a number with too many digits)") from None


def list_folder(folder: Path, relevant: tuple[str, ...] = CHECKPOINT_SUFFIXES) -> list[str]:
    """The names of the regular files in ``folder`` (links followed; broken links and
    subfolders left out), sorted; a :class:`CheckpointError` naming the folder when it cannot
    be listed, or naming the entry when one whose name ends in one of ``relevant`` cannot be
    looked at (permissions, a link loop): leaving such a shard out would index part of the
    checkpoint. Other entries that cannot be looked at are left out."""
    names: list[str] = []
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                try:
                    if entry.is_file():
                        names.append(entry.name)
                except OSError as exc:
                    if entry.name.endswith(relevant):
                        raise CheckpointError(
                            f"cannot look at {Path(folder) / entry.name} in checkpoint folder {folder}: "
                            f"{exc.strerror or exc}") from exc
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint folder {folder}: {exc.strerror or exc}") from exc
    return sorted(names)
