"""Real compute in the engine loop (``tools/compute.py``) and the hand-written arm
(``tools/handwritten.py``), on real checkpoints written to disk.

What is checked, and why:

* the compute model is the expert MLP it claims, ``down · (silu(gate · x) ⊙ up · x)``, on the
  expert's own stored tensors (fp32, fp16, bf16), computed directly in float64 here; a layer
  sums its experts on the rows routed to each; an uint8 layout runs the fallback and says so;
* the hand-written arm hands out, for every expert it serves, exactly the bytes and tensors
  the store's views hold, and never keeps more than its budget;
* ``--compute sleep:MS`` still runs, the hand-written arm is a row of the real-I/O replay, and
  bad values of ``--compute``/``--compute-on`` are one JSON error with exit status 2;
* the demo shows the default beside ``lru`` and the hand-written arm with a verdict.
"""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from iosched import ExpertStore, ExpertView, _settings, load_index
from iosched.tools import compute
from iosched.tools.cli import main
from iosched.tools.handwritten import HandwrittenLRU
from iosched.tools.synth import write_safetensors_moe
from tests.conftest import cached_pages, drop_page_cache, warm_page_cache
from tests.test_engine_replay import run_json


def _direct(tensors: Any, x: np.ndarray) -> np.ndarray:
    g, u, d = (np.asarray(tensors[r]).astype(np.float64) for r in ("gate_proj", "up_proj", "down_proj"))
    h = x.astype(np.float64) @ g.T
    return ((h / (1 + np.exp(-h))) * (x.astype(np.float64) @ u.T)) @ d.T  # type: ignore[no-any-return]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.asyncio
async def test_the_expert_mlp_on_its_own_tensors(tmp_path: Path, dtype: Any) -> None:
    write_safetensors_moe(tmp_path, n_layers=1, n_experts=4, hidden=64, intermediate=24, dtype=dtype)
    async with await ExpertStore.open(tmp_path, budget_bytes=1 << 20, backend="pread") as store:
        async with store.acquire_many([(0, 1), (0, 3)]) as views:
            x = (np.random.default_rng(1).standard_normal((3, 64)) / 8).astype(np.float32)
            for view in views:
                assert str(view.tensors["gate_proj"].dtype) == dtype  # as stored
                got = compute.expert_mlp(view.tensors, x)
                np.testing.assert_allclose(got, _direct(view.tensors, x), rtol=2e-4, atol=1e-5)
            # a layer: expert 1 on 3 rows, expert 3 on 1 row, summed onto the tokens' rows
            engine = compute.Compute(compute.NUMPY, "loop")
            checksum = engine.run_layer(views, [3, 1])
            x3 = engine._input(64, 3)
            want = _direct(views[0].tensors, x3)
            want[:1] += _direct(views[1].tensors, x3[:1])
            assert checksum == pytest.approx(want[0, 0], rel=1e-4, abs=1e-6)
            assert engine.seconds > 0 and not engine.fallbacks


@pytest.mark.asyncio
async def test_compute_on_a_thread_is_the_same_work(tmp_path: Path) -> None:
    write_safetensors_moe(tmp_path, n_layers=1, n_experts=2, hidden=32, intermediate=16)
    async with await ExpertStore.open(tmp_path, budget_bytes=1 << 20, backend="pread") as store:
        async with store.acquire_many([(0, 0), (0, 1)]) as views:
            on_thread, on_loop = compute.Compute(compute.NUMPY, "thread"), compute.Compute(compute.NUMPY, "loop")
            try:
                await on_thread.layer(views, [1, 1])
                await on_loop.layer(views, [1, 1])
            finally:
                on_thread.close()
            assert on_thread.seconds > 0 and on_loop.seconds > 0


def test_a_quantized_layout_runs_the_fallback_and_says_so() -> None:
    raw = np.frombuffer(bytes(range(256)) * 4, dtype=np.uint8).reshape(8, 128)
    view = ExpertView((0, 0), raw.reshape(-1), {"gate_proj": raw, "up_proj": raw, "down_proj": raw})
    engine = compute.Compute(compute.NUMPY, "loop")
    want = 3 * float(raw.astype(np.float64).sum())
    assert engine.run_layer([view], [1]) == pytest.approx(want)
    assert engine.fallbacks == {"uint8"}


