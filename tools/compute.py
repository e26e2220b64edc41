"""Real compute for the engine loop of ``iosched demo`` and ``iosched replay`` (real reads).

Why real compute: a ``sleep`` standing in for an expert's matmuls leaves the CPU free, so it
hides the contention between the engine's compute and the store's own work (its policy, its
reads' system calls) on the same cores; on two cores a policy once looked 13 % faster with a
sleep and 9 % slower with real compute.  ``--compute numpy`` (the default) runs,
per routed expert, the SwiGLU expert MLP of Qwen3/Mixtral-style models on the expert's own
tensors, ``down · (silu(gate · x) ⊙ up · x)``, on as many rows as the batch routed to that
expert (decode: one row), and sums the experts' outputs as the layer does.

Weights as stored: ``float32`` goes to BLAS as is.  ``bfloat16`` (the demo checkpoint's type)
and ``float16`` are upcast to ``float32`` first: numpy has no bf16 arithmetic, and its fp16
matmul has no BLAS kernel (measured on the development machine, one 1024 x 384 expert: fp16
native 18 ms, fp16 -> fp32 + BLAS 7.5 ms, bf16 -> fp32 + BLAS 2.4 ms); the upcast is the
dequantize step a CPU engine pays for a compressed layout.  Any other type (a GGUF quantized
tensor comes as ``uint8`` bytes) falls back to a matvec of each tensor's stored shape on a
``float32`` copy of its bytes: real work of the same order, not the model's arithmetic, and
:attr:`Compute.fallbacks` says so.

Where it runs (``--compute-on``): ``thread`` hands each layer's compute to one worker thread
(``run_in_executor`` on a 1-thread pool) and awaits it, as an engine that keeps its event loop
free does; numpy releases the GIL inside BLAS and the casts, so the store's loop runs its
batch-end work and issues prefetches meanwhile.  ``loop`` computes on the event loop itself,
as the README's example does: nothing else on the loop runs until the layer is done.

BLAS threads: OpenBLAS starts one thread per core.  On these shapes (a matvec per tensor, a
few rows in prefill) one thread is faster (one 1024 x 384 bf16 expert: 1.9 ms against 2.4 ms
with two) and leaves the other core to the reads and the loop, so :func:`limit_blas_threads`
sets one, through OpenBLAS's own call (``threadpoolctl`` is not a dependency), unless
``OPENBLAS_NUM_THREADS`` or ``OMP_NUM_THREADS`` says otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from iosched import ExpertKey, ExpertView, StoreError, clock

from . import _command

COMPUTE_ON = ("thread", "loop")
DEFAULT_COMPUTE_ON = "thread"
AWAITS = ("as-ready", "all")
"""What the engine awaits before it computes on a layer's experts: ``as-ready`` (an iosched
store's ``acquire_as_ready``: those at hand first, then each batch of loads as it lands), or
``all`` (``acquire_many``: every one).  The hand-written arm always awaits all, as the engine
a user writes around ``os.pread`` does."""
DEFAULT_AWAITS = "as-ready"
"""Where real compute runs by default: a worker thread, as engines that keep their loop free do
(docs/benchmarks.md, "Real compute and the hand-written arm", measures both)."""
ROLES = ("gate_proj", "up_proj", "down_proj")
BLAS_THREADS = 1
"""OpenBLAS threads for the compute (module docstring: measured faster on these shapes)."""


@dataclass(frozen=True)
class ComputeModel:
    """Modelled compute for runs on virtual time (``iosched replay --simulate --critical-path``):
    a layer takes ``fixed_s + sum over its experts of (per_byte_s + per_byte_row_s x rows) x
    bytes``, the shape of the real numpy compute's cost (the upcast and a matvec pass over
    every weight byte once per layer, the matmul once more per extra row; module docstring).
    :func:`calibrate` measures the three numbers on this machine with the real compute.

    ``io_slowdown``: how much longer the same layer takes while the drive is busy with the
    store's reads (their threads, interrupts and DMA share the cores and the memory bus: on
    the 2-core development VM, compute beside O_DIRECT reads at depth took 1.5-1.8x as long as
    alone), applied in proportion to the share of the layer's time the modelled drive was
    busy: ``seconds x (1 + io_slowdown x busy)``.  :func:`calibrate` measures it beside real
    O_DIRECT reads of a file when given one."""

    fixed_s: float = 0.0
    per_byte_s: float = 0.0
    per_byte_row_s: float = 0.0
    io_slowdown: float = 0.0
    fresh_slowdown: float = 0.0
    """How much longer an expert's compute takes on bytes a read has just brought in (by
    DMA, past the CPU caches) than on bytes computed on before: on the development VM,
    576 KiB bf16 experts read with O_DIRECT and computed at once took 1.4-2.8x as long.
    Applied to the layer's share of such experts (its misses)."""

    def seconds(self, nbytes: Sequence[int], rows: Sequence[int], busy: float = 0.0, fresh: int = 0,
                share: float = 1.0) -> float:
        """The compute of ``nbytes``' experts, ``share`` of their layer's (a batch of an
        ``acquire_as_ready`` layer pays that share of the layer's fixed cost, so that a layer
        computed in three batches costs what it costs in one)."""
        t = self.fixed_s * share
        for b, r in zip(nbytes, rows, strict=True):
            t += (self.per_byte_s + self.per_byte_row_s * max(r, 1)) * b
        fresh_share = min(1.0, fresh / len(nbytes)) if nbytes else 0.0
        return t * (1.0 + self.io_slowdown * min(1.0, max(0.0, busy))) * (1.0 + self.fresh_slowdown * fresh_share)

    @property
    def label(self) -> str:
        if self.per_byte_s == 0 and self.per_byte_row_s == 0:
            text = f"const:{1e3 * self.fixed_s:.6g}"
        else:
            text = (f"linear:{1e3 * self.fixed_s:.6g},{1e3 * self.per_byte_s * 2**20:.6g},"
                    f"{1e3 * self.per_byte_row_s * 2**20:.6g}")
        return (text + (f",io:{self.io_slowdown:.4g}" if self.io_slowdown else "")
                + (f",fresh:{self.fresh_slowdown:.4g}" if self.fresh_slowdown else ""))


