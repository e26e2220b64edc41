"""``iosched bench-readpath`` (``tools/readpath_bench.py``): every arm reads the same groups of
misses from a real checkpoint, and the hand-written arm is the reference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from iosched.tools import readpath_bench


def test_the_demo_size_runs_every_expert_once_per_pass(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert readpath_bench.main(["--sizes", "36K", "--backends", "pread,odirect", "--rounds", "1",
                                "--dir", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {row["arm"]: row for row in out["rows"]}
    assert set(rows) == {"handwritten", "iosched:pread", "iosched:odirect"}
    layers, experts = readpath_bench.SHAPES["36K"][2:]
    assert out["groups"] == {"36K": layers * experts // readpath_bench.GROUP}
    for row in rows.values():
        assert row["expert_bytes"] == 36864 and row["size"] == "36K"
        assert row["reads"] == layers * experts  # each expert once, one extent each
        assert row["p50_ms"] > 0 and row["cpu_ms_per_group"] > 0
    assert rows["handwritten"]["ratio"] == 1.0


def test_an_unknown_size_is_refused_by_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert readpath_bench.main(["--sizes", "4K", "--dir", str(tmp_path), "--json"]) == 2
    captured = capsys.readouterr()
    assert "4K" in captured.out + captured.err
