"""Self-sizing: the token cycle, and a budget sized in whole cycles.

One token routes ``k`` experts in every MoE layer, so producing it touches ``k`` experts of
each layer: the *token cycle*, ``TD = k × Σ layer expert bytes``. Between an expert's use by
one token and its reuse by the next, the engine touches every other expert of that cycle,
all distinct (other layers, or other experts of the same layer): the reuse distance is about
``TD``. LRU hits exactly when the reuse distance fits in the cache, so a budget below one
cycle buys no hit from one token to the next, whatever the routing; each cycle above one
keeps reuse over one more token. Hence a budget below one cycle is warned about at open, and
``budget="auto"`` sizes in whole cycles.

``TD`` uses the *largest* expert of each layer, not the mean: the budget must hold the k
experts a token actually picks, and the worst pick is k of the largest. Layers whose experts
differ in size (mixed quantization, a different intermediate size) would otherwise leave a
cycle of large experts short of room, and the cycle would evict itself. For the usual
checkpoint every expert of a layer is the same size, and largest = mean.

``budget="auto"`` opens at ``auto_start_cycles`` cycles (or fewer, if fewer fit) and grows
between turns while the measured benefit (felt wait a larger budget would have saved)
exceeds the measured cost (memory stalls): :mod:`iosched.runtime._growth`.
"""

from __future__ import annotations

import weakref

from iosched._errors import BudgetError
from iosched._layout import CheckpointIndex

__all__ = ["AUTO_FRACTION", "auto_budget", "mem_available", "token_cycle_bytes", "whole_cycles"]

AUTO_FRACTION = 0.5
"""The share of ``MemAvailable`` that ``budget="auto"`` may take.

Half, because the rest is not ours to take: after ``open`` the engine still allocates its
dense weights, KV cache and activations (all absent from ``MemAvailable`` at open time), and
the page cache in the other half is what the buffered backends (``pread``, ``mmap``) and
``hint()`` read from; ``MemAvailable`` itself counts reclaimable page cache, which a budget
that took all of it would silently evict. Half is the conservative default; an engine that
knows better passes an integer budget."""

_MEMINFO = "/proc/meminfo"

_layer_sum: dict[int, int] = {}
"""``id(index)`` -> Σ over layers of the largest expert; dropped when the index is collected.
``stats()`` reports the cycle per call, and summing thousands of experts each time is not
free; an index is frozen, so its sum never changes."""


def _largest_per_layer_sum(index: CheckpointIndex) -> int:
    key = id(index)
    total = _layer_sum.get(key)
    if total is None:
        total = sum(index.expert_bytes_by_layer().values())
        _layer_sum[key] = total
        weakref.finalize(index, _layer_sum.pop, key, None)
    return total


def token_cycle_bytes(index: CheckpointIndex, k: int) -> int:
    """``TD = k × Σ over layers of the largest expert of the layer``, in bytes.

    Raises :class:`BudgetError` unless ``k`` is a positive integer.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise BudgetError(f"experts_per_token must be a positive integer, got {k!r}")
    return k * _largest_per_layer_sum(index)


def whole_cycles(index: CheckpointIndex, k: int) -> int:
    """The token cycles it takes to hold every expert of the checkpoint (at least 1)."""
    total = sum(layout.nbytes for layout in index.experts.values())
    return max(1, -(-total // token_cycle_bytes(index, k)))


def auto_budget(index: CheckpointIndex, k: int, mem_available: int,
                start_cycles: int | None = None) -> int:
    """The budget ``budget="auto"`` opens with: the most whole token cycles that fit in
    ``AUTO_FRACTION`` of ``mem_available`` bytes, at most ``start_cycles`` of them (the rest
    is grown into, :mod:`iosched.runtime._growth`), and never more cycles than it takes to hold every
    expert of the checkpoint (room past that would never be used).

    Raises :class:`BudgetError` naming the numbers when not even one cycle fits.
    """
    td = token_cycle_bytes(index, k)
    usable = int(mem_available * AUTO_FRACTION)
    cycles = usable // td
    if cycles < 1:
        raise BudgetError(
            f'budget="auto": one token cycle is {td} bytes (k={k} experts per token × '
            f"{td // k} bytes per layer sweep), but only {usable} bytes are usable "
            f"({AUTO_FRACTION:g} of MemAvailable {mem_available}); pass an integer budget_bytes"
        )
    if start_cycles is not None:
        cycles = min(cycles, start_cycles)
    return min(cycles, whole_cycles(index, k)) * td


def mem_available(path: str = _MEMINFO) -> int:
    """``MemAvailable`` from ``/proc/meminfo``, in bytes.

    Raises :class:`BudgetError` when the file cannot be read or has no such line (not Linux,
    or a kernel older than 3.14): ``budget="auto"`` then needs an integer budget instead.
    """
    try:
        with open(path, encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    parts = line.split()
                    unit = parts[2].lower() if len(parts) > 2 else "b"
                    scale = {"kb": 1024, "mb": 1 << 20, "gb": 1 << 30, "b": 1}.get(unit)
                    if scale is None:
                        break
                    return int(parts[1]) * scale
    except (OSError, ValueError, IndexError) as exc:
        raise BudgetError(f'budget="auto": cannot read MemAvailable from {path}: {exc}') from exc
    raise BudgetError(f'budget="auto": no MemAvailable line in {path}; pass an integer budget_bytes')


def mem_total(path: str = _MEMINFO) -> int | None:
    """``MemTotal`` from ``/proc/meminfo`` in bytes, or ``None`` where it cannot be read."""
    try:
        with open(path, encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
