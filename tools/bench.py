"""``iosched bench``: random reads of one block size at one queue depth, per backend.

Why a benchmark of its own: the store's choices (which backend, how many reads in flight,
``pread_threads``) should rest on measured throughput and tail latency for the reads it
actually makes (MiB-sized, random, page-aligned) through the same backend objects and the
same event loop, not on a C tool's numbers.  ``--fio`` runs fio on the same file, sizes and
depths next to ours, so ``ratio`` says how much of the drive the Python path leaves unused.

What one run does: ``qd`` reader coroutines, each with its own page-aligned buffer
(``mmap.mmap(-1, bs)``, as the store's slabs), loop read -> record latency until ``seconds``
have passed.  Offsets are uniform random multiples of ``max(4096, backend.alignment)`` (not
of ``bs``: experts do not start on block-size boundaries) in ``[0, file_size - bs]``, from a
fixed seed per reader, so every backend and the naive arm read the same offsets.  The
backend's thread pool is sized to ``qd`` (setting ``pread_threads``) so the depth asked for
is the depth the drive sees.  A zero-copy backend (``mmap``) is driven through ``map`` +
``unmap``, the calls the store makes, rather than ``read``.

The naive arm (``--backend naive``) is what a user writes by hand: ``aiofiles.open`` per
reader, ``await f.seek(off); await f.read(bs)``.  aiofiles has no ``pread`` and runs every
call on the loop's default executor (``min(32, cpus + 4)`` threads): that is the point.

Page cache: buffered numbers of a file that fits in RAM measure memory, not the drive, so
the file is dropped from the page cache (``posix_fadvise(DONTNEED)``) before every run by
default (``--no-drop-cache`` to keep it) and the output says whether the file fits in RAM
and how much of it was cached when the run started.

``--sweep`` runs backends x block sizes x depths, ``--reps`` times *interleaved* (rep 1 of
every configuration, then rep 2, ...) so slow drift (thermal, a neighbour, the host's cache)
spreads over all configurations instead of biasing one, and reports medians.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import mmap
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np

from iosched import BackendUnavailable, ReadError, StoreError, backends, settings
from iosched.backends import Backend, Caps, ZeroCopyBackend
from iosched.topology import drive_of

from . import _command, _runner
from ._progress import run_progress
from .fio import FioError, FioJob, fio_version, require_fio, run_fio

NAIVE = "naive"
"""The hand-written aiofiles arm; not a backend in ``backends/``."""
DEFAULT_SEED = 1
DEFAULT_FILE_SIZE = "1G"
SWEEP_BS = ("64K", "256K", "1M", "4M", "16M")
SWEEP_QD = (1, 2, 4, 8, 16, 32, 64)
MIN_ALIGN = 4096
"""Offsets are multiples of this (or of the backend's alignment, if larger): a page, and a
multiple of every common logical block size, so O_DIRECT reads need no rounding."""
FILE_VERSION = 1
"""Bump when the generated test file's contents change, so old caches are not reused."""

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*(?:([kmgt])(i?)b?|b?)\s*$", re.IGNORECASE)


# ---------------------------------------------------------------------------------------------
# sizes, files, the page cache


def parse_size(text: str) -> int:
    """Bytes in ``text``: ``4096``, ``64k``, ``64K``, ``4M``, ``4MiB``, ``1G``.

    Suffixes are binary (``k`` = 1024), as in fio (its default ``kb_base=1024``), so ``--bs``
    means the same to both arms.  Raises :class:`StoreError` naming the text.
    """
    match = _SIZE_RE.match(text)
    if match is None or int(match.group(1)) <= 0:
        raise StoreError(f"bad size {text!r}: expected a positive byte count such as 4096, 64k, 4M or 4MiB")
    return int(match.group(1)) * _UNITS[(match.group(2) or "").lower()]


def human_size(n: int) -> str:
    """``n`` bytes for people: ``16 MiB`` (binary units spelled out, since MB/s here is 10^6)."""
    for suffix, unit in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= unit:
            value = n / unit
            return f"{value:.0f} {suffix}" if value == int(value) else f"{value:.1f} {suffix}"
    return f"{n} B"


def format_size(n: int) -> str:
    """``n`` bytes with the largest binary suffix that divides it exactly (``1048576`` -> ``1M``)."""
    for suffix, unit in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n % unit == 0 and n >= unit:
            return f"{n // unit}{suffix}"
    return str(n)


def _parse_list(text: str, parse: Callable[[str], Any], what: str) -> list[Any]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise StoreError(f"{what}: empty list {text!r}")
    return [parse(item) for item in items]


def _parse_qd(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise StoreError(f"bad queue depth {text!r}: expected a positive integer")
    return value


def mem_info() -> dict[str, int]:
    """MemTotal and MemAvailable in bytes (empty where /proc/meminfo is missing)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("MemTotal", "MemAvailable"):
                    out[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def drop_page_cache(path: str) -> None:
    """Ask the kernel to forget the file's clean cached pages, so reads go to the drive.

    Under a virtual machine the host may still cache the disk image; ``cached_fraction`` only
    sees this kernel's page cache.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def cached_fraction(path: str) -> float | None:
    """Share of the file's pages in the page cache now (``mincore``), or ``None`` if unknown.

    Why: proves the drop worked, and tells a reader of a buffered result whether it measured
    the drive or memory.
    """
    try:
        size = os.path.getsize(path)
        if size == 0:
            return 0.0
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        finally:
            os.close(fd)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            return None
        try:
            pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vec = np.zeros(pages, dtype=np.uint8)
            if libc.mincore(addr, size, vec.ctypes.data) != 0:
                return None
            return float(np.count_nonzero(vec & 1)) / pages
        finally:
            libc.munmap(addr, size)
    except (OSError, AttributeError):
        return None


def check_file(path: str) -> int:
    """The size of an existing regular file, or a :class:`StoreError` naming it."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise StoreError(f"{path}: no such file (bench reads an existing file; omit --file to "
                         f"use a generated one)") from None
    except OSError as exc:
        raise StoreError(f"{path}: cannot stat: {exc.strerror or exc}") from None
    if not os.path.isfile(path):
        raise StoreError(f"{path}: not a regular file")
    return st.st_size


def default_test_file(size: int) -> Path:
    """A file of ``size`` random bytes in the cache folder, made on first use and reused.

    Random, not zeros: a drive or filesystem that compresses or dedupes (and sparse files)
    would make zeros look fast.  Written to a temporary name and renamed, so an interrupted
    run never leaves a short file behind that a later run would trust.
    """
    from .demo import cache_dir

    folder = cache_dir()
    path = folder / f"bench-v{FILE_VERSION}-{format_size(size)}.bin"
    if path.is_file() and path.stat().st_size == size:
        return path
    folder.mkdir(parents=True, exist_ok=True)
    print(f"iosched bench: writing a {human_size(size)} test file of random bytes to {path} "
          f"(once; later runs reuse it)", file=sys.stderr)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    rng = np.random.default_rng(DEFAULT_SEED)
    chunk = 64 << 20
    try:
        with open(tmp, "wb") as f:
            left = size
            while left > 0:
                n = min(chunk, left)
                f.write(rng.bytes(n))
                left -= n
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def machine_info(path: str) -> dict[str, Any]:
    """Facts a reader needs to compare two results: CPUs, memory, kernel, the drive."""
    mem = mem_info()
    out: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "mem_total_bytes": mem.get("MemTotal"),
        "mem_available_bytes": mem.get("MemAvailable"),
        "kernel": platform.release(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "loop": _runner.loop_factory()[0],
        "fio": fio_version(),
    }
    try:
        out["device"] = drive_of(path).as_dict()  # as `iosched topology` reports the drive
    except Exception:  # the device facts are informative only
        pass
    return out


# ---------------------------------------------------------------------------------------------
# backends


def _make_backend(name: str, direct: bool | None, qd: int) -> tuple[Backend, str, bool]:
    """A new, unopened backend for ``name`` in the caching mode asked for, the name it runs
    under, and whether its reads bypass the page cache (``Caps.DIRECT``, which the uring
    backend keeps truthful per instance).

    ``direct``: ``None`` takes the backend as ``backends.create`` makes it (what the store
    would run: uring is O_DIRECT by default); ``True`` maps ``pread`` to ``odirect`` and gives
    ``uring`` ``direct=True``; ``False`` gives ``uring`` ``direct=False``.  ``mmap`` cannot
    bypass the page cache and ``odirect`` cannot use it: asking is a
    :class:`BackendUnavailable`, as is a backend ``backends.available()`` rules out (with its
    reason).  Thread pools are sized to ``qd`` (setting ``pread_threads``) and the uring
    ring's CQ to at least ``qd``, so the depth asked for is the depth the drive sees.
    """
    if name == "auto":
        name, _ = backends.resolve("auto")
    effective = "odirect" if (direct and name == "pread") else name
    if direct and effective == "mmap":
        raise BackendUnavailable("backend 'mmap' cannot bypass the page cache (a mapping is the "
                                 "page cache); drop --direct")
    if direct is False and effective == "odirect":
        raise BackendUnavailable("backend 'odirect' always bypasses the page cache; drop --buffered")
    backends.resolve(effective)  # unknown or unavailable: BackendUnavailable with the reason
    kwargs: dict[str, Any] = {}
    if effective == "uring":
        if direct is not None:
            kwargs["direct"] = direct
        if qd > 64:  # the ring keeps at most 2 * entries reads in flight (its CQ size)
            kwargs["entries"] = 1 << (qd - 1).bit_length()
    with settings.override(pread_threads=max(1, qd)):
        if kwargs:  # a caching mode or ring size other than the store's: the class takes them
            from iosched.backends.uring import UringBackend

            backend: Backend = UringBackend(**kwargs)
        else:
            backend = backends.create(effective)
    return backend, effective, Caps.DIRECT in backend.caps


def _probe(name: str, direct: bool | None, path: str) -> tuple[str, bool, int]:
    """Open ``name`` on ``path`` once: (reported name, bypasses the page cache, offset
    alignment).  Fails early, before a sweep spends minutes, for a backend that cannot run."""
    if name == NAIVE:
        if direct:
            raise BackendUnavailable("the naive arm reads through aiofiles, which opens files "
                                     "buffered; it has no --direct")
        return NAIVE, False, MIN_ALIGN
    backend, effective, is_direct = _make_backend(name, direct, 1)
    try:
        backend.open([path])
        align = max(MIN_ALIGN, backend.alignment(0))
    finally:
        backend.close()
    return effective, is_direct, align


# ---------------------------------------------------------------------------------------------
# one run


@dataclass(frozen=True)
class RunSpec:
    file: str
    file_size: int
    backend: str
    """As asked (``pread``, ``odirect``, ``mmap``, ``uring``, ``auto`` or ``naive``)."""
    bs: int
    qd: int
    seconds: float
    direct: bool | None = None
    """``True`` --direct, ``False`` --buffered, ``None`` each backend's own default."""
    drop_cache: bool = True
    seed: int = DEFAULT_SEED


@dataclass
class _Samples:
    latencies: list[list[float]]
    elapsed: float
    loop_cpu: float
    process_cpu: float


ReadAt = Callable[[int], Awaitable[int]]
"""One reader's read: offset -> bytes read."""


def _offsets(seed: int, reader: int, slots: int, align: int) -> Iterator[int]:
    """Reader ``reader``'s endless stream of random aligned offsets (same for every arm)."""
    rng = np.random.default_rng([seed, reader])
    while True:
        yield from (rng.integers(0, slots, size=1024, dtype=np.int64) * align).tolist()


async def _drive(readers: Sequence[ReadAt], spec: RunSpec, align: int) -> _Samples:
    """Run every reader until ``spec.seconds`` have passed; each keeps one read in flight."""
    slots = (spec.file_size - spec.bs) // align + 1
    loop_cpu0, proc_cpu0 = time.thread_time(), time.process_time()
    t_start = time.perf_counter()
    deadline = t_start + spec.seconds

    async def one(i: int, read_at: ReadAt) -> list[float]:
        lat: list[float] = []
        offsets = _offsets(spec.seed, i, slots, align)
        clock = time.perf_counter
        while clock() < deadline:
            offset = next(offsets)
            t0 = clock()
            n = await read_at(offset)
            lat.append(clock() - t0)
            if n != spec.bs:
                raise ReadError(f"{spec.file}: read of {spec.bs} bytes at offset {offset} "
                                f"returned {n}")
        return lat

    tasks = [asyncio.ensure_future(one(i, r)) for i, r in enumerate(readers)]
    try:
        latencies = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # backends finish their reads first
        raise
    elapsed = time.perf_counter() - t_start
    return _Samples(list(latencies), elapsed, time.thread_time() - loop_cpu0,
                    time.process_time() - proc_cpu0)


def _backend_readers(backend: Backend, spec: RunSpec,
                     bufs: Sequence[memoryview]) -> tuple[list[ReadAt], str]:
    if Caps.ZERO_COPY in backend.caps:
        zc = cast(ZeroCopyBackend, backend)  # Caps.ZERO_COPY promises map/unmap

        async def map_at(offset: int) -> int:
            view = await zc.map(0, offset, spec.bs)
            n = view.nbytes
            del view
            zc.unmap(0, offset, spec.bs)
            return n

        return [map_at] * spec.qd, "map+unmap"

    def reader(buf: memoryview) -> ReadAt:
        async def read_at(offset: int) -> int:
            return await backend.read(0, offset, spec.bs, buf)

        return read_at

    return [reader(buf) for buf in bufs], "read"


async def _naive(spec: RunSpec, align: int) -> _Samples:
    """The hand-written arm: one aiofiles file object per reader, seek then read."""
    import aiofiles

    files = [await aiofiles.open(spec.file, "rb") for _ in range(spec.qd)]
    try:
        def reader(f: Any) -> ReadAt:
            async def read_at(offset: int) -> int:
                await f.seek(offset)
                data: bytes = await f.read(spec.bs)
                return len(data)

            return read_at

        return await _drive([reader(f) for f in files], spec, align)
    finally:
        for f in files:
            await f.close()


def _summary(spec: RunSpec, samples: _Samples) -> dict[str, Any]:
    lat = np.concatenate([np.asarray(x, dtype=np.float64) for x in samples.latencies]) * 1e3
    reads = int(lat.size)
    if reads == 0:
        raise StoreError(f"{spec.file}: no read completed in {spec.seconds} s")
    p50, p90, p99 = (float(v) for v in np.percentile(lat, [50, 90, 99]))
    nbytes = reads * spec.bs
    return {
        "bs": spec.bs, "qd": spec.qd, "reads": reads, "bytes": nbytes,
        "seconds": samples.elapsed, "mbps": nbytes / samples.elapsed / 1e6,
        "iops": reads / samples.elapsed,
        "p50_ms": p50, "p90_ms": p90, "p99_ms": p99,
        "mean_ms": float(lat.mean()), "max_ms": float(lat.max()),
        "python_overhead_us": samples.loop_cpu / reads * 1e6,
        "cpu_us_per_read": samples.process_cpu / reads * 1e6,
    }


def run_once(spec: RunSpec) -> dict[str, Any]:
    """One timed run of ``spec``: the contract's keys plus latency detail and CPU per read.

    ``python_overhead_us`` is the event-loop thread's CPU time per read (the Python side:
    scheduling, futures, the bench's own bookkeeping); ``cpu_us_per_read`` is the whole
    process's, worker threads and kernel copies included.  ``cached_fraction`` and
    ``cached_after`` are the share of the file in the page cache when the run started and
    ended: a buffered run of a file that fits in RAM caches it as it goes, and a high
    ``cached_after`` says most of the run was served from memory, not the drive.
    """
    if spec.bs > spec.file_size:
        raise StoreError(f"{spec.file}: {spec.file_size} bytes is smaller than one block of {spec.bs}")
    fits = _page_cache_facts(spec.file_size)
    if spec.backend == NAIVE:
        if spec.direct:
            raise BackendUnavailable("the naive arm reads through aiofiles, which opens files "
                                     "buffered; it has no --direct")
        if spec.drop_cache:
            drop_page_cache(spec.file)
        cached = cached_fraction(spec.file)
        samples = _runner.run(lambda: _naive(spec, MIN_ALIGN))
        cached_after = cached_fraction(spec.file)
        out = _summary(spec, samples)
        out.update(backend=NAIVE, direct=False, path="aiofiles seek+read",
                   backend_info={"executor": "loop default",
                                 "max_workers": min(32, (os.cpu_count() or 1) + 4)})
    else:
        backend, effective, is_direct = _make_backend(spec.backend, spec.direct, spec.qd)
        mms = [mmap.mmap(-1, spec.bs) for _ in range(spec.qd)]
        bufs = [memoryview(m) for m in mms]
        try:
            backend.open([spec.file])
            align = max(MIN_ALIGN, backend.alignment(0))
            if is_direct and spec.bs % align:
                raise StoreError(f"--bs {spec.bs} is not a multiple of {align}, the alignment "
                                 f"O_DIRECT needs on {spec.file}")
            if spec.drop_cache:
                drop_page_cache(spec.file)
            cached = cached_fraction(spec.file)
            readers, path = _backend_readers(backend, spec, bufs)
            samples = _runner.run(lambda: _drive(readers, spec, align))
            cached_after = cached_fraction(spec.file)
            info = backend.info()
        finally:
            backend.close()
            for buf, m in zip(bufs, mms, strict=True):
                buf.release()
                try:
                    m.close()
                except BufferError:  # a view still held; freed when it is collected
                    pass
        out = _summary(spec, samples)
        out.update(backend=effective, direct=is_direct, path=path, backend_info=info)
    out.update(file=spec.file, file_size=spec.file_size, loop=_runner.loop_factory()[0],
               drop_cache=spec.drop_cache, cached_fraction=cached, cached_after=cached_after, **fits)
    if spec.backend not in (out["backend"], "auto"):
        out["requested_backend"] = spec.backend
    return out


def _page_cache_facts(file_size: int) -> dict[str, Any]:
    available = mem_info().get("MemAvailable")
    return {"fits_in_ram": None if available is None else file_size <= available,
            "mem_available_bytes": available}


def run_fio_for(spec: RunSpec, arm: str, direct: bool, align: int) -> dict[str, Any]:
    """fio on the same file, size, depth, duration and caching mode as ``spec`` on ``arm``."""
    if spec.drop_cache:
        drop_page_cache(spec.file)
    return run_fio(FioJob(file=spec.file, bs=spec.bs, qd=spec.qd, seconds=spec.seconds,
                          direct=direct, backend=arm, align=align))


# ---------------------------------------------------------------------------------------------
# sweep


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def sweep(file: str, file_size: int, arms: Sequence[str], bs_list: Sequence[int],
          qd_list: Sequence[int], *, seconds: float, reps: int, direct: bool | None, drop_cache: bool,
          with_fio: bool, seed: int = DEFAULT_SEED,
          on_run: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every arm x bs x qd, ``reps`` times interleaved; medians per configuration.

    With ``with_fio`` each configuration's fio run sits next to ours, ours first on even reps
    and fio first on odd ones, so neither always inherits the other's warm or cold state.
    An arm that cannot run here is listed under ``skipped`` with the reason; a fio failure
    on one configuration lands in that row's ``fio_error`` instead of ending the sweep.
    """
    skipped: dict[str, str] = {}
    probed: dict[str, tuple[bool, int]] = {}
    names: list[str] = []
    for arm in arms:
        try:
            name, is_direct, align = _probe(arm, direct, file)
        except StoreError as exc:
            skipped[arm] = str(exc)
            continue
        if name not in probed:
            names.append(name)
            probed[name] = (is_direct, align)
    configs = [(name, bs, qd) for name in names for bs in bs_list for qd in qd_list]
    ours: dict[tuple[str, int, int], list[dict[str, Any]]] = {c: [] for c in configs}
    theirs: dict[tuple[str, int, int], list[dict[str, Any]]] = {c: [] for c in configs}
    fio_errors: dict[tuple[str, int, int], str] = {}
    for rep in range(reps):
        for config in configs:
            name, bs, qd = config
            spec = RunSpec(file, file_size, name, bs, qd, seconds, direct, drop_cache, seed)
            is_direct, align = probed[name]
            order = ("ours", "fio") if rep % 2 == 0 else ("fio", "ours")
            for which in order:
                if which == "fio" and not with_fio:
                    continue
                if on_run is not None:
                    on_run(f"rep {rep + 1}/{reps} {which:4s} {name} bs={format_size(bs)} qd={qd}")
                if which == "ours":
                    ours[config].append(run_once(spec))
                elif config not in fio_errors:
                    try:
                        theirs[config].append(run_fio_for(spec, name, is_direct, align))
                    except FioError as exc:
                        fio_errors[config] = str(exc)
    rows: list[dict[str, Any]] = []
    for config in configs:
        name, bs, qd = config
        runs = ours[config]
        row: dict[str, Any] = {
            "backend": name, "bs": bs, "qd": qd, "direct": probed[name][0], "reps": len(runs),
            "mbps": _median([r["mbps"] for r in runs]),
            "p50_ms": _median([r["p50_ms"] for r in runs]),
            "p99_ms": _median([r["p99_ms"] for r in runs]),
            "reads": _median([r["reads"] for r in runs]),
            "python_overhead_us": _median([r["python_overhead_us"] for r in runs]),
            "cpu_us_per_read": _median([r["cpu_us_per_read"] for r in runs]),
            "cached_fraction": _median([r["cached_fraction"] for r in runs]),
            "cached_after": _median([r["cached_after"] for r in runs]),
            "mbps_reps": [r["mbps"] for r in runs],
        }
        if with_fio:
            fio_runs = theirs[config]
            row["fio_mbps"] = _median([r["fio_mbps"] for r in fio_runs])
            row["fio_p50_ms"] = _median([r["fio_p50_ms"] for r in fio_runs])
            row["fio_p99_ms"] = _median([r["fio_p99_ms"] for r in fio_runs])
            row["fio_mbps_reps"] = [r["fio_mbps"] for r in fio_runs]
            row["fio_engine"] = fio_runs[0]["fio_engine"] if fio_runs else None
            row["ratio"] = (row["mbps"] / row["fio_mbps"]
                            if row["mbps"] is not None and row["fio_mbps"] else None)
            if config in fio_errors:
                row["fio_error"] = fio_errors[config]
        rows.append(row)
    return {
        "sweep": rows, "file": file, "file_size": file_size, "seconds": seconds, "reps": reps,
        "direct": direct, "drop_cache": drop_cache, "seed": seed, "backends": names,
        "bs_list": list(bs_list), "qd_list": list(qd_list), "skipped": skipped,
        "fio": with_fio, "loop": _runner.loop_factory()[0],
        **_page_cache_facts(file_size),
    }


def plot_sweep(result: dict[str, Any], path: str) -> None:
    """One row of panels per block size: MB/s vs depth and p99 vs depth, a line per backend
    (fio dashed in the same colour), log2 depth axis.  Rows share nothing but the depth axis,
    since MB/s at 64 KiB and at 16 MiB differ by orders of magnitude."""
    from matplotlib.figure import Figure

    rows: list[dict[str, Any]] = result["sweep"]
    bs_list: list[int] = result["bs_list"]
    qd_list: list[int] = result["qd_list"]
    names: list[str] = result["backends"]
    fig = Figure(figsize=(11, 3.4 * max(1, len(bs_list)) + 0.6), layout="constrained")
    axes = fig.subplots(max(1, len(bs_list)), 2, squeeze=False)
    colors = [f"C{i}" for i in range(10)]
    for i, bs in enumerate(bs_list):
        ax_bw, ax_p99 = axes[i][0], axes[i][1]
        fio_drawn: set[tuple[str, bool]] = set()
        for j, name in enumerate(names):
            mine = sorted((r for r in rows if r["backend"] == name and r["bs"] == bs),
                          key=lambda r: int(r["qd"]))
            if not mine:
                continue
            color = colors[j % len(colors)]
            qds = [r["qd"] for r in mine]
            ax_bw.plot(qds, [r["mbps"] for r in mine], marker="o", color=color, label=name)
            ax_p99.plot(qds, [r["p99_ms"] for r in mine], marker="o", color=color, label=name)
            engine = (mine[0].get("fio_engine") or {}).get("ioengine", "fio")
            fio_key = (engine, bool(mine[0]["direct"]))
            if (result.get("fio") and fio_key not in fio_drawn
                    and any(r.get("fio_mbps") for r in mine)):
                # pread and the naive arm both pair with buffered psync: one fio line, not two
                fio_drawn.add(fio_key)
                label = f"fio {engine}{' direct' if fio_key[1] else ''}"
                ax_bw.plot(qds, [r.get("fio_mbps") for r in mine], ls="--", marker=".",
                           color=color, alpha=0.7, label=label)
                ax_p99.plot(qds, [r.get("fio_p99_ms") for r in mine], ls="--", marker=".",
                            color=color, alpha=0.7, label=label)
        for ax, ylabel, what in ((ax_bw, "MB/s (10^6 B/s)", "throughput"),
                                 (ax_p99, "p99 latency (ms)", "p99 latency")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(qd_list, [str(q) for q in qd_list])
            ax.set_xlabel("queue depth")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{human_size(bs)} random reads: {what}")
            ax.grid(True, which="both", alpha=0.3)
        ax_p99.set_yscale("log")
        ax_bw.set_ylim(bottom=0)
        ax_bw.legend(fontsize="small")
    requested = result.get("direct")
    mode = "O_DIRECT" if requested is True else "buffered" if requested is False else "each backend's default"
    if result.get("drop_cache"):
        mode += ", page cache dropped before each run"
    fig.suptitle(f"iosched bench: {os.path.basename(result['file'])} "
                 f"({human_size(int(result['file_size']))}, {mode})\nmedian of "
                 f"{result['reps']} interleaved reps of {result['seconds']:g} s; dashed: fio")
    fig.savefig(path, dpi=110)


# ---------------------------------------------------------------------------------------------
# command line


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``iosched bench`` on ``sub`` (``tools/cli.py``'s subparsers)."""
    p = sub.add_parser("bench", help="random-read throughput and latency per backend, block size, depth",
                       description=__doc__.splitlines()[0] if __doc__ else None)
    _add_arguments(p)
    p.set_defaults(func=cmd_bench)


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--file", default=None,
                   help="file to read (must exist); default: a generated file of --size random "
                        "bytes in the cache folder, reused")
    p.add_argument("--size", default=None,
                   help=f"size of the generated file when --file is not given (default {DEFAULT_FILE_SIZE})")
    p.add_argument("--backend", default="pread",
                   help=f"pread, odirect, mmap, uring, auto or {NAIVE} (aiofiles by hand); default pread")
    p.add_argument("--bs", default="1M", help="read size: bytes or 64k, 4M, 4MiB... (default 1M)")
    p.add_argument("--qd", default="8", help="reads in flight: reader coroutines (default 8)")
    p.add_argument("--seconds", type=_command.positive_float, default=None,
                   help="duration of each run (default 5; 1 with --sweep)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--direct", action="store_true",
                      help="O_DIRECT: pread becomes odirect, uring gets direct=True (mmap, naive: refused)")
    mode.add_argument("--buffered", action="store_true",
                      help="through the page cache: uring gets direct=False (odirect: refused); "
                           "default: each backend as the store makes it (uring is O_DIRECT)")
    p.add_argument("--drop-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="drop the file from the page cache before every run (default on)")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help="random offsets' seed")
    p.add_argument("--fio", action="store_true",
                   help="also run fio on the same configuration(s); rows get fio_mbps and ratio")
    p.add_argument("--sweep", action="store_true",
                   help="backends x block sizes x queue depths, --reps interleaved repetitions")
    p.add_argument("--backends", default=None,
                   help=f"sweep: comma list (default every available backend and {NAIVE})")
    p.add_argument("--bs-list", default=None, help=f"sweep: comma list (default {','.join(SWEEP_BS)})")
    p.add_argument("--qd-list", default=None,
                   help=f"sweep: comma list (default {','.join(map(str, SWEEP_QD))})")
    p.add_argument("--reps", type=_command.positive_int, default=3,
                   help="sweep: repetitions per configuration (default 3)")
    p.add_argument("--plot", default=None, metavar="PATH.png",
                   help="sweep: write MB/s and p99 vs depth per block size (matplotlib)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def _resolve_file(args: argparse.Namespace) -> tuple[str, int]:
    if args.file is not None:
        if args.size is not None:
            raise StoreError("--size sizes the generated file; it cannot be combined with --file")
        return args.file, check_file(args.file)
    size = parse_size(args.size or DEFAULT_FILE_SIZE)
    path = str(default_test_file(size))
    return path, size


def cmd_bench(args: argparse.Namespace) -> dict[str, Any]:
    """The ``bench`` subcommand: one run, or ``--sweep``; returns the JSON object."""
    if not args.sweep:
        given = [flag for flag, value in (("--backends", args.backends), ("--bs-list", args.bs_list),
                                          ("--qd-list", args.qd_list), ("--plot", args.plot))
                 if value is not None]
        if given:
            raise StoreError(f"{', '.join(given)} only apply with --sweep")
    if args.seconds is not None and not args.seconds > 0:
        raise StoreError(f"--seconds must be positive, got {args.seconds}")
    if args.reps <= 0:
        raise StoreError(f"--reps must be positive, got {args.reps}")
    if args.fio:
        require_fio()
    bs = parse_size(args.bs)
    qd = _parse_qd(args.qd)
    direct: bool | None = True if args.direct else (False if args.buffered else None)
    if args.sweep:
        arms = (_parse_list(args.backends, str, "--backends") if args.backends
                else [n for n, why in backends.available().items() if why is None] + [NAIVE])
        bs_list = _parse_list(args.bs_list, parse_size, "--bs-list") if args.bs_list else [
            parse_size(s) for s in SWEEP_BS]
        qd_list = _parse_list(args.qd_list, _parse_qd, "--qd-list") if args.qd_list else list(SWEEP_QD)
        if args.plot is not None and not args.plot.lower().endswith(".png"):
            raise StoreError(f"--plot {args.plot}: expected a .png path")
    file, size = _resolve_file(args)
    seconds = args.seconds if args.seconds is not None else (1.0 if args.sweep else 5.0)
    if args.sweep:
        out = _cmd_sweep(args, file, size, arms, bs_list, qd_list, seconds, direct)
    else:
        spec = RunSpec(file, size, args.backend, bs, qd, seconds, direct, args.drop_cache, args.seed)
        out = run_once(spec)
        if args.fio:
            align = _probe(args.backend, direct, file)[2]
            try:
                out.update(run_fio_for(spec, out["backend"], bool(out["direct"]), align))
                out["ratio"] = out["mbps"] / out["fio_mbps"] if out["fio_mbps"] else None
            except FioError as exc:
                out["fio_error"] = str(exc)
    if not args.json:
        from rich.console import Console

        console = Console()
        if not console.is_terminal:  # piped to a file: do not squeeze the table into 80 columns
            console = Console(width=max(console.width, 140))
        console.print(sweep_table(out) if args.sweep else run_table(out))
    return out


def _cmd_sweep(args: argparse.Namespace, file: str, size: int, arms: list[str],
               bs_list: list[int], qd_list: list[int], seconds: float,
               direct: bool | None) -> dict[str, Any]:
    runs = len(arms) * len(bs_list) * len(qd_list) * args.reps * (2 if args.fio else 1)
    note = (f"iosched bench --sweep: up to {runs} runs of {seconds:g} s "
            f"(about {runs * seconds / 60:.1f} min plus set-up) on {file}")
    with run_progress("sweep", runs, note) as on_run:
        out = sweep(file, size, arms, bs_list, qd_list, seconds=seconds, reps=args.reps,
                    direct=direct, drop_cache=args.drop_cache, with_fio=args.fio,
                    seed=args.seed, on_run=on_run)
    out["machine"] = machine_info(file)
    if args.plot is not None:
        plot_sweep(out, args.plot)
        out["plot"] = args.plot
    return out


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _cache_note(out: dict[str, Any]) -> str:
    fits = out.get("fits_in_ram")
    avail = out.get("mem_available_bytes")
    size = human_size(int(out["file_size"]))
    if fits is None:
        ram = "RAM size unknown"
    else:
        ram = (f"{'fits' if fits else 'does not fit'} in RAM "
               f"({(avail or 0) / 2**30:.1f} GiB available)")
    drop = "dropped from the page cache before each run" if out.get("drop_cache") else \
        "page cache NOT dropped: buffered runs may measure memory"
    return f"file {out['file']} ({size}) {ram}; {drop}"


def run_table(out: dict[str, Any]) -> Any:
    """A rich table of one run."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"iosched bench: {out['backend']}, {human_size(out['bs'])} reads at qd {out['qd']}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("MB/s (10^6 B/s)", _fmt(out["mbps"], ".1f")), ("IOPS", _fmt(out["iops"], ".0f")),
        ("p50 latency", f"{out['p50_ms']:.3f} ms"), ("p90 latency", f"{out['p90_ms']:.3f} ms"),
        ("p99 latency", f"{out['p99_ms']:.3f} ms"), ("max latency", f"{out['max_ms']:.3f} ms"),
        ("reads", str(out["reads"])), ("seconds", f"{out['seconds']:.2f}"),
        ("O_DIRECT", str(out["direct"])), ("event loop", out["loop"]),
        ("loop-thread CPU per read", f"{out['python_overhead_us']:.1f} µs"),
        ("process CPU per read", f"{out['cpu_us_per_read']:.1f} µs"),
        ("file cached before run", _fmt(out.get("cached_fraction"), ".1%")),
        ("file cached after run", _fmt(out.get("cached_after"), ".1%")),
    ]
    if "fio_mbps" in out:
        rows += [("fio MB/s", _fmt(out["fio_mbps"], ".1f")),
                 (f"fio p99 ({out.get('fio_latency', 'clat')})", f"{_fmt(out['fio_p99_ms'], '.3f')} ms"),
                 ("ours / fio", _fmt(out.get("ratio"), ".2f"))]
    if "fio_error" in out:
        rows.append(("fio error", out["fio_error"]))
    for label, value in rows:
        table.add_row(label, value)
    return Group(table, Text(_cache_note(out), style="dim"))


def sweep_table(out: dict[str, Any]) -> Any:
    """A rich table of a sweep: one row per configuration, medians."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    with_fio = bool(out.get("fio"))
    table = Table(title=f"iosched bench --sweep: median of {out['reps']} interleaved reps, "
                        f"{out['seconds']:g} s each")
    table.add_column("backend", no_wrap=True)
    for name in ("bs", "qd"):
        table.add_column(name, justify="right")
    for name in ("MB/s", "p50 ms", "p99 ms", "loop µs/read", "cached at end"):
        table.add_column(name, justify="right")
    if with_fio:
        for name in ("fio MB/s", "fio p99 ms", "ours/fio"):
            table.add_column(name, justify="right")
    for row in out["sweep"]:
        direct_note = " (direct)" if row["direct"] and row["backend"] != "odirect" else ""
        cells = [row["backend"] + direct_note,
                 format_size(row["bs"]), str(row["qd"]), _fmt(row["mbps"], ".0f"),
                 _fmt(row["p50_ms"], ".2f"), _fmt(row["p99_ms"], ".2f"),
                 _fmt(row["python_overhead_us"], ".1f"), _fmt(row.get("cached_after"), ".0%")]
        if with_fio:
            cells += [_fmt(row.get("fio_mbps"), ".0f"), _fmt(row.get("fio_p99_ms"), ".2f"),
                      "error" if "fio_error" in row else _fmt(row.get("ratio"), ".2f")]
        table.add_row(*cells)
    for name, why in out.get("skipped", {}).items():
        table.add_row(f"[dim]{name}: skipped[/dim]", "", "", f"[dim]{why}[/dim]")
    return Group(table, Text(_cache_note(out), style="dim"))


def main(argv: Sequence[str] | None = None) -> int:
    """``iosched bench`` on its own (tests, ``python -m iosched.tools.bench``); ``argv`` excludes
    ``bench``.  The command line's own entry point runs it, with its conventions."""
    return _command.run_one("bench", add_parser, argv)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