@dataclass(frozen=True)
class ComputeSpec:
    """``--compute``: ``numpy`` (real compute), ``sleep`` for ``sleep_s`` seconds a layer, or
    ``model`` (:class:`ComputeModel`, a sleep of the modelled length: for virtual time)."""

    kind: str
    sleep_s: float = 0.0
    model: ComputeModel | None = None

    @property
    def label(self) -> str:
        if self.kind == "model" and self.model is not None:
            return self.model.label
        return "numpy" if self.kind == "numpy" else f"sleep:{1e3 * self.sleep_s:g}"


NUMPY = ComputeSpec("numpy")


def parse_compute(text: str) -> ComputeSpec:
    """``numpy`` or ``sleep:MS`` (MS a finite number >= 0); an argparse type, so a bad value
    is a usage error (``--json``: one JSON error object, exit status 2)."""
    if text == "numpy":
        return NUMPY
    kind, _, ms = text.partition(":")
    if kind == "sleep" and ms:
        try:
            value = float(ms)
        except ValueError:
            value = float("nan")
        if value == value and 0 <= value < float("inf"):
            return ComputeSpec("sleep", value / 1e3)
    raise argparse.ArgumentTypeError(f"{text!r} is not numpy or sleep:MS (MS a number >= 0)")


def add_compute_arguments(p: argparse.ArgumentParser, *, prefix: str = "",
                          default: ComputeSpec | None = NUMPY) -> None:
    """``--compute``, ``--compute-on``, ``--engine-awaits`` and ``--compute-ms`` on ``p`` (``iosched demo`` and
    ``iosched replay``), each help led by ``prefix`` (``"real I/O: "`` where the option applies
    to one mode only); ``default`` is ``--compute``'s."""
    p.add_argument("--compute", type=parse_compute, default=default, metavar="numpy|sleep:MS",
                   help=f"{prefix}the engine's compute per layer: numpy (default: each routed "
                        f"expert's SwiGLU MLP on its own tensors) or sleep:MS (an emulated sleep)")
    p.add_argument("--compute-on", choices=COMPUTE_ON, default=DEFAULT_COMPUTE_ON,
                   help=f"{prefix}where numpy compute runs: thread (a worker thread, the event "
                        f"loop stays free) or loop (on the event loop); default {DEFAULT_COMPUTE_ON}")
    p.add_argument("--engine-awaits", choices=AWAITS, default=DEFAULT_AWAITS,
                   help=f"{prefix}what the engine awaits before computing on a layer: as-ready "
                        f"(iosched's acquire_as_ready: the experts at hand first, the others as "
                        f"their reads land) or all (acquire_many); the hand-written arm always "
                        f"awaits all; default {DEFAULT_AWAITS}")
    p.add_argument("--compute-ms", type=_command.non_negative_float, default=None,
                   help=f"{prefix}the same as --compute sleep:MS")


