"""Verified bytes: every read checked against the manifest, and mirrors sampled at open.

``ExpertStore.open(verify="reads")`` gives the read path (``_io.ReadPath``) a
:class:`Verifier`.  After each extent lands (in a slab, or mapped by the zero-copy backend),
and before any view of it is built, the read path hashes the extent's bytes and compares them
with the manifest's digest (``_manifest.py``):

* **match**: ``verified_bytes`` grows; the extent may be published.
* **mismatch** on a replica: ``verify_mismatches`` grows, that (replica, extent) is marked bad
  (tried last for that extent from then on, while the replica keeps serving its other extents;
  one verified read from it clears the mark), the mismatch counts as the replica's read error
  (``per_replica`` / ``per_device`` ``errors``, and towards the router's degraded mark), and
  the extent is read again from the next replica (``verify_retries``).  When every replica
  mismatched, the last one's :class:`ChecksumError` (a :class:`ReadError`) names the file, the
  extent (offset, length) and both digests; the load fails as any failed read does, and every
  other expert stays available.
* **striped** reads (one extent from several replicas at once) cannot say which leg was wrong:
  a mismatch there marks nobody, counts one mismatch and one retry, and the extent is read
  again whole through the failover path above, which can.

Hashing runs on the event loop for extents under :data:`THREAD_BYTES`, in a worker thread
above it (``xxhash`` releases the GIL), so one check never holds the loop longer than about
the time a thread round trip costs.  With verify on, a resident expert's hit path is
unchanged: only loads hash.

:func:`sample_mirrors` (``verify_mirrors=N``) compares, at open, ``N`` experts chosen with a
fixed seed: each mirror's copy of their extents against the manifest's digest when a manifest
is loaded, else against the primary's bytes.  A difference refuses the open with a
:class:`MirrorError` naming the mirror's file and the expert, like a mirror whose header
differs: a mirror known to hold wrong bytes is not one to route reads to.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import random
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from iosched import _settings
from iosched._errors import ChecksumError, InvariantError, StoreError
from iosched._layout import CheckpointIndex

from ._manifest import DEFAULT_HASH, HASHES, Manifest, default_manifest_path, hex_digest, load_manifest
from ._mirrors import MirrorError

log = logging.getLogger("iosched")

MODES = ("off", "reads")
"""``verify=``: ``off`` (no check), ``reads`` (every read checked against the manifest)."""
THREAD_BYTES = 4 << 20
"""Extents of at least this many bytes are hashed in a worker thread, smaller ones on the
loop.  Measured (``iosched bench-verify``'s ``hash_placement_us``, docs/benchmarks.md,
"Verified reads"): a ``to_thread`` round trip costs 35-65 µs over the hash itself; 4 MiB
hashes in 66 µs on the loop, 16 MiB in 315 µs.  So below 4 MiB the loop is held no longer
than a round trip would cost, and above it a load no longer holds up the hits of others."""
SAMPLE_SEED = 0
"""The experts ``verify_mirrors`` samples: ``random.Random(SAMPLE_SEED).sample`` of the sorted
keys, the same ones at every open of the same checkpoint."""


async def _in_thread(fn: Any, data: Any) -> int:
    """``fn(data)`` in a worker thread; if the caller is cancelled, still wait for the thread
    (it reads ``data``, a slab the store would otherwise recycle at once)."""
    fut = asyncio.ensure_future(asyncio.to_thread(fn, data))
    try:
        return int(await asyncio.shield(fut))
    except asyncio.CancelledError:
        while not fut.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({fut})
        if not fut.cancelled():
            fut.exception()  # retrieved: the cancellation is what we report
        raise


class Verifier:
    """Checks extents against a manifest and keeps the counters ``stats()`` reports."""

    def __init__(self, manifest: Manifest, paths: Sequence[str]) -> None:
        """``paths``: the backend's files (every replica's), by the index ``Replica.file``."""
        self.manifest = manifest
        self._digest = HASHES[manifest.hash_name]
        self._paths = list(paths)
        self.bad: set[tuple[int, int]] = set()
        """``(backend file, extent offset)`` pairs whose last read did not match."""
        self._warned: set[str] = set()
        self.verified_bytes = 0
        self.mismatches = 0
        self.retries = 0
        self.seconds = 0.0

    def is_bad(self, replica_file: int, offset: int) -> bool:
        return (replica_file, offset) in self.bad

    async def digest(self, data: Any) -> int:
        t0 = time.perf_counter()
        value = (self._digest(data) if len(data) < THREAD_BYTES
                 else await _in_thread(self._digest, data))
        self.seconds += time.perf_counter() - t0
        return value

    def _expected(self, file: int, offset: int, length: int) -> int:
        entry = self.manifest.checksums.get((file, offset))
        if entry is None or entry[0] != length:
            raise InvariantError(f"no manifest checksum for {length} bytes at {offset} of file {file}")
        return entry[1]

    async def check(self, key: Hashable, replica_file: int, file: int, offset: int, data: Any) -> None:
        """Hash ``data``, the extent of checkpoint file ``file`` at ``offset`` as replica file
        ``replica_file`` served it; a :class:`ChecksumError` when it differs from the manifest
        (the (replica, extent) pair is then marked bad)."""
        want = self._expected(file, offset, len(data))
        got = await self.digest(data)
        mark = (replica_file, offset)
        if got == want:
            self.verified_bytes += len(data)
            self.bad.discard(mark)
            return
        self.mismatches += 1
        path = self._paths[replica_file]
        self.bad.add(mark)
        if path not in self._warned:  # once per file: a bad copy would otherwise flood the log
            self._warned.add(path)
            log.warning("%s: the extent at %d (%d bytes) of expert %r does not match the manifest: "
                        "read from another replica if there is one; later mismatches of this file are "
                        "counted in stats()['verify_mismatches'], not logged", path, offset, len(data), key)
        raise ChecksumError(
            f"{path}: the extent of expert {key!r} at offset {offset} ({len(data)} bytes) does not "
            f"match the manifest {self.manifest.path}: {self.manifest.hash_name} expected "
            f"{self.manifest.hex(want)}, read {self.manifest.hex(got)}")

    async def matches(self, file: int, offset: int, data: Any) -> bool:
        """Whether ``data`` (a striped read, no replica to blame) matches; a mismatch counts
        one mismatch and one retry (the caller reads the extent again whole)."""
        if await self.digest(data) == self._expected(file, offset, len(data)):
            self.verified_bytes += len(data)
            return True
        self.mismatches += 1
        self.retries += 1
        return False


def _pread(path: str, offset: int, length: int) -> bytes:
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        data = f.read(length)
    return data


def sample_mirrors(index: CheckpointIndex, replicas: Sequence[Sequence[str]], manifest: Manifest | None,
                   n: int) -> int:
    """Compare ``n`` sampled experts' extents on every mirror (``replicas[i][1:]``) with the
    manifest, or the primary (``replicas[i][0]``) without one; the extents compared.  A
    mismatch raises :class:`MirrorError` naming the mirror's file, the expert and the extent."""
    keys = sorted(index.experts)
    chosen = random.Random(SAMPLE_SEED).sample(keys, min(n, len(keys)))
    name = manifest.hash_name if manifest is not None else DEFAULT_HASH
    digest = HASHES[name]
    compared = 0
    for key in chosen:
        for ext in index.experts[key].extents:
            copies = replicas[ext.file][1:]
            if not copies:
                continue
            if manifest is not None:
                want, against = manifest.checksums[(ext.file, ext.offset)][1], f"the manifest {manifest.path}"
            else:
                want, against = digest(_pread(replicas[ext.file][0], ext.offset, ext.length)), \
                    f"its primary {replicas[ext.file][0]}"
            for copy in copies:
                got = digest(_pread(copy, ext.offset, ext.length))
                compared += 1
                if got != want:
                    raise MirrorError(
                        f"mirror file {copy} does not match {against}: expert {key!r}, the extent at "
                        f"offset {ext.offset} ({ext.length} bytes): {name} {hex_digest(name, want)} "
                        f"expected, {hex_digest(name, got)} read (verify_mirrors sampled it)")
    return compared


