"""Per-token telemetry (JSON lines) on a real checkpoint, the demo's ``--telemetry``, and the
Prometheus exporter, scraped over HTTP.  The page-cache tier is forced both ways on real files:
``POSIX_FADV_DONTNEED`` drops a file's pages (drive reads), reading it whole warms them."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from iosched import ExpertStore, _settings, backends
from iosched._telemetry import start_exporter
from iosched.backends.faults import FaultPlan, FaultyBackend
from iosched.formats._checkpoint import load_index
from iosched.runtime._telemetry import COUNTERS, SECONDS, TIERS
from iosched.tools.cli import main
from tests.conftest import EXPERTS, LAYERS, drop_page_cache, warm_page_cache


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _assert_add_up(lines: list[dict[str, Any]], final: dict[str, Any]) -> None:
    """Every counter's deltas sum to its total, and each line is consistent on its own."""
    for name in COUNTERS:
        assert sum(r[name] for r in lines) == final[name], name
    for name in SECONDS:
        assert sum(r[name] for r in lines) == pytest.approx(final[name], abs=1e-9), name
    for tier in TIERS:
        assert sum(r["hits_by_tier"][tier] for r in lines) == final["hits_by_tier"][tier], tier
    for r in lines:
        assert r["requests"] == r["hits"] + r["misses"] + r["single_flight_joins"]
        assert r["hits_by_tier"]["resident"] == r["hits"]
        assert r["hits_by_tier"]["drive"] == r["physical_misses"]
        assert r["migration_bytes"] <= r["bytes_read"]
        assert r["resident_bytes"] <= r["budget_bytes"]
    tiers = final["hits_by_tier"]
    assert tiers["page_cache"] + tiers["drive"] <= final["misses"]  # demand loads that finished
    assert final["prefetch_issued"] == (final["prefetch_used"] + final["prefetch_wasted"]
                                        + final["prefetch_failed"] + final["prefetch_unused"])


async def _settle(store: ExpertStore) -> None:
    while store.stats()["loading"]:
        await asyncio.sleep(0.001)


