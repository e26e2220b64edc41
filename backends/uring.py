"""``uring``: reads through io_uring, completions delivered on the event loop.

Why: ``pread`` and ``odirect`` park a thread per read in flight, so depth costs threads, GIL
hand-offs and context switches.  io_uring takes a batch of reads in one system call and posts
completions to a shared ring; the event loop hears of them through an eventfd.

Invariants:

* **One ring per event loop**, made by the first read on that loop (:class:`_Ring`).  SQEs are
  prepared, submitted and reaped only on the loop's thread, so the ring needs no lock.  Its
  eventfd is registered with the ring and watched by ``loop.add_reader``; the callback drains
  the eventfd *before* reaping, so a CQE posted during the reap wakes it again.
* **Batching**: a read queues its SQE and schedules one ``io_uring_submit`` (``call_soon``):
  the reads started in one loop iteration share one system call.  A full SQ is submitted at once.
* A read has at most one SQE in flight, a ring at most ``2 * entries`` (its CQ size, held by a
  semaphore), so the completion queue never overflows.
* **Buffers**: the binding's ``io_uring_prep_read`` takes a writable byte buffer (Cython
  ``unsigned char[:]``, passing ``&buf[0]``), so a memoryview slice of the core's mmap slab or a
  bytearray goes in as is.  The view stays in ``_Ring.pending`` until its CQE, and a cancelled
  read waits for that CQE before re-raising: until then the kernel may write into the buffer.
* CQE ``res``: > 0 bytes (a short count is resubmitted for the rest), 0 end of file, < 0
  ``-errno``: :class:`ReadError` naming the file; ``-EINVAL`` on an O_DIRECT descriptor makes
  the file buffered for good, as in ``odirect``.
* Reads carry IOSQE_ASYNC: kernel workers copy from the page cache (buffered) or build and
  submit the bios (O_DIRECT), not the submitting ``io_uring_enter`` on the event loop's thread,
  whose CPU is the engine's.
* Direct mode mirrors ``odirect``: a direct and a buffered descriptor per file; the buffered one
  reads past the last whole block and every file whose filesystem refuses O_DIRECT.

:func:`probe` sets up a ring and reads a temp file through it in a fresh interpreter, so a
binding that crashes on this CPU or kernel costs a reason, not the engine's process.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import itertools
import json
import logging
import os
import select
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any, ClassVar

from iosched._errors import BackendUnavailable, InvariantError, ReadError

from ._base import Caps
from ._direct import DirectFiles, DirectFilesOwner
from .pread import open_all

log = logging.getLogger("iosched.backends")

_IOSQE_ASYNC = 1 << 4
"""Kernel ABI (IOSQE_ASYNC_BIT = 4); liburing 2024.5.3 does not export the constant."""
_MAX_SQE_BYTES = 1 << 30
"""One SQE reads at most this (nbytes is 32-bit, res signed); a multiple of every block size."""


def _liburing() -> Any:
    import liburing  # no stubs (ignore_missing_imports); imported only after probe()

    return liburing


class _Op:
    """One SQE in flight: the future its CQE resolves, and the buffer the kernel writes."""

    __slots__ = ("fut", "buf", "reaped")

    def __init__(self, fut: asyncio.Future[int], buf: memoryview) -> None:
        self.fut, self.buf = fut, buf
        self.reaped = False
        """Its CQE's result is in ``fut``, and the coroutine awaiting it has not resumed yet."""