def test_parse_compute() -> None:
    assert compute.parse_compute("numpy") == compute.NUMPY
    assert compute.parse_compute("sleep:2.5") == compute.ComputeSpec("sleep", 0.0025)
    for bad in ("bogus", "sleep", "sleep:", "sleep:-1", "sleep:nan", "sleep:x", "numpy:1"):
        with pytest.raises(Exception, match="numpy or sleep"):
            compute.parse_compute(bad)


@pytest.mark.asyncio
async def test_the_handwritten_arm_serves_the_stores_bytes_within_its_budget(tmp_path: Path) -> None:
    write_safetensors_moe(tmp_path, n_layers=3, n_experts=8, hidden=64, intermediate=24, n_shards=2)
    index = load_index(tmp_path)
    one = max(layout.nbytes for layout in index.experts.values())
    budget = 5 * one
    hand = HandwrittenLRU(index, budget, drop_behind=True)
    rng = random.Random(0)
    served = set()
    try:
        async with await ExpertStore.open(tmp_path, budget_bytes=1 << 22, backend="pread") as store:
            for _ in range(60):
                layer = rng.randrange(3)
                keys = rng.sample([(layer, e) for e in range(8)], 3)
                views = await hand.get_many(keys)
                assert hand.used <= budget
                assert sum(v.data.nbytes for v in hand.cache.values()) == hand.used
                async with store.acquire_many(keys) as ref:
                    for mine, theirs in zip(views, ref, strict=True):
                        assert mine.key == theirs.key
                        assert mine.data.tobytes() == theirs.data.tobytes()
                        for name, t in theirs.tensors.items():
                            np.testing.assert_array_equal(mine.tensors[name], t)
                served.update(keys)
    finally:
        hand.close()
    assert len(served) == 24 and hand.hits > 0 and hand.requests - hand.hits >= 24
    assert hand.bytes_read == (hand.requests - hand.hits) * one  # one expert's bytes per miss


@pytest.mark.asyncio
async def test_the_handwritten_arm_leaves_nothing_in_the_page_cache(tmp_path: Path) -> None:
    """With ``drop_behind`` the arm's memory is its budget: no page of the checkpoint stays
    cached, neither the index's header reads, nor a range's partial end pages, nor readahead
    past the range (on a disk that reads ahead 8 MiB, a qwen run at 162 MiB of budget would
    otherwise leave 510 MiB of the checkpoint cached)."""
    write_safetensors_moe(tmp_path, n_layers=3, n_experts=8, hidden=256, intermediate=96, n_shards=2)
    index = load_index(tmp_path)
    paths = [str(p) for p in index.files]
    for path in paths:
        warm_page_cache(path)  # as a store's index read or an earlier run leaves it
        drop_page_cache(path)  # skips where the filesystem keeps its pages (tmpfs)
        warm_page_cache(path)
    one = max(layout.nbytes for layout in index.experts.values())
    hand = HandwrittenLRU(index, 4 * one, drop_behind=True)
    rng = random.Random(1)
    try:
        for _ in range(40):
            layer = rng.randrange(3)
            await hand.get_many(rng.sample([(layer, e) for e in range(8)], 3))
    finally:
        hand.close()
    assert hand.requests - hand.hits > 8
    assert [cached_pages(path) for path in paths] == [0] * len(paths)


