"""Tests of tools.trace: the real traces' facts, the exact replay sequence, and error reports.

The real-trace tests run on the bundled gz copies (always present); when the shared
directory is there too, the bundled copies are checked to parse to the same sequence.
"""

from __future__ import annotations

import gzip
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from iosched._errors import StoreError
from iosched.tools.trace import (
    RouteTrace,
    TraceError,
    bundled_trace_names,
    bundled_trace_path,
    load_bundled_trace,
    load_route_trace,
    load_route_trace_text,
)

SHARED = Path(__file__).resolve().parents[2] / "shared" / "traces"

EXPECTED = {
    # name: (arch, MoE layers, experts, k, prompt tokens, decode tokens)
    "qwen": ("qwen3moe", 48, 128, 6, 28, 128),
    "gemma": ("gemma4", 30, 128, 6, 29, 128),
}


@pytest.fixture(scope="module", params=sorted(EXPECTED))
def real(request: pytest.FixtureRequest) -> tuple[str, RouteTrace]:
    name: str = request.param
    return name, load_bundled_trace(name)


# -- the real traces -------------------------------------------------------------------------


def test_bundled_names_and_paths() -> None:
    assert set(EXPECTED) <= set(bundled_trace_names())
    for name in EXPECTED:
        p = bundled_trace_path(name)
        assert p.is_file() and p.name == f"{name}.route.csv.gz"
    assert bundled_trace_path().name == "qwen.route.csv.gz"


def test_bundled_unknown_name_lists_available() -> None:
    with pytest.raises(TraceError) as ei:
        bundled_trace_path("mixtral")
    msg = str(ei.value)
    assert "mixtral" in msg and "qwen" in msg and "gemma" in msg


def test_header(real: tuple[str, RouteTrace]) -> None:
    name, tr = real
    arch, n_layers, n_expert, k, _, _ = EXPECTED[name]
    assert tr.arch == arch
    assert tr.n_layer == n_layers and tr.layers == tuple(range(n_layers))
    assert tr.n_expert == n_expert and tr.k == k
    assert sorted(tr.expert_bytes) == list(tr.layers)
    assert all(b > 0 for b in tr.expert_bytes.values())
    assert tr.td_bytes == 6 * sum(tr.expert_bytes.values())
    assert tr.turns == (0,)
    assert (tr.req_turn == 0).all()


def test_expert_sizes_match_readme(real: tuple[str, RouteTrace]) -> None:
    name, tr = real
    mib = sorted({round(b / 2**20, 2) for b in tr.expert_bytes.values()})
    assert mib == {"qwen": [2.53, 2.92], "gemma": [3.43, 4.14]}[name]


def test_prefill_is_one_batch_per_layer(real: tuple[str, RouteTrace]) -> None:
    name, tr = real
    pre = [b for b in tr.batches() if b[0] == 0]
    assert [layer for _, _, layer, _ in pre] == list(tr.layers)
    assert all(token == -1 for _, token, _, _ in pre)
    # prefill comes first, as one contiguous block
    n_pre = int((tr.req_phase == 0).sum())
    assert (tr.req_phase[:n_pre] == 0).all() and (tr.req_phase[n_pre:] == 1).all()
    assert (tr.req_token[:n_pre] == -1).all()


def test_decode_batches(real: tuple[str, RouteTrace]) -> None:
    name, tr = real
    *_, decode_tokens = EXPECTED[name]
    assert tr.n_decode_tokens() == decode_tokens
    dec = [b for b in tr.batches() if b[0] == 1]
    assert len(dec) == decode_tokens * len(tr.layers)
    expect = [(t, layer) for t in range(decode_tokens) for layer in tr.layers]
    assert [(t, layer) for _, t, layer, _ in dec] == expect
    for _, _, _, experts in dec:
        assert 1 <= experts.size <= tr.k
        assert np.unique(experts).size == experts.size
    # these traces route k distinct experts for every decode (token, layer)
    assert int((tr.req_phase == 1).sum()) == decode_tokens * len(tr.layers) * tr.k


