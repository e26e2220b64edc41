"""tools/synth_trace.py: synthetic traces parse as route_trace v1, are deterministic, and the
policies replay them with their invariants intact."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from iosched.tools.replay import Requests, budget_for, simulate
from iosched.tools.synth_trace import SynthShape, main, synth_trace_text
from iosched.tools.trace import load_route_trace, load_route_trace_text

SMALL = SynthShape(layers=6, experts=16, k=3, prompt=8, decode=24)


@pytest.mark.parametrize("topics", [0, 3])
def test_synthetic_trace_parses_with_its_shape_and_prompt_rows(topics: int) -> None:
    shape = SynthShape(**{**SMALL.__dict__, "topics": topics})
    text = synth_trace_text(shape, seed=5)
    assert text == synth_trace_text(shape, seed=5)  # deterministic
    assert text != synth_trace_text(shape, seed=6)
    trace = load_route_trace_text(text, "synthetic")
    assert (trace.n_layer, trace.n_expert, trace.k) == (6, 16, 3)
    assert trace.n_decode_tokens() == 24 and trace.n_rows == (8 + 24) * 6 * 3
    assert len(trace.routing) == 6 and all(r.shape == (8, 3) for r in trace.routing.values())
    assert all(len(set(r)) == 3 for rows in trace.routing.values() for r in rows.tolist())


def test_policies_replay_a_synthetic_trace_between_lru_and_belady(tmp_path: Path) -> None:
    path = tmp_path / "syn.csv"
    assert main([str(path), "--seed", "2", "--layers", "8", "--experts", "32", "--k", "4",
                 "--prompt", "16", "--decode", "48"]) == 0
    trace = load_route_trace(path)
    reqs = Requests.of(trace)
    budget = budget_for(trace, 2)
    hits = {p: simulate(reqs, p, 2, budget, check_every=97)["decode_hit"] for p in ("lru", "default", "belady")}
    assert hits["lru"] <= hits["belady"] and np.isfinite(hits["default"])


def test_impossible_shape_is_refused() -> None:
    with pytest.raises(ValueError):
        synth_trace_text(SynthShape(k=70, experts=64), seed=1)
