"""``iosched replay`` with real I/O, and ``--train A --eval B`` (``tools/engine_replay.py``).

What is checked, and why:

* the real replay of a bundled trace for a few decode tokens keeps the simulation's contract
  keys and adds the felt-wait columns, with sane values (reads happened, hits are ratios);
* Belady, which reads the future, is refused in real mode and in train mode, naming itself;
* train/eval reports a seeded and a cold arm per (policy, budget), never merged, measured on
  the evaluation trace only; traces of different shapes are refused, naming both;
* seeding does something where the policy keeps state across evictions (LFU's kept counts)
  and nothing where it keeps none (LRU): the arms are the same policy objects, seeded or not.
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path
from typing import Any

import pytest

from iosched import StoreError, _settings
from iosched.tools import replay

CONTRACT_ROW = {"policy": str, "cycles": float, "budget_bytes": int, "requests": int,
                "decode_hit": float, "byte_hit": float}
REAL_EXTRA = ("felt_wait_s", "felt_wait_per_token_ms", "service_s", "bytes_read", "tokens_per_s")


def run_json(capsys: pytest.CaptureFixture[str], argv: list[str], status: int = 0) -> dict[str, Any]:
    assert replay.main(argv) == status
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    return out


def test_real_replay_gemma_three_tokens(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with _settings.override(cache_dir=str(tmp_path)):
        out = run_json(capsys, ["gemma", "--cycles", "1", "--policy", "lru", "--tokens", "3",
                                "--compute-ms", "0", "--json"])
    assert out["mode"] == "real" and out["trace"] == "gemma" and out["tokens"] == 3
    assert Path(out["checkpoint"]).parent == tmp_path
    [row] = out["results"]
    for key, kind in CONTRACT_ROW.items():
        assert isinstance(row[key], kind), (key, row)
    for key in REAL_EXTRA:
        assert isinstance(row[key], (int, float)), (key, row)
    assert row["policy"] == "lru" and row["cycles"] == 1.0
    assert row["budget_bytes"] == int(1.0 * out["td_bytes"])
    assert 0.0 <= row["decode_hit"] <= 1.0 and 0.0 <= row["byte_hit"] <= 1.0
    assert row["bytes_read"] > 0 and row["felt_wait_s"] >= 0 and row["felt_wait_per_token_ms"] >= 0
    assert row["tokens"] == 3 and row["decode_requests"] > 0
    # every request is classified once, by the store and by the replay alike
    assert row["requests"] == row["store_hits"] + row["store_misses"] + row["single_flight_joins"]
    assert row["hits"] == row["store_hits"] + row["single_flight_joins"]


def test_real_replay_auto_budget_row(cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with _settings.override(cache_dir=str(cache_dir), auto_start_cycles=1):
        out = run_json(capsys, ["gemma", "--cycles", "1", "--policy", "lru", "--tokens", "8",
                                "--compute-ms", "0", "--auto-budget", "--json"])
    fixed, auto = out["results"]
    assert not fixed["auto"] and fixed["budget_growth"] is None
    assert auto["auto"] and auto["start_cycles"] == 1.0
    growth = auto["budget_growth"]
    assert growth["decisions"] >= 1  # at least the end of the trace's turn
    # the row's budget is the one the store ended with: the start plus what it grew
    assert auto["budget_bytes"] == (1 + growth["grown_cycles"]) * out["td_bytes"]
    assert auto["cycles"] == pytest.approx(1 + growth["grown_cycles"])


def test_auto_budget_needs_real_io(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(capsys, ["gemma", "--simulate", "--auto-budget", "--json"], status=2)
    assert "--auto-budget" in out["error"]


@pytest.mark.parametrize("argv", [
    ["gemma", "--cycles", "1", "--policy", "lru,belady", "--tokens", "1", "--json"],
    ["qwen", "--simulate", "--train", "qwen", "--policy", "belady", "--cycles", "1", "--json"],
])
def test_belady_rejected(argv: list[str], capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with _settings.override(cache_dir=str(tmp_path)):
        out = run_json(capsys, argv, status=2)
    assert "belady" in out["error"]
    assert not list(tmp_path.iterdir())  # refused before any checkpoint was built


def test_train_eval_shape_mismatch(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(capsys, ["gemma", "--simulate", "--train", "qwen", "--eval", "gemma",
                            "--policy", "lfu", "--cycles", "1", "--json"], status=2)
    assert "qwen" in out["error"] and "gemma" in out["error"] and "shape" in out["error"]


def test_train_eval_arms(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(capsys, ["qwen", "--simulate", "--train", "qwen", "--eval", "qwen",
                            "--policy", "lru,lfu", "--cycles", "1,4", "--json"])
    assert out["mode"] == "train_eval" and out["train"] == "qwen" and out["eval"] == "qwen"
    rows = out["results"]
    assert len(rows) == 2 * 2 * 2
    arms: dict[tuple[str, float, str], dict[str, Any]] = {}
    for row in rows:
        for key, kind in CONTRACT_ROW.items():
            assert isinstance(row[key], kind), (key, row)
        assert row["requests"] == out["requests"]  # only the evaluation trace is counted
        arm = (row["policy"], row["cycles"], row["arm"])
        assert arm not in arms
        arms[arm] = row
    assert {a for _, _, a in arms} == {"seeded", "cold"}
    for policy in ("lru", "lfu"):
        for c in (1.0, 4.0):
            seeded, cold = arms[(policy, c, "seeded")], arms[(policy, c, "cold")]
            assert seeded["train_requests"] == out["train_requests"] and "train_requests" not in cold
            if policy == "lru":  # no state outside the resident set: seeding cannot change it
                assert seeded["hits"] == cold["hits"]
    # LFU keeps its counts across evictions: having seen the trace once changes its choices
    assert any(arms[("lfu", c, "seeded")]["hits"] != arms[("lfu", c, "cold")]["hits"]
               for c in (1.0, 4.0))


def test_eval_without_train_and_mismatched_eval(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(capsys, ["qwen", "--simulate", "--eval", "qwen", "--json"], status=2)
    assert "--train" in out["error"]
    out = run_json(capsys, ["qwen", "--simulate", "--train", "qwen", "--eval", "gemma",
                            "--json"], status=2)
    assert "gemma" in out["error"] and "qwen" in out["error"]


@pytest.mark.parametrize("scale", [0, 65, True, 2.0])
def test_a_bad_scale_is_named(tmp_path: Path, scale: object) -> None:
    from iosched.tools import demo
    from iosched.tools.trace import load_bundled_trace

    with pytest.raises(StoreError, match="--scale"):
        demo.demo_checkpoint(load_bundled_trace("gemma"), tmp_path, scale)  # type: ignore[arg-type]
    assert not any(tmp_path.iterdir())  # nothing was written


def test_resident_plays_every_arm_fully_resident_token_by_token(
        cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--resident``: every arm loaded whole, then the same tokens on each: nothing misses
    after the load, each arm times every decode token, and the first arm is the paired
    ratios' reference."""
    with _settings.override(cache_dir=str(cache_dir)):
        out = run_json(capsys, ["gemma", "--resident", "--policy", "lru,default,handwritten",
                                "--tokens", "3", "--compute", "sleep:0", "--json"])
    assert out["mode"] == "resident" and out["reference"] == "lru" and out["tokens"] == 3
    rows = {r["policy"]: r for r in out["results"]}
    assert list(rows) == ["lru", "default", "handwritten"]
    everything = rows["lru"]["budget_bytes"]
    for name, row in rows.items():
        assert row["tokens"] == 3 and row["tokens_per_s"] > 0 and row["budget_bytes"] == everything
        assert row["felt_wait_per_token_ms"] == pytest.approx(0.0, abs=1.0), name
        assert row["decode_hit"] == 1.0 and row["requests"] > 0, name
        if name != "handwritten":
            assert row["store_misses_after_load"] == 0, name
    assert rows["lru"]["paired_time_vs_first"] == 1.0
    assert rows["default"]["paired_tokens_per_s_vs_first"] > 0


