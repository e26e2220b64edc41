"""Fuzzing the checkpoint parsers (issue #13, point 7) with hypothesis.

Inputs: arbitrary bytes as a safetensors file; a real header (``write_safetensors_moe``)
mutated byte by byte and entry by entry; arbitrary JSON as ``model.safetensors.index.json`` and
as ``config.json`` beside real shards; a real GGUF file (``write_gguf_moe``) mutated byte by
byte. The only outcomes allowed: a :class:`CheckpointIndex` that holds its invariants (every
extent inside its file, buffers laid out without gaps) or a :class:`CheckpointError`. Anything
else (``RecursionError``, ``ValueError``, ``MemoryError``, ``KeyError`` ...) fails the test.

Bounds: the peak of Python allocations (``tracemalloc``) while indexing one input stays under
:data:`PEAK_BYTES` (every input here is under 64 KiB: a cap proportional to the header, never
to a count it claims, keeps far under it; the issue's findings blew past 1 GiB), and each input
takes at most :data:`DEADLINE` (hypothesis' deadline; the findings never returned).

Deterministic: ``derandomize=True`` and no example database, so CI runs the same examples
every time. The whole file runs in about 10 s on two shared cores (300 examples a test).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
import tracemalloc
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from iosched._errors import CheckpointError
from iosched._layout import CheckpointIndex
from iosched.formats._checkpoint import load_index
from iosched.tools.synth import write_gguf_moe, write_safetensors_moe

PEAK_BYTES = 32 << 20
"""Peak traced allocations for one input of at most 64 KiB."""
DEADLINE = timedelta(seconds=5)
"""Per input; generous for two shared cores under tracemalloc (a real input takes milliseconds)."""
SIZES: dict[str, Any] = dict(n_layers=2, n_experts=2, hidden=4, intermediate=4)
FUZZ = settings(
    derandomize=True, database=None, deadline=DEADLINE, max_examples=300,
    suppress_health_check=[HealthCheck.too_slow],
)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=20), inner, max_size=5),
    max_leaves=30,
)
"""Any JSON value (``json.dumps`` writes NaN and Infinity as Python's json reads them)."""


def check_outcome(source: Path) -> None:
    """Index ``source``: a valid index or a CheckpointError, within the memory bound."""
    tracemalloc.start()
    try:
        index = load_index(source)
    except CheckpointError as exc:
        assert str(exc)
        return
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < PEAK_BYTES, peak
    check_index(index)


def check_index(index: CheckpointIndex) -> None:
    assert index.experts
    for (layer, expert), lay in index.experts.items():
        assert lay.key == (layer, expert)
        assert 0 <= expert < index.experts_per_layer()
        pos = 0
        for t in lay.tensors:
            assert t.buf_offset == pos and t.nbytes > 0
            pos += t.nbytes
        assert pos == lay.nbytes == sum(e.length for e in lay.extents)
        for e in lay.extents:
            assert 0 <= e.offset and e.offset + e.length <= index.file_sizes[e.file]
            assert index.file_sizes[e.file] == os.stat(index.files[e.file]).st_size


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="iosched-fuzz-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def real_safetensors(workdir: Path) -> bytes:
    folder = write_safetensors_moe(workdir / "st", dtype="float16", index_json=False, dense=False, **SIZES)
    return (folder / "model.safetensors").read_bytes()


@pytest.fixture(scope="module")
def real_gguf(workdir: Path) -> bytes:
    return write_gguf_moe(workdir / "g" / "m.gguf", **SIZES).read_bytes()


@pytest.fixture(scope="module")
def shard_folder(workdir: Path) -> tuple[Path, str]:
    """Two real shards, and the text of their real index json (which the fuzzer overwrites)."""
    folder = write_safetensors_moe(workdir / "shards", dtype="float16", n_shards=2, **SIZES)
    return folder, (folder / "model.safetensors.index.json").read_text()


def mutate(data: bytes, edits: list[tuple[int, int, int]], cut: int | None) -> bytes:
    """Apply (position, kind, byte) edits: 0 replaces, 1 inserts, 2 deletes; then cut."""
    out = bytearray(data)
    for pos, kind, byte in edits:
        i = pos % (len(out) + 1)
        if kind == 0 and i < len(out):
            out[i] = byte
        elif kind == 1:
            out.insert(i, byte)
        elif i < len(out):
            del out[i]
    return bytes(out[:cut] if cut is not None else out)


edits = st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 2), st.integers(0, 255)), max_size=8)


@FUZZ
@given(data=st.binary(max_size=1024))
def test_arbitrary_bytes_as_safetensors(workdir: Path, data: bytes) -> None:
    check_outcome(_write(workdir / "any.safetensors", data))


@FUZZ
@given(blob=st.binary(max_size=512), declared=st.integers(0, (1 << 64) - 1) | st.none())
def test_arbitrary_header_behind_a_length_prefix(workdir: Path, blob: bytes, declared: int | None) -> None:
    n = len(blob) if declared is None else declared
    check_outcome(_write(workdir / "prefixed.safetensors", struct.pack("<Q", n) + blob + bytes(64)))