class _Ring:
    """An io_uring, its eventfd and its SQEs in flight; used only on ``loop``'s thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, entries: int, counts: dict[str, int]) -> None:
        self._L = L = _liburing()
        self.loop, self.counts = loop, counts
        self.ring, self.cqe = L.io_uring(), L.io_uring_cqe()
        self.pending: dict[int, _Op] = {}  # user_data -> op, from prep to CQE
        self.queued: list[int] = []  # prepared, not yet taken by the kernel
        self.slots = asyncio.Semaphore(2 * entries)
        self.reaped = 0
        """Ops whose CQE was reaped and whose awaiting coroutine has not resumed yet."""
        self.broken: str | None = None
        self._ids = itertools.count(1)
        self._flush: asyncio.Handle | None = None
        self._live, self.efd = False, -1
        try:
            L.io_uring_queue_init(entries, self.ring)
            self._live = True  # only now: exiting a ring whose init failed would crash
            self.efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            L.io_uring_register_eventfd(self.ring, self.efd)
            loop.add_reader(self.efd, self._reap)
        except BaseException as exc:
            self.close()
            if not isinstance(exc, OSError):
                raise
            raise BackendUnavailable(f"uring: cannot set up an io_uring of {entries} entries: "
                                     f"{exc.strerror or exc}{_sysctl_note()}") from exc

    def submit(self, fd: int, buf: memoryview, offset: int, flags: int) -> tuple[int, _Op]:
        """Queue a read of ``len(buf)`` bytes; the loop's next flush submits it."""
        if self.broken is not None:
            raise OSError(errno.EIO, self.broken)
        L = self._L
        sqe = L.io_uring_get_sqe(self.ring)
        if not sqe:  # the submission queue is full: hand it to the kernel now
            self.flush()
            sqe = L.io_uring_get_sqe(self.ring)
            if not sqe:
                raise OSError(errno.EBUSY, "the io_uring submission queue stays full")
        ud = next(self._ids)
        try:
            L.io_uring_prep_read(sqe, fd, buf, len(buf), offset)
        except BaseException:
            L.io_uring_prep_nop(sqe)  # never leave the slot's stale SQE (an old read) queued
            raise
        finally:
            sqe.user_data = ud
            self.queued.append(ud)
        if flags:
            sqe.flags = flags
        op = self.pending[ud] = _Op(self.loop.create_future(), buf)
        if self._flush is None:
            self._flush = self.loop.call_soon(self._scheduled_flush)
        return ud, op

    def flush(self) -> None:
        """Submit every queued SQE in one ``io_uring_enter``; raises OSError."""
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        if self.queued:
            n = self._L.io_uring_submit(self.ring)
            self.counts["batches"] += 1
            self.counts["submissions"] += n
            del self.queued[:n]
            if self.queued:  # the kernel took part of the queue: the rest next iteration
                self._flush = self.loop.call_soon(self._scheduled_flush)

    def _scheduled_flush(self) -> None:
        self._flush = None
        try:
            self.flush()
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EBUSY, errno.EINTR):  # transient: retry soon
                self._flush = self.loop.call_later(0.001, self._scheduled_flush)
                return
            # The ring is unusable.  Queued SQEs never reached the kernel and never will (no
            # io_uring_enter again), so their reads fail now; those in flight still complete.
            self.broken = f"io_uring_submit failed: {exc.strerror or exc}"
            for ud in self.queued:
                op = self.pending.pop(ud, None)
                if op is not None and not op.fut.done():
                    op.fut.set_exception(OSError(exc.errno, self.broken))
            self.queued.clear()

    def _reap(self) -> None:
        try:
            os.eventfd_read(self.efd)  # drain first: a CQE posted after this re-arms it
        except BlockingIOError:
            pass
        L, ring, cqe, pending = self._L, self.ring, self.cqe, self.pending
        while L.io_uring_peek_cqe(ring, cqe) == 0:
            ud, res = cqe.user_data, cqe.res
            L.io_uring_cqe_seen(ring, cqe)
            op = pending.pop(ud, None)  # the kernel is done with op.buf
            if op is not None and not op.fut.done():
                op.fut.set_result(res)
                op.reaped = True
                self.reaped += 1

    def undelivered(self) -> int:
        """CQEs not reaped yet, and those reaped whose coroutine has not resumed."""
        return int(self._L.io_uring_cq_ready(self.ring)) + self.reaped if self._live else 0

    def _resumed(self, op: _Op) -> None:
        if op.reaped:
            op.reaped = False
            self.reaped -= 1

    async def io(self, fd: int, buf: memoryview, offset: int, flags: int) -> int:
        """One SQE, awaited: its CQE's ``res``.  Cancelled, it waits for the CQE first."""
        ud, op = self.submit(fd, buf, offset, flags)
        try:
            return await op.fut
        except asyncio.CancelledError:
            while ud in self.pending:  # the kernel may still write into buf
                op.fut = self.loop.create_future()
                try:
                    await op.fut
                except (asyncio.CancelledError, OSError):
                    pass
            raise
        finally:  # (a CQE is reaped at most once: the reap pops the op from pending)
            self._resumed(op)

    def close(self) -> None:
        if self._flush is not None:
            self._flush.cancel()
        if self.efd >= 0:
            try:
                self.loop.remove_reader(self.efd)
            except RuntimeError:  # uvloop, once the loop is closed (asyncio returns False)
                pass
        if self._live:
            self._live = False
            self._L.io_uring_queue_exit(self.ring)  # also unregisters the eventfd
        if self.efd >= 0:
            os.close(self.efd)
            self.efd = -1


