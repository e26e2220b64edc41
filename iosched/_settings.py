"""Settings: one table, an ``IOSCHED_*`` environment default for each, a runtime override.

Modelled on kvikio's ``defaults``: every knob has an environment variable, read once when
first needed, and :func:`override` changes it at run time for a ``with`` block (tests, the
benchmark sweeps).  ``docs/settings.md`` is generated from :data:`SETTINGS` by
``tools/settings_doc.py`` so the table and the code cannot drift apart.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ._errors import StoreError


@dataclass(frozen=True)
class Setting:
    name: str
    env: str
    default: Any
    parse: Callable[[str], Any]
    doc: str


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise ValueError(f"must be a positive integer, got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(f"must be an integer >= 0, got {text!r}")
    return value


def _width(text: str) -> int | str:
    if text == "k":
        return text
    value = int(text)
    if value < 0:
        raise ValueError(f"must be k or an integer >= 0, got {text!r}")
    return value


def _choice(*options: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in options:
            raise ValueError(f"must be one of {', '.join(options)}, got {text!r}")
        return text

    return parse


def _probability(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"must be a probability from 0 to 1, got {text!r}")
    return value


SETTINGS: dict[str, Setting] = {
    s.name: s
    for s in (
        Setting(
            "backend", "IOSCHED_BACKEND", "auto", _choice("auto", "pread", "odirect", "mmap", "uring"),
            "Read backend used when `ExpertStore.open(backend=None)`.",
        ),
        Setting(
            "policy", "IOSCHED_POLICY", "default", str,
            "Residency policy used when `ExpertStore.open(policy=None)`.",
        ),
        Setting(
            "pread_threads", "IOSCHED_PREAD_THREADS", 16, _positive_int,
            "Worker threads of the `pread` backend: the most reads in flight at once. "
            "16 is not measured yet: it is twice the queue depth of 8 at which NVMe drives "
            "commonly saturate for MiB-sized reads; issue #3's `iosched bench --sweep` replaces it "
            "with a measured value.",
        ),
        Setting(
            "pread_inline_max", "IOSCHED_PREAD_INLINE_MAX", 128 << 10, _non_negative_int,
            "Bytes: a `pread` read this small that the page cache holds whole is copied on the "
            "event loop's thread (`preadv2(RWF_NOWAIT)`), not handed to a worker; 0: always a worker. "
            "128 KiB: such a copy took 16 us against 51 us for a worker's round trip (a 36 KiB one "
            "6.3 us, 256 KiB 24 us; docs/benchmarks.md, \"Small cached reads and the compute thread\").",
        ),
        Setting(
            "queue_depth", "IOSCHED_QUEUE_DEPTH", 8, _positive_int,
            "Reads in flight per drive; more wait in its queue, demand before prefetch. 8: on the "
            "development VM's virtio disk O_DIRECT throughput is flat from queue depth 4 on while "
            "p99 latency grows with depth (docs/benchmarks.md); NVMe drives commonly saturate near 8 "
            "for MiB-sized reads. `iosched topology --probe` measures it per drive.",
        ),
        Setting(
            "inflight_bytes", "IOSCHED_INFLIGHT_BYTES", 2 << 20, _non_negative_int,
            "Bytes of reads in flight per drive at most, beside `queue_depth` (a read larger "
            "than it starts alone when nothing else is in flight); 0: no limit. Reads in flight "
            "share the drive's bandwidth and finish together, so an engine that computes each "
            "expert as it lands (`acquire_as_ready`) waited for all of a layer's misses before the "
            "first; one expert at a time lands the first after a fraction of the time. 2 MiB: "
            "with 2.25 MiB experts at one token cycle the felt wait was 42-45 ms a token at caps of "
            "0.5-4.5 MiB against 84-100 ms with 8 reads in flight, +21-25 % tokens/s "
            "(docs/benchmarks.md, \"Reads in flight per drive\").",
        ),
        Setting(
            "stripe_threshold", "IOSCHED_STRIPE_THRESHOLD", 4 << 20, _positive_int,
            "O_DIRECT reads of at least this many bytes are split across the healthy replicas of "
            "their file, legs proportional to the drives' weights. 4 MiB: below it a read is one "
            "or two of a drive's largest requests (max_sectors_kb is commonly 1-4 MiB), so splitting "
            "adds a request per leg without adding bandwidth.",
        ),
        Setting(
            "cache_dir", "IOSCHED_CACHE_DIR", "", str,
            "Where `iosched demo` keeps its checkpoint; empty means `$XDG_CACHE_HOME/iosched` "
            "(`~/.cache/iosched`).",
        ),
        Setting(
            "prefetch_width", "IOSCHED_PREFETCH_WIDTH", "k", _width,
            "Loads the `default`/`moe` policy may start after each `acquire_many`, for the next "
            "layer's predicted experts: `k` (the experts routed per token and layer) bounds "
            "prefetch to one token cycle of bytes per token, what a cold cache reads anyway; "
            "`0` turns prefetch off. `token_budget_bytes` caps it further. Hits against bytes "
            "moved for other widths: docs/tried-and-dropped.md.",
        ),
        Setting(
            "prefetch_pacing", "IOSCHED_PREFETCH_PACING", "idle", _choice("idle", "none"),
            "How much of the policy's prefetch proposals the store issues: `idle` (between two "
            "batch ends, what the drives' idle time times their measured bandwidth could have "
            "read; iosched/runtime/_pacing.py), or `none` (all of them, within `token_budget_bytes`). "
            "Measured for `idle`: on a drive-bound run prefetching everything raised the felt "
            "wait by 20-42 % (docs/tried-and-dropped.md).",
        ),
        Setting(
            "lookahead_min_probability", "IOSCHED_LOOKAHEAD_MIN_PROBABILITY", 0.5, _probability,
            "The least probability an engine's lookahead (`ExpertStore.expect`) must give an expert "
            "for the store to load it ahead. 0.5: a prefetch on the critical path replay's "
            "measurements pays when it is used more often than not (docs/residency.md, "
            "\"The engine's lookahead\").",
        ),
        Setting(
            "auto_start_cycles", "IOSCHED_AUTO_START_CYCLES", 2, _positive_int,
            'Token cycles `budget_bytes="auto"` opens with (fewer if fewer fit in half of '
            "MemAvailable); it grows from there while a larger budget's measured benefit exceeds "
            "its measured cost (iosched/runtime/_growth.py). 2: one token's reuse distance is about one "
            "cycle, so 2 is the smallest whole-cycle budget in which reuse from one token to the "
            "next fits under LRU, and the replays measure the steepest gain per cycle between 1 "
            "and 2 cycles (docs/residency.md).",
        ),
        Setting(
            "verify", "IOSCHED_VERIFY", "off", _choice("off", "reads"),
            "Verification used when `ExpertStore.open(verify=None)`: `reads` checks every read "
            "against the checkpoint's manifest (`iosched manifest`), `off` checks nothing. `off` "
            "by default: measured (`iosched bench-verify`, docs/benchmarks.md), the check costs "
            "nothing measurable on drive reads, but up to a fifth of page-cache throughput at 16 "
            "MiB experts and 22-45 % of `mmap`'s from 2.5 MiB up; and it needs a manifest.",
        ),
        Setting(
            "verify_mirrors", "IOSCHED_VERIFY_MIRRORS", 0, _non_negative_int,
            "Experts `ExpertStore.open(verify_mirrors=None)` samples on every mirror at open, "
            "compared with the manifest (or the primary); a difference refuses the open. 0: none "
            "(each sampled expert costs one read per mirror, and one of the primary without a manifest).",
        ),
        Setting(
            "loop", "IOSCHED_LOOP", "auto", _choice("auto", "uvloop", "asyncio"),
            "Event loop of the command-line tools: uvloop when installed (`auto`), or plain asyncio.",
        ),
    )
}

_overrides: dict[str, Any] = {}
_cache: dict[str, Any] = {}


def get(name: str) -> Any:
    """The setting's value: the innermost :func:`override`, else its environment variable, else the default."""
    if name in _overrides:
        return _overrides[name]
    if name not in _cache:
        setting = SETTINGS[name]
        raw = os.environ.get(setting.env)
        if raw is None or raw == "":
            _cache[name] = setting.default
        else:
            try:
                _cache[name] = setting.parse(raw)
            except ValueError as exc:
                raise StoreError(f"environment variable {setting.env}: {exc}") from None
    return _cache[name]


@contextlib.contextmanager
def override(**values: Any) -> Iterator[None]:
    """Set settings for the duration of a ``with`` block: ``with override(pread_threads=4): ...``."""
    unknown = set(values) - set(SETTINGS)
    if unknown:
        raise StoreError(f"unknown setting(s): {', '.join(sorted(unknown))}")
    saved = dict(_overrides)
    _overrides.update(values)
    try:
        yield
    finally:
        _overrides.clear()
        _overrides.update(saved)