def test_every_batch_distinct_and_in_range(real: tuple[str, RouteTrace]) -> None:
    _, tr = real
    assert (np.diff(tr.req_batch) >= 0).all() and tr.req_batch[0] == 0
    assert set(np.diff(tr.req_batch).tolist()) <= {0, 1}
    n = 0
    for _, _, _, experts in tr.batches():
        assert np.unique(experts).size == experts.size
        n += experts.size
    assert n == tr.n_requests
    assert tr.req_expert.min() >= 0 and tr.req_expert.max() < tr.n_expert
    assert set(tr.req_layer.tolist()) == set(tr.layers)
    assert (tr.req_bytes == [tr.expert_bytes[int(x)] for x in tr.req_layer]).all()


def test_prefill_token_counts(real: tuple[str, RouteTrace]) -> None:
    """Prefill batch sizes are bounded by the prompt tokens routed through the layer."""
    name, tr = real
    *_, prompt, _ = EXPECTED[name]
    for _, _, _, experts in (b for b in tr.batches() if b[0] == 0):
        assert 1 <= experts.size <= min(tr.n_expert, prompt * tr.k)


def test_arrays_are_read_only(real: tuple[str, RouteTrace]) -> None:
    _, tr = real
    for arr in (tr.req_layer, tr.req_expert, tr.req_phase, tr.req_batch, tr.req_token):
        with pytest.raises(ValueError):
            arr[0] = 1
    assert tr.req_phase.dtype == np.int8
    for arr in (tr.req_layer, tr.req_expert, tr.req_batch, tr.req_token, tr.req_turn):
        assert arr.dtype == np.int32


@pytest.mark.skipif(not SHARED.is_dir(), reason=f"{SHARED} is not present, so only the bundled copies are tested")
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_bundled_equals_shared(name: str) -> None:
    shared = SHARED / f"{name}.route.csv"
    bundled = bundled_trace_path(name)
    assert gzip.decompress(bundled.read_bytes()) == shared.read_bytes()
    a, b = load_route_trace(shared), load_route_trace(bundled)
    assert a.source == str(shared) and b.source == str(bundled)
    for field in ("model", "arch", "n_layer", "n_expert", "k", "expert_bytes",
                  "dense_bytes", "layers", "turns", "n_rows"):
        assert getattr(a, field) == getattr(b, field), field
    for field in ("req_layer", "req_expert", "req_phase", "req_batch", "req_token",
                  "req_turn"):
        assert np.array_equal(getattr(a, field), getattr(b, field)), field


# -- exact sequence semantics on hand-written traces ----------------------------------------

HEAD = """# route_trace v1
# model=/m/tiny model.gguf arch=toy n_layer=4 n_expert=8 n_expert_used=2
# layer=1 expert_bytes=100 dense_bytes=7
# layer=3 expert_bytes=300 dense_bytes=9
turn,phase,step,layer,slot,expert,weight,residency,expert_bytes
"""


def parse(rows: str, head: str = HEAD) -> RouteTrace:
    return load_route_trace_text(head + rows, "mem")


def seq(tr: RouteTrace) -> list[tuple[int, int, int, list[int]]]:
    return [(p, t, layer, e.tolist()) for p, t, layer, e in tr.batches()]


def test_header_fields_in_memory() -> None:
    tr = parse("0,1,5,1,0,3,0.5,0,100\n")
    assert tr.source == "mem"
    assert tr.model == "/m/tiny model.gguf" and tr.arch == "toy"
    assert (tr.n_layer, tr.n_expert, tr.k) == (4, 8, 2)
    assert tr.expert_bytes == {1: 100, 3: 300} and tr.dense_bytes == {1: 7, 3: 9}
    assert tr.layers == (1, 3)
    assert tr.td_bytes == 2 * 400
    assert tr.n_rows == 1 and tr.n_requests == 1 and tr.n_batches == 1


