"""``iosched inspect``: the report on a checkpoint, people's and ``--json``'s."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from iosched import load_index
from iosched.tools.cli import main
from tests.conftest import EXPERTS, LAYERS


def _inspect_json(path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> dict[str, object]:
    assert main(["inspect", str(path), "--json", *extra]) == 0
    out: dict[str, object] = json.loads(capsys.readouterr().out)
    return out


def test_safetensors_report(st_checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    r = _inspect_json(st_checkpoint, capsys)
    index = load_index(st_checkpoint)
    assert r["format"] == "safetensors"
    assert r["moe_layers"] == LAYERS and r["experts_per_layer"] == EXPERTS
    assert r["experts"] == LAYERS * EXPERTS
    assert r["layers"] == f"0-{LAYERS - 1}"
    layout = index.experts[(0, 0)]
    expert = r["expert"]
    assert isinstance(expert, dict)
    assert expert["bytes"] == layout.nbytes and expert["extents"] == len(layout.extents)
    names = {t["name"]: t for t in expert["tensors"]}
    assert set(names) == {t.name for t in layout.tensors}
    for t in layout.tensors:
        assert names[t.name]["shape"] == list(t.shape)
        assert names[t.name]["dtype"] == str(t.dtype)
        assert names[t.name]["source_name"] == t.source_name
        assert names[t.name]["ggml_type"] is None
    assert r["experts_per_token"] == index.experts_per_token


def test_gguf_report_names_the_ggml_types(gguf_checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    r = _inspect_json(gguf_checkpoint, capsys)
    assert r["format"] == "gguf"
    index = load_index(gguf_checkpoint)
    expert = r["expert"]
    assert isinstance(expert, dict)
    for t, spec in zip(expert["tensors"], index.experts[(0, 0)].tensors, strict=True):
        assert t["name"] == spec.name
        g = spec.ggml_type
        assert t["ggml_type"] == (g.name if g is not None else None)


def test_multi_extent_experts_are_warned_about(gguf_checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A GGUF expert is one slice of each merged tensor: several reads per miss, said."""
    r = _inspect_json(gguf_checkpoint, capsys)
    extents = r["extents_per_expert"]
    assert isinstance(extents, dict) and extents["max"] > 1
    warnings = r["warnings"]
    assert isinstance(warnings, list)
    assert any("iosched pack" in w for w in warnings)


def test_layer_option(st_checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    r = _inspect_json(st_checkpoint, capsys, "--layer", str(LAYERS - 1))
    expert = r["expert"]
    assert isinstance(expert, dict) and expert["layer"] == LAYERS - 1
    assert main(["inspect", str(st_checkpoint), "--json", "--layer", str(LAYERS + 5)]) == 2
    err = json.loads(capsys.readouterr().out)
    assert "--layer" in err["error"]


def test_people_output(st_checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(st_checkpoint)]) == 0
    out = capsys.readouterr().out
    assert f"{EXPERTS} per layer" in out
    assert "gate_proj" in out and "source tensor" in out


def test_a_refused_checkpoint_is_an_error_naming_it(tmp_path: Path) -> None:
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(b"\x00" * 3)
    proc = subprocess.run([sys.executable, "-m", "iosched.tools.cli", "inspect", str(bad), "--json"],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 2
    err = json.loads(proc.stdout)
    assert err["type"] == "CheckpointError" and str(bad) in err["error"]


def test_fused_gguf_views_carry_their_parents_ggml_type(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """llama.cpp's fused gate_up_exps (Gemma 4, Q4_K): the halves are views of the fused
    tensor, listed with its GGML type."""
    from tests import _gguf_corpus as gc

    case = next(c for c in gc.cases() if (c.arch, c.qtype, c.layout, c.variant) == ("gemma4", "Q4_K", "fused", ""))
    r = _inspect_json(gc.write_case(case, tmp_path).source, capsys)
    expert = r["expert"]
    assert isinstance(expert, dict)
    views = {v["name"]: v for v in expert["views"]}
    assert set(views) == {"gate_proj", "up_proj"}
    assert all(v["of"] == "gate_up_proj" and v["ggml_type"] == "Q4_K" for v in views.values())
    assert {t["name"]: t["ggml_type"] for t in expert["tensors"]}["gate_up_proj"] == "Q4_K"
    skipped = r["skipped"]
    assert isinstance(skipped, list)
    kinds = {s["kind"] for s in skipped}
    assert {"dense", "router"} <= kinds