class UringBackend(DirectFilesOwner):
    """io_uring reads; ``UringBackend(direct=False)`` builds a :class:`BufferedUringBackend`,
    so that ``caps`` (a class attribute in the protocol) always describes the instance."""

    name: ClassVar[str] = "uring"
    caps: ClassVar[Caps] = Caps.NATIVE_ASYNC | Caps.DIRECT | Caps.TURN_BATCHED

    def __new__(cls, direct: bool = True, entries: int = 64) -> UringBackend:
        klass: type[UringBackend] = BufferedUringBackend if cls is UringBackend and not direct else cls
        return object.__new__(klass)

    def __init__(self, direct: bool = True, entries: int = 64) -> None:
        self._entries = entries
        self.direct_flags = _IOSQE_ASYNC
        """SQE flags of O_DIRECT reads.  IOSQE_ASYNC hands the block-layer submission (page
        pinning, bio building) to io-wq workers instead of the loop's ``io_uring_enter``:
        measured on the dev VM (docs/backends.md), same MB/s within noise and the loop
        thread's CPU per 4 MiB read down from 213 to 37 µs (64 KiB: 39 to 24 µs)."""
        self._rings: dict[asyncio.AbstractEventLoop, _Ring] = {}
        self._counts = dict.fromkeys(("submissions", "batches", "resubmits", "tail_reads"), 0)
        self._paths: list[str] = []
        self._fds: list[int] = []  # buffered descriptors
        self._direct = DirectFiles(self.name)

    def open(self, paths: Sequence[str]) -> None:
        self._paths, self._fds = list(paths), open_all(paths, 0)
        if Caps.DIRECT not in self.caps:
            self._direct.open_buffered(paths)
            return
        self._open_direct(paths)

    async def read(self, file: int, offset: int, length: int, buf: memoryview) -> int:
        if not self._fds:
            raise InvariantError("backend used before open()")
        view = memoryview(buf)
        if view.readonly:
            raise TypeError("uring: cannot read into a read-only buffer")
        view = view.cast("B")[:max(length, 0)] if view.format != "B" else view[:max(length, 0)]
        if len(view) < length:
            raise ValueError(f"uring: a {len(view)}-byte buffer cannot hold {length} bytes")
        loop, done = asyncio.get_running_loop(), 0
        ring = self._rings.get(loop)
        if ring is None:
            ring = self._rings[loop] = _Ring(loop, self._entries, self._counts)
        async with ring.slots:
            fd = self._direct.fds[file]
            if fd is not None:
                while done < length:
                    n = await self._sqe(ring, fd, file, view, done, offset, direct=True)
                    if n < 0:  # -EINVAL: the filesystem refuses O_DIRECT reads
                        self._direct.fall_back(file, "the filesystem refuses O_DIRECT reads (EINVAL)")
                        break
                    done += n
                    if n == 0 or n % self._direct.align[file]:
                        break  # the file ends inside this read
                    self._counts["resubmits"] += done < length
                if done < length and self._direct.fds[file] is not None:
                    self._counts["tail_reads"] += 1
            while done < length:
                n = await self._sqe(ring, self._fds[file], file, view, done, offset, direct=False)
                if n == 0:
                    break
                done += n
                self._counts["resubmits"] += done < length
        return done

    async def _sqe(self, ring: _Ring, fd: int, file: int, view: memoryview, done: int,
                   offset: int, direct: bool) -> int:
        """Read ``view[done:]`` (at most one SQE's worth) at ``offset + done``: the count, or
        -EINVAL for a direct read the filesystem refuses; any other error is a ReadError."""
        what = f"{'O_DIRECT ' if direct else ''}read of {len(view)} bytes at offset {offset}"
        while True:
            try:
                res = await ring.io(fd, view[done:done + _MAX_SQE_BYTES], offset + done,
                                    self.direct_flags if direct else _IOSQE_ASYNC)
            except OSError as exc:
                raise ReadError(f"{self._paths[file]}: {what} failed: {exc.strerror or exc}") from exc
            if res >= 0 or (direct and res == -errno.EINVAL):
                return res
            if -res not in (errno.EINTR, errno.EAGAIN):
                why = os.strerror(-res)
                raise ReadError(f"{self._paths[file]}: {what} failed: {why}") from OSError(-res, why)
            self._counts["resubmits"] += 1

    def undelivered(self) -> int:
        try:
            ring = self._rings.get(asyncio.get_running_loop())
        except RuntimeError:
            return 0
        return 0 if ring is None else ring.undelivered()

    def info(self) -> dict[str, Any]:
        return {
            "entries": self._entries,
            "rings": len(self._rings),
            **self._counts,
            "direct": Caps.DIRECT in self.caps,
            **self._direct.info(),
            # O_DIRECT reads are drive reads; buffered ones are not probed (a probe would be one
            # more round trip through the ring), so the core counts them as drive reads too.
            "page_cache_probe": "none",
        }

    def close(self) -> None:
        """Call on the loops' thread (or after they stopped), with no read in flight."""
        for ring in self._rings.values():
            ring.close()
        self._rings.clear()
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        self._direct.close()