def parse_compute_model(text: str) -> ComputeModel | None:
    """``--compute-model``: ``const:MS`` (every layer), ``linear:FIXED_MS,MS_PER_MIB,MS_PER_MIB_ROW``
    (:class:`ComputeModel`, per MiB of routed expert bytes), either followed by ``,io:X`` (its
    ``io_slowdown``) and ``,fresh:X`` (its ``fresh_slowdown``), or ``calibrate`` (``None``:
    measure it here with :func:`calibrate`); an argparse type."""
    if text == "calibrate":
        return None
    extra = {"io": 0.0, "fresh": 0.0}
    parts = text.split(",")
    base: list[str] = []
    for part in parts:
        name, sep, value = part.partition(":")
        if name in extra and sep and base:
            try:
                extra[name] = float(value)
            except ValueError:
                extra[name] = float("nan")
            if not (extra[name] == extra[name] and 0 <= extra[name] < float("inf")):
                raise argparse.ArgumentTypeError(f"{text!r}: {name}:X must be a number >= 0")
        else:
            base.append(part)
    text = ",".join(base)
    io, fresh = extra["io"], extra["fresh"]
    kind, _, rest = text.partition(":")
    try:
        values = [float(v) for v in rest.split(",")] if rest else []
    except ValueError:
        values = []
    if all(v == v and 0 <= v < float("inf") for v in values):
        if kind == "const" and len(values) == 1:
            return ComputeModel(fixed_s=values[0] / 1e3, io_slowdown=io, fresh_slowdown=fresh)
        if kind == "linear" and len(values) == 3:
            return ComputeModel(values[0] / 1e3, values[1] / 1e3 / 2**20, values[2] / 1e3 / 2**20, io, fresh)
    raise argparse.ArgumentTypeError(f"{text!r} is not calibrate, const:MS or "
                                     f"linear:FIXED_MS,MS_PER_MIB,MS_PER_MIB_ROW (numbers >= 0), "
                                     f"each optionally followed by ,io:X and ,fresh:X")


CALIBRATION_ROWS = 16
"""Rows per expert of the calibration's multi-row case (a prefill batch's order of size)."""
CALIBRATION_REPS = 7
"""Timed repetitions per case (median), after one untimed warm-up."""
CALIBRATION_PASSES = 5
"""Passes over the three cases, interleaved; each case's time is the median of its passes'
medians.  Why: a VM's compute speed drifts by a fifth or more from minute to minute and has
slow stretches (one calibration read 0.94 ms a MiB where the others, minutes apart, read
0.37-0.51, and the critical-path prediction then missed its felt wait by 43-50 %).  One pass
takes ~0.09 s at 576 KiB experts, five ~0.45 s: a stretch shorter than that is outvoted, a
longer one is not (six calibrations with five passes: 0.48-0.59 ms a MiB)."""
CALIBRATION_SPAN = 96 << 20
"""Bytes of distinct experts the calibration cycles through, so that every layer computes on
weights the CPU caches do not hold, as an engine's freshly read experts are: well above the
development VM's 32 MiB L3 (AMD EPYC).  Measured there, 576 KiB bf16 experts: the same 8
experts over and over computed in 19 ms a token, freshly read ones in the real-I/O replay in
27-31 ms."""