def test_replay_sleep_compute_and_the_handwritten_row(cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with _settings.override(cache_dir=str(cache_dir)):
        out = run_json(capsys, ["gemma", "--cycles", "1", "--policy", "lru,handwritten", "--tokens", "3",
                                "--compute", "sleep:2", "--json"])
    assert out["compute"] == "sleep:2" and out["compute_ms"] == 2 and out["compute_on"] is None
    lru, hand = out["results"]
    assert (lru["policy"], hand["policy"]) == ("lru", "handwritten")
    for row in (lru, hand):
        assert row["tokens"] == 3 and row["bytes_read"] > 0 and row["tokens_per_s"] > 0
        assert row["budget_bytes"] == int(out["td_bytes"])
        assert row["compute_ms_per_token"] >= 0.9 * 2 * 30  # 30 layers a token, 2 ms each
    # the same trace, budget and LRU order: the same hits and the same bytes
    assert hand["decode_hits"] == lru["decode_hits"] and hand["bytes_read"] == lru["bytes_read"]


def test_replay_numpy_compute_on_the_loop(cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with _settings.override(cache_dir=str(cache_dir)):
        out = run_json(capsys, ["gemma", "--cycles", "1", "--policy", "lru", "--tokens", "2",
                                "--compute-on", "loop", "--json"])
    assert out["compute"] == "numpy" and out["compute_on"] == "loop"
    [row] = out["results"]
    assert row["compute_ms_per_token"] > 0 and row["compute_fallbacks"] == []


def test_handwritten_needs_real_io(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(capsys, ["gemma", "--simulate", "--policy", "handwritten", "--json"], status=2)
    assert "handwritten" in out["error"] and "--simulate" in out["error"]


@pytest.mark.parametrize("argv", [
    ["demo", "--compute", "bogus", "--json"],
    ["demo", "--compute", "sleep:-1", "--json"],
    ["demo", "--compute-on", "gpu", "--json"],
    ["replay", "gemma", "--compute", "bogus", "--json"],
    ["replay", "gemma", "--compute-on", "gpu", "--json"],
])
def test_bad_compute_options_are_one_json_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    out = json.loads(capsys.readouterr().out)
    assert out["type"] == "UsageError" and "--compute" in out["error"]


def test_demo_side_by_side(cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with _settings.override(cache_dir=str(cache_dir)):
        assert main(["demo", "--json", "--tokens", "3", "--trace", "gemma", "--rounds", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [a["arm"] for a in out["arms"]] == ["default", "lru", "handwritten"]
    for arm in out["arms"]:
        assert len(arm["tokens_per_s_rounds"]) == 2 and arm["tokens_per_s"] > 0
        assert arm["compute"] == "numpy" and arm["compute_on"] == "thread"
    fastest = max(out["arms"], key=lambda a: a["tokens_per_s"])["arm"]
    assert fastest in out["verdict"]
    if fastest != "default":
        assert "default does not win" in out["verdict"]
    with _settings.override(cache_dir=str(cache_dir)):
        assert main(["demo", "--json", "--tokens", "2", "--trace", "gemma", "--compare", "none",
                     "--compute", "sleep:0"]) == 0
    alone = json.loads(capsys.readouterr().out)
    assert [a["arm"] for a in alone["arms"]] == ["default"] and alone["compute"] == "sleep:0"


def test_drive_engine_still_takes_seconds(cache_dir: Path) -> None:
    """Callers that pass a number of seconds (the emulation) keep working."""
    from iosched.tools import demo
    from iosched.tools.trace import load_bundled_trace

    trace = load_bundled_trace("gemma")
    folder = demo.demo_checkpoint(trace, cache_dir)

    async def go() -> demo.EngineRun:
        async with await ExpertStore.open(folder, budget_bytes=1 << 24, backend="pread") as store:
            return await demo.drive_engine(store, trace, 0.0, max_tokens=2)

    run = asyncio.run(go())
    assert run.tokens == 2 and run.decode_compute_s >= 0


class _RecordingCompute(compute.Compute):
    """The real compute, recording each batch's experts and its share of the layer."""

    def __init__(self) -> None:
        super().__init__(compute.ComputeSpec("sleep", sleep_s=0.0), awaits="as-ready")
        self.batches: list[tuple[list[tuple[int, int]], float]] = []

    async def layer(self, views: Any, rows: Any, fresh: int = 0, share: float = 1.0) -> None:
        self.batches.append(([v.key for v in views], share))
        await super().layer(views, rows, fresh, share)


@pytest.mark.asyncio
async def test_a_layer_computed_in_batches_pays_its_fixed_cost_once(st_checkpoint: Path) -> None:
    """With ``acquire_as_ready`` a layer is computed in several batches; each is told its share
    of the layer (its experts over the layer's), so the emulated sleep and a model's fixed cost
    per layer add up to one layer's, not one per batch."""
    from iosched.tools import demo

    engine = _RecordingCompute()
    async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, backend="pread", policy="lru") as store:
        async with store.acquire((0, 0)):
            pass
        keys = [(0, 0), (0, 1), (0, 2), (0, 3)]
        requests, found = await demo.lease_and_compute(store, keys, [1] * 4, engine)
    assert (requests, found) == (4, 1)
    assert len(engine.batches) >= 2 and engine.batches[0] == ([(0, 0)], 0.25)
    assert sorted(k for ks, _ in engine.batches for k in ks) == keys
    assert sum(share for _, share in engine.batches) == pytest.approx(1.0)
    for ks, share in engine.batches:
        assert share == pytest.approx(len(ks) / len(keys))
    model = compute.ComputeModel(fixed_s=0.004, per_byte_s=1e-9)
    whole = model.seconds([1000] * 4, [1] * 4)
    parts = model.seconds([1000], [1], share=0.25) + model.seconds([1000] * 3, [1] * 3, share=0.75)
    assert parts == pytest.approx(whole)
