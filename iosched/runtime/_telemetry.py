"""Per-token telemetry (JSON lines) and an optional Prometheus exporter.

:class:`TokenTelemetry` writes one JSON object per line: at each ``store.token_boundary()``
the counters' *deltas* since the previous boundary (or since the store opened), and one last
line when the store closes, so the lines' deltas add up to the store's totals.  ``stats()``
stays the summary; ``docs/telemetry.md`` lists every field and how each is measured.

The file is opened (buffered) when the store opens, written and flushed once per line so a
crashing engine loses at most the token in progress, and closed with the store.  One record
is one ``stats()`` snapshot and one small ``write`` + ``flush`` into the page cache (no
``fsync``): microseconds on the event loop, once per token.

:func:`start_exporter` serves ``store.stats()`` to Prometheus (``prometheus-client``, an
optional dependency), bound to ``127.0.0.1`` unless told otherwise; the metrics are read
from the store at scrape time, so the exporter adds nothing to the store's hot path.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import IO, Any, Protocol

from iosched._errors import StoreError

from ._outputs import temporary_beside


class MetricsSource(Protocol):
    """What the exporter needs of a store (``ExpertStore`` is one)."""

    def stats(self) -> dict[str, Any]: ...

    def on_close(self, callback: Callable[[], None]) -> None: ...

COUNTERS = (
    "requests", "hits", "misses", "single_flight_joins", "bytes_read",
    "admissions", "rejections", "evictions", "load_errors",
    "prefetch_issued", "prefetch_dropped", "prefetch_refused", "prefetch_refused_bytes",
    "prefetch_promoted", "hints", "hints_skipped", "retries", "failovers", "queue_waits",
    "stripes", "stripe_redos", "prefetch_used", "prefetch_wasted", "prefetch_failed",
    "physical_misses", "migration_bytes", "verified_bytes", "verify_mismatches", "verify_retries",
    "retired_slabs", "retired_released",
)
"""Monotonic integer counters of ``stats()``: each record holds their deltas."""
SECONDS = ("felt_wait_s", "service_s", "verify_s")
"""Monotonic float counters of ``stats()`` (seconds): deltas too."""
GAUGES = ("resident_bytes", "resident_experts", "leased", "loading", "idle_slab_bytes", "budget_bytes",
          "prefetch_unused", "verify_bad_extents", "retired_bytes")
"""Current values at the end of the interval, not deltas."""
TIERS = ("resident", "page_cache", "drive")
"""Keys of ``hits_by_tier``: each a monotonic counter, so each record holds their deltas."""
DEVICE_COUNTERS = ("reads", "bytes", "errors")


class TokenTelemetry:
    """Writes one JSON line per token interval for ``path``: into a temporary file beside it
    (``iosched/runtime/_outputs.py``), renamed to ``path`` when the store closes, so a file of that
    name is only ever a complete run's.  ``path`` was checked by ``_outputs`` (outside the
    checkpoint, absent or an iosched telemetry file)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self.writing = temporary_beside(self.path)
        """Where the lines go until ``close()``."""
        try:
            self._file: IO[str] | None = open(self.writing, "x", encoding="utf-8", buffering=1 << 16)
        except FileExistsError:  # a crashed run of this very process id left it: ours, replace it
            self._file = open(self.writing, "w", encoding="utf-8", buffering=1 << 16)
        except OSError as exc:
            raise StoreError(f"telemetry={path}: cannot write {self.writing}: {exc.strerror or exc}") from None
        self._t0 = self._t_last = time.monotonic()
        self._prev: dict[str, Any] = {}
        self._interval = 0
        self.lines = 0

    def record(self, stats: Mapping[str, Any], end: str = "boundary") -> dict[str, Any] | None:
        """Write the record of the interval ending now (``end``: ``"boundary"`` or ``"close"``)
        from the store's ``stats()`` at its end; returns it, or ``None`` once closed."""
        if self._file is None:
            return None
        now = time.monotonic()
        dt = now - self._t_last
        prev = self._prev
        rec: dict[str, Any] = {"token": self._interval, "end": end,
                               "t": round(now - self._t0, 6), "dt": round(dt, 6)}
        for name in COUNTERS:
            value = stats.get(name)
            if isinstance(value, int):
                rec[name] = value - int(prev.get(name, 0))
        for name in SECONDS:
            rec[name] = float(stats[name]) - float(prev.get(name, 0.0))
        for name in GAUGES:
            rec[name] = stats[name]
        prev_tiers: dict[str, int] = prev.get("hits_by_tier", {})
        rec["hits_by_tier"] = {t: stats["hits_by_tier"][t] - prev_tiers.get(t, 0) for t in TIERS}
        devices: dict[str, dict[str, Any]] = {}
        prev_dev: dict[str, dict[str, int]] = prev.get("per_device", {})
        for dev, now_d in stats["per_device"].items():
            before = prev_dev.get(dev, {})
            row: dict[str, Any] = {k: now_d[k] - before.get(k, 0) for k in DEVICE_COUNTERS}
            row["in_flight"] = now_d["in_flight"]
            row["bandwidth_bytes_per_s"] = row["bytes"] / dt if dt > 0 else 0.0
            devices[dev] = row
        rec["per_device"] = devices
        self._prev = dict(stats)
        self._t_last = now
        self._interval += 1
        self._file.write(json.dumps(rec, separators=(",", ":")) + "\n")
        self._file.flush()
        self.lines += 1
        return rec

    def close(self) -> None:
        """Finish the file: the lines written move to ``path`` (replacing an earlier run's)."""
        if self._file is not None:
            self._file.close()
            self._file = None
            os.replace(self.writing, self.path)

    def discard(self) -> None:
        """Drop the file unfinished (the store failed to open): nothing lands at ``path``."""
        if self._file is not None:
            self._file.close()
            self._file = None
            with contextlib.suppress(OSError):
                os.unlink(self.writing)