@dataclass(frozen=True)
class Verification:
    """What ``open`` decided about verification (``stats()`` reports it): the mode, the
    manifest loaded (if any), the experts ``verify_mirrors`` asked to sample and the extents
    it compared."""

    mode: str = "off"
    manifest: Manifest | None = None
    mirrors: int = 0
    mirror_samples: int = 0

    def sample(self, index: CheckpointIndex, replicas: Sequence[Sequence[str]]) -> Verification:
        """After the mirrors were matched: the sampled comparison (``MirrorError`` on a
        difference)."""
        if self.mirrors == 0 or all(len(row) == 1 for row in replicas):
            return self
        return dataclasses.replace(self, mirror_samples=sample_mirrors(index, replicas, self.manifest,
                                                                       self.mirrors))

    def verifier(self, paths: Sequence[str]) -> Verifier | None:
        """The read path's verifier (``paths``: the backend's files), ``None`` unless ``reads``."""
        if self.mode != "reads":
            return None
        if self.manifest is None:
            raise InvariantError("verify='reads' without a manifest")
        return Verifier(self.manifest, paths)


def check_arguments(verify: str | None, verify_mirrors: int | None) -> None:
    """``open``'s checks that need no file."""
    if verify is not None and verify not in MODES:
        raise StoreError(f"verify must be one of {', '.join(MODES)}, got {verify!r}")
    n = verify_mirrors
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
        raise StoreError(f"verify_mirrors must be a non-negative integer, got {n!r}")


def prepare(index: CheckpointIndex, verify: str | None, manifest: str | os.PathLike[str] | None,
            verify_mirrors: int | None) -> Verification:
    """The mode and the manifest: ``manifest`` when given (always read and matched to the
    checkpoint, so a wrong one is refused at once), else the default one
    (:func:`~iosched.formats._manifest.default_manifest_path`) when ``verify="reads"`` needs it
    (missing: a :class:`CheckpointError` saying how to write it) or when ``verify_mirrors``
    can use it (if it exists)."""
    mode = str(_settings.get("verify")) if verify is None else verify
    n = int(_settings.get("verify_mirrors")) if verify_mirrors is None else verify_mirrors
    path: str | os.PathLike[str] | None = manifest
    if path is None:
        default = default_manifest_path(index)
        if mode == "reads" or (n > 0 and os.path.exists(default)):
            path = default
    loaded = None if path is None else load_manifest(path, index)
    return Verification(mode, loaded, n)
