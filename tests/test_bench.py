"""``iosched bench``: real, tiny runs on a 16 MiB file (the whole module takes a few seconds).

Throughput numbers on a CI machine mean nothing, so the tests check the shape and the sense
of the output (keys and types, bytes > 0, p50 <= p99, row counts, a PNG, a fio ratio) and
the errors a user meets first (a missing file, a bad size), not speed.  The fio ratio needs
fio, which the benchmark's set-up installs (``make bench-deps``): it is a ``bench`` test, run
by ``make bench-tests`` and ``make bench``, not by ``make test``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import pytest

from iosched import _settings
from iosched.tools import bench
from iosched.tools.fio import FioJob, engine_for, fio_binary, parse_report

CONTRACT = {"backend": str, "bs": int, "qd": int, "bytes": int, "seconds": float, "mbps": float,
            "p50_ms": float, "p99_ms": float}
EXTRA = {"loop": str, "reads": int, "python_overhead_us": float, "file": str, "direct": bool}
FAST = ["--seconds", "0.2", "--json"]


@pytest.fixture(scope="module")
def data_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("bench") / "data.bin"
    path.write_bytes(os.urandom(16 << 20))
    return str(path)


def run_json(capsys: pytest.CaptureFixture[str], argv: list[str], status: int = 0) -> dict[str, Any]:
    assert bench.main(argv) == status
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    return out


def check_run(out: dict[str, Any]) -> None:
    for key, kind in {**CONTRACT, **EXTRA}.items():
        assert isinstance(out[key], kind), (key, out[key])
    assert out["bytes"] > 0 and out["mbps"] > 0 and out["reads"] > 0
    assert out["bytes"] == out["reads"] * out["bs"]
    assert 0 < out["p50_ms"] <= out["p99_ms"]


@pytest.mark.parametrize("backend", ["pread", bench.NAIVE])
def test_single_run_json(data_file: str, capsys: pytest.CaptureFixture[str], backend: str) -> None:
    out = run_json(capsys, ["--file", data_file, "--backend", backend, "--bs", "256k", "--qd", "2", *FAST])
    check_run(out)
    assert out["backend"] == backend and out["bs"] == 256 << 10 and out["qd"] == 2
    assert out["file"] == data_file and out["direct"] is False
    assert isinstance(out["fits_in_ram"], bool)


def test_direct_pread_is_odirect(data_file: str, capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(capsys, ["--file", data_file, "--backend", "pread", "--direct", "--bs", "64K",
                            "--qd", "2", *FAST])
    check_run(out)
    assert out["backend"] == "odirect" and out["direct"] is True


def test_table_output(data_file: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--file", data_file, "--bs", "1M", "--qd", "1", "--seconds", "0.2"]) == 0
    text = capsys.readouterr().out
    for label in ("MB/s", "p99 latency", "RAM"):
        assert label in text


def test_sweep_rows_and_plot(data_file: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "sweep.png"
    out = run_json(capsys, ["--file", data_file, "--sweep", "--backends", f"pread,{bench.NAIVE}",
                            "--bs-list", "64K,1M", "--qd-list", "1,4", "--reps", "1",
                            "--plot", str(png), *FAST])
    rows = out["sweep"]
    assert len(rows) == 2 * 2 * 2
    assert {(r["backend"], r["bs"], r["qd"]) for r in rows} == {
        (b, bs, qd) for b in ("pread", bench.NAIVE) for bs in (64 << 10, 1 << 20) for qd in (1, 4)}
    for row in rows:
        assert row["mbps"] > 0 and 0 < row["p50_ms"] <= row["p99_ms"] and row["reps"] == 1
    assert out["machine"]["cpus"] and out["file"] == data_file and out["skipped"] == {}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_skips_what_cannot_run(data_file: str, capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(capsys, ["--file", data_file, "--sweep", "--backends", "odirect,nosuch",
                            "--buffered", "--bs-list", "64K", "--qd-list", "1", "--reps", "1", *FAST])
    assert set(out["skipped"]) == {"odirect", "nosuch"}
    assert "nosuch" in out["skipped"]["nosuch"]
    assert out["sweep"] == []


@pytest.mark.bench
@pytest.mark.skipif(fio_binary() is None, reason="fio is not installed (apt-get install fio, or make bench-deps)")
def test_fio_ratio(data_file: str, capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(capsys, ["--file", data_file, "--backend", "pread", "--bs", "1M", "--qd", "2",
                            "--fio", *FAST])
    check_run(out)
    assert "fio_error" not in out, out.get("fio_error")
    assert out["fio_mbps"] > 0 and out["ratio"] > 0
    assert out["fio_engine"] == {"ioengine": "psync", "iodepth": 1, "numjobs": 2}


def test_fio_missing_says_how_to_install(data_file: str, capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    out = run_json(capsys, ["--file", data_file, "--fio", *FAST], status=2)
    assert "apt-get install fio" in out["error"] and "make bench-deps" in out["error"]


def test_missing_file_is_named_and_not_created(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.bin"
    out = run_json(capsys, ["--file", str(missing), *FAST], status=2)
    assert str(missing) in out["error"]
    assert not missing.exists()


def test_generated_file_is_made_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with _settings.override(cache_dir=str(tmp_path)):
        first = run_json(capsys, ["--size", "8M", "--bs", "1M", "--qd", "1", *FAST])
        made = Path(first["file"])
        assert made.parent == tmp_path and made.stat().st_size == 8 << 20
        mtime = made.stat().st_mtime_ns
        second = run_json(capsys, ["--size", "8M", "--bs", "1M", "--qd", "1", *FAST])
    assert second["file"] == first["file"] and made.stat().st_mtime_ns == mtime


def test_bad_input_is_one_json_error(data_file: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert "12Q" in run_json(capsys, ["--file", data_file, "--bs", "12Q", *FAST], status=2)["error"]
    assert "--sweep" in run_json(capsys, ["--file", data_file, "--qd-list", "1", *FAST], status=2)["error"]


def test_add_parser_registers_bench(data_file: str) -> None:
    parser = argparse.ArgumentParser(prog="iosched")
    sub = parser.add_subparsers(dest="command", required=True)
    bench.add_parser(sub)
    args = parser.parse_args(["bench", "--file", data_file, "--bs", "64k", "--qd", "1", *FAST])
    out = args.func(args)
    check_run(out)
    json.dumps(out)  # the CLI prints it as JSON


@pytest.mark.parametrize("text,value", [("4096", 4096), ("64k", 64 << 10), ("64K", 64 << 10),
                                        ("4M", 4 << 20), ("4MiB", 4 << 20), ("4MB", 4 << 20),
                                        ("1G", 1 << 30), ("512b", 512)])
def test_parse_size(text: str, value: int) -> None:
    assert bench.parse_size(text) == value


def test_fio_arguments_and_report() -> None:
    assert engine_for("uring", 8) == ("io_uring", 8, 1)
    assert engine_for("odirect", 8) == ("psync", 1, 8)
    assert engine_for(bench.NAIVE, 8) == ("psync", 1, 8)
    argv = FioJob("/f", 1 << 20, 4, 0.25, True, "uring").argv()
    assert "--runtime=250ms" in argv and "--direct=1" in argv and "--iodepth=4" in argv
    report = json.dumps({"jobs": [{"read": {
        "bw_bytes": 2_000_000, "iops": 2.0, "io_bytes": 4 << 20, "runtime": 1000,
        "clat_ns": {"percentile": {"50.000000": 1_000_000, "99.000000": 3_000_000}}}}]})
    parsed = parse_report("fio: a warning first\n" + report)
    assert parsed["fio_mbps"] == 2.0 and parsed["fio_latency"] == "clat"
    assert parsed["fio_p50_ms"] == 1.0 and parsed["fio_p99_ms"] == 3.0
