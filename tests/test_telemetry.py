"""Per-token telemetry (JSON lines) on a real checkpoint, the demo's ``--telemetry``, and the
Prometheus exporter, scraped over HTTP."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from iosched import ExpertStore, _settings
from iosched._telemetry import COUNTERS, NOT_MEASURED, SECONDS, start_exporter
from tests.conftest import EXPERTS, LAYERS
from tools.cli import main


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


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
    assert len(_lines(out)) == n  # written and flushed at each boundary, before close
    while store.stats()["loading"]:  # let the last prefetch land: close() would wait for it
        await asyncio.sleep(0.001)
    final = store.stats()
    await store.close()

    lines = _lines(out)
    assert len(lines) == n + 1  # one per boundary, and the interval ending at close
    assert [r["token"] for r in lines] == list(range(n + 1))
    assert [r["end"] for r in lines] == ["boundary"] * n + ["close"]
    assert lines[0]["requests"] == 0  # nothing happened before the first boundary
    ts = [r["t"] for r in lines]
    assert ts == sorted(ts) and all(r["dt"] >= 0 for r in lines)
    for name in COUNTERS:
        assert sum(r[name] for r in lines) == final[name], name
    for name in SECONDS:
        assert sum(r[name] for r in lines) == pytest.approx(final[name], abs=1e-9), name
    assert final["bytes_read"] > 0 and final["misses"] > 0 and final["hits"] > 0
    for r in lines:
        assert r["requests"] == r["hits"] + r["misses"] + r["single_flight_joins"]
        assert {k: r[k] for k in NOT_MEASURED} == NOT_MEASURED
        assert r["resident_bytes"] <= r["budget_bytes"]
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
async def test_no_telemetry_by_default(st_checkpoint: Path, tmp_path: Path) -> None:
    async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 30, backend="pread") as store:
        store.token_boundary()
        assert store._telemetry is None
    assert list(tmp_path.iterdir()) == []


def test_demo_telemetry(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "demo.jsonl"
    with _settings.override(cache_dir=str(tmp_path / "cache")):
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
    (dev,) = stats["per_device"]
    assert f'iosched_device_bytes_total{{device="{dev}"}} {float(stats["bytes_read"])}' in text
    assert f'iosched_device_in_flight{{device="{dev}"}} 0.0' in text
    await store.close()  # stops the exporter
    with pytest.raises(OSError):
        await asyncio.to_thread(_scrape, exporter.port)
    exporter.close()  # idempotent