CONTENTION_WINDOW_S = 0.3
"""Seconds each arm of the contention calibration computes for (three interleaved pairs)."""


def calibrate(hidden: int, intermediate: int, k: int, dtype: str = "bfloat16",
              contend: str | None = None, contend_depth: int = 8) -> ComputeModel:
    """:class:`ComputeModel` of the real numpy compute (:meth:`Compute.run_layer`, one BLAS
    thread) on this machine, for experts of ``gate``/``up`` ``[intermediate, hidden]`` in
    ``dtype``: medians of one expert on one row, ``k`` experts on one row and ``k`` experts on
    :data:`CALIBRATION_ROWS` rows each (over :data:`CALIBRATION_PASSES` interleaved passes),
    solved for the fixed, per-byte and per-byte-row terms.
    Each repetition takes the next experts of a pool of :data:`CALIBRATION_SPAN` bytes (cold
    in the CPU caches).  ``contend``: a file on the drive, read with O_DIRECT by
    ``contend_depth`` threads (an expert's size a read, random offsets, as the store's
    misses are) while ``k`` experts on one row are timed again: the ratio, less one, is
    :attr:`ComputeModel.io_slowdown`."""
    import importlib
    import statistics

    ml_dtypes: Any = importlib.import_module("ml_dtypes")  # a dependency (bfloat16), untyped
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    nbytes = 3 * hidden * intermediate * np_dtype.itemsize
    rng = np.random.default_rng(0)
    pool_bytes = rng.integers(0, 256, max(CALIBRATION_SPAN, 2 * k * nbytes), dtype=np.uint8)
    # the demo checkpoint's values (tools/synth.py: sign and mantissa random, magnitude
    # 2**-7 .. 2**-5): raw random bytes hold denormals, and values of other magnitudes were
    # measured to compute up to 6x slower than the checkpoint's own, which is what is modelled
    pool_bytes[1::2] = (pool_bytes[1::2] & 0x80) | 0x3C
    n_experts = pool_bytes.size // nbytes

    class _View:
        def __init__(self, i: int) -> None:
            raw = pool_bytes[i * nbytes:(i + 1) * nbytes].view(np_dtype)
            gate_up = hidden * intermediate
            self.tensors = {"gate_proj": raw[:gate_up].reshape(intermediate, hidden),
                            "up_proj": raw[gate_up:2 * gate_up].reshape(intermediate, hidden),
                            "down_proj": raw[2 * gate_up:].reshape(hidden, intermediate)}

    views = [_View(i) for i in range(n_experts)]
    engine = Compute(NUMPY, "loop")
    cursor = 0
    try:
        def median(n: int, rows: int, at_least_s: float = 0.0) -> float:
            nonlocal cursor
            times: list[float] = []
            start = time.perf_counter()
            rep = 0
            while rep <= CALIBRATION_REPS or time.perf_counter() - start < at_least_s:
                rep += 1
                if cursor + n > n_experts:
                    cursor = 0
                batch = views[cursor:cursor + n]
                cursor += n
                t0 = time.perf_counter()
                engine.run_layer(batch, [rows] * n)  # type: ignore[arg-type]  # duck-typed views
                if rep > 1:  # the first is the warm-up
                    times.append(time.perf_counter() - t0)
            return statistics.median(times)

        median(k, CALIBRATION_ROWS)  # warm-up: the workspace, BLAS's buffers, the pool's pages
        passes = [(median(1, 1), median(k, 1), median(k, CALIBRATION_ROWS)) for _ in range(CALIBRATION_PASSES)]
        t1, tk, tkr = (statistics.median(case) for case in zip(*passes, strict=True))
        io_slowdown = 0.0
        if contend is not None:  # interleaved, long enough for the readers' scheduling to show
            ratios = []
            for _ in range(3):
                alone = median(k, 1, CONTENTION_WINDOW_S)
                with DirectReaders(contend, nbytes, contend_depth):
                    ratios.append(median(k, 1, CONTENTION_WINDOW_S) / alone)
            io_slowdown = max(0.0, statistics.median(ratios) - 1.0)
        fresh_slowdown = _fresh_slowdown(engine, contend, hidden, intermediate, np_dtype, k) if contend else 0.0
    finally:
        engine.close()
    per_expert_1 = max(0.0, (tk - t1) / max(k - 1, 1))  # (a + b) x bytes
    fixed = max(0.0, t1 - per_expert_1)
    per_row = max(0.0, (tkr - tk) / (k * (CALIBRATION_ROWS - 1)))  # b x bytes
    return ComputeModel(fixed, max(0.0, per_expert_1 - per_row) / nbytes, per_row / nbytes, io_slowdown,
                        fresh_slowdown)


