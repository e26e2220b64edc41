"""The critical-path replay: the real store on virtual time (``iosched.clock``,
``backends/modelled.py``, ``tools/critical_path.py``).

What is checked, and why:

* the virtual-time loop skips sleeps exactly (a 10 s sleep takes no wall time and moves the
  clock 10 s), never runs a timer early, and ``uncharged`` takes real time back without the
  clock going backwards: the instrument's own reads of ``stats()`` cost the engine nothing;
* the drive model's arithmetic: one read costs latency + bytes / bandwidth, reads in flight
  share the transfer pipe (the second ends one transfer after the first);
* the store on the modelled drive, CPU free: a miss's felt wait is exactly the modelled read,
  and the store's own clock (``iosched.clock.now``) is the loop's;
* the replay: with ``--cpu free`` the same inputs give the same numbers (every key but the
  measured loop CPU); bytes split into demand and prefetch add up to ``bytes_read``; ``lru``
  moves no prefetch bytes; precision and coverage are ratios; errors name their culprit
  (no --simulate, the hand-written arm, a bad probe file);
* ``--drive FILE.json`` reads ``iosched topology --probe --json``'s shape: bandwidth is the
  depth-qd MB/s, latency the depth-1 median less its transfer.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from iosched import ExpertStore, _settings, clock
from iosched.backends.modelled import DriveModel, ModelledBackend
from iosched.tools.compute import ComputeModel, calibrate, parse_compute_model

from .test_engine_replay import run_json

MEASURED = ("cpu_ms_per_token", "loop_cpu_ms_per_token", "seconds")
"""Row keys measured in real time even with --cpu free (the loop thread's CPU, wall time)."""


def test_virtual_loop_skips_sleeps_exactly() -> None:
    async def main() -> tuple[float, float, list[float]]:
        loop = clock.running_virtual_loop()
        assert loop is not None
        loop.skipping = True
        fired: list[float] = []
        t0 = loop.time()
        loop.call_later(3.0, lambda: fired.append(loop.time() - t0))
        wall = time.perf_counter()
        await asyncio.sleep(10.0)
        return loop.time() - t0, time.perf_counter() - wall, fired

    virtual, wall, fired = clock.run(main(), charge_cpu=False)
    assert virtual == pytest.approx(10.0, abs=1e-9)
    assert wall < 1.0
    assert fired == [pytest.approx(3.0, abs=1e-9)]


def test_uncharged_takes_real_time_back_and_never_goes_backwards() -> None:
    async def main() -> tuple[float, float, float]:
        loop = clock.running_virtual_loop()
        assert loop is not None
        t0 = loop.time()
        with loop.uncharged():
            inside = loop.time()
            time.sleep(0.05)
            assert loop.time() == inside  # stands still meanwhile
        after = loop.time()
        return t0, inside, after

    t0, inside, after = clock.run(main(), charge_cpu=True)
    assert t0 <= inside <= after
    assert after - t0 < 0.04  # the 50 ms slept inside were taken back


def test_store_clock_is_the_loop_clock_inside_run() -> None:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        return clock.now() - loop.time()

    assert clock.run(main(), charge_cpu=False) == 0.0
    assert clock.now() == pytest.approx(time.perf_counter(), abs=1.0)  # restored afterwards


def test_drive_model_latency_and_shared_pipe() -> None:
    drive = DriveModel(bandwidth=1e9, latency=100e-6)
    first = drive.schedule(1_000_000, now=0.0)
    second = drive.schedule(1_000_000, now=0.0)
    assert first == pytest.approx(100e-6 + 1e-3)
    assert second == pytest.approx(first + 1e-3)  # its latency overlapped, its bytes waited
    late = drive.schedule(1000, now=1.0)
    assert late == pytest.approx(1.0 + 100e-6 + 1e-6)
    with pytest.raises(Exception, match="bandwidth"):
        DriveModel(bandwidth=0, latency=0)


def test_drive_model_as_a_rate_limit() -> None:
    drive = DriveModel(bandwidth=1e9, latency=100e-6, burst=2e-3)
    # the credit lets the first 2 ms of bytes through at once, each read then takes its latency
    assert drive.schedule(1_000_000, now=0.0) == pytest.approx(100e-6)
    assert drive.schedule(1_000_000, now=0.0) == pytest.approx(100e-6)
    assert drive.schedule(1_000_000, now=0.0) == pytest.approx(1e-3 + 100e-6)  # paced from here
    # after an idle second the credit is back, and no more than it
    assert drive.schedule(3_000_000, now=1.0) == pytest.approx(1.0 + 1e-3 + 100e-6)


def test_a_miss_on_the_modelled_drive_waits_exactly_the_model(st_checkpoint: Path) -> None:
    async def main() -> tuple[float, int, int]:
        loop = clock.running_virtual_loop()
        assert loop is not None
        drive = DriveModel(bandwidth=1e8, latency=1e-3)
        async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 30, backend=ModelledBackend(drive),
                                          policy="lru") as store:
            loop.skipping = True
            key, layout = next(iter(store.index.experts.items()))
            nbytes = layout.nbytes
            async with store.acquire(key) as view:
                assert len(view.data) == nbytes
            return store.stats()["felt_wait_s"], nbytes, drive.bytes

    felt, nbytes, moved = clock.run(main(), charge_cpu=False)
    assert moved >= nbytes
    assert felt == pytest.approx(1e-3 + moved / 1e8, rel=1e-9)