@FUZZ
@given(edits=edits, cut=st.none() | st.integers(0, 1 << 12))
def test_mutated_real_safetensors_bytes(workdir: Path, real_safetensors: bytes,
                                        edits: list[tuple[int, int, int]], cut: int | None) -> None:
    n = struct.unpack("<Q", real_safetensors[:8])[0]
    # positions fall in the prefix and header (where the parser looks) three times in four
    scaled = [(p % (8 + n) if p % 4 else p, k, b) for p, k, b in edits]
    check_outcome(_write(workdir / "mutated.safetensors", mutate(real_safetensors, scaled, cut)))


@FUZZ
@given(picks=st.lists(st.tuples(st.integers(0, 1000), st.sampled_from(["dtype", "shape", "data_offsets", None]),
                                json_values), min_size=1, max_size=4))
def test_mutated_real_safetensors_entries(workdir: Path, real_safetensors: bytes,
                                          picks: list[tuple[int, str | None, Any]]) -> None:
    n = struct.unpack("<Q", real_safetensors[:8])[0]
    header = json.loads(real_safetensors[8:8 + n])
    names = sorted(header)
    for i, field, value in picks:
        name = names[i % len(names)]
        if field is None or not isinstance(header[name], dict):
            header[name] = value
        else:
            header[name][field] = value
    blob = json.dumps(header).encode()
    data = struct.pack("<Q", len(blob)) + blob + real_safetensors[8 + n:]
    check_outcome(_write(workdir / "entries.safetensors", data))


SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
TENSORS = [f"model.layers.{i}.mlp.experts.{j}.{p}.weight" for i in range(3) for j in range(3)
           for p in ("gate_proj", "up_proj", "down_proj")]
shard_names = st.sampled_from(SHARDS * 4 + ["../x", "/etc/passwd", "", ".", "a/../" + SHARDS[0], "a\\b"]) | st.text(
    max_size=10)
weight_maps = st.dictionaries(st.sampled_from(TENSORS) | st.text(max_size=10), shard_names, max_size=20)


@FUZZ
@given(doc=json_values | st.fixed_dictionaries({"weight_map": weight_maps}),
       real=st.booleans(), changes=st.dictionaries(st.sampled_from(TENSORS), shard_names, max_size=3))
def test_arbitrary_index_json(shard_folder: tuple[Path, str], doc: Any, real: bool, changes: dict[str, str]) -> None:
    """Any JSON, any weight map, or the real one with a few entries changed."""
    folder, real_text = shard_folder
    if real:
        doc = json.loads(real_text)
        doc["weight_map"].update(changes)
    (folder / "model.safetensors.index.json").write_text(json.dumps(doc))
    check_outcome(folder)


@FUZZ
@given(doc=json_values | st.dictionaries(
    st.sampled_from(["num_experts_per_tok", "num_experts", "num_local_experts", "n_routed_experts", "top_k",
                     "text_config"]), json_values, max_size=4))
def test_arbitrary_config_json(workdir: Path, doc: Any) -> None:
    folder = workdir / "cfg"
    if not folder.exists():
        write_safetensors_moe(folder, dtype="float16", **SIZES)
    (folder / "config.json").write_text(json.dumps(doc))
    check_outcome(folder)


@FUZZ
@given(edits=edits, cut=st.none() | st.integers(0, 1 << 13))
def test_mutated_real_gguf(workdir: Path, real_gguf: bytes, edits: list[tuple[int, int, int]], cut: int | None) -> None:
    # most positions in the header (metadata and tensor infos, about the first 1.3 KiB)
    scaled = [(p % 1536 if p % 4 else p, k, b) for p, k, b in edits]
    check_outcome(_write(workdir / "mutated.gguf", mutate(real_gguf, scaled, cut)))


@FUZZ
@given(words=st.lists(st.integers(0, (1 << 64) - 1), min_size=1, max_size=8), at=st.integers(0, 200))
def test_real_gguf_with_absurd_counts(workdir: Path, real_gguf: bytes, words: list[int], at: int) -> None:
    """u64 words written over the header: claimed counts and lengths of any size."""
    out = bytearray(real_gguf)
    for i, word in enumerate(words):
        pos = 8 + 8 * ((at + 7 * i) % 160)
        out[pos:pos + 8] = struct.pack("<Q", word)
    check_outcome(_write(workdir / "counts.gguf", bytes(out)))


def test_the_real_inputs_index(real_safetensors: bytes, real_gguf: bytes, workdir: Path) -> None:
    """The unmutated inputs are valid: the fuzzers start from checkpoints that index."""
    for name, data in (("ok.safetensors", real_safetensors), ("ok.gguf", real_gguf)):
        index = load_index(_write(workdir / name, data))
        check_index(index)
        assert len(index.experts) == SIZES["n_layers"] * SIZES["n_experts"]


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path
