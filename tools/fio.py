"""Running fio as the reference arm of ``iosched bench --fio``, and reading its JSON.

Why fio: it is what storage people trust for "what can this drive do", written in C with no
event loop in the way, so ``ours / fio`` says how much of the drive our Python read path
leaves on the table for the same file, block size, depth, duration and caching mode.

Engine mapping (what makes the depths comparable):

* ``uring`` -> ``ioengine=io_uring``, ``iodepth=N``, one job: one submitter, N reads in flight,
  as our ring backend does;
* ``pread``, ``odirect``, the naive arm -> ``ioengine=psync``, ``numjobs=N``, ``iodepth=1``:
  psync is synchronous, so depth comes from N jobs, as ours comes from N threads;
* ``mmap`` -> ``ioengine=mmap``, ``numjobs=N``.

Random offsets are aligned to the same granularity as ours (``blockalign``), not to the block
size (fio's default), so both arms pick from the same set of offsets.

Latency: ours is the whole ``await read()``, submission to completion, which is fio's total
``lat`` (``slat + clat``), so fio runs with ``lat_percentiles=1`` and ``fio_p50_ms`` /
``fio_p99_ms`` come from ``lat_ns``; ``clat_ns`` (what fio prints by default) is kept as
``fio_clat_p50_ms`` / ``fio_clat_p99_ms``, and used where an older fio has no ``lat_ns``
percentiles.  The difference matters for io_uring on a cached file, where a read completes
inside the submission and its clat is near zero.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Any

from iosched import StoreError

INSTALL_HINT = "install it with `apt-get install fio` (or `make bench-deps`)"


class FioError(StoreError):
    """fio is missing, failed, or printed something that is not its JSON report."""


@dataclass(frozen=True)
class FioJob:
    """One fio run, in our terms; :meth:`argv` turns it into fio's."""

    file: str
    bs: int
    qd: int
    seconds: float
    direct: bool
    backend: str
    """Our backend name (or ``naive``); picks the ioengine and how the depth is made."""
    align: int = 4096
    extra: tuple[str, ...] = field(default=())

    def engine(self) -> tuple[str, int, int]:
        """(ioengine, iodepth, numjobs) that matches our backend at depth ``qd``."""
        return engine_for(self.backend, self.qd)

    def argv(self, fio: str = "fio") -> list[str]:
        ioengine, iodepth, numjobs = self.engine()
        runtime_ms = max(1, round(self.seconds * 1000))
        args = [
            fio, "--output-format=json", "--name=iosched-bench", f"--filename={self.file}",
            "--rw=randread", f"--bs={self.bs}", f"--blockalign={self.align}",
            f"--ioengine={ioengine}", f"--iodepth={iodepth}", f"--numjobs={numjobs}",
            "--group_reporting", f"--direct={int(self.direct)}",
            "--randrepeat=1", "--norandommap", "--time_based", f"--runtime={runtime_ms}ms",
            "--ramp_time=0", "--invalidate=1", "--allow_file_create=0", "--lat_percentiles=1",
        ]
        return args + list(self.extra)


def engine_for(backend: str, qd: int) -> tuple[str, int, int]:
    """fio's (ioengine, iodepth, numjobs) for our ``backend`` at queue depth ``qd``."""
    if backend == "uring":
        return "io_uring", qd, 1
    if backend == "mmap":
        return "mmap", 1, qd
    return "psync", 1, qd


def fio_binary() -> str | None:
    return shutil.which("fio")


def require_fio() -> str:
    """The fio executable, or a :class:`FioError` that says how to install it."""
    path = fio_binary()
    if path is None:
        raise FioError(f"--fio needs fio, which is not installed: {INSTALL_HINT}")
    return path


def fio_version() -> str | None:
    path = fio_binary()
    if path is None:
        return None
    try:
        done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def parse_report(text: str) -> dict[str, Any]:
    """Bandwidth and latency percentiles of the (group-reported) read job.

    Tolerates lines fio prints before its JSON (warnings such as "fio: ... not supported").
    Returns ``{"fio_mbps", "fio_bw_bytes", "fio_iops", "fio_p50_ms", "fio_p99_ms",
    "fio_clat_p50_ms", "fio_clat_p99_ms", "fio_latency", "fio_io_bytes", "fio_runtime_s"}``:
    ``fio_p*`` are total latency (``lat_ns``) when fio reported its percentiles, else
    completion latency (``clat_ns``), as ``fio_latency`` says; a percentile is ``None`` when
    fio reported none (no completed read).
    """
    start = text.find("{")
    if start < 0:
        raise FioError(f"fio printed no JSON report: {text.strip()[:500]!r}")
    try:
        report = json.loads(text[start:])
        read = report["jobs"][0]["read"]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise FioError(f"cannot read fio's JSON report ({exc}): {text[start:start + 300]!r}") from None
    clat: dict[str, float] = (read.get("clat_ns") or {}).get("percentile") or {}
    total: dict[str, float] = (read.get("lat_ns") or {}).get("percentile") or {}

    def pct(percentiles: dict[str, float], key: str) -> float | None:
        value = percentiles.get(key)
        return None if value is None else float(value) / 1e6

    best = total or clat
    bw = float(read.get("bw_bytes", 0))
    return {
        "fio_mbps": bw / 1e6,
        "fio_bw_bytes": bw,
        "fio_iops": float(read.get("iops", 0.0)),
        "fio_p50_ms": pct(best, "50.000000"),
        "fio_p99_ms": pct(best, "99.000000"),
        "fio_clat_p50_ms": pct(clat, "50.000000"),
        "fio_clat_p99_ms": pct(clat, "99.000000"),
        "fio_latency": "lat" if total else "clat",
        "fio_io_bytes": int(read.get("io_bytes", 0)),
        "fio_runtime_s": float(read.get("runtime", 0)) / 1000,
    }


def run_fio(job: FioJob) -> dict[str, Any]:
    """Run ``job`` and return :func:`parse_report`'s dict plus the engine and command line."""
    fio = require_fio()
    argv = job.argv(fio)
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=job.seconds * 4 + 60)
    except subprocess.TimeoutExpired as exc:
        raise FioError(f"fio did not finish within {exc.timeout:.0f} s: {' '.join(argv)}") from None
    if done.returncode != 0:
        why = (done.stderr.strip() or done.stdout.strip())[-500:]
        raise FioError(f"fio failed (exit {done.returncode}) on {job.file}: {why}")
    out = parse_report(done.stdout)
    ioengine, iodepth, numjobs = job.engine()
    out["fio_engine"] = {"ioengine": ioengine, "iodepth": iodepth, "numjobs": numjobs}
    out["fio_cmd"] = " ".join(argv[1:])
    return out