FRESH_REPS = 40
"""Layers each arm of the fresh-bytes calibration computes (interleaved, medians)."""


def _fresh_slowdown(engine: Compute, path: str, hidden: int, intermediate: int, np_dtype: np.dtype[Any],
                    k: int) -> float:
    """:attr:`ComputeModel.fresh_slowdown`: ``k`` experts' worth of ``path`` read with O_DIRECT
    into page-aligned buffers (as the store's slabs are) and computed on at once, against the
    same buffers computed on again, interleaved; the median ratio less one.  The bytes are a
    real checkpoint's (the probe's file), read past its header."""
    import mmap
    import random
    import statistics

    nbytes = 3 * hidden * intermediate * np_dtype.itemsize
    length = -(-nbytes // 4096) * 4096
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    bufs = [mmap.mmap(-1, length) for _ in range(k)]
    try:
        size = os.fstat(fd).st_size
        if size < (2 << 20) + length:
            return 0.0

        class _View:
            def __init__(self, buf: mmap.mmap) -> None:
                raw = np.frombuffer(buf, dtype=np.uint8, count=nbytes).view(np_dtype)
                gu = hidden * intermediate
                self.tensors = {"gate_proj": raw[:gu].reshape(intermediate, hidden),
                                "up_proj": raw[gu:2 * gu].reshape(intermediate, hidden),
                                "down_proj": raw[2 * gu:].reshape(hidden, intermediate)}

        views = [_View(b) for b in bufs]
        rng = random.Random(0)
        fresh_t: list[float] = []
        again_t: list[float] = []
        for _ in range(FRESH_REPS + 1):
            for b in bufs:
                os.preadv(fd, [b], rng.randrange(1 << 20, size - length) // 4096 * 4096)
            t0 = time.perf_counter()
            engine.run_layer(views, [1] * k)  # type: ignore[arg-type]  # duck-typed views
            t1 = time.perf_counter()
            engine.run_layer(views, [1] * k)  # type: ignore[arg-type]
            fresh_t.append(t1 - t0)
            again_t.append(time.perf_counter() - t1)
        del views  # their arrays export the buffers
        return max(0.0, statistics.median(fresh_t[1:]) / statistics.median(again_t[1:]) - 1.0)
    finally:
        os.close(fd)
        for b in bufs:
            with contextlib.suppress(BufferError):  # a view still alive: the GC closes it
                b.close()


class DirectReaders:
    """``depth`` threads reading ``path`` with O_DIRECT, ``nbytes`` (rounded up to 4 KiB) a
    read at random aligned offsets, until the block ends: the drive as busy as the store's
    misses keep it.  Written by hand: fio would be the reference, but it is not always
    installed and its start-up would sit inside the timed window."""

    ALIGN = 4096

    def __init__(self, path: str, nbytes: int, depth: int) -> None:
        import threading

        self._path, self._depth = path, max(1, depth)
        self._length = -(-nbytes // self.ALIGN) * self.ALIGN
        self._stop = threading.Event()
        self._threads: list[Any] = []
        self.reads = 0

    def _run(self, seed: int) -> None:
        import mmap
        import random

        rng = random.Random(seed)
        fd = os.open(self._path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        buf = mmap.mmap(-1, self._length)
        try:
            slots = max(1, (os.fstat(fd).st_size - self._length) // self.ALIGN)
            while not self._stop.is_set():
                os.preadv(fd, [buf], rng.randrange(slots) * self.ALIGN)
                self.reads += 1
        finally:
            buf.close()
            os.close(fd)

    def __enter__(self) -> DirectReaders:
        import threading

        try:
            os.close(os.open(self._path, os.O_RDONLY | getattr(os, "O_DIRECT", 0)))
        except OSError as exc:
            raise StoreError(f"{self._path}: cannot read it with O_DIRECT to calibrate: {exc.strerror or exc}") from exc
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(self._depth)]
        for t in self._threads:
            t.start()
        time.sleep(0.05)  # the queue fills
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()


def limit_blas_threads(n: int = BLAS_THREADS) -> int | None:
    """Set numpy's OpenBLAS to ``n`` threads (unless the environment already chose); the count
    set, or ``None`` when no OpenBLAS call was found (then ``OPENBLAS_NUM_THREADS`` before
    starting Python does it)."""
    if os.environ.get("OPENBLAS_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS"):
        return None
    libs = Path(np.__file__).resolve().parent.parent / "numpy.libs"
    for path in sorted(libs.glob("*openblas*")):
        lib = ctypes.CDLL(str(path))  # already loaded by numpy: the same handle
        for name in ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_",
                     "openblas_set_num_threads"):
            fn = getattr(lib, name, None)
            if fn is not None:
                fn(n)
                return n
    return None


Workspace = dict[tuple[int, ...], list[npt.NDArray[np.float32]]]
"""Upcast buffers by tensor shape (:func:`_as_float`)."""


def _as_float(t: npt.NDArray[Any], workspace: Workspace | None = None, slot: int = 0) -> npt.NDArray[np.float32]:
    """``t`` as ``float32``: itself, or an upcast into the ``workspace`` buffer of its shape
    (slot ``slot``), or a new array without one.  Why a workspace: a fresh 1 MiB upcast per
    tensor goes to ``mmap`` and back on every layer in a process whose allocator has just
    trimmed its heap, and its page faults then cost more than the upcast (measured on the
    development VM, 576 KiB bf16 experts: 0.27 ms against 0.025 ms an expert); engines keep
    such buffers."""
    if t.dtype == np.float32:
        return t
    if workspace is None:
        return t.astype(np.float32)
    bufs = workspace.setdefault(t.shape, [])
    while len(bufs) <= slot:
        bufs.append(np.empty(t.shape, dtype=np.float32))
    np.copyto(bufs[slot], t, casting="unsafe")
    return bufs[slot]


def is_float_layout(tensors: Any) -> bool:
    """True when the expert has the three SwiGLU roles as 2-D float tensors (fp32, fp16, bf16)."""
    for role in ROLES:
        t = tensors.get(role)
        if t is None or t.ndim != 2 or not (t.dtype.kind == "f" or t.dtype.name == "bfloat16"):
            return False
    return True


def expert_mlp(tensors: Any, x: npt.NDArray[np.float32],
               workspace: Workspace | None = None) -> npt.NDArray[np.float32]:
    """``down · (silu(gate · x) ⊙ up · x)`` for ``x`` of shape ``[rows, hidden]`` (Hugging Face
    layout: ``gate``/``up`` are ``[intermediate, hidden]``, ``down`` ``[hidden, intermediate]``)."""
    gate, up, down = (_as_float(tensors[r], workspace, slot) for slot, r in enumerate(ROLES))
    h = x @ gate.T
    with np.errstate(over="ignore"):  # exp(-h) overflows to inf for very negative h: silu -> -0
        h *= 1.0 / (1.0 + np.exp(-h))
    h *= x @ up.T
    out: npt.NDArray[np.float32] = h @ down.T
    return out


def _fallback(tensors: Any) -> float:
    """A matvec of each tensor's stored shape on a float32 copy of it (quantized layouts)."""
    total = 0.0
    for t in tensors.values():
        m = _as_float(np.asarray(t).reshape(t.shape[0] if t.ndim else 1, -1))
        total += float((m @ np.ones(m.shape[1], dtype=np.float32)).sum())
    return total


class Compute:
    """One engine's compute: :meth:`layer` per batch, on its views, inside their lease."""

    def __init__(self, spec: ComputeSpec = NUMPY, on: str = DEFAULT_COMPUTE_ON,
                 awaits: str = DEFAULT_AWAITS) -> None:
        if on not in COMPUTE_ON:
            raise ValueError(f"compute on {on!r}: choose one of {', '.join(COMPUTE_ON)}")
        if awaits not in AWAITS:
            raise ValueError(f"engine awaits {awaits!r}: choose one of {', '.join(AWAITS)}")
        self.spec, self.on, self.awaits = spec, on, awaits
        self.seconds = 0.0
        """Time spent computing (the layer calls themselves), summed."""
        self.fallbacks: set[str] = set()
        """Why some experts ran the fallback matvec (their tensor types), if any did."""
        self.blas_threads = limit_blas_threads() if spec.kind == "numpy" else None
        self._pool = (ThreadPoolExecutor(1, thread_name_prefix="compute")
                      if spec.kind == "numpy" and on == "thread" else None)
        self._x: dict[int, npt.NDArray[np.float32]] = {}
        self._workspace: Workspace = {}
        self.drive_busy: Callable[[], float] | None = None
        """Model compute: the drive's busy seconds so far (the modelled drive's transfer
        time), whose share of the time since the previous layer scales
        :attr:`ComputeModel.io_slowdown`; ``None``: the drive counts as idle."""
        self._busy_mark = (0.0, 0.0)
        self.pollute = spec.kind == "model"
        """Model compute on virtual time: read as many bytes as the layer's experts hold from
        a buffer larger than the CPU caches (off the virtual clock), so that the store's
        Python after it runs on caches as cold as the real compute leaves them."""
        self._cold: npt.NDArray[np.uint64] | None = None
        self.off_clock_cpu_s = 0.0
        """CPU time of those sweeps (the engine loop leaves it out of its CPU per token)."""
        self._cold_at = 0
        """Upcast buffers by tensor shape, reused by every layer (:func:`_as_float`)."""

    @property
    def label(self) -> str:
        return self.spec.label + (f" on {self.on}" if self.spec.kind in ("numpy", "model") else "")

    def _input(self, hidden: int, rows: int) -> npt.NDArray[np.float32]:
        x = self._x.get(hidden)
        if x is None or x.shape[0] < rows:
            rng = np.random.default_rng(hidden)  # an activation of unit norm per row
            x = (rng.standard_normal((max(rows, 1), hidden)) / np.sqrt(hidden)).astype(np.float32)
            self._x[hidden] = x
        return x[:rows]

    def run_layer(self, views: Sequence[ExpertView], rows: Sequence[int]) -> float:
        """The layer's experts, each on its ``rows``, their outputs summed; a checksum."""
        t0 = time.perf_counter()
        out: npt.NDArray[np.float32] | None = None
        total = 0.0
        for view, n in zip(views, rows, strict=True):
            tensors = view.tensors
            if not is_float_layout(tensors):
                self.fallbacks.add(", ".join(sorted({str(t.dtype) for t in tensors.values()})))
                total += _fallback(tensors)
                continue
            y = expert_mlp(tensors, self._input(tensors["gate_proj"].shape[1], max(n, 1)), self._workspace)
            if out is None:
                out = y
            elif out.shape[0] >= y.shape[0]:  # the combine: each expert's rows onto their tokens'
                out[: y.shape[0]] += y
            else:
                y[: out.shape[0]] += out
                out = y
        if out is not None:
            total += float(out[0, 0])
        self.seconds += time.perf_counter() - t0
        return total

    async def layer(self, views: Sequence[ExpertView], rows: Sequence[int], fresh: int = 0,
                    share: float = 1.0) -> None:
        """This batch's compute, where :attr:`on` says (``sleep``: the emulation).  ``share``:
        the part of its layer the batch is (its experts over the layer's), for what is a
        layer's cost in the emulation and the model: the sleep, the model's fixed cost."""
        if self.spec.kind == "sleep":
            t0 = clock.now()
            await asyncio.sleep(self.spec.sleep_s * share)
            self.seconds += clock.now() - t0
        elif self.spec.kind == "model" and self.spec.model is not None:
            t0 = clock.now()
            busy = 0.0
            if self.drive_busy is not None:
                now, busy_s = clock.now(), self.drive_busy()
                mark_t, mark_busy = self._busy_mark
                if now > mark_t:
                    busy = (busy_s - mark_busy) / (now - mark_t)
                self._busy_mark = (now, busy_s)
            sizes = [v.data.nbytes for v in views]
            seconds = self.spec.model.seconds(sizes, rows, busy, fresh, share)
            virtual = clock.running_virtual_loop()
            if virtual is not None and self.pollute:
                with virtual.uncharged():
                    c0 = time.thread_time()
                    self._sweep(sum(sizes))
                    self.off_clock_cpu_s += time.thread_time() - c0
            if self.on == "thread":  # elsewhere: the loop runs the store meanwhile
                await asyncio.sleep(seconds)
            else:  # on the loop: nothing else runs until it is done
                if virtual is not None:
                    virtual.advance(seconds)
                else:
                    time.sleep(seconds)
            self.seconds += clock.now() - t0
        elif self._pool is not None:
            await asyncio.get_running_loop().run_in_executor(self._pool, self.run_layer, views, rows)
        else:
            self.run_layer(views, rows)

    @property
    def in_thread(self) -> bool:
        """Whether the compute runs in a thread of its own (numpy, ``on="thread"``): an
        ``acquire_as_ready`` group then hands its batches to that thread (:meth:`arrivals`)."""
        return self._pool is not None

    async def arrivals(self, batches: Iterable[Sequence[ExpertView]], rows_of: Mapping[ExpertKey, int]) -> None:
        """Compute on each batch of ``batches`` (a group's ``in_thread()``, blocking between
        them) in the compute thread, each view on its ``rows_of[view.key]`` rows: one hand-off
        to the thread a layer, not one a batch (docs/benchmarks.md, "Batches handed to the
        compute thread")."""
        if self._pool is None:
            raise StoreError(f"compute {self.label!r} has no thread to take the batches in")
        await asyncio.get_running_loop().run_in_executor(self._pool, self._run_batches, batches, rows_of)

    def _run_batches(self, batches: Iterable[Sequence[ExpertView]], rows_of: Mapping[ExpertKey, int]) -> None:
        for views in batches:
            self.run_layer(views, [rows_of[view.key] for view in views])

    def _sweep(self, nbytes: int) -> None:
        if self._cold is None:
            self._cold = np.ones(CALIBRATION_SPAN // 8, dtype=np.uint64)
        words = min(self._cold.size, max(1, nbytes // 8))
        if self._cold_at + words > self._cold.size:
            self._cold_at = 0
        self._cold[self._cold_at:self._cold_at + words].sum()
        self._cold_at += words

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def describe(self) -> dict[str, Any]:
        return {"compute": self.spec.label, "compute_on": self.on if self.spec.kind in ("numpy", "model") else None,
                "blas_threads": self.blas_threads, "compute_fallbacks": sorted(self.fallbacks)}