@pytest.mark.asyncio
async def test_token_lines_sum_to_stats(st_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "telemetry.jsonl"
    n = 5
    store = await ExpertStore.open(st_checkpoint, budget_bytes=1 << 30, backend="pread",
                                   telemetry=out)
    for token in range(n):
        store.token_boundary()
        keys = [(layer, (token + i) % EXPERTS) for layer in range(LAYERS) for i in range(2)]
        async with store.acquire_many(keys):
            await asyncio.sleep(0)
        store.prefetch([(0, (token + 3) % EXPERTS)])
    # written and flushed at each boundary, before close, into the file beside the target that
    # close() renames into place (no file of that name until the run is complete)
    assert not out.exists() and len(_lines(Path(store._telemetry.writing))) == n  # type: ignore[union-attr]
    await _settle(store)  # let the last prefetch land: close() would wait for it
    final = store.stats()
    await store.close()

    lines = _lines(out)
    assert len(lines) == n + 1  # one per boundary, and the interval ending at close
    assert [p.name for p in tmp_path.iterdir()] == [out.name]  # the temporary file was renamed
    assert [r["token"] for r in lines] == list(range(n + 1))
    assert [r["end"] for r in lines] == ["boundary"] * n + ["close"]
    assert lines[0]["requests"] == 0  # nothing happened before the first boundary
    ts = [r["t"] for r in lines]
    assert ts == sorted(ts) and all(r["dt"] >= 0 for r in lines)
    _assert_add_up(lines, final)
    assert final["bytes_read"] > 0 and final["misses"] > 0 and final["hits"] > 0
    assert final["migration_bytes"] > 0 and final["prefetch_issued"] > 0
    for dev, totals in final["per_device"].items():
        assert sum(r["per_device"][dev]["bytes"] for r in lines) == totals["bytes"]
        assert sum(r["per_device"][dev]["reads"] for r in lines) == totals["reads"]
        assert sum(r["per_device"][dev]["errors"] for r in lines) == totals["errors"] == 0
        for r in lines:
            row = r["per_device"][dev]
            assert row["in_flight"] >= 0
            assert row["bandwidth_bytes_per_s"] == (pytest.approx(row["bytes"] / r["dt"], rel=0.05) if r["dt"] else 0.0)
    assert sum(d["bytes"] for d in lines[1]["per_device"].values()) == lines[1]["bytes_read"] > 0


@pytest.mark.asyncio
async def test_hits_by_tier_on_real_files(st_copy: Path, tmp_path: Path, backend: str) -> None:
    """A miss after the shards' pages were dropped is a drive read on every backend; a miss
    of a warm shard is a page-cache one for the buffered backends, which probe it, and a drive
    read for the O_DIRECT ones, which never read the page cache."""
    out = tmp_path / "tiers.jsonl"
    buffered = backend in ("pread", "mmap")
    store = await ExpertStore.open(st_copy, budget_bytes=1 << 20, backend=backend, telemetry=out)
    store.token_boundary()
    for path in store.index.files:
        drop_page_cache(path)
    async with store.acquire((0, 0)):
        pass
    store.token_boundary()
    for path in store.index.files:
        warm_page_cache(path)
    async with store.acquire((LAYERS - 1, EXPERTS - 1)):
        pass
    async with store.acquire((LAYERS - 1, EXPERTS - 1)):
        pass
    store.token_boundary()
    final = store.stats()
    await store.close()

    lines = _lines(out)
    assert [r["hits_by_tier"] for r in lines[1:3]] == [
        {"resident": 0, "page_cache": 0, "drive": 1},
        {"resident": 1, "page_cache": int(buffered), "drive": int(not buffered)},
    ]
    assert final["physical_misses"] == 2 - buffered and final["misses"] == 2
    assert final["migration_bytes"] == 0  # no prefetch
    _assert_add_up(lines, final)


@pytest.mark.asyncio
async def test_prefetch_used_wasted_failed_and_migration_bytes(st_copy: Path, tmp_path: Path) -> None:
    out = tmp_path / "prefetch.jsonl"
    sizes = {layout.nbytes for layout in load_index(st_copy).experts.values()}
    assert len(sizes) == 1  # the budget below is counted in experts
    nbytes = sizes.pop()
    be = FaultyBackend(backends.create("pread"), FaultPlan())
    store = await ExpertStore.open(st_copy, budget_bytes=2 * nbytes, backend=be, telemetry=out)
    a, b, c, d, e = [(0, i) for i in range(5)]

    store.token_boundary()  # token 1: two prefetches, one used (twice: counted once)
    assert store.prefetch([a, b]) == 2
    await _settle(store)
    for _ in range(2):
        async with store.acquire(a):
            pass
    store.token_boundary()  # token 2: b evicted unused (LRU order a, b -> b, a)
    assert store.prefetch([c]) == 1
    await _settle(store)
    store.token_boundary()  # token 3: d evicts a (used); an acquire joins d's load
    assert store.prefetch([d]) == 1
    async with store.acquire(d):
        pass
    store.token_boundary()  # token 4: e evicts c (unused) and fails; a demand miss
    be.set_plan(FaultPlan.on(st_copy, eio_rate=1.0))
    assert store.prefetch([e]) == 1
    await _settle(store)
    be.set_plan(FaultPlan())
    async with store.acquire((1, 0)):
        pass
    s = store.stats()
    await store.close()

    assert (s["prefetch_issued"], s["prefetch_used"], s["prefetch_wasted"], s["prefetch_failed"],
            s["prefetch_unused"]) == (5, 2, 2, 1, 0)
    assert s["single_flight_joins"] == 1 and s["load_errors"] == 1
    assert s["migration_bytes"] == 4 * nbytes  # a, b, c, d; e failed before reading a byte
    assert s["bytes_read"] == 5 * nbytes  # and one demand miss
    lines = _lines(out)
    assert [(r["prefetch_used"], r["prefetch_wasted"], r["prefetch_failed"]) for r in lines[1:]] == [
        (1, 0, 0), (0, 1, 0), (1, 0, 0), (0, 1, 1)]
    assert [r["migration_bytes"] for r in lines[1:]] == [2 * nbytes, nbytes, nbytes, 0]
    assert [r["prefetch_unused"] for r in lines[1:]] == [1, 1, 1, 0]
    _assert_add_up(lines, s)


@pytest.mark.asyncio
async def test_no_telemetry_by_default(st_checkpoint: Path, tmp_path: Path) -> None:
    async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 30, backend="pread") as store:
        store.token_boundary()
        assert store._telemetry is None
    assert list(tmp_path.iterdir()) == []