def _critical(capsys: pytest.CaptureFixture[str], tmp: Path, *extra: str, status: int = 0) -> dict[str, Any]:
    with _settings.override(cache_dir=str(tmp)):
        return run_json(capsys, ["gemma", "--simulate", "--critical-path", "--tokens", "4", "--cycles", "1",
                                 "--compute-model", "const:1", "--json", *extra], status=status)


def test_critical_path_is_reproducible_with_cpu_free(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _critical(capsys, tmp_path, "--policy", "lru,default", "--cpu", "free")
    b = _critical(capsys, tmp_path, "--policy", "lru,default", "--cpu", "free")
    assert a["mode"] == "critical-path" and a["cpu"] == "free" and a["compute"] == "const:1"
    for ra, rb in zip(a["results"], b["results"], strict=True):
        assert {k: v for k, v in ra.items() if k not in MEASURED} == {k: v for k, v in rb.items() if k not in MEASURED}
    lru, default = a["results"]
    assert lru["policy"] == "lru" and lru["prefetch_bytes"] == 0 and lru["prefetch_precision"] is None
    for r in (lru, default):
        assert r["demand_bytes"] + r["prefetch_bytes"] == r["bytes_read"] > 0
        assert r["tokens"] == 4 and r["tokens_per_s"] > 0
        assert 0 <= r["felt_p50_ms"] <= r["felt_p99_ms"]
        assert r["prefetch_coverage"] is None or 0 <= r["prefetch_coverage"] <= 1
        assert r["drive"]["bytes"] == r["bytes_read"]
    if default["prefetch_issued"]:
        assert 0 <= default["prefetch_precision"] <= 1
    # compute is 1 ms a layer and a token visits every layer: a token takes at least that
    layers = 30  # gemma-4-26B-A4B's MoE layers
    assert all(1 / r["tokens_per_s"] >= layers * 1e-3 * 0.999 for r in (lru, default))


def test_critical_path_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with _settings.override(cache_dir=str(tmp_path)):
        out = run_json(capsys, ["gemma", "--critical-path", "--json"], status=2)
    assert "--simulate" in out["error"]
    out = _critical(capsys, tmp_path, "--policy", "handwritten", status=2)
    assert "handwritten" in out["error"]
    bad = tmp_path / "probe.json"
    bad.write_text(json.dumps({"drives": {"vda": {"probe": None}}}))
    out = _critical(capsys, tmp_path, "--drive", str(bad), status=2)
    assert str(bad) in out["error"] and "probe" in out["error"]


def test_drive_from_a_topology_probe(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    probe = {"drives": {"vda": {"probe": {"mbps": 1000.0, "qd": 16, "bs": 1 << 20,
                                          "qd1": {"mbps": 400.0, "p50_ms": 2.0, "p99_ms": 4.0}}}}}
    path = tmp_path / "probe.json"
    path.write_text(json.dumps(probe))
    out = _critical(capsys, tmp_path, "--policy", "lru", "--drive", str(path), "--cpu", "free")
    assert out["drive_mbps"] == pytest.approx(1000.0)
    assert out["drive_latency_us"] == pytest.approx(1e6 * (2e-3 - (1 << 20) / 1e9))
    assert out["drive_probe"]["drive"] == "vda"
    # modelled as a rate limit in front of the drive: each read takes the drive's whole
    # depth-1 time behind the limit (nothing of it is the limit's bandwidth)
    out = _critical(capsys, tmp_path, "--policy", "lru", "--drive", str(path), "--cpu", "free",
                    "--drive-mbps", "400", "--drive-burst-ms", "2")
    assert out["drive_mbps"] == pytest.approx(400.0) and out["drive_burst_ms"] == pytest.approx(2.0)
    assert out["drive_latency_us"] == pytest.approx(2000.0)


def test_compute_model_spellings_and_calibration() -> None:
    assert parse_compute_model("calibrate") is None
    assert parse_compute_model("const:2") == ComputeModel(fixed_s=2e-3)
    lin = parse_compute_model("linear:0.1,1,0.5")
    assert lin is not None and lin.seconds([2**20], [3]) == pytest.approx(1e-4 + 1e-3 + 3 * 0.5e-3)
    for bad in ("const:-1", "linear:1,2", "fast", "const:nan"):
        with pytest.raises(Exception, match="calibrate"):
            parse_compute_model(bad)
    model = calibrate(128, 48, 2)
    assert model.fixed_s >= 0 and model.per_byte_s >= 0 and model.per_byte_row_s >= 0
    assert model.seconds([3 * 128 * 48 * 2] * 2, [1, 1]) > 0  # real work takes time


def test_critical_path_with_a_synthetic_lookahead(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = _critical(capsys, tmp_path, "--policy", "default", "--cpu", "free", "--lookahead-recall", "0.9",
                    "--compute-on", "thread")
    assert out["lookahead_recall"] == 0.9
    [row] = out["results"]
    # every decode batch but the last hands the store an estimate; some of its experts load
    assert row["lookahead_expected"] > 0 and row["lookahead_recall"] == 0.9
    assert row["prefetch_issued"] >= row["lookahead_started"]
