"""The command line: ``iosched demo --json`` on the real bundled trace, and its errors."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from iosched import _settings
from iosched.tools import _command
from iosched.tools.cli import build_parser, main

CONTRACT_KEYS = {
    "requests", "hits", "misses", "single_flight_joins", "bytes_read", "resident_bytes",
    "budget_bytes", "leased", "loading", "admissions", "rejections", "evictions",
    "felt_wait_s", "service_s", "per_device",
}


def test_demo_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with _settings.override(cache_dir=str(tmp_path)):
        assert main(["demo", "--json", "--tokens", "3", "--compute-ms", "0", "--trace", "gemma"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert CONTRACT_KEYS <= set(out)
    assert out["tokens"] == 3
    assert out["requests"] == out["hits"] + out["misses"] + out["single_flight_joins"] > 0
    assert out["bytes_read"] > 0 and out["misses"] > 0
    assert out["resident_bytes"] <= out["budget_bytes"]
    assert out["leased"] == 0 and out["loading"] == 0
    (dev,) = out["per_device"].values()
    assert dev["bytes"] == out["bytes_read"]
    assert any(p.name.startswith("demo-") for p in tmp_path.iterdir())


def test_demo_table(cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with _settings.override(cache_dir=str(cache_dir)):
        assert main(["demo", "--tokens", "2", "--compute-ms", "0", "--trace", "gemma"]) == 0
    text = capsys.readouterr().out
    for label in ("tokens/s", "hit rate", "felt wait", "read service time", "bytes read", "per device"):
        assert label in text


def test_bad_input_is_one_json_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--json", "--trace", "mixtral"]) == 2
    out = json.loads(capsys.readouterr().out)
    assert "mixtral" in out["error"]


@pytest.mark.parametrize("argv", [
    ["replay", "--json"],                                # a required argument missing
    ["bench", "--seconds", "abc", "--json"],             # a value of the wrong type
    ["demo", "--budget-cycles", "x", "--json"],
    ["--json"],                                          # no subcommand at all
])
def test_usage_errors_are_one_json_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    out = json.loads(captured.out)  # exactly one JSON object, as the contract promises
    assert out["type"] == "UsageError" and out["error"].startswith("iosched")


def test_usage_error_without_json_names_the_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "usage: iosched replay" in captured.err and "TRACE" in captured.err


def test_hitpath_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["hitpath", "--json", "--n", "200", "--reps", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    row = out["loops"]["asyncio"]
    for key in ("median_us", "p90_us", "group_of_k_median_us", "group_awaited_median_us",
                "between_median_us", "as_ready_awaited_median_us"):
        assert row[key] > 0, key


def test_settings_doc_is_current() -> None:
    from iosched.tools.settings_doc import render

    assert (Path(__file__).parents[1] / "docs" / "settings.md").read_text() == render(), (
        "docs/settings.md is stale: run python -m iosched.tools.settings_doc > docs/settings.md"
    )


# ------------------------------------------------------------------------- bad option values

BAD_VALUES = {
    _command.positive_int: ["0", "-1", "1.5", "x", ""],
    _command.non_negative_int: ["-1", "x", ""],
    _command.positive_float: ["0", "-2", "nan", "inf", "x"],
    _command.non_negative_float: ["-0.5", "nan", "-inf", "x"],
    _command.fraction: ["1.5", "-0.1", "nan"],
    _command.int_list: ["", "0", "1,x", ",", "2,-3"],
}
UNCHECKED_OPTIONS = {"--seed"}
"""Numeric options where every integer is valid."""


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def _numeric_options() -> list[tuple[str, str, Any]]:
    rows = []
    for name, sub in sorted(_subcommands().items()):
        for action in sub._actions:
            if action.type in BAD_VALUES:
                rows.append((name, action.option_strings[0], action.type))
    return rows


def test_no_numeric_option_takes_a_bare_int_or_float() -> None:
    bare = [f"{name} {action.option_strings}" for name, sub in _subcommands().items() for action in sub._actions
            if action.type in (int, float) and not set(action.option_strings) & UNCHECKED_OPTIONS]
    assert not bare, f"use a converter of iosched/tools/_command.py (VALUE_TYPES): {bare}"
    assert len(_numeric_options()) > 30  # the converters are found (every subcommand has some)


@pytest.mark.parametrize("command,option,kind", _numeric_options())
def test_a_bad_option_value_is_one_json_error(command: str, option: str, kind: Any,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    sub = _subcommands()[command]
    positionals = ["placeholder" for a in sub._actions if not a.option_strings and a.nargs is None]
    for value in BAD_VALUES[kind]:
        assert main([command, *positionals, f"{option}={value}", "--json"]) == 2, (option, value)
        out = capsys.readouterr().out
        assert out.count("\n") == 1, out  # exactly one JSON object
        error = json.loads(out)
        assert error["type"] == "UsageError" and option in error["error"], error