def test_prefill_sorted_by_step_slot_first_occurrence_kept() -> None:
    # Rows deliberately out of order. Layer 1, sorted by (step, slot):
    #   (0,0)=5 (0,1)=2 (1,0)=2 (1,1)=7 (2,0)=5 (2,1)=0  -> 5, 2, 7, 0
    rows = """0,0,2,1,1,0,nan,0,0
0,0,1,3,0,6,0.1,0,0
0,0,1,1,1,7,0.2,0,0
0,0,0,1,1,2,0.3,0,0
0,0,2,1,0,5,0.4,0,0
0,0,0,3,0,4,0.5,0,0
0,0,1,1,0,2,0.6,0,0
0,0,0,1,0,5,0.7,0,0
"""
    tr = parse(rows)
    assert seq(tr) == [(0, -1, 1, [5, 2, 7, 0]), (0, -1, 3, [4, 6])]
    assert tr.req_batch.tolist() == [0, 0, 0, 0, 1, 1]
    assert tr.req_layer.tolist() == [1, 1, 1, 1, 3, 3]
    assert tr.n_decode_tokens() == 0
    assert tr.req_bytes.tolist() == [100] * 4 + [300] * 2


def test_decode_step_order_layer_order_slot_order() -> None:
    rows = """0,1,9,3,1,1,0.1,0,0
0,1,9,3,0,2,0.9,0,0
0,1,4,3,0,6,0.9,0,0
0,1,4,1,1,0,0.1,0,0
0,1,4,1,0,7,0.9,0,0
0,1,9,1,0,3,0.9,0,0
0,1,4,3,1,6,0.1,0,0
0,0,0,3,0,5,0.9,0,0
"""
    tr = parse(rows)
    assert seq(tr) == [
        (0, -1, 3, [5]),
        (1, 0, 1, [7, 0]),
        (1, 0, 3, [6]),  # repeated expert inside one decode batch: requested once
        (1, 1, 1, [3]),
        (1, 1, 3, [2, 1]),
    ]
    assert tr.req_token.tolist() == [-1, 0, 0, 0, 1, 1, 1]
    assert tr.req_batch.tolist() == [0, 1, 1, 2, 3, 4, 4]
    assert tr.req_phase.tolist() == [0, 1, 1, 1, 1, 1, 1]
    assert tr.n_decode_tokens() == 2


def test_residency_and_expert_bytes_columns_are_ignored() -> None:
    a = parse("0,1,0,1,0,3,0.5,0,100\n0,1,0,1,1,4,0.5,0,100\n")
    b = parse("0,1,0,1,0,3,0.5,2,0\n0,1,0,1,1,4,0.5,1,999\n")
    assert seq(a) == seq(b)
    assert a.req_bytes.tolist() == b.req_bytes.tolist() == [100, 100]


def test_several_turns_replay_prefill_then_decode_per_turn() -> None:
    rows = """1,1,3,1,0,6,0.5,0,0
1,0,0,1,0,5,0.5,0,0
0,1,2,1,0,4,0.5,0,0
0,0,0,1,0,1,0.5,0,0
0,0,1,1,0,2,0.5,0,0
0,1,3,1,0,3,0.5,0,0
1,1,2,1,0,7,0.5,0,0
"""
    tr = parse(rows)
    assert tr.turns == (0, 1)
    assert seq(tr) == [
        (0, -1, 1, [1, 2]),
        (1, 0, 1, [4]),
        (1, 1, 1, [3]),
        (0, -1, 1, [5]),
        (1, 2, 1, [7]),
        (1, 3, 1, [6]),
    ]
    assert tr.req_turn.tolist() == [0, 0, 0, 0, 1, 1, 1]
    assert tr.n_decode_tokens() == 4


