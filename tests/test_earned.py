"""The default policy (residency/alternatives/earned.py): ``moe`` while its measured gain in felt wait
exceeds the time its hooks take, then ``coact`` for good (tests/test_coact.py has the
switch with prefetches on)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest

from iosched import ExpertStore
from iosched.residency import POLICIES, Capability, ResidencyTable, bind, make_policy
from iosched.residency.alternatives.earned import MIN_WINDOWS, EarnedPolicy
from iosched.residency.alternatives.moe import MoEPolicy
from iosched.residency.lru import LRUPolicy
from tests.test_moe import SHAPE, TD, UNIT, drive


class StepClock:
    """A clock that moves ``step`` seconds at every reading: each timed hook then costs
    ``step`` (it reads the clock twice), whatever the machine."""

    def __init__(self, step: float) -> None:
        self.t = 0.0
        self.step = step

    def __call__(self) -> float:
        self.t += self.step
        return self.t


def routed_tokens(n: int, seed: int = 7) -> list[list[list[int]]]:
    """Tokens of a skewed routing (k = 2 of 8 per layer, experts 0-2 favoured)."""
    rng = random.Random(seed)
    weights = [8, 6, 4, 1, 1, 1, 1, 1]
    out = []
    for _ in range(n):
        token = []
        for _layer in SHAPE.layers:
            picks: list[int] = []
            while len(picks) < SHAPE.experts_per_token:
                e = rng.choices(range(SHAPE.n_expert), weights)[0]
                if e not in picks:
                    picks.append(e)
            token.append(picks)
        out.append(token)
    return out


def test_earned_declares_what_moe_does_and_cost() -> None:
    assert POLICIES["earned"] is EarnedPolicy
    assert POLICIES["moe"] is MoEPolicy
    policy = make_policy("earned")
    assert EarnedPolicy.capabilities == MoEPolicy.capabilities | Capability.COST
    hooks = bind(policy)
    assert isinstance(policy, EarnedPolicy) and hooks.costed is not None and hooks.end_batch is not None


def test_without_a_clock_it_decides_exactly_as_moe() -> None:
    """The hit-rate replay gives no clock: every hit and every prefetch as moe's own."""
    tokens = routed_tokens(60)
    for budget in (TD // 2, TD, 2 * TD):
        moe_table = ResidencyTable(budget, MoEPolicy(SHAPE))
        earned = EarnedPolicy(SHAPE)
        earned_table = ResidencyTable(budget, earned)
        assert drive(moe_table, tokens) == drive(earned_table, tokens)
        assert {e.key for e in moe_table.entries()} == {e.key for e in earned_table.entries()}
        assert not earned.switched and earned.cost_verdict is None


def test_a_moe_that_costs_more_than_it_saves_switches_to_coact_and_says_why() -> None:
    """With prefetching off (width 0) coact is lru: after the switch the policy decides
    exactly as an lru twin holding the same experts in the same order."""
    policy = EarnedPolicy(SHAPE, prefetch_width=0)
    policy.set_clock(StepClock(0.01))  # 10 ms a hook: far more than any saving below
    table = ResidencyTable(TD, policy)
    tokens = routed_tokens(40)
    drive(table, tokens[:20], prefetch=False, wait_s=1e-4)
    assert policy.switched
    verdict = policy.cost_verdict
    assert verdict is not None and verdict.startswith("coact after") and "took" in verdict
    assert policy.windows >= MIN_WINDOWS
    # From now on: LRU's order over what is resident (moe's last uses), LRU's decisions.  The twin: an lru
    # table holding the same experts, reserved oldest first (its order is theirs)
    lru = LRUPolicy()
    lru_table = ResidencyTable(TD, lru)
    order = list(policy.victims())
    assert set(order) == {e.key for e in table.entries()} and len(order) == len(table)
    for key in order:
        twin = lru_table.reserve(key, UNIT)
        assert twin is not None
        lru_table.publish(twin)
    assert list(lru.victims()) == order
    assert (drive(table, tokens[20:], prefetch=False, wait_s=1e-4)
            == drive(lru_table, tokens[20:], prefetch=False, wait_s=1e-4))
    assert list(policy.victims()) == list(lru.victims())
    assert policy.end_batch() == [] and policy.pinned_experts == 0


def test_a_moe_that_saves_more_than_it_costs_stays() -> None:
    """Free hooks (a clock that never moves) and misses that cost: moe never loses, so it stays."""
    policy = EarnedPolicy(SHAPE, prefetch_width=0)
    policy.set_clock(lambda: 0.0)
    table = ResidencyTable(TD // 2, policy)
    drive(table, routed_tokens(40), prefetch=False, wait_s=0.01)
    assert policy.windows >= MIN_WINDOWS
    # equal misses (gain 0) is not a loss when the cost is 0 either: it stays unless it lost
    assert not policy.switched or "saved -" in str(policy.cost_verdict)


def test_after_the_switch_a_prefetch_takes_free_bytes_only() -> None:
    policy = EarnedPolicy(SHAPE, prefetch_width=0)
    policy.set_clock(StepClock(0.01))
    table = ResidencyTable(TD, policy)
    drive(table, routed_tokens(20), prefetch=False, wait_s=1e-4)
    assert policy.switched
    assert policy.admit_prefetch((0, 7), UNIT, [])
    assert not policy.admit_prefetch((0, 7), UNIT, [next(iter(policy.victims()))])


def test_the_store_hands_its_clock_and_reports_the_verdict(st_checkpoint: Path) -> None:
    async def main() -> dict[str, Any]:
        async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, policy="earned",
                                          experts_per_token=2) as store:
            policy = store._table.policy
            assert isinstance(policy, EarnedPolicy) and policy._now is not None
            async with store.acquire_many([(0, 1), (0, 2)]):
                pass
            return store.stats()

    stats = asyncio.run(main())
    assert stats["policy"] == "earned" and stats["policy_verdict"] is None


@pytest.mark.parametrize("windows, shadow_misses, felt_ms, cost_ms, switches", [
    (0, 100, 150.0, 0.0, False),     # the 1st token is not judged, even a loss
    (1, 100, 150.0, 0.0, True),      # the 2nd: no saving at all (100 priced at 1 ms, 150 felt)
    (1, 100, 90.0, 50.0, True),      # a saving (10 ms) that does not pay for its hooks (50)
    (1, 100, 40.0, 50.0, False),     # 60 ms saved for 50 taken: it stays
    (5, 100, 40.0, 70.0, True),      # and is judged again every token, on the sums since the start
])
def test_the_judgement_asks_from_the_2nd_token_whether_the_saving_pays_for_the_hooks(
        windows: int, shadow_misses: int, felt_ms: float, cost_ms: float, switches: bool) -> None:
    policy = EarnedPolicy(SHAPE)
    policy.set_clock(lambda: 0.0)
    policy.windows = windows  # the judgement about to run is the (windows + 1)-th
    policy._shadow_misses, policy._misses = shadow_misses, 90
    policy._priced_misses, policy._priced_felt_s = 90, 0.090  # 1 ms a miss
    policy._felt_s, policy._spent_s = felt_ms / 1e3, cost_ms / 1e3
    policy._judge()
    assert policy.switched == switches
    assert (policy.cost_verdict is not None) == switches


def test_a_moe_whose_every_wait_is_a_join_is_still_judged() -> None:
    """No request missed (each joined a prefetch still in flight), yet the engine waited: the
    shadow's misses are priced at those waits, and a moe that saved nothing leaves."""
    policy = EarnedPolicy(SHAPE)
    policy.set_clock(lambda: 0.0)
    policy.windows = 1
    policy._shadow_misses, policy._misses, policy._waits = 100, 0, 100
    policy._felt_s, policy._spent_s = 0.5, 0.001
    policy._judge()
    assert policy.switched and "saved" in str(policy.cost_verdict)
