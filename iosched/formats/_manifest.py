"""The manifest: every expert extent's checksum, in a sidecar file beside the checkpoint.

Why: a mirror (or the primary) of the right size and the right header bytes can still hold
wrong bytes inside its experts (a bad copy, a flipped bit on a drive, a file patched in
place); nothing about the file's shape can tell.  ``iosched manifest CHECKPOINT``
(:func:`write_manifest`) reads every expert's extents once, with plain reads independent of
the store's read path, and writes their checksums; ``ExpertStore.open(verify="reads")``
checks every read against them (``_verify.py``).

What is checksummed: each *extent* (an expert's bytes as they sit contiguously in one file,
``ExpertLayout.extents``), not the whole expert, so a read is checked right after it lands,
on whichever replica served it, before the views are built: a safetensors expert is one
extent, a GGUF expert three.

The hash: xxHash's XXH3 (the ``xxhash`` package, the reference C implementation's binding),
128 bits by default.  Measured here (2-core AMD EPYC VM, ``docs/benchmarks.md``): 32-36 GB/s
for 36 KiB to 16 MiB buffers, ``xxh3_64`` the same within noise, against 0.9 GB/s for BLAKE2b;
so the wider digest costs nothing, and a corrupted extent passes with probability 2^-128.  It
is a checksum against accidents, not a defence against an attacker who writes the manifest
too.  ``xxh3_64`` is accepted when reading (``hash`` says which).

The file (JSON, ``FORMAT`` / ``VERSION``)::

    {"format": "iosched-manifest", "version": 1, "hash": "xxh3_128",
     "checkpoint": {"format": "safetensors", "files": [
        {"name": "model-00001-of-00002.safetensors", "size": 123, "header_bytes": 80,
         "header": "<hex digest of the bytes before the first expert>",
         "probe_offset": 80, "probe_bytes": 4096,
         "probe": "<hex digest of the first expert's first 4 KiB>"}, ...]},
     "experts": [
        [layer, expert, [[file, offset, length, "<hex digest>"], ...]],
        ...]}

``name`` is relative to the checkpoint folder (a single-file checkpoint: the file's name),
``file`` indexes ``files``.  The checkpoint's identity is its files' names, sizes, header
digests and *probe* digests (the first :data:`PROBE_BYTES` of each file's first expert: two
checkpoints of one architecture have byte-identical headers, their weights differ): a manifest
whose identity or extents differ from the checkpoint's is a :class:`CheckpointError` naming the
manifest, so one checkpoint's manifest is never used for another.  Checking it at open reads
each file's header and one 4 KiB probe.  ``format`` is the first key the writer writes, so a file is recognised as a
manifest from its first bytes (``iosched manifest`` never overwrites anything else).
Default place (:func:`default_manifest_path`): ``iosched.manifest.json`` inside the checkpoint
folder, ``NAME.iosched.manifest.json`` beside a single-file checkpoint; ``--out`` /
``manifest=`` for anywhere else (a read-only Hugging Face cache, say).
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import xxhash

from iosched._atomic import StagedFile
from iosched._errors import CheckpointError, StoreError
from iosched._layout import CheckpointIndex, ExpertKey

from ._checkpoint import load_index
from ._mirrors import header_ends

FORMAT = "iosched-manifest"
VERSION = 1
MANIFEST_NAME = "iosched.manifest.json"
HASHES: Mapping[str, Callable[[Any], int]] = {
    "xxh3_128": xxhash.xxh3_128_intdigest,
    "xxh3_64": xxhash.xxh3_64_intdigest,
}
"""Digest functions by the name a manifest records; each takes any buffer (bytes, a
memoryview of a slab or of a mapping) and returns the digest as an integer."""
DIGEST_BITS: Mapping[str, int] = {"xxh3_128": 128, "xxh3_64": 64}
DEFAULT_HASH = "xxh3_128"
PROBE_BYTES = 4096
"""Expert bytes of each file hashed into the identity: one page, one read per file at open."""
_SIGNATURE = re.compile(rb'\A\s*\{\s*"format"\s*:\s*"' + FORMAT.encode() + rb'"')


def hex_digest(hash_name: str, value: int) -> str:
    """``value`` as the fixed-width lowercase hex a manifest and an error message show."""
    return f"{value:0{DIGEST_BITS[hash_name] // 4}x}"


@dataclass(frozen=True)
class Manifest:
    """A manifest read back and matched to a checkpoint index (:func:`load_manifest`)."""

    path: str
    hash_name: str
    checksums: Mapping[tuple[int, int], tuple[int, int]]
    """``(file, offset)`` of each extent (``file`` indexes the checkpoint index's ``files``)
    to its ``(length, digest)``."""

    def digest(self, data: Any) -> int:
        return HASHES[self.hash_name](data)

    def hex(self, value: int) -> str:
        return hex_digest(self.hash_name, value)


@dataclass(frozen=True)
class ManifestSummary:
    """What :func:`write_manifest` wrote (``iosched manifest --json`` prints it)."""

    manifest: str
    checkpoint: str
    format: str
    hash: str
    files: int
    experts: int
    extents: int
    bytes: int
    """Expert bytes read and hashed."""
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def default_manifest_path(index: CheckpointIndex) -> str:
    """``iosched.manifest.json`` in a checkpoint folder; ``NAME.iosched.manifest.json``
    beside a single-file checkpoint ``NAME``."""
    root = os.path.abspath(index.root)
    if os.path.isdir(root):
        return os.path.join(root, MANIFEST_NAME)
    return f"{root}.{MANIFEST_NAME}"


def _file_names(index: CheckpointIndex) -> list[str]:
    root = os.path.abspath(index.root)
    if os.path.isdir(root):
        return [os.path.relpath(path, root) for path in index.files]
    return [os.path.basename(path) for path in index.files]


def _probes(index: CheckpointIndex) -> list[tuple[int, int]]:
    """Per file: its first expert extent's offset, and how many of its bytes the probe hashes."""
    first: list[tuple[int, int] | None] = [None] * len(index.files)
    for layout in index.experts.values():
        for ext in layout.extents:
            seen = first[ext.file]
            if seen is None or ext.offset < seen[0]:
                first[ext.file] = (ext.offset, min(PROBE_BYTES, ext.length))
    return [probe or (0, 0) for probe in first]


def _identity(index: CheckpointIndex, hash_name: str) -> list[dict[str, Any]]:
    """Per file: its name, size, and the digests of its header bytes (before its first expert)
    and of its first expert's first :data:`PROBE_BYTES`."""
    digest = HASHES[hash_name]
    rows = []
    for name, path, size, end, (at, n) in zip(_file_names(index), index.files, index.file_sizes,
                                              header_ends(index), _probes(index), strict=True):
        try:
            with open(path, "rb") as f:
                head = f.read(end)
                f.seek(at)
                probe = f.read(n)
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot read its header: {exc.strerror or exc}") from exc
        rows.append({"name": name, "size": size, "header_bytes": end,
                     "header": hex_digest(hash_name, digest(head)),
                     "probe_offset": at, "probe_bytes": n, "probe": hex_digest(hash_name, digest(probe))})
    return rows


def is_manifest_file(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` starts like a manifest this module wrote (its first key is ``format``)."""
    with open(path, "rb") as f:
        return _SIGNATURE.match(f.read(256)) is not None


def _hash_extents(index: CheckpointIndex, hash_name: str,
                  on_bytes: Callable[[int], None] | None) -> dict[ExpertKey, list[list[Any]]]:
    """Every extent's digest, read in file order (sequential reads, one buffer reused)."""
    digest = HASHES[hash_name]
    jobs = sorted(((ext.file, ext.offset, ext.length, key, i)
                   for key, layout in index.experts.items() for i, ext in enumerate(layout.extents)))
    rows: dict[ExpertKey, list[list[Any]]] = {key: [[] for _ in layout.extents]
                                             for key, layout in index.experts.items()}
    buf = bytearray(max((job[2] for job in jobs), default=0))
    view = memoryview(buf)
    handles: dict[int, Any] = {}
    try:
        for file, offset, length, key, i in jobs:
            f = handles.get(file)
            if f is None:
                f = handles[file] = open(index.files[file], "rb", buffering=0)
            f.seek(offset)
            got = f.readinto(view[:length]) or 0
            while got < length:
                more = f.readinto(view[got:length]) or 0
                if more == 0:
                    raise CheckpointError(f"{index.files[file]}: the file ends at {offset + got}, "
                                          f"inside the extent of expert {key!r} ({length} bytes at {offset})")
                got += more
            rows[key][i] = [file, offset, length, hex_digest(hash_name, digest(view[:length]))]
            if on_bytes is not None:
                on_bytes(length)
    except OSError as exc:
        raise CheckpointError(f"{exc.filename or index.root}: cannot read: {exc.strerror or exc}") from exc
    finally:
        for f in handles.values():
            f.close()
    return rows


def _write_file(path: str, text: str) -> None:
    """Replace ``path`` by the manifest ``text``, atomically (:mod:`iosched._atomic`): a
    reader sees the old manifest or the new one, never half of one."""
    try:
        staged = StagedFile(path, prefix=".iosched-manifest-", suffix=".tmp")
    except OSError as exc:
        raise StoreError(f"cannot write the manifest {path}: {exc.strerror or exc}; "
                         "write it elsewhere (iosched manifest --out PATH, then open(manifest=PATH))") from exc
    with staged:
        staged.file.write(text.encode("utf-8"))


def _writable_target(path: str) -> None:
    """Refuse to replace anything but a manifest (a checkpoint shard, a user's file)."""
    if os.path.isdir(path):
        raise StoreError(f"{path} is a folder; give the manifest's file name")
    if os.path.lexists(path) and not (os.path.isfile(path) and is_manifest_file(path)):
        raise StoreError(f"{path} exists and is not an iosched manifest; it is left as it is "
                         "(remove it, or choose another --out)")
    if not os.path.isdir(os.path.dirname(path) or "."):
        raise StoreError(f"cannot write the manifest {path}: its folder does not exist")


def write_manifest(source: str | os.PathLike[str], out: str | os.PathLike[str] | None = None, *,
                   hash_name: str = DEFAULT_HASH,
                   on_bytes: Callable[[int], None] | None = None) -> ManifestSummary:
    """Read every expert extent of the checkpoint ``source`` and write their checksums to
    ``out`` (default :func:`default_manifest_path`), atomically; an existing manifest there is
    replaced, any other file is refused (:class:`StoreError`).  ``on_bytes(n)`` is called as
    each extent of ``n`` bytes is hashed (a progress bar).  Synchronous: it reads the whole
    expert set once, at the drive's sequential speed."""
    if hash_name not in HASHES:
        raise StoreError(f"unknown hash {hash_name!r}; choose one of {', '.join(HASHES)}")
    t0 = time.perf_counter()
    index = load_index(source)
    path = os.path.abspath(os.fspath(out)) if out is not None else default_manifest_path(index)
    _writable_target(path)
    identity = _identity(index, hash_name)
    rows = _hash_extents(index, hash_name, on_bytes)
    head = {"format": FORMAT, "version": VERSION, "hash": hash_name,
            "checkpoint": {"format": index.format, "files": identity}}
    lines = [json.dumps([key[0], key[1], rows[key]], separators=(",", ":")) for key in sorted(rows)]
    text = json.dumps(head)[:-1] + ', "experts": [\n' + ",\n".join(lines) + "\n]}\n"
    _write_file(path, text)
    extents = sum(len(r) for r in rows.values())
    nbytes = sum(ext.length for layout in index.experts.values() for ext in layout.extents)
    return ManifestSummary(path, os.path.abspath(index.root), index.format, hash_name, len(index.files),
                           len(rows), extents, nbytes, time.perf_counter() - t0)


def _read_doc(path: str, index: CheckpointIndex) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"manifest {path} does not exist; write it with `iosched manifest "
                              f"{index.root}` (--out PATH to put it elsewhere)") from None
    except OSError as exc:
        raise CheckpointError(f"manifest {path}: cannot read: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise CheckpointError(f"manifest {path} is not valid JSON: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not an iosched manifest")
    if doc.get("version") != VERSION:
        raise CheckpointError(f"manifest {path} has version {doc.get('version')!r}; this iosched "
                              f"reads version {VERSION} (write it again with `iosched manifest`)")
    if doc.get("hash") not in HASHES:
        raise CheckpointError(f"manifest {path}: unknown hash {doc.get('hash')!r}")
    return doc


def _match_files(path: str, doc: dict[str, Any], index: CheckpointIndex) -> list[int]:
    """The index's file number of each manifest file; refuses another checkpoint's manifest."""
    hash_name = str(doc["hash"])
    mine = {row["name"]: (i, row) for i, row in enumerate(_identity(index, hash_name))}
    theirs = doc["checkpoint"]["files"]
    names = [str(row["name"]) for row in theirs]
    if sorted(names) != sorted(mine):
        raise CheckpointError(
            f"manifest {path} is not of this checkpoint: it lists the files {sorted(names)}, "
            f"{index.root} has {sorted(mine)}")
    order = []
    for row in theirs:
        i, own = mine[row["name"]]
        if int(row["size"]) != own["size"]:
            raise CheckpointError(f"manifest {path} is not of this checkpoint: it was written for "
                                  f"{row['name']} of {row['size']} bytes, {index.files[i]} is {own['size']}")
        if row["header"] != own["header"]:
            raise CheckpointError(f"manifest {path} is not of this checkpoint: the header of "
                                  f"{index.files[i]} differs from the one it was written for")
        if (row["probe_offset"], row["probe_bytes"], row["probe"]) != (
                own["probe_offset"], own["probe_bytes"], own["probe"]):
            raise CheckpointError(
                f"manifest {path} is not of this checkpoint: the first {own['probe_bytes']} expert "
                f"bytes of {index.files[i]} (at {own['probe_offset']}) differ from those it was written "
                "for (another checkpoint of the same layout, or the file changed since)")
        order.append(i)
    return order


def load_manifest(path: str | os.PathLike[str], index: CheckpointIndex) -> Manifest:
    """Read the manifest at ``path`` and match it to ``index``: the same files (names, sizes,
    header digests) and exactly the same experts and extents, else a :class:`CheckpointError`
    naming the manifest."""
    where = os.path.abspath(os.fspath(path))
    doc = _read_doc(where, index)
    try:
        files = _match_files(where, doc, index)
        checksums: dict[tuple[int, int], tuple[int, int]] = {}
        seen: set[ExpertKey] = set()
        for layer, expert, extents in doc["experts"]:
            key = (int(layer), int(expert))
            layout = index.experts.get(key)
            listed = [(files[int(f)], int(off), int(n)) for f, off, n, _ in extents]
            if layout is None:
                raise CheckpointError(f"manifest {where} is not of this checkpoint: it lists expert "
                                      f"{key!r}, which {index.root} does not have")
            if listed != [(e.file, e.offset, e.length) for e in layout.extents]:
                raise CheckpointError(f"manifest {where} is not of this checkpoint: expert {key!r} "
                                      f"has other extents in {index.root}")
            seen.add(key)
            for (file, offset, length), (*_, digest) in zip(listed, extents, strict=True):
                checksums[(file, offset)] = (length, int(digest, 16))
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise CheckpointError(f"manifest {where} is malformed: {exc!r}") from exc
    missing = set(index.experts) - seen
    if missing:
        raise CheckpointError(f"manifest {where} is not of this checkpoint: it lacks {len(missing)} "
                              f"experts, {min(missing)!r} the first")
    return Manifest(where, str(doc["hash"]), checksums)