def test_demo_telemetry(tmp_path: Path, cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "demo.jsonl"
    with _settings.override(cache_dir=str(cache_dir)):
        assert main(["demo", "--json", "--tokens", "3", "--compute-ms", "0", "--trace", "gemma",
                     "--telemetry", str(out)]) == 0
    result = json.loads(capsys.readouterr().out)
    lines = _lines(out)
    # the demo calls token_boundary() before each decode token: line 0 is the prefill,
    # lines 1..3 the three decode tokens (the last written at close)
    assert len(lines) == 3 + 1
    assert [r["end"] for r in lines] == ["boundary"] * 3 + ["close"]
    for name in ("requests", "hits", "misses", "bytes_read", "evictions", "admissions"):
        assert sum(r[name] for r in lines) == result[name], name
    assert all(r["requests"] > 0 for r in lines)


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        body: bytes = resp.read()
    return body.decode()


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in the scrape")


@pytest.mark.asyncio
async def test_prometheus_exporter(st_checkpoint: Path) -> None:
    pytest.importorskip("prometheus_client", reason="prometheus-client is not installed (optional)")
    store = await ExpertStore.open(st_checkpoint, budget_bytes=1 << 30, backend="pread")
    exporter = start_exporter(store, port=0)
    assert exporter.addr == "127.0.0.1" and exporter.port > 0
    async with store.acquire_many([(0, e) for e in range(3)]):
        pass
    async with store.acquire((0, 1)):
        pass
    store.token_boundary()
    text = await asyncio.to_thread(_scrape, exporter.port)
    stats = store.stats()
    assert _metric(text, "iosched_requests_total") == stats["requests"] == 4
    assert _metric(text, "iosched_hits_total") == stats["hits"] == 1
    assert _metric(text, "iosched_bytes_read_total") == stats["bytes_read"] > 0
    assert _metric(text, "iosched_tokens_total") == 1
    assert _metric(text, "iosched_resident_bytes") == stats["resident_bytes"]
    assert _metric(text, "iosched_budget_bytes") == 1 << 30
    for tier in ("resident", "page_cache", "drive"):
        assert _metric(text, f'iosched_hits_by_tier_total{{tier="{tier}"}}') == stats["hits_by_tier"][tier]
    assert stats["hits_by_tier"]["page_cache"] + stats["hits_by_tier"]["drive"] == 3
    assert _metric(text, "iosched_physical_misses_total") == stats["physical_misses"]
    store.prefetch([(1, 0)])
    while store.stats()["loading"]:
        await asyncio.sleep(0.001)
    text = await asyncio.to_thread(_scrape, exporter.port)
    stats = store.stats()
    assert _metric(text, "iosched_migration_bytes_total") == stats["migration_bytes"] > 0
    assert _metric(text, "iosched_prefetch_unused") == 1
    async with store.acquire((1, 0)):
        pass
    text = await asyncio.to_thread(_scrape, exporter.port)
    assert _metric(text, "iosched_prefetch_used_total") == 1
    assert _metric(text, "iosched_prefetch_wasted_total") == 0
    (dev,) = stats["per_device"]
    assert f'iosched_device_bytes_total{{device="{dev}"}} {float(stats["bytes_read"])}' in text
    assert f'iosched_device_in_flight{{device="{dev}"}} 0.0' in text
    await store.close()  # stops the exporter
    with pytest.raises(OSError):
        await asyncio.to_thread(_scrape, exporter.port)
    exporter.close()  # idempotent
