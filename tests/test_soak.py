"""``iosched soak`` at a small size, through the command line: every byte right, the budget
never exceeded, no lease leaked, faults on the mirror failed over; and a failing check
turns into ``"ok": false`` and exit status 1."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from iosched import _settings
from iosched.tools import soak as soak_tool
from iosched.tools.cli import main


def run_soak(tmp_path: Path, capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    with _settings.override(cache_dir=str(tmp_path)):
        assert main(["soak", "--json", "--acquires", "2000", "--layers", "4", "--experts", "16",
                     "--tasks", "8", "--budget-experts", "32", "--fault-rate", "0.2",
                     "--cancel-rate", "0.1", *args]) == 0
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    return out


def test_small_soak_is_clean(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = run_soak(tmp_path, capsys)
    assert out["ok"] is True
    assert out["acquires"] == 2000 == out["completed"] + out["cancelled"] + out["failed"]
    assert out["wrong_bytes"] == 0 and out["excursions"] == 0 and out["leaked_leases"] == 0
    assert out["failed"] == 0 and out["invariant_violations"] == 0
    assert out["verified_views"] >= out["completed"] > 0 and out["cancelled"] > 0
    assert out["retries"] > 0 and out["failovers"] > 0
    faults = out["faults_injected"]
    assert faults["eio"] + faults["short"] == out["per_replica"][out["mirror"]]["errors"] > 0
    assert out["per_replica"][out["checkpoint"]]["errors"] == 0
    assert out["peak_resident_bytes"] <= out["budget_bytes"] == 32 * out["expert_bytes"]
    assert out["budget_samples"] > 0
    assert 0 < out["latency_p50_ms"] <= out["latency_p99_ms"]
    assert out["rss_peak_bytes"] > 0 and out["rss_baseline_bytes"] > 0
    assert out["overhead_bytes"] == out["rss_peak_bytes"] - out["budget_bytes"]
    assert any(p.name.startswith("soak-") for p in tmp_path.iterdir())


def test_soak_is_reproducible_in_its_faults(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # One task reading one expert at a time: with several reads in flight, the order in which
    # the pool's threads reach the seeded fault draws (and so which read a fault hits) varies.
    # LRU: the default policy's prefetches are paced by measured idle time, so which reads
    # happen (and draw faults) depends on timing.
    same = ("--cancel-rate", "0", "--tasks", "1", "--group", "1", "--budget-experts", "4",
            "--policy", "lru")
    a = run_soak(tmp_path, capsys, *same)
    b = run_soak(tmp_path, capsys, *same)
    assert a["faults_injected"] == b["faults_injected"] and a["retries"] == b["retries"] > 0


def test_wrong_bytes_fail_the_soak(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(soak_tool, "_digest", lambda data: b"not the checksum")
    with _settings.override(cache_dir=str(tmp_path)), pytest.raises(SystemExit) as exit_:
        main(["soak", "--json", "--acquires", "50", "--layers", "2", "--experts", "8",
              "--tasks", "2", "--budget-experts", "8"])
    assert exit_.value.code == 1
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False and out["wrong_bytes"] > 0 and out["errors"]


def test_bad_options_are_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with _settings.override(cache_dir=str(tmp_path)):
        assert main(["soak", "--json", "--tasks", "16", "--group", "4", "--budget-experts", "10"]) == 2
    assert "at least --tasks x --group" in json.loads(capsys.readouterr().out)["error"]


def test_soak_with_verify_catches_every_corruption(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = run_soak(tmp_path, capsys, "--verify", "--corrupt-rate", "0.2")
    assert out["ok"] is True and out["wrong_bytes"] == 0 and out["failed"] == 0
    corrupted = out["faults_injected"]["corrupt"]
    assert out["verify"] == "reads" and corrupted > 0
    assert out["verify_mismatches"] == corrupted == out["verify_retries"]
    assert out["verified_bytes"] > 0 and out["verify_s"] > 0
    faults = out["faults_injected"]
    assert faults["eio"] + faults["short"] + corrupted == out["per_replica"][out["mirror"]]["errors"]


def test_corruption_without_verify_fails_the_soak(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the negative control: the soak's own byte check sees what an unverified store serves
    with _settings.override(cache_dir=str(tmp_path)), pytest.raises(SystemExit) as exit_:
        main(["soak", "--json", "--acquires", "400", "--layers", "2", "--experts", "8",
              "--tasks", "2", "--budget-experts", "8", "--fault-rate", "0", "--corrupt-rate", "0.5"])
    assert exit_.value.code == 1
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False and out["wrong_bytes"] > 0 and out["verify"] == "off"
    assert out["faults_injected"]["corrupt"] > 0
