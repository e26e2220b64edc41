"""Real compute for the engine loop of ``iosched demo`` and ``iosched replay`` (real reads).

Why real compute: a ``sleep`` standing in for an expert's matmuls leaves the CPU free, so it
hides the contention between the engine's compute and the store's own work (its policy, its
reads' system calls) on the same cores; on two cores a policy once looked 13 % faster with a
sleep and 9 % slower with real compute (issue #15).  ``--compute numpy`` (the default) runs,
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
import ctypes
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from iosched import ExpertView, clock

COMPUTE_ON = ("thread", "loop")
DEFAULT_COMPUTE_ON = "thread"
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
    :func:`calibrate` measures the three numbers on this machine with the real compute."""

    fixed_s: float = 0.0
    per_byte_s: float = 0.0
    per_byte_row_s: float = 0.0

    def seconds(self, nbytes: Sequence[int], rows: Sequence[int]) -> float:
        t = self.fixed_s
        for b, r in zip(nbytes, rows, strict=True):
            t += (self.per_byte_s + self.per_byte_row_s * max(r, 1)) * b
        return t

    @property
    def label(self) -> str:
        if self.per_byte_s == 0 and self.per_byte_row_s == 0:
            return f"const:{1e3 * self.fixed_s:.6g}"
        return (f"linear:{1e3 * self.fixed_s:.6g},{1e3 * self.per_byte_s * 2**20:.6g},"
                f"{1e3 * self.per_byte_row_s * 2**20:.6g}")


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


def parse_compute_model(text: str) -> ComputeModel | None:
    """``--compute-model``: ``const:MS`` (every layer), ``linear:FIXED_MS,MS_PER_MIB,MS_PER_MIB_ROW``
    (:class:`ComputeModel`, per MiB of routed expert bytes), or ``calibrate`` (``None``: measure
    it here with :func:`calibrate`); an argparse type."""
    if text == "calibrate":
        return None
    kind, _, rest = text.partition(":")
    try:
        values = [float(v) for v in rest.split(",")] if rest else []
    except ValueError:
        values = []
    if all(v == v and 0 <= v < float("inf") for v in values):
        if kind == "const" and len(values) == 1:
            return ComputeModel(fixed_s=values[0] / 1e3)
        if kind == "linear" and len(values) == 3:
            return ComputeModel(values[0] / 1e3, values[1] / 1e3 / 2**20, values[2] / 1e3 / 2**20)
    raise argparse.ArgumentTypeError(f"{text!r} is not calibrate, const:MS or "
                                     f"linear:FIXED_MS,MS_PER_MIB,MS_PER_MIB_ROW (numbers >= 0)")


CALIBRATION_ROWS = 16
"""Rows per expert of the calibration's multi-row case (a prefill batch's order of size)."""
CALIBRATION_REPS = 7
"""Timed repetitions per case (median), after one untimed warm-up."""


def calibrate(hidden: int, intermediate: int, k: int, dtype: str = "bfloat16") -> ComputeModel:
    """:class:`ComputeModel` of the real numpy compute (:meth:`Compute.run_layer`, one BLAS
    thread) on this machine, for experts of ``gate``/``up`` ``[intermediate, hidden]`` in
    ``dtype``: medians of one expert on one row, ``k`` experts on one row and ``k`` experts on
    :data:`CALIBRATION_ROWS` rows each, solved for the fixed, per-byte and per-byte-row terms."""
    import importlib
    import statistics

    ml_dtypes: Any = importlib.import_module("ml_dtypes")  # a dependency (bfloat16), untyped
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(0)

    class _View:
        def __init__(self) -> None:
            self.tensors = {
                "gate_proj": rng.standard_normal((intermediate, hidden)).astype(np_dtype),
                "up_proj": rng.standard_normal((intermediate, hidden)).astype(np_dtype),
                "down_proj": rng.standard_normal((hidden, intermediate)).astype(np_dtype)}

    views = [_View() for _ in range(k)]
    nbytes = 3 * hidden * intermediate * np_dtype.itemsize
    engine = Compute(NUMPY, "loop")
    try:
        def median(n: int, rows: int) -> float:
            engine.run_layer(views[:n], [rows] * n)  # type: ignore[arg-type]  # duck-typed views
            times = []
            for _ in range(CALIBRATION_REPS):
                t0 = time.perf_counter()
                engine.run_layer(views[:n], [rows] * n)  # type: ignore[arg-type]
                times.append(time.perf_counter() - t0)
            return statistics.median(times)

        t1, tk, tkr = median(1, 1), median(k, 1), median(k, CALIBRATION_ROWS)
    finally:
        engine.close()
    per_expert_1 = max(0.0, (tk - t1) / max(k - 1, 1))  # (a + b) x bytes
    fixed = max(0.0, t1 - per_expert_1)
    per_row = max(0.0, (tkr - tk) / (k * (CALIBRATION_ROWS - 1)))  # b x bytes
    return ComputeModel(fixed, max(0.0, per_expert_1 - per_row) / nbytes, per_row / nbytes)


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


