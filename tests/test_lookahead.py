"""``ExpertStore.expect``: the engine's own next-layer lookahead (issue #15, point 4).

What is checked, and why:

* bad input (an unknown layer, a wrong length, a value outside [0, 1] or NaN, not numbers)
  is a ``StoreError`` naming it, and nothing is loaded or counted: the store stays usable;
* the experts of at least ``lookahead_min_probability`` are loaded ahead, likeliest first,
  and no others; a later ``acquire`` of one is a hit and counts as a used prefetch;
* the loads go through the prefetch path's budgets: without an idle allowance (the pacer,
  before any read measured the drive) nothing starts, and the eviction guard still decides;
* a policy that declares ``Capability.LOOKAHEAD`` gets the estimate; one without an eviction
  guard (``lru``) gets it into free bytes only, never displacing a resident expert;
* the synthetic predictor the replays use has the recall it states.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from iosched import ExpertStore, StoreError, settings
from iosched.tools.demo import SyntheticLookahead

from .conftest import EXPERTS

BIG = 1 << 24


@pytest.mark.asyncio
async def test_bad_expectations_are_refused_and_record_nothing(st_checkpoint: Path) -> None:
    async with await ExpertStore.open(st_checkpoint, budget_bytes=BIG, policy="lru") as store:
        good = np.zeros(EXPERTS)
        for layer, probs, needle in [
            (99, good, "no layer 99"),
            ("1", good, "layer must be an int"),
            (1, np.zeros(EXPERTS + 1), f"shape ({EXPERTS},)"),
            (1, np.full(EXPERTS, 1.5), "not in [0, 1]"),
            (1, np.full(EXPERTS, np.nan), "expert 0"),
            (1, ["a"] * EXPERTS, "numbers"),
        ]:
            with pytest.raises(StoreError, match=needle.replace("(", r"\(").replace(")", r"\)")
                               .replace("[", r"\[").replace("]", r"\]")):
                store.expect(layer, probs)  # type: ignore[arg-type]
        s = store.stats()
        assert s["lookahead_expected"] == 0 and s["prefetch_issued"] == 0
        async with store.acquire((1, 0)) as view:  # still usable
            assert view.key == (1, 0)


@pytest.mark.asyncio
async def test_likely_experts_are_loaded_ahead_and_used(st_checkpoint: Path) -> None:
    probs = np.full(EXPERTS, 0.1)
    probs[[5, 2]] = [0.9, 0.6]
    with settings.override(prefetch_pacing="none", lookahead_min_probability=0.5):
        for policy in ("lru", "default"):
            async with await ExpertStore.open(st_checkpoint, budget_bytes=BIG, policy=policy) as store:
                assert store.expect(2, probs) == 2
                s = store.stats()
                assert s["lookahead_expected"] == 2 and s["lookahead_started"] == 2
                assert s["prefetch_issued"] == 2
                async with store.acquire_many([(2, 5), (2, 2)]):
                    pass
                s = store.stats()
                assert s["prefetch_used"] == 2, policy
                assert s["misses"] == 0  # resident or joined: no demand read
                assert store.expect(2, probs) == 0  # resident now: nothing to start


@pytest.mark.asyncio
async def test_the_pacer_and_the_threshold_bound_what_starts(st_checkpoint: Path) -> None:
    probs = np.full(EXPERTS, 0.4)
    with settings.override(lookahead_min_probability=0.5):  # nothing reaches it
        async with await ExpertStore.open(st_checkpoint, budget_bytes=BIG, policy="lru") as store:
            assert store.expect(0, probs) == 0
            assert store.stats()["lookahead_expected"] == 0
    probs[3] = 1.0
    async with await ExpertStore.open(st_checkpoint, budget_bytes=BIG, policy="lru") as store:
        # the idle-time pacer knows no bandwidth before any read: it allows nothing yet
        assert store.expect(0, probs) == 0
        assert store.stats()["lookahead_expected"] == 1


def test_the_synthetic_predictor_has_its_stated_recall() -> None:
    rng = np.random.default_rng(3)
    for recall in (0.0, 0.7, 1.0):
        ahead = SyntheticLookahead(recall, 128, seed=1)
        hits = total = 0
        for _ in range(400):
            truth = rng.choice(128, size=8, replace=False)
            probs = ahead.probabilities(truth)
            assert probs.shape == (128,) and np.all((probs >= 0) & (probs <= 1))
            assert probs.sum() == pytest.approx(8.0)  # calibrated: the mass is k
            top = np.flatnonzero(probs == probs.max()) if recall > 0 else np.array([], dtype=np.int64)
            hits += len(set(top.tolist()) & set(truth.tolist()))
            total += 8
        if recall > 0:
            assert hits / total == pytest.approx(recall, abs=0.03)
    with pytest.raises(StoreError, match="recall"):
        SyntheticLookahead(1.5, 128)


@pytest.mark.asyncio
async def test_a_policy_without_a_guard_takes_the_estimate_into_free_bytes_only(st_checkpoint: Path) -> None:
    probs = np.zeros(EXPERTS)
    probs[7] = 1.0
    with settings.override(prefetch_pacing="none"):
        async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, policy="lru") as store:
            one = store.index.experts[(0, 0)].nbytes
        async with await ExpertStore.open(st_checkpoint, budget_bytes=2 * one, policy="lru") as store:
            async with store.acquire_many([(0, 0), (0, 1)]):
                pass  # the budget is full now
            assert store.expect(3, probs) == 0  # lru cannot say what (3, 7) may displace
            async with store.acquire((0, 0)):
                pass
            assert store.stats()["hits"] == 1
