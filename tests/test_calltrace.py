"""Tests of tools.calltrace: the ``call row layer expert:gate ...`` routing trace text.

What is checked, and why:

* the bundled traces written as call text and read back give the very request sequence the
  CSV gave, and replaying both gives the same hits: the two formats are one sequence;
* a hand-written trace in both formats, with the grouping rules spelled out (prefill read
  from multi-row batches, layer wrap, turns, dedup inside a batch, token numbering);
* every malformed input names the file, the line and what is wrong;
* the facts derived when the header is missing, and the ``sizes_assumed`` flag;
* ``iosched replay`` on a call file (format sniffing, ``--expert-bytes``) and its errors.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from iosched.tools import replay
from iosched.tools.calltrace import (
    DEFAULT_EXPERT_BYTES,
    format_call_trace,
    is_call_line,
    load_call_trace,
    load_call_trace_text,
)
from iosched.tools.replay import Requests, budget_for, load_trace, simulate
from iosched.tools.trace import RouteTrace, TraceError, load_bundled_trace, load_route_trace_text
from tests.test_trace import assert_names_the_line

ARRAYS = ("req_layer", "req_expert", "req_phase", "req_batch", "req_token", "req_turn")
FACTS = ("expert_bytes", "dense_bytes", "k", "n_expert", "n_layer", "layers", "turns", "model",
         "arch", "sizes_assumed")


def same_sequence(a: RouteTrace, b: RouteTrace) -> None:
    for name in ARRAYS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and np.array_equal(x, y), name


def seq(tr: RouteTrace) -> list[tuple[int, int, int, list[int]]]:
    return [(p, t, layer, e.tolist()) for p, t, layer, e in tr.batches()]


# -- the bundled traces, both ways ------------------------------------------------------------


@pytest.fixture(scope="module", params=["qwen", "gemma"])
def both(request: pytest.FixtureRequest) -> tuple[RouteTrace, RouteTrace]:
    csv = load_bundled_trace(request.param)
    return csv, load_call_trace_text(format_call_trace(csv), f"{request.param}.calls")


def test_round_trip_keeps_the_request_sequence(both: tuple[RouteTrace, RouteTrace]) -> None:
    csv, calls = both
    same_sequence(csv, calls)
    for name in FACTS:
        assert getattr(csv, name) == getattr(calls, name), name
    assert calls.td_bytes == csv.td_bytes and not calls.sizes_assumed
    assert calls.n_decode_tokens() == csv.n_decode_tokens() == 128


def test_replaying_both_formats_gives_the_same_hits(both: tuple[RouteTrace, RouteTrace]) -> None:
    csv, calls = both
    a, b = Requests.of(csv), Requests.of(calls)
    for policy in ("lru", "belady"):
        for cycles in (1.0, 4.0):
            ra = simulate(a, policy, cycles, budget_for(csv, cycles))
            rb = simulate(b, policy, cycles, budget_for(calls, cycles))
            assert ra["decode_hit"] == rb["decode_hit"], (policy, cycles)
            assert (ra["hits"], ra["hit_bytes"]) == (rb["hits"], rb["hit_bytes"])


def test_written_files_are_sniffed_plain_and_gzip(tmp_path: Path) -> None:
    csv = load_bundled_trace("gemma")
    text = format_call_trace(csv)
    plain, packed = tmp_path / "gemma.calls.txt", tmp_path / "gemma.calls.txt.gz"
    plain.write_text(text)
    packed.write_bytes(gzip.compress(text.encode()))
    for path in (plain, packed):
        tr = load_trace(str(path))
        assert tr.source == str(path)
        same_sequence(csv, tr)
        same_sequence(csv, load_call_trace(path))


# -- the grouping rules, on a trace written by hand in both formats ---------------------------

H = """# model=/m/tiny model.gguf arch=toy n_layer=4 n_expert=8 n_expert_used=2
# layer=1 expert_bytes=100 dense_bytes=7
# layer=3 expert_bytes=300 dense_bytes=9
"""

CALLS = H + """# turn 0, prefill of three prompt tokens: one forward, a batch of several rows per layer
0 0 1 5:0.5 2:0.3
0 1 1 2:0.6 7:0.1
0 2 1 5:nan 0:0.2
1 0 3 4:0.9 6:0.1
1 1 3 6:0.5 4:0.5