# ---------------------------------------------------------------------------- Prometheus

_COUNTER_HELP = {
    "requests": "acquires of a known key",
    "hits": "acquires that found the expert resident",
    "misses": "acquires that found nothing and started a load",
    "single_flight_joins": "acquires that joined a load in flight",
    "bytes_read": "bytes read from the checkpoint's drives",
    "admissions": "experts the policy admitted",
    "rejections": "experts the policy did not admit",
    "evictions": "experts evicted",
    "load_errors": "loads that failed",
    "prefetch_issued": "prefetch loads started",
    "prefetch_dropped": "prefetches dropped for want of room",
    "prefetch_refused": "prefetches refused by the per-token byte budget",
    "prefetch_used": "prefetched experts an acquire then leased",
    "prefetch_wasted": "prefetched experts that left the store unused",
    "prefetch_failed": "prefetch loads that failed",
    "physical_misses": "demand loads not served wholly by the page cache (drive reads)",
    "migration_bytes": "bytes read by loads a prefetch started (moved ahead of demand)",
    "retries": "reads retried on another replica",
    "failovers": "reads another replica served after an error",
    "tokens": "token boundaries",
    "verified_bytes": "extent bytes checked against the manifest and found equal",
    "verify_mismatches": "extent reads whose bytes differed from the manifest",
    "verify_retries": "extent reads redone after a checksum mismatch",
    "retired_slabs": "slabs retired, not reused: a view of their expert outlived its lease",
    "retired_released": "retired slabs taken back once their last view died",
}
_GAUGE_HELP = {
    "resident_bytes": "bytes of resident and loading experts",
    "budget_bytes": "the byte budget",
    "resident_experts": "resident experts",
    "leased": "experts leased now",
    "loading": "experts loading now",
    "idle_slab_bytes": "idle slab bytes in the pool",
    "prefetch_unused": "prefetched experts not leased yet",
    "verify_bad_extents": "(replica, extent) pairs whose last read did not match the manifest",
    "retired_bytes": "bytes of retired slabs still referenced by views kept past their lease",
}


class PrometheusExporter:
    """Serves ``iosched_*`` metrics of one store over HTTP; :meth:`close` stops the server.
    Create with :func:`start_exporter`."""

    def __init__(self, store: MetricsSource, port: int = 0, addr: str = "127.0.0.1") -> None:
        # An optional dependency: the ignores keep mypy green where it is not installed.
        from prometheus_client import CollectorRegistry, start_http_server  # type: ignore[import-not-found, unused-ignore]
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily  # type: ignore[import-not-found, unused-ignore]
        from prometheus_client.registry import Collector  # type: ignore[import-not-found, unused-ignore]

        class _StoreCollector(Collector):  # type: ignore[misc, unused-ignore]
            def collect(self) -> Iterator[Any]:
                s = store.stats()
                for name, help_ in _COUNTER_HELP.items():
                    # prometheus_client appends "_total" to a counter's name
                    yield CounterMetricFamily(f"iosched_{name}", help_, value=s.get(name) or 0)
                yield CounterMetricFamily("iosched_felt_wait_seconds",
                                          "wall time some acquire was waiting", value=s["felt_wait_s"])
                yield CounterMetricFamily("iosched_service_seconds",
                                          "read service time summed over loads", value=s["service_s"])
                yield CounterMetricFamily("iosched_verify_seconds",
                                          "time spent hashing reads to check them", value=s["verify_s"])
                for name, help_ in _GAUGE_HELP.items():
                    yield GaugeMetricFamily(f"iosched_{name}", help_, value=s[name])
                tiers = CounterMetricFamily("iosched_hits_by_tier",
                                            "acquires served by tier: resident (store hits), page_cache "
                                            "and drive (demand loads)", labels=["tier"])
                for tier in TIERS:
                    tiers.add_metric([tier], s["hits_by_tier"][tier])
                yield tiers
                reads = CounterMetricFamily("iosched_device_reads", "reads per device", labels=["device"])
                nbytes = CounterMetricFamily("iosched_device_bytes", "bytes read per device", labels=["device"])
                errors = CounterMetricFamily("iosched_device_errors", "read errors per device", labels=["device"])
                inflight = GaugeMetricFamily("iosched_device_in_flight", "reads in flight per device",
                                             labels=["device"])
                for dev, d in s["per_device"].items():
                    reads.add_metric([dev], d["reads"])
                    nbytes.add_metric([dev], d["bytes"])
                    errors.add_metric([dev], d["errors"])
                    inflight.add_metric([dev], d["in_flight"])
                yield from (reads, nbytes, errors, inflight)

        self.registry = CollectorRegistry()
        self.registry.register(_StoreCollector())
        server, thread = start_http_server(port, addr=addr, registry=self.registry)
        self._server = server
        self._thread: threading.Thread | None = thread
        self.addr = addr
        self.port: int = self._server.server_port

    def close(self) -> None:
        """Stop serving; idempotent."""
        if self._thread is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join()
            self._thread = None

    def __enter__(self) -> PrometheusExporter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def start_exporter(store: MetricsSource, port: int = 0, addr: str = "127.0.0.1") -> PrometheusExporter:
    """Serve ``store``'s metrics at ``http://addr:port/metrics`` (``port=0``: a free port, see
    ``.port``) until the exporter's :meth:`~PrometheusExporter.close` or the store's ``close``.
    Needs ``prometheus-client`` (``ImportError`` without it)."""
    exporter = PrometheusExporter(store, port, addr)
    store.on_close(exporter.close)
    return exporter