def _as_float(t: npt.NDArray[Any]) -> npt.NDArray[np.float32]:
    return t if t.dtype == np.float32 else t.astype(np.float32)


def is_float_layout(tensors: Any) -> bool:
    """True when the expert has the three SwiGLU roles as 2-D float tensors (fp32, fp16, bf16)."""
    for role in ROLES:
        t = tensors.get(role)
        if t is None or t.ndim != 2 or not (t.dtype.kind == "f" or t.dtype.name == "bfloat16"):
            return False
    return True


def expert_mlp(tensors: Any, x: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """``down · (silu(gate · x) ⊙ up · x)`` for ``x`` of shape ``[rows, hidden]`` (Hugging Face
    layout: ``gate``/``up`` are ``[intermediate, hidden]``, ``down`` ``[hidden, intermediate]``)."""
    gate, up, down = (_as_float(tensors[r]) for r in ROLES)
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

    def __init__(self, spec: ComputeSpec = NUMPY, on: str = DEFAULT_COMPUTE_ON) -> None:
        if on not in COMPUTE_ON:
            raise ValueError(f"compute on {on!r}: choose one of {', '.join(COMPUTE_ON)}")
        self.spec, self.on = spec, on
        self.seconds = 0.0
        """Time spent computing (the layer calls themselves), summed."""
        self.fallbacks: set[str] = set()
        """Why some experts ran the fallback matvec (their tensor types), if any did."""
        self.blas_threads = limit_blas_threads() if spec.kind == "numpy" else None
        self._pool = (ThreadPoolExecutor(1, thread_name_prefix="compute")
                      if spec.kind == "numpy" and on == "thread" else None)
        self._x: dict[int, npt.NDArray[np.float32]] = {}

    @property
    def label(self) -> str:
        return self.spec.label + (f" on {self.on}" if self.spec.kind == "numpy" else "")

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
            y = expert_mlp(tensors, self._input(tensors["gate_proj"].shape[1], max(n, 1)))
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

    async def layer(self, views: Sequence[ExpertView], rows: Sequence[int]) -> None:
        """This batch's compute, where :attr:`on` says (``sleep``: the emulation)."""
        if self.spec.kind == "sleep":
            t0 = clock.now()
            await asyncio.sleep(self.spec.sleep_s)
            self.seconds += clock.now() - t0
        elif self.spec.kind == "model" and self.spec.model is not None:
            t0 = clock.now()
            await asyncio.sleep(self.spec.model.seconds([v.data.nbytes for v in views], rows))
            self.seconds += clock.now() - t0
        elif self._pool is not None:
            await asyncio.get_running_loop().run_in_executor(self._pool, self.run_layer, views, rows)
        else:
            self.run_layer(views, rows)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def describe(self) -> dict[str, Any]:
        return {"compute": self.spec.label, "compute_on": self.on if self.spec.kind == "numpy" else None,
                "blas_threads": self.blas_threads, "compute_fallbacks": sorted(self.fallbacks)}