2 0 1 7:0.9 0:0.1
3 0 3 6:0.8
4 0 1 3:1
5 0 3 2:0.5 1:-inf
6 0 1 1:0.5 2:0.5
6 1 1 2:0.5 3:0.5
7 0 3 0:1
8 0 3 5:1
"""
CSV = """# route_trace v1
""" + H + """turn,phase,step,layer,slot,expert,weight,residency,expert_bytes
0,0,0,1,0,5,0.5,0,0
0,0,0,1,1,2,0.3,0,0
0,0,1,1,0,2,0.6,0,0
0,0,1,1,1,7,0.1,0,0
0,0,2,1,0,5,nan,0,0
0,0,2,1,1,0,0.2,0,0
0,0,0,3,0,4,0.9,0,0
0,0,0,3,1,6,0.1,0,0
0,0,1,3,0,6,0.5,0,0
0,0,1,3,1,4,0.5,0,0
0,1,0,1,0,7,0.9,0,0
0,1,0,1,1,0,0.1,0,0
0,1,0,3,0,6,0.8,0,0
0,1,1,1,0,3,1,0,0
0,1,1,3,0,2,0.5,0,0
0,1,1,3,1,1,-inf,0,0
1,0,0,1,0,1,0.5,0,0
1,0,0,1,1,2,0.5,0,0
1,0,1,1,0,2,0.5,0,0
1,0,1,1,1,3,0.5,0,0
1,0,0,3,0,0,1,0,0
1,1,0,3,0,5,1,0,0
"""

EXPECTED = [
    (0, -1, 1, [5, 2, 7, 0]),  # prefill: rows in order, each expert once (5 and 2 repeat)
    (0, -1, 3, [4, 6]),
    (1, 0, 1, [7, 0]),  # decode token 0
    (1, 0, 3, [6]),
    (1, 1, 1, [3]),  # layer 3 -> 1: the layer wraps, a new forward, token 1
    (1, 1, 3, [2, 1]),
    (0, -1, 1, [1, 2, 3]),  # a prefill after decode: turn 1
    (0, -1, 3, [0]),  # one row, but its forward has a multi-row batch: still prefill
    (1, 2, 3, [5]),  # the same layer again with another call: a new forward, token 2
]


def test_hand_written_trace_follows_the_grouping_rules() -> None:
    tr = load_call_trace_text(CALLS, "hand.calls")
    assert seq(tr) == EXPECTED
    assert tr.req_turn.tolist() == [0] * 12 + [1] * 5 and tr.turns == (0, 1)
    assert tr.req_batch.tolist() == [0, 0, 0, 0, 1, 1, 2, 2, 3, 4, 5, 5, 6, 6, 6, 7, 8]
    assert tr.n_decode_tokens() == 3 and tr.n_rows == 22
    assert (tr.model, tr.arch, tr.n_layer, tr.n_expert, tr.k) == ("/m/tiny model.gguf", "toy",
                                                                  4, 8, 2)
    assert tr.expert_bytes == {1: 100, 3: 300} and tr.dense_bytes == {1: 7, 3: 9}
    assert tr.layers == (1, 3) and not tr.sizes_assumed


def test_hand_written_trace_equals_the_same_routing_as_csv() -> None:
    calls = load_call_trace_text(CALLS, "hand.calls")
    csv = load_route_trace_text(CSV, "hand.csv")
    assert seq(csv) == EXPECTED
    same_sequence(csv, calls)
    for name in FACTS:
        assert getattr(csv, name) == getattr(calls, name), name
    again = load_call_trace_text(format_call_trace(calls), "again")
    same_sequence(calls, again)


def test_rows_in_row_order_and_call_per_forward() -> None:
    # Rows out of file order inside a group; one call number for a whole forward; CRLF.
    text = "7 2 0 3:1\r\n7 0 0 1:1 5:1\r\n7 1 0 5:1 4:1\r\n7 0 2 6:1\r\n8 0 0 2:1\r\n8 0 2 1:1\r\n"
    tr = load_call_trace_text(text, "m")
    assert seq(tr) == [(0, -1, 0, [1, 5, 4, 3]), (0, -1, 2, [6]), (1, 0, 0, [2]), (1, 0, 2, [1])]


def test_chunked_prefill_is_one_turn_of_several_forwards() -> None:
    text = """0 0 0 1:1 2:1