class BufferedUringBackend(UringBackend):
    """io_uring reads through the page cache (``UringBackend(direct=False)``)."""

    caps: ClassVar[Caps] = Caps.NATIVE_ASYNC | Caps.TURN_BATCHED


def _sysctl_note() -> str:
    """What ``kernel.io_uring_disabled`` says, for a reason string."""
    try:
        with open("/proc/sys/kernel/io_uring_disabled") as f:
            value = f.read().strip()
    except OSError as exc:
        return f" (/proc/sys/kernel/io_uring_disabled unreadable: {exc.strerror or exc})"
    meaning = {"0": "allowed by the kernel; a seccomp filter (container runtime) may refuse it",
               "1": "limited to the group in kernel.io_uring_group",
               "2": "disabled for every process"}.get(value, "unknown value")
    return f" (kernel.io_uring_disabled = {value}: {meaning})"


def _probe_here() -> str | None:
    """Set up a ring with an eventfd and read a temp file through it, in this process."""
    try:
        L = _liburing()
        ring = L.io_uring()
    except Exception as exc:
        return f"the liburing package cannot be imported: {exc} (pip install liburing==2024.5.3)"
    try:
        L.io_uring_queue_init(4, ring)
    except Exception as exc:
        return f"io_uring_queue_init failed: {getattr(exc, 'strerror', None) or exc}{_sysctl_note()}"
    payload, buf, efd = b"iosched io_uring probe", bytearray(64), -1
    try:
        efd = os.eventfd(0, os.EFD_CLOEXEC)
        L.io_uring_register_eventfd(ring, efd)
        with tempfile.TemporaryFile() as f:
            f.write(payload)
            f.flush()
            sqe = L.io_uring_get_sqe(ring)
            L.io_uring_prep_read(sqe, f.fileno(), buf, len(buf), 0)
            sqe.flags, sqe.user_data = _IOSQE_ASYNC, 1
            L.io_uring_submit(ring)
            cqe = L.io_uring_cqe()
            if not select.select([efd], [], [], 10)[0] or L.io_uring_peek_cqe(ring, cqe) != 0:
                return "io_uring: the probe read's completion never reached the eventfd"
            res = cqe.res
            L.io_uring_cqe_seen(ring, cqe)
        if res < 0:
            return f"io_uring: the probe read failed: {os.strerror(-res)}"
        return None if bytes(buf[:res]) == payload else "io_uring: the probe read wrong bytes"
    except Exception as exc:  # the probe never raises: whatever fails is the reason
        return f"io_uring: the probe failed: {getattr(exc, 'strerror', None) or exc}"
    finally:
        L.io_uring_queue_exit(ring)
        if efd >= 0:
            os.close(efd)


@functools.cache
def probe() -> str | None:
    """``None`` when io_uring works here, else why not; cached.  Probes in a fresh interpreter
    (once, ~0.15 s), so a liburing build that dies on this CPU or kernel (illegal instruction,
    segfault) yields a reason instead of killing the engine."""
    if not sys.executable:
        return _probe_here()
    # The child finds this package where the parent did: the parent's own search path.
    code = ("import json, sys; sys.path[:0] = json.loads(sys.argv[1]); "
            "from iosched.backends.uring import _probe_here; print(json.dumps(_probe_here()))")
    try:
        proc = subprocess.run([sys.executable, "-c", code, json.dumps(sys.path)], capture_output=True,
                              text=True, timeout=60, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return "io_uring: the probe process did not finish in 60 s"
    except OSError:  # cannot spawn here (a sandbox): probe in this process
        return _probe_here()
    if proc.returncode < 0:
        sig = signal.Signals(-proc.returncode).name if -proc.returncode in signal.valid_signals() else -proc.returncode
        return f"io_uring: the probe process died of signal {sig} (a liburing build this CPU cannot run?)"
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        err = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return f"io_uring: the probe process failed (exit {proc.returncode}): {err}"
    result = json.loads(lines[-1])
    return None if result is None else str(result)