def test_blank_lines_crlf_and_nan_weight() -> None:
    text = HEAD.replace("\n", "\r\n") + "0,1,0,1,0,3,NaN,0,0\r\n\r\n0,1,0,1,1,4,nan,0,0\r\n"
    tr = load_route_trace_text(text, "crlf")
    assert seq(tr) == [(1, 0, 1, [3, 4])]


def test_gzip_and_plain_files(tmp_path: Path) -> None:
    text = HEAD + "0,1,0,1,0,3,0.5,0,0\n"
    plain = tmp_path / "t.route.csv"
    plain.write_text(text)
    gz = tmp_path / "t.route.csv.gz"
    gz.write_bytes(gzip.compress(text.encode()))
    assert seq(load_route_trace(plain)) == seq(load_route_trace(str(gz))) == [(1, 0, 1, [3])]


def test_unreadable_files_raise_trace_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.route.csv"
    with pytest.raises(TraceError, match="nope.route.csv"):
        load_route_trace(missing)
    bad_gz = tmp_path / "bad.route.csv.gz"
    bad_gz.write_bytes(b"not gzip at all")
    with pytest.raises(TraceError, match="bad.route.csv.gz"):
        load_route_trace(bad_gz)


# -- malformed input: TraceError naming the file and the line --------------------------------

V = "# route_trace v1\n"
M = "# model=/m arch=toy n_layer=4 n_expert=8 n_expert_used=2\n"
L1 = "# layer=1 expert_bytes=100 dense_bytes=7\n"
C = "turn,phase,step,layer,slot,expert,weight,residency,expert_bytes\n"
R = "0,1,0,1,0,3,0.5,0,100\n"