0 1 0 3:1
1 0 1 4:1
2 0 0 2:1
2 1 0 5:1
3 0 1 4:1 6:1
4 0 0 7:1
5 0 0 2:1
5 1 0 0:1
"""
    tr = load_call_trace_text(text, "chunks")
    assert seq(tr) == [(0, -1, 0, [1, 2, 3]), (0, -1, 1, [4]), (0, -1, 0, [2, 5]),
                       (0, -1, 1, [4, 6]), (1, 0, 0, [7]), (0, -1, 0, [2, 0])]
    assert tr.req_turn.tolist() == [0] * 9 + [1, 1] and tr.turns == (0, 1)
    same_sequence(tr, load_call_trace_text(format_call_trace(tr), "again"))


def test_is_call_line() -> None:
    assert is_call_line("0 0 1 3:0.5") and is_call_line("  12\t0  7 3:nan 4:1")
    assert not is_call_line("turn,phase,step") and not is_call_line("0 0 1")
    assert not is_call_line("# 0 0 1 3:1")


# -- malformed input: TraceError naming the file and the line ---------------------------------

M = "# model=/m arch=toy n_layer=4 n_expert=8 n_expert_used=2\n"
R = "0 0 1 3:0.5\n"

BAD = [
    # (id, text, line, words the message must contain)
    ("empty-file", "", 1, "empty trace"),
    ("comments-only", "# hello\n\n# world\n\n", 3, "empty trace"),
    ("header-only", M, 1, "empty trace"),
    ("too-few-fields", R + "1 0 3\n", 2, "3 fields, expected at least 4"),
    ("too-few-after-blank", "\n\n0 0 1\n", 3, "expected at least 4"),
    ("non-int-call", "x 0 1 3:0.5\n", 1, "call 'x' is not an integer"),
    ("float-row", "0 0.5 1 3:0.5\n", 1, "row '0.5' is not an integer"),
    ("non-int-layer", R + "1 0 one 3:0.5\n", 2, "layer 'one' is not an integer"),
    ("negative-call", "-1 0 1 3:0.5\n", 1, "call -1 is negative"),
    ("negative-row", "0 -1 1 3:0.5\n", 1, "row -1 is negative"),
    ("negative-layer", "0 0 -2 3:0.5\n", 1, "layer -2 is negative"),
    ("no-colon", "0 0 1 3\n", 1, "bad expert:gate field '3': no ':'"),
    ("bad-gate", R + "1 0 2 3:heavy\n", 2, "bad expert:gate field '3:heavy'"),
    ("empty-gate", "0 0 1 3:\n", 1, "bad expert:gate field '3:'"),
    ("bad-expert", "0 0 1 x3:0.5\n", 1, "bad expert:gate field 'x3:0.5'"),
    ("negative-expert", "0 0 1 -3:0.5\n", 1, "expert -3 is negative"),
    ("expert-twice", "0 0 1 3:0.5 4:0.2 3:0.1\n", 1, "expert 3 listed twice in one row"),
    ("call-backwards", "5 0 1 3:1\n5 1 1 4:1\n4 0 3 2:1\n", 3, "call 4 moves backwards"),
    ("group-reappears", "0 0 1 3:1\n0 0 3 2:1\n0 1 1 4:1\n", 3,
     "group (call 0, layer 1) reappears after another group (first at line 1)"),
    ("row-repeated", "0 0 1 3:1\n0 1 1 4:1\n0 0 1 5:1\n", 3,
     "row 0 repeated in group (call 0, layer 1) (first at line 1)"),
    ("row-repeated-crlf", "0 0 1 3:1\r\n0 0 1 4:1\r\n", 2, "row 0 repeated"),
    ("expert-ge-header", M + R + "1 0 3 8:1\n", 3, "expert 8 out of range (n_expert=8)"),
    ("layer-ge-header", M + "0 0 4 1:1\n", 2, "layer 4 out of range (n_layer=4)"),
    ("row-wider-than-k", M + "0 0 1 1:1 2:1 3:1\n", 2, "3 experts, more than n_expert_used=2"),
    ("layer-absurd", "0 0 2000000 1:1\n", 1, "layer 2000000 out of range"),
    ("expert-absurd", "0 0 1 2000000:1\n", 1, "expert 2000000 out of range"),
    ("header-after-data", R + "# layer=1 expert_bytes=5\n", 2, "header line after the first"),
    ("missing-layer-size", "# layer=1 expert_bytes=100\n" + R + "1 0 3 2:1\n", 3,
     "layer 3 has no '# layer=3 expert_bytes=...' header line"),
    ("model-non-int", "# model=/m n_layer=x\n" + R, 1, "n_layer='x' is not an integer"),
    ("model-k-gt-experts", "# model=/m n_expert=2 n_expert_used=3\n" + R, 1, "exceeds"),
    ("model-twice", M + M + R, 2, "second model line (first at line 1)"),
    ("layer-line-twice", "# layer=1 expert_bytes=5\n# layer=1 expert_bytes=5\n" + R, 2,
     "layer 1 given twice"),
    ("layer-line-zero-bytes", "# layer=1 expert_bytes=0\n" + R, 1, "below 1"),
    ("layer-line-out-of-range", "# model=/m n_layer=2\n# layer=3 expert_bytes=1\n" + R, 2,
     "layer=3 out of range (n_layer=2)"),
    ("csv-given", "# route_trace v1\n" + M, 1, "route_trace CSV, not a call trace"),
]


@pytest.mark.parametrize("text,line,words", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_malformed_raises_trace_error_with_line(text: str, line: int, words: str) -> None:
    assert_names_the_line(load_call_trace_text, text, "bad.calls", line, words)


def test_bad_case_ids_unique() -> None:
    assert not [k for k, n in Counter(b[0] for b in BAD).items() if n > 1]


def test_malformed_file_message_names_path(tmp_path: Path) -> None:
    p = tmp_path / "broken.calls.gz"
    p.write_bytes(gzip.compress((R + "1 0 2 3:0.1 3:0.2\n").encode()))
    with pytest.raises(TraceError, match=r"broken\.calls\.gz:2: expert 3 listed twice"):
        load_call_trace(p)
    with pytest.raises(TraceError, match="nope.calls"):
        load_call_trace(tmp_path / "nope.calls")


def test_neither_format_names_the_file_and_line(tmp_path: Path) -> None:
    p = tmp_path / "odd.txt"
    p.write_text("# a comment\n\nturn,phase,step,layer\n")
    with pytest.raises(TraceError) as ei:
        load_trace(str(p))
    assert str(ei.value).startswith(f"{p}:3: neither trace format matched"), ei.value


# -- derived facts and sizes ------------------------------------------------------------------

BARE = "0 0 2 5:0.5 1:0.5 3:0.1\n0 1 2 4:1\n1 0 6 0:1\n2 0 2 9:1\n3 0 6 2:1 7:1\n"


def test_facts_derived_without_header() -> None:
    tr = load_call_trace_text(BARE, "bare")
    assert (tr.n_layer, tr.n_expert, tr.k, tr.layers) == (7, 10, 3, (2, 6))
    assert tr.expert_bytes == {2: DEFAULT_EXPERT_BYTES, 6: DEFAULT_EXPERT_BYTES}
    assert tr.dense_bytes == {2: 0, 6: 0} and (tr.model, tr.arch) == ("", "")
    assert tr.sizes_assumed and tr.td_bytes == 3 * 2 * DEFAULT_EXPERT_BYTES
    assert seq(tr) == [(0, -1, 2, [5, 1, 3, 4]), (0, -1, 6, [0]), (1, 0, 2, [9]), (1, 0, 6, [2, 7])]
    # written back without '# layer=' lines, so a reader assumes the sizes again
    text = format_call_trace(tr)
    assert not [line for line in text.splitlines() if line.startswith("# layer=")]
    again = load_call_trace_text(text, "again")
    same_sequence(tr, again)
    assert again.sizes_assumed and again.expert_bytes == tr.expert_bytes


def test_partial_model_line_and_expert_bytes_argument() -> None:
    tr = load_call_trace_text("# model=/x arch=a n_expert=16\n# a comment\n" + BARE, "p",
                              expert_bytes=4096)
    assert (tr.model, tr.arch, tr.n_layer, tr.n_expert, tr.k) == ("/x", "a", 7, 16, 3)
    assert tr.expert_bytes == {2: 4096, 6: 4096} and not tr.sizes_assumed
    sized = load_call_trace_text("# layer=2 expert_bytes=10\n# layer=6 expert_bytes=30 "
                                 "dense_bytes=5\n# layer=4 expert_bytes=20\n" + BARE, "s")
    assert sized.expert_bytes == {2: 10, 4: 20, 6: 30} and sized.layers == (2, 4, 6)
    assert sized.dense_bytes == {2: 0, 4: 0, 6: 5} and not sized.sizes_assumed


@pytest.mark.parametrize("text,nbytes,words", [
    (BARE, 0, "bare: expert_bytes=0 is not a positive number"),
    ("# layer=2 expert_bytes=10\n# layer=6 expert_bytes=30\n" + BARE, 64, "bare:1: the header "
     "gives expert_bytes per layer ('# layer=' lines); an expert_bytes argument (--expert-bytes)"),
])
def test_bad_expert_bytes_argument(text: str, nbytes: int, words: str) -> None:
    with pytest.raises(TraceError) as ei:
        load_call_trace_text(text, "bare", expert_bytes=nbytes)
    assert words in str(ei.value)


# -- what format_call_trace cannot write ------------------------------------------------------

CSV_HEAD = """# route_trace v1
# model=/m arch=toy n_layer=4 n_expert=8 n_expert_used=2
# layer=1 expert_bytes=100
# layer=3 expert_bytes=300
turn,phase,step,layer,slot,expert,weight,residency,expert_bytes
"""


@pytest.mark.parametrize("rows,words", [
    # decode token 0 routes only layer 1, token 1 only layer 3: a reader joins them
    ("0,1,0,1,0,3,1,0,0\n0,1,1,3,0,4,1,0,0\n", "would join them"),
    # two turns of decode only: a reader starts a turn only at a prefill after decode
    ("0,1,0,1,0,3,1,0,0\n1,1,0,1,0,4,1,0,0\n", "turn 1 after turn 0"),
    # a one-token prompt routing one expert per layer reads as decode
    ("0,0,0,1,0,3,1,0,0\n0,0,0,3,0,4,1,0,0\n", "one expert per layer"),
])
def test_format_refuses_what_would_read_back_otherwise(rows: str, words: str) -> None:
    tr = load_route_trace_text(CSV_HEAD + rows, "odd.csv")
    with pytest.raises(TraceError, match=words) as ei:
        format_call_trace(tr)
    assert str(ei.value).startswith("odd.csv: ")


def test_format_splits_a_short_prefill_batch_so_it_reads_as_prefill() -> None:
    # one prompt token routing k=2 experts in each layer: chunks of k would be one row each
    tr = load_route_trace_text(CSV_HEAD + "0,0,0,1,0,3,1,0,0\n0,0,0,1,1,5,1,0,0\n"
                               "0,0,0,3,0,4,1,0,0\n0,1,0,1,0,3,1,0,0\n", "short.csv")
    text = format_call_trace(tr)
    assert "0 0 1 3:nan\n0 1 1 5:nan\n1 0 3 4:nan\n2 0 1 3:nan\n" in text
    same_sequence(tr, load_call_trace_text(text, "again"))


# -- the command line --------------------------------------------------------------------------


def run_json(capsys: pytest.CaptureFixture[str], argv: list[str], status: int = 0) -> dict[str, Any]:
    assert replay.main(argv) == status
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    return out


@pytest.fixture
def bare_file(tmp_path: Path) -> Path:
    p = tmp_path / "bare.calls"
    p.write_text("# emitted by some engine\n" + BARE)
    return p


def test_cli_replays_a_call_file_and_reports_assumed_sizes(
        bare_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [str(bare_file), "--simulate", "--cycles", "1", "--policy", "lru,belady", "--json"]
    out = run_json(capsys, argv)
    assert out["sizes_assumed"] is True and out["trace"] == str(bare_file)
    assert out["k"] == 3 and out["td_bytes"] == 3 * 2 * DEFAULT_EXPERT_BYTES
    assert [r["policy"] for r in out["results"]] == ["lru", "belady"]
    assert out["requests"] == 8 and out["decode_requests"] == 3
    sized = run_json(capsys, argv + ["--expert-bytes", "4096"])
    assert sized["sizes_assumed"] is False and sized["td_bytes"] == 3 * 2 * 4096
    assert [r["decode_hit"] for r in sized["results"]] == [r["decode_hit"] for r in out["results"]]
    csv = run_json(capsys, ["gemma", "--simulate", "--cycles", "1", "--policy", "lru", "--json"])
    assert csv["sizes_assumed"] is False


def test_cli_table_and_train_eval_say_sizes_were_assumed(
        bare_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert replay.main([str(bare_file), "--simulate", "--cycles", "1", "--policy", "lru"]) == 0
    assert "expert sizes assumed" in " ".join(capsys.readouterr().out.split())
    out = run_json(capsys, [str(bare_file), "--simulate", "--train", str(bare_file), "--cycles",
                            "1", "--policy", "lru", "--json"])
    assert out["sizes_assumed"] is True and {r["arm"] for r in out["results"]} == {"seeded", "cold"}


@pytest.mark.parametrize("argv,words", [
    (["gemma", "--expert-bytes", "4096"], "--expert-bytes applies to call traces only"),
    (["BARE", "--expert-bytes", "0"], "argument --expert-bytes: '0' is not a positive integer"),
    (["BARE", "--train", "gemma"], "have different shapes"),
    (["BARE", "--train", "gemma", "--expert-bytes", "64"], "--expert-bytes applies to call"),
])
def test_cli_expert_bytes_errors(bare_file: Path, capsys: pytest.CaptureFixture[str],
                                 argv: list[str], words: str) -> None:
    argv = [str(bare_file) if a == "BARE" else a for a in argv]
    out = run_json(capsys, [*argv, "--simulate", "--policy", "lru", "--cycles", "1", "--json"],
                   status=2)
    assert words in out["error"], out


def test_cli_expert_bytes_with_a_csv_file_fails_cleanly(tmp_path: Path) -> None:
    csv = tmp_path / "t.route.csv"
    csv.write_text(CSV)
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-m", "iosched.tools.cli", "replay", str(csv), "--simulate",
                             "--policy", "lru", "--cycles", "1", "--expert-bytes", "4096"],
                            cwd=root, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert f"{csv}: --expert-bytes applies to call traces only" in result.stderr
    assert "Traceback" not in result.stderr