def test_resident_refuses_a_budget_that_does_not_hold_the_checkpoint(
        cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with _settings.override(cache_dir=str(cache_dir)):
        out = run_json(capsys, ["gemma", "--resident", "--cycles", "1", "--policy", "lru,default",
                                "--tokens", "1", "--compute", "sleep:0", "--json"], status=2)
    assert "do not hold the checkpoint" in out["error"] and "--cycles 21.34 or more" in out["error"]
    out = run_json(capsys, ["gemma", "--resident", "--cycles", "1,2", "--policy", "lru,default",
                            "--json"], status=2)
    assert "one --cycles value" in out["error"]
    out = run_json(capsys, ["gemma", "--resident", "--policy", "lru", "--json"], status=2)
    assert "two or more distinct" in out["error"]
    out = run_json(capsys, ["gemma", "--resident", "--simulate", "--json"], status=2)
    assert "--resident" in out["error"] and "--simulate" in out["error"]


def test_resident_groups_are_whole_tokens_and_prompt_batches() -> None:
    from iosched.tools.paired_bench import groups_of
    from iosched.tools.trace import load_bundled_trace

    trace = load_bundled_trace("gemma")
    groups = groups_of(trace, 2)
    decode = [g for is_decode, g in groups if is_decode]
    assert len(decode) == 2 and all(len(g) == len(trace.layers) for g in decode)
    assert all(len(g) == 1 for is_decode, g in groups if not is_decode)
    assert sum(len(g) for _, g in groups_of(trace, None)) == len(list(trace.batches()))


def test_paired_plays_every_arm_cold_token_by_token(
        cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--paired``: the arms open empty, play the same tokens in turn, and each row says what
    its own arm read; lru and the hand-written engine, both LRUs of the same budget, hit the
    same requests (the paired design changes when a token runs, not what it routes)."""
    with _settings.override(cache_dir=str(cache_dir)):
        out = run_json(capsys, ["gemma", "--paired", "--cycles", "1,4", "--policy", "lru,default,handwritten",
                                "--tokens", "3", "--compute", "sleep:0", "--json"])
    assert out["mode"] == "paired" and out["reference"] == "lru" and out["tokens"] == 3 and out["cold"]
    assert out["copies"] == [out["checkpoint"]] * 3  # one checkpoint for all, by default
    assert [(r["policy"], r["cycles"]) for r in out["results"]] == [
        (p, c) for c in (1.0, 4.0) for p in ("lru", "default", "handwritten")]
    for row in out["results"]:
        assert row["tokens"] == 3 and row["tokens_per_s"] > 0 and row["bytes_read"] > 0, row
        assert row["budget_bytes"] == int(row["cycles"] * out["td_bytes"])
        assert row["decode_requests"] == 3 * 30 * out["k"] and 0.0 <= row["decode_hit"] <= 1.0
        assert row["paired_q1"] <= row["paired_tokens_per_s_vs_first"] <= row["paired_q3"]
        assert len(row["token_ms"]) == 3 and min(row["token_ms"]) > 0
        # the engine's compute in the arm's tokens: part of each token's time
        assert 0 <= row["compute_ms_per_token"] <= sum(row["token_ms"]) / 3
        assert 0 < row["loop_cpu_ms_per_token"] <= sum(row["token_ms"]) / 3 * 1.05  # one thread's CPU
    by = {(r["policy"], r["cycles"]): r for r in out["results"]}
    for c in (1.0, 4.0):
        assert by[("lru", c)]["paired_tokens_per_s_vs_first"] == 1.0
        assert by[("lru", c)]["decode_hit"] == by[("handwritten", c)]["decode_hit"]


def test_paired_refuses_what_it_cannot_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(capsys, ["gemma", "--paired", "--policy", "lru", "--json"], status=2)
    assert "two or more distinct" in out["error"]
    out = run_json(capsys, ["gemma", "--paired", "--simulate", "--json"], status=2)
    assert "--paired" in out["error"] and "--simulate" in out["error"]
    out = run_json(capsys, ["gemma", "--paired", "--resident", "--policy", "lru,default", "--json"], status=2)
    assert "--resident does not combine with --paired" in out["error"]
    out = run_json(capsys, ["gemma", "--paired", "--policy", "lru,belady", "--json"], status=2)
    assert "belady" in out["error"]
    out = run_json(capsys, ["gemma", "--copies", "--policy", "lru", "--json"], status=2)
    assert "--copies goes with --paired" in out["error"]


def test_arm_clock_runs_only_while_its_arm_plays() -> None:
    import time

    from iosched import clock
    from iosched.tools.paired_bench import ArmClock

    arm = ArmClock()
    arm.pause()
    frozen = arm.now()
    time.sleep(0.02)
    assert arm.now() == frozen  # paused: it stands still
    arm.resume()
    with clock.use(arm.now):
        a = clock.now()
        time.sleep(0.01)
        b = clock.now()
    assert frozen <= a < b and b - a >= 0.009  # running: real seconds, from where it stopped
    assert a - frozen < 0.01  # the 20 ms paused are not on it


def test_arm_copies_are_made_once_and_never_touch_the_original(tmp_path: Path) -> None:
    from iosched.tools.paired_bench import arm_copies

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "a.safetensors").write_bytes(b"x" * 5000)
    (ckpt / "index.json").write_text("{}")
    (ckpt / ".complete").write_text("built\n")
    before = {f.name: (f.read_bytes(), f.stat().st_mtime_ns) for f in ckpt.iterdir()}
    one, two = arm_copies(ckpt, 2)
    assert [one.name, two.name] == ["ckpt.copy1", "ckpt.copy2"]
    for copy in (one, two):
        assert (copy / "a.safetensors").read_bytes() == b"x" * 5000 and (copy / "index.json").read_text() == "{}"
        assert (copy / ".complete").exists() and os.stat(copy / "a.safetensors").st_ino != os.stat(
            ckpt / "a.safetensors").st_ino  # a copy of the bytes, not a link to the same blocks
    stamp = (one / "a.safetensors").stat().st_mtime_ns
    assert arm_copies(ckpt, 1) == [one] and (one / "a.safetensors").stat().st_mtime_ns == stamp  # reused
    (two / "a.safetensors").write_bytes(b"short")  # a copy that no longer matches: made again
    assert arm_copies(ckpt, 2)[1] == two and (two / "a.safetensors").read_bytes() == b"x" * 5000
    assert {f.name: (f.read_bytes(), f.stat().st_mtime_ns) for f in ckpt.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "ckpt.copy1", "ckpt.copy2"]


def test_play_orders_let_each_arm_follow_each_other_equally() -> None:
    from collections import Counter

    from iosched.tools.paired_bench import play_orders

    for n in (2, 3, 4):
        orders = play_orders(n)
        assert len(orders) == len(set(orders)) and all(sorted(o) == list(range(n)) for o in orders)
        follows = Counter((a, b) for o in orders for a, b in itertools.pairwise(o))
        assert len(set(follows.values())) == 1 and len(follows) == n * (n - 1), (n, follows)
    assert sorted(play_orders(6)) == sorted(tuple((r + i) % 6 for i in range(6)) for r in range(6))