BAD = [
    # (id, text, line, words the message must contain)
    ("empty-file", "", 1, "version"),
    ("no-version", M + L1 + C + R, 1, "missing version"),
    ("unknown-version", "# route_trace v2\n" + M + L1 + C + R, 1, "unknown trace version"),
    ("version-after-blank", "\n\n# route_trace v9\n" + M, 3, "unknown trace version"),
    ("no-model-line", V + L1 + C + R, 3, "missing '# model="),
    ("model-missing-key", V + "# model=/m arch=toy n_layer=4 n_expert=8\n" + L1 + C + R, 2,
     "n_expert_used"),
    ("model-non-int", V + M.replace("n_expert=8", "n_expert=eight") + L1 + C + R, 2,
     "not an integer"),
    ("model-k-gt-experts", V + M.replace("n_expert_used=2", "n_expert_used=9") + L1 + C + R,
     2, "exceeds"),
    ("model-twice", V + M + M + L1 + C + R, 3, "second model line"),
    ("unknown-header", V + M + "# hello world\n" + L1 + C + R, 3, "unrecognised"),
    ("header-no-kv", V + M + "# layer=1 expert_bytes\n" + C + R, 3, "not an integer"),
    ("layer-missing-bytes", V + M + "# layer=1 dense_bytes=7\n" + C + R, 3, "expert_bytes"),
    ("layer-bytes-zero", V + M + "# layer=1 expert_bytes=0\n" + C + R, 3, "below"),
    ("layer-out-of-range", V + M + "# layer=4 expert_bytes=10\n" + C, 3, "out of range"),
    ("layer-twice", V + M + L1 + L1 + C + R, 4, "twice"),
    ("no-layer-lines", V + M + C + R, 3, "missing expert_bytes"),
    ("no-column-line", V + M + L1, 4, "column line"),
    ("wrong-columns", V + M + L1 + "turn,phase,step,layer,expert,slot,weight,residency,"
     "expert_bytes\n" + R, 4, "column line"),
    ("no-rows", V + M + L1 + C, 4, "empty trace"),
    ("no-rows-blank", V + M + L1 + C + "\n\n", 4, "empty trace"),
    ("too-few-fields", V + M + L1 + C + R + "0,1,0,1,1,3,0.5,0\n", 6, "8 fields, expected 9"),
    ("too-many-fields", V + M + L1 + C + "0,1,0,1,0,3,0.5,0,100,1\n", 5, "10 fields"),
    ("comment-in-rows", V + M + L1 + C + R + "# layer=3 expert_bytes=1\n", 6, "header line"),
    ("non-int-expert", V + M + L1 + C + R + "0,1,0,1,1,x3,0.5,0,0\n", 6, "expert 'x3'"),
    ("float-step", V + M + L1 + C + "0,1,0.5,1,0,3,0.5,0,0\n", 5, "step '0.5'"),
    ("non-int-residency", V + M + L1 + C + "0,1,0,1,0,3,0.5,hit,0\n", 5, "residency"),
    ("non-int-bytes-col", V + M + L1 + C + "0,1,0,1,0,3,0.5,0,1.5\n", 5, "expert_bytes"),
    ("bad-weight", V + M + L1 + C + "0,1,0,1,0,3,heavy,0,0\n", 5, "weight"),
    ("huge-int", V + M + L1 + C + R + "0,1,0,1,1," + "9" * 30 + ",0.5,0,0\n", 6, "too large"),
    ("layer-not-moe", V + M + L1 + C + R + R + "0,1,0,2,0,3,0.5,0,0\n", 7, "layer 2"),
    ("layer-ge-n-layer", V + M + L1 + C + "0,1,0,4,0,3,0.5,0,0\n", 5, "layer 4 out of range"),
    ("layer-negative", V + M + L1 + C + "0,1,0,-1,0,3,0.5,0,0\n", 5, "out of range"),
    ("expert-ge-n-expert", V + M + L1 + C + R + "0,1,0,1,1,8,0.5,0,0\n", 6,
     "expert 8 out of range"),
    ("expert-negative", V + M + L1 + C + "0,1,0,1,0,-3,0.5,0,0\n", 5, "out of range"),
    ("slot-ge-k", V + M + L1 + C + "0,1,0,1,2,3,0.5,0,0\n", 5, "slot 2"),
    ("bad-phase", V + M + L1 + C + "0,2,0,1,0,3,0.5,0,0\n", 5, "phase 2"),
    ("negative-step", V + M + L1 + C + "0,1,-1,1,0,3,0.5,0,0\n", 5, "negative"),
    ("negative-turn", V + M + L1 + C + "-1,1,0,1,0,3,0.5,0,0\n", 5, "negative"),
    ("duplicate-row", V + M + L1 + C + R + "0,1,1,1,0,4,0.5,0,0\n" + R, 7, "first at line 5"),
]


def assert_names_the_line(load: Callable[[str, str], object], text: str, source: str,
                          line: int, words: str) -> None:
    """``load(text, source)`` raises a TraceError (a StoreError) that starts with
    ``source:line:`` and says ``words``."""
    with pytest.raises(TraceError) as ei:
        load(text, source)
    msg = str(ei.value)
    assert msg.startswith(f"{source}:{line}: "), msg
    assert words in msg, msg
    assert isinstance(ei.value, StoreError)


@pytest.mark.parametrize("text,line,words", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_malformed_raises_trace_error_with_line(text: str, line: int, words: str) -> None:
    assert_names_the_line(load_route_trace_text, text, "bad.csv", line, words)


def test_malformed_file_message_names_path(tmp_path: Path) -> None:
    p = tmp_path / "broken.route.csv.gz"
    p.write_bytes(gzip.compress((V + M + L1 + C + R + "0,1,0,1,1,99,0.5,0,0\n").encode()))
    with pytest.raises(TraceError, match=r"broken\.route\.csv\.gz:6: expert 99"):
        load_route_trace(p)


def test_bad_case_ids_unique() -> None:
    assert not [k for k, n in Counter(b[0] for b in BAD).items() if n > 1]
