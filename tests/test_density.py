"""``density`` (residency/density.py), the default: ``coact``'s prefetch, eviction by learned
hit density, and the LRU shadow that can overrule the ranking."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from iosched import ExpertStore
from iosched._errors import InvariantError
from iosched.residency import POLICIES, Capability, ResidencyTable, bind, make_policy
from iosched.residency._hazard import AGE_MAX, count_bin
from iosched.residency._policy import ModelShape
from iosched.residency.coact import _LRU_HOOKS, CoactPolicy
from iosched.residency.density import (
    COST_VERDICT_FROM,
    GUARD_SIGMAS,
    MATERIAL_SHARE,
    MIN_TOKENS,
    MISS_FIXED_BYTES,
    REFRESH_SETTLED,
    RERANK_MAX,
    DensityPolicy,
)
from iosched.residency.lru import LRUPolicy
from tests._wrappers import GatedBackend
from tests.conftest import EXPERTS, LAYERS
from tests.test_earned import routed_tokens
from tests.test_moe import SHAPE, TD, UNIT, drive, run_store_with_prefetch


def density(budget: int, width: int | None = 0) -> tuple[DensityPolicy, ResidencyTable]:
    policy = DensityPolicy(width)
    policy.set_shape(SHAPE)
    return policy, ResidencyTable(budget, policy)


def test_density_is_the_default_with_coacts_abilities() -> None:
    assert POLICIES["default"] is DensityPolicy and POLICIES["density"] is DensityPolicy
    assert DensityPolicy.capabilities == CoactPolicy.capabilities | Capability.FELT_WAIT
    policy = make_policy("default", prefetch_width=2)
    assert isinstance(policy, DensityPolicy)
    hooks = bind(policy)
    assert hooks.end_batch is not None and hooks.prepare is not None and hooks.admit_prefetch is not None
    assert hooks.set_felt_wait is not None and bind(CoactPolicy()).set_felt_wait is None


def test_below_one_cycle_it_keeps_what_lru_evicts() -> None:
    """The same two experts per layer every token, half a token cycle of budget: LRU evicts
    the layer that comes next and never hits; ranking by density (the layer just served is
    the farthest from its next chance) keeps some, and the shadow lets it."""
    tokens = [[[0, 1]] * 4 for _ in range(30)]
    lru_hits = drive(ResidencyTable(TD // 2, LRUPolicy()), tokens)
    policy, table = density(TD // 2)
    hits = drive(table, tokens)
    assert sum(lru_hits) == 0
    assert sum(hits[8 * 5:]) >= 0.25 * len(hits[8 * 5:])  # at most 0.5: 4 of the 8 fit
    assert policy.eviction == "density"


def test_on_skewed_routing_it_hits_more_than_lru_at_one_token_cycle() -> None:
    """Experts 0-2 are routed far more often than the rest: counts and ages together keep
    the popular ones through a token that routed others; LRU keeps only the last token's."""
    tokens = routed_tokens(200)
    lru_hits = drive(ResidencyTable(TD, LRUPolicy()), tokens)
    policy, table = density(TD)
    hits = drive(table, tokens)
    assert sum(hits) > sum(lru_hits) * 1.05
    assert policy.eviction == "density"


def test_it_evicts_the_layer_just_served_before_the_next_one() -> None:
    """Equally used experts everywhere, a miss in layer 3: the first victims are not layer 0's
    (the next visit) but those whose next chance is farthest away."""
    policy, table = density(TD)
    drive(table, [[[0, 1], [0, 1], [0, 1], [0, 1]] for _ in range(6)])
    policy.on_request((3, 5), UNIT, False)  # layer 3's batch is in progress
    order = [key for key in policy.victims() if isinstance(key, tuple)]
    assert set(order) == {(layer, e) for layer in range(4) for e in (0, 1)} and len(order) == 8
    assert all(key[0] != 0 for key in order[:4])


def test_the_shadow_turns_the_eviction_to_lru_when_the_ranking_misses_more() -> None:
    """After :data:`MIN_TOKENS` tokens, misses above the LRU shadow's by more than
    GUARD_SIGMAS of its noise: from then on the eviction is LRU's order, for good, and the
    verdict says why."""
    policy, table = density(TD)
    tokens = routed_tokens(MIN_TOKENS + 2)
    drive(table, tokens[:MIN_TOKENS - 1])
    assert policy.eviction == "density"
    shadow = policy._shadow_misses  # white box: a ranking that missed this many more
    policy._all_misses = shadow + int(GUARD_SIGMAS * np.sqrt(shadow)) + 20
    drive(table, tokens[MIN_TOKENS - 1:])
    assert policy.eviction.startswith("lru (lru after")
    verdict = policy.cost_verdict
    assert verdict is not None and "LRU shadow" in verdict
    assert list(policy.victims()) == list(policy._order)


class SteppingClock:
    """A store clock that moves ``step`` seconds at every read: every timed piece of the
    policy's work then costs at least ``step``."""

    def __init__(self, step: float) -> None:
        self.step, self.t = step, 0.0

    def __call__(self) -> float:
        self.t += self.step
        return self.t


def costed_density(budget: int, step: float, felt_per_miss: float, width: int | None = 0) -> DensityPolicy:
    """``density`` (prefetch width ``width``) told a clock that moves ``step`` a read and a
    felt wait of ``felt_per_miss`` seconds for each of its misses so far."""
    policy, _ = density(budget, width)
    policy.set_clock(SteppingClock(step))
    policy.set_felt_wait(lambda: felt_per_miss * (policy._all_misses + policy._used))
    return policy


@pytest.mark.parametrize(("cycles", "to"), [(1, "lru"), (2, "s3fifo")])
def test_a_ranking_that_costs_more_than_its_lead_could_save_retires(cycles: int, to: str) -> None:
    """Skewed routing at one and two token cycles: with each of the ranking's pieces of work
    costing 10 ms and each miss felt for 1 us, what its lead over the LRU shadow could have
    saved (plus 2 sigma, at its mean felt wait a miss) is far below what it costs.  Not before
    :data:`COST_VERDICT_FROM` decode tokens (as the shadow's verdict, at one cycle as at
    two); from then on, for good, LRU's order at one cycle,
    S3-FIFO's above (``residency/_s3fifo.py``: it keeps most of the ranking's hits there at
    LRU's cost), and the verdict gives both sides."""
    at = COST_VERDICT_FROM
    tokens = routed_tokens(at + 4)
    policy = costed_density(cycles * TD, step=0.01, felt_per_miss=1e-6)
    table = ResidencyTable(cycles * TD, policy)
    drive(table, tokens[:at - 1])
    assert policy.eviction == "density" and policy._cost_s > 0
    drive(table, tokens[at - 1:])
    assert policy.eviction.startswith(f"{to} ({to} after {at} decode tokens: the ranking cost")
    verdict = policy.cost_verdict
    assert verdict is not None and "its lead could have saved" in verdict and "LRU shadow" in verdict
    assert "plus 2 sigma" in verdict and "% of the decode's time" in verdict
    # (without a prefetch, prefetch_width 0, nothing of coact's is left either: LRU's or
    # S3-FIFO's work alone, and no batch-end work)
    assert policy._retired and policy.end_batch() is None
    if to == "lru":
        assert policy._s3 is None and list(policy.victims()) == list(policy._order)
    else:
        assert policy._s3 is not None
        assert set(policy.victims()) == set(policy._order)
    table.check()


def trial_density(cycles: int) -> tuple[DensityPolicy, ResidencyTable]:
    """``density`` (prefetch width 2) whose ranking the cost verdict retires at token
    :data:`COST_VERDICT_FROM` while ``coact``'s prefetch trial runs (each piece of its work
    10 ms on the clock, each miss felt for 1 us)."""
    policy = costed_density(cycles * TD, step=0.01, felt_per_miss=1e-6, width=2)
    table = ResidencyTable(cycles * TD, policy)
    drive(table, routed_tokens(COST_VERDICT_FROM + 1))
    return policy, table


def test_retired_to_lrus_order_at_one_token_cycle_the_trial_stops() -> None:
    """At one token cycle the cost verdict retires the ranking to LRU's order while the trial
    runs: the trial stops there, the prefetch off (a guess could displace only the next
    layer's fresh experts), the verdict says why, and what is left is LRU's own hooks."""
    policy, table = trial_density(1)
    assert policy.eviction.startswith("lru")
    assert policy._trial is None and not policy.prefetching and policy._retired
    verdict = policy.cost_verdict
    assert verdict is not None and "the eviction became LRU's at one token cycle of budget or less" in verdict
    assert "LRU alone from here on" in verdict and "; eviction: lru after" in verdict
    assert policy._handed and policy.end_batch() is None
    assert list(policy.victims()) == list(policy._order)
    table.check()
    drive(table, routed_tokens(2))  # LRU's hooks go on serving the table
    table.check()


def test_retired_to_s3fifo_the_trial_goes_on() -> None:
    """Above one token cycle the cost verdict retires to S3-FIFO's queues: the trial goes on,
    its count of admissions as it was."""
    policy, _ = trial_density(2)
    assert policy.eviction.startswith("s3fifo")
    assert policy._trial is not None, "the trial still runs"
    assert policy._trial_restart is None


def test_turned_to_lrus_order_above_one_token_cycle_the_trial_counts_admissions_again() -> None:
    """Above one token cycle a turn to LRU's order (the shadow's overrule) leaves the trial
    running with its count of admissions started again: the guard's victims are LRU's from
    here, and stale ones can be among them."""
    policy, _ = trial_density(2)
    policy._to_lru("lru after the test's overrule")
    assert policy._trial is not None and not policy._retired
    assert policy._trial_restart is not None and policy._trial_restart[1] == "the eviction became LRU's"
    assert policy._trial_admitted == 0


@pytest.mark.parametrize("cycles", [1, 2])
def test_the_verdict_prices_the_lead_not_all_of_lrus_wait(cycles: int) -> None:
    """The verdict prices what the ranking's lead over the LRU shadow saved: each piece of its
    work costing 1 ms and each miss felt for 5 ms, its lead plus 2 sigma (here it trails the
    shadow by a few misses, within the noise) is worth less than it cost by token 16, though
    all of LRU's felt wait (the bound: the most any eviction could save) is worth
    more."""
    tokens = routed_tokens(REFRESH_SETTLED + 4)
    policy = costed_density(cycles * TD, step=1e-3, felt_per_miss=5e-3)
    drive(ResidencyTable(cycles * TD, policy), tokens)
    to = "lru" if cycles == 1 else "s3fifo"
    assert policy.eviction.startswith(f"{to} ({to} after ")
    assert "its lead could have saved" in policy.eviction and "plus 2 sigma" in policy.eviction
    decided = int(policy.eviction.split(" after ")[1].split()[0])
    assert COST_VERDICT_FROM <= decided <= REFRESH_SETTLED


@pytest.mark.parametrize("share", [0.004, 0.04])
def test_a_ranking_that_costs_less_than_a_percent_of_the_decode_stays(share: float) -> None:
    """The same losing lead, but the ranking's cost a small share of the decode's time (a clock
    that moves mostly outside the policy's work, as an engine's compute does): below
    :data:`MATERIAL_SHARE` it stays (a switch of eviction order mid-run costs misses of its own),
    above it retires."""
    tokens = routed_tokens(REFRESH_SETTLED + 4)
    policy, _ = density(TD)
    clock = SteppingClock(1e-3)
    policy.set_clock(clock)
    policy.set_felt_wait(lambda: 1e-9 * (policy._all_misses + policy._used))
    table = ResidencyTable(TD, policy)
    for token in tokens:
        cost = policy._cost_s
        drive(table, [token])
        clock.t += (policy._cost_s - cost) / share  # the engine's time in this token, beside the policy's work
    assert (policy.eviction == "density") == (share < MATERIAL_SHARE)


def test_after_the_ranking_s3fifo_evicts_and_keeps_its_invariants() -> None:
    """Retired to S3-FIFO at two token cycles, the policy goes on through more tokens with the
    table's invariants and its own re-checked after each: the queues hold exactly the resident
    keys, and nothing of the ranking runs between batches any more."""
    tokens = routed_tokens(REFRESH_SETTLED + 40)
    policy = costed_density(2 * TD, step=0.01, felt_per_miss=1e-6)
    table = ResidencyTable(2 * TD, policy)
    drive(table, tokens[:REFRESH_SETTLED + 1])
    s3 = policy._s3
    assert s3 is not None
    for token in tokens[REFRESH_SETTLED + 1:]:
        drive(table, [token])
        table.check()
    assert s3.main and len(s3.small) + len(s3.main) == len(table)
    assert s3.small_bytes == SHAPE.token_cycle_bytes


def test_s3fifo_turns_to_lru_when_the_budget_falls_below_two_token_cycles() -> None:
    """S3-FIFO loses to LRU at one token cycle (the probationary queue is the whole budget):
    a budget that shrinks there turns the eviction to LRU's; one that grows to hold the model
    too (nothing is evicted)."""
    for budget, saying in [(TD, "lru (lru: the budget fell to 1.00 token cycles"),
                           (SHAPE.n_expert * sum(SHAPE.expert_bytes.values()), "lru (the budget holds every expert")]:
        policy = costed_density(2 * TD, step=0.01, felt_per_miss=1e-6)
        table = ResidencyTable(2 * TD, policy)
        drive(table, routed_tokens(REFRESH_SETTLED + 1))
        assert policy._s3 is not None
        policy.set_budget(budget)
        assert policy._s3 is None and policy.eviction.startswith(saying)
        assert list(policy.victims()) == list(policy._order)


@pytest.mark.parametrize(("step", "felt_per_miss"), [(0.0, 1e-6), (1e-6, 1.0)])
def test_a_ranking_that_costs_nothing_or_saves_more_than_it_costs_stays(step: float, felt_per_miss: float) -> None:
    """The same run with free CPU (the critical-path replay's ``--cpu free``: the clock
    stands still while the policy works), or with misses priced far above the ranking's
    microseconds: the ranking stays, and the hits are those of a policy with no clock."""
    tokens = routed_tokens(3 * REFRESH_SETTLED)
    clockless, table = density(TD)
    expected = drive(table, tokens)
    policy = costed_density(TD, step, felt_per_miss)
    assert drive(ResidencyTable(TD, policy), tokens) == expected
    assert policy.eviction == "density" and policy.cost_verdict is None


@pytest.mark.parametrize("engine_waits", [False, True])
def test_the_store_hands_the_default_its_felt_wait_less_its_own_work(st_checkpoint: Path,
                                                                      engine_waits: bool) -> None:
    """``set_felt_wait``: the store's callable reads the felt wait ``stats()`` reports, less
    the batch-end work that ran while the engine waited (there that time is the policy's own
    cost, not the reads').  Here the engine waits as a compute thread does that takes a
    group's batches (``in_thread``): blocked for a read held back while the work runs."""

    async def main() -> None:
        backend = GatedBackend()
        backend.gate.set()
        async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, policy="default",
                                          experts_per_token=2, backend=backend) as store:
            policy = store._table.policy
            assert isinstance(policy, DensityPolicy) and policy._felt is not None
            prefetcher = store._prefetcher
            for layer in (0, 1, 0):
                if not engine_waits:
                    async with store.acquire_many([(layer, 0), (layer, 1)]):
                        await asyncio.sleep(0)  # the batch-end work runs at the engine's next await
                    continue
                backend.gate.clear()
                async with store.acquire_as_ready([(layer, 0), (layer, 1)]) as arrivals:
                    batches = arrivals.in_thread()
                    taker = threading.Thread(target=list, args=(batches,))
                    taker.start()
                    while not batches.blocked and taker.is_alive():  # no await: the work waits for it
                        time.sleep(0.001)
                    await asyncio.sleep(0.005)  # the batch-end work, the thread blocked meanwhile
                    backend.gate.set()
                    await asyncio.to_thread(taker.join)
            felt = store.stats()["felt_wait_s"]
            assert felt > 0 and (prefetcher.work_in_felt_s > 0) == engine_waits
            if engine_waits:
                assert policy._felt() == pytest.approx(felt - prefetcher.work_in_felt_s)
            else:
                assert policy._felt() == felt

    asyncio.run(main())


def test_a_ranking_no_worse_than_lru_is_not_overruled() -> None:
    """Every token routes what the last one did, at exactly one token cycle: LRU is optimal,
    the ranking matches it, and the shadow has nothing to overrule."""
    tokens = [[[0, 1], [2, 3], [4, 5], [6, 7]] for _ in range(20)]
    lru_hits = drive(ResidencyTable(TD, LRUPolicy()), tokens)
    policy, table = density(TD)
    hits = drive(table, tokens)
    assert hits == lru_hits
    assert policy.eviction == "density"


def test_a_budget_that_holds_the_model_ranks_nothing() -> None:
    """Nothing is ever evicted: the eviction is LRU's from the start, nothing is learned (a
    resident acquire costs ``coact``'s), and no verdict claims an overruling."""
    whole = SHAPE.n_expert * sum(SHAPE.expert_bytes.values())
    policy, table = density(whole)
    drive(table, routed_tokens(5))
    assert policy.eviction.startswith("lru (the budget holds every expert")
    assert int(policy._dv.sum()) == 0
    assert policy.cost_verdict is None


def test_prompt_rows_are_visits_of_their_layer() -> None:
    """``on_routing``: each row of a prompt is one visit (ages and counts move, the hazard
    table learns), and the prompt's own batch then adds no visit of its own."""
    policy, table = density(TD)
    rows = np.array([[0, 1], [0, 2], [0, 3]], dtype=np.int64)
    before = policy._hz.exposed.sum()
    policy.on_routing(0, rows)
    assert int(policy._dv[0]) == 3
    assert policy._count[0, 0] == 3 and policy._count[0, 3] == 1
    assert policy._hz.exposed.sum() == before + 3 * SHAPE.n_expert  # every expert, every row
    drive(table, [[[0, 1, 2, 3], [0], [0], [0]]])  # the prompt's batch of layer 0 (> k)
    assert int(policy._dv[0]) == 3


def _count_rankings(policy: DensityPolicy) -> list[int]:
    """The positions ``policy`` ranks for from now on (its ``_densities``, counted)."""
    calls: list[int] = []
    real = policy._densities

    def counting(cur: int) -> tuple[np.ndarray, np.ndarray]:
        calls.append(cur)
        return real(cur)

    policy._densities = counting  # type: ignore[method-assign]
    return calls


def test_prepare_ranks_the_next_batch_so_its_misses_find_it_ranked() -> None:
    policy, table = density(TD)
    drive(table, routed_tokens(4))
    calls = _count_rankings(policy)
    for e in (0, 1):
        hit = table.get((0, e)) is not None
        policy.on_request((0, e), UNIT, hit)
    assert policy.end_batch() is not None
    policy.prepare()
    assert calls == [1]  # ranked for layer 1, while the engine computes on layer 0
    policy.on_request((1, 7), UNIT, table.get((1, 7)) is not None)
    list(policy.victims())
    assert calls == [1]  # layer 1's miss used it


def _batch_end(policy: DensityPolicy, table: ResidencyTable, layer: int, experts: list[int]) -> None:
    """One decode batch as the store plays it: its requests (misses loaded), then the batch-end
    work (``end_batch``, ``prepare``)."""
    for e in experts:
        key = (layer, e)
        hit = table.get(key) is not None
        policy.on_request(key, UNIT, hit)
        if not hit:
            entry = table.reserve(key, UNIT)
            if entry is not None:
                table.publish(entry)
    assert policy.end_batch() is not None
    policy.prepare()


WIDE = ModelShape(layers=(0, 1, 2, 3), n_expert=32, experts_per_token=2,
                  expert_bytes={0: UNIT, 1: UNIT, 2: UNIT, 3: UNIT})
"""32 experts a layer: 16 token cycles hold the model, so 8 still rank."""


@pytest.mark.parametrize(("cycles", "serves"), [(1, 1), (2, 2), (4, RERANK_MAX), (8, RERANK_MAX)])
def test_one_ranking_serves_as_many_batches_as_the_horizon_allows(cycles: int, serves: int) -> None:
    """At one token cycle every batch ranks afresh; at ``h`` cycles a ranking serves ``h``
    batches, at most :data:`RERANK_MAX` (fewer numpy calls on the loop, the same hits)."""
    policy = DensityPolicy(0)
    policy.set_shape(WIDE)
    table = ResidencyTable(cycles * WIDE.token_cycle_bytes, policy)
    assert policy._rerank == serves
    rng = np.random.default_rng(5)
    tokens = [[rng.choice(32, size=2, replace=False).tolist() for _ in range(4)] for _ in range(40)]
    drive(table, tokens)
    assert policy.eviction == "density"
    calls = _count_rankings(policy)
    batches = 4 * RERANK_MAX
    for i in range(batches):
        _batch_end(policy, table, i % 4, rng.choice(32, size=2, replace=False).tolist())
    # (one more where the first batch's misses ranked before any batch end had)
    assert batches // serves <= len(calls) <= batches // serves + 1


def test_a_ranking_serves_its_own_batch_or_the_few_after_it_and_never_a_stale_one() -> None:
    """At one token cycle a ranking serves only the batch it was made for, not the same layer
    a token later (its ages are a token old then); above, the ``_rerank`` batches from it."""
    policy, _ = density(TD)
    policy._rank_epoch, policy._rank_pos = 5, 2
    policy._rerank = 1
    assert policy._ranking_serves(5, 2)
    assert not policy._ranking_serves(5 + len(SHAPE.layers), 2)  # a token later, same layer
    assert not policy._ranking_serves(6, 3) and not policy._ranking_serves(4, 2)
    policy._rerank = 2
    assert policy._ranking_serves(5, 2) and policy._ranking_serves(6, 3)
    assert not policy._ranking_serves(7, 0) and not policy._ranking_serves(4, 1)
    policy._rank_epoch = -1
    assert not policy._ranking_serves(5, 2)


def test_an_expert_routed_since_the_ranking_is_offered_after_it() -> None:
    """A ranking that serves several batches placed an expert by its density when it was
    made; routed since, that place is stale (its age is 0 now), so it is offered only after
    every expert the ranking still places, and every resident expert is still offered once."""
    policy = DensityPolicy(0)
    policy.set_shape(WIDE)
    table = ResidencyTable(4 * WIDE.token_cycle_bytes, policy)
    rng = np.random.default_rng(7)
    drive(table, [[rng.choice(32, size=2, replace=False).tolist() for _ in range(4)] for _ in range(40)])
    assert policy._rerank == RERANK_MAX
    policy._rank_epoch = -1  # rank afresh, for the batch at hand
    key = next(iter(policy.victims()))  # its lowest density
    assert isinstance(key, tuple)
    layer = key[0]
    if policy._batch_pos == layer:  # a batch of another layer between
        other = (layer + 1) % 4
        policy.on_request((other, 0), UNIT, table.get((other, 0)) is not None)
        assert policy.end_batch() is not None
    policy.on_request(key, UNIT, True)  # a later batch routes it: a hit
    assert policy.end_batch() is not None  # its visit: age 0, one use more
    assert policy._ranking_serves(policy._epoch, layer)  # the ranking made a batch ago still serves this one
    order = list(policy.victims())
    assert len(order) == len(set(order)) == len(table)
    routed_since = {divmod(f, WIDE.n_expert) for f in policy._since_rank}
    assert key in routed_since
    first_late = min(order.index(k) for k in routed_since if k in order)
    assert first_late > 0 and order.index(key) >= first_late
    assert all(k not in routed_since for k in order[:first_late])


def test_every_resident_expert_is_offered_once_also_those_come_after_the_ranking() -> None:
    """A batch that goes on after its ranking was made (single acquires of one layer, a
    prefetch): its loads, once resident and released, are offered too (else a miss could wait
    for room only they hold), and nothing twice."""
    policy, table = density(TD)
    drive(table, routed_tokens(4))
    policy.on_request((2, 0), UNIT, table.get((2, 0)) is not None)
    list(policy.victims())  # ranked now
    for e in range(1, 8):  # the same batch grows: each miss is loaded and published
        key = (2, e)
        hit = table.get(key) is not None
        policy.on_request(key, UNIT, hit)
        if not hit:
            entry = table.reserve(key, UNIT)
            assert entry is not None
            table.publish(entry)
    order = list(policy.victims())
    assert len(order) == len(set(order)) == len(table)
    assert set(order) == {entry.key for entry in table._entries.values()}


def test_what_left_the_ranking_or_came_back_is_skipped_from_its_head_for_good() -> None:
    """The misses of the batches a ranking serves take its head in order: the ones it
    evicted are passed over once (a cursor), not again at every later miss, and one that
    comes back (loaded again) is offered after the ranking, by its fresh density."""
    policy, table = density(2 * TD)
    drive(table, routed_tokens(6))
    assert policy.eviction == "density" and policy._rerank == 2
    policy._rank_epoch = -1
    first = list(policy.victims())[:4]  # ranked now: the head's first four
    for key in first[:3]:
        table.evict(table._entries[key])
    order = list(policy.victims())
    assert order[0] == first[3] and policy._head_at == 3
    assert len(order) == len(set(order)) == len(table)
    back = table.reserve(first[0], UNIT)  # loaded again
    assert back is not None
    table.publish(back)
    order = list(policy.victims())
    assert policy._head_at == 3 and order[-1] == first[0] and order[0] == first[3]
    policy.check(set(table._entries))


def test_retired_its_hooks_are_lrus_own_and_an_engines_lookahead_rebuilds_the_rest() -> None:
    """Retired (LRU's eviction, the prefetch off for good), the membership hooks are LRU's
    own over the policy's order (anything more costs a retired ``default`` 0.5 % with 2.25 MiB
    experts, 2-3 % with 36 KiB ones), and they decide exactly as ``lru`` from the same state;
    an engine's lookahead takes the bookkeeping up again, rebuilt: the held bytes, the
    resident mask, the per-layer counts, each expert fresh to the guard."""
    policy, table = density(TD)
    tokens = routed_tokens(12)
    drive(table, tokens[:4])
    policy._trial, policy._prefetching, policy._verdict = None, False, "prefetch off (test)"
    policy._to_lru("lru (test)")
    assert policy._retired and policy.end_batch() is None
    policy._retire()  # a second retirement changes nothing
    assert all(getattr(policy, name).__self__.__class__ is LRUPolicy
               for name in _LRU_HOOKS)
    twin = ResidencyTable(table.budget_bytes, LRUPolicy())  # ``lru`` with the same residents, in order
    for key, nbytes in policy._order.items():
        entry = twin.reserve(key, nbytes)
        assert entry is not None
        twin.publish(entry)
    hits = drive(table, tokens[4:8])  # evictions and loads while retired
    assert hits == drive(twin, tokens[4:8])
    table.check()
    assert list(policy.victims()) == list(policy._order) == list(twin.policy.victims())
    policy.on_expect(SHAPE.layers[0], np.full(SHAPE.n_expert, 0.5))
    assert not policy._retired and "on_request" not in vars(policy)
    assert policy._held == sum(policy._bytes.values()) == table.used_bytes
    table.check()  # the held bytes, the mask and the per-layer counts, rebuilt
    assert all(policy._order[key] == policy._visits[policy._pos_of(key)] for key in policy._order)
    drive(table, tokens[8:])
    table.check()


def test_check_catches_a_resident_mask_out_of_step() -> None:
    policy, table = density(TD)
    drive(table, routed_tokens(3))
    table.check()
    flat = int(np.flatnonzero(policy._res)[0])
    policy._res[flat] = False
    with pytest.raises(InvariantError, match="resident mask"):
        table.check()


def test_the_store_runs_the_default_and_every_view_has_the_checkpoints_bytes(st_checkpoint: Path) -> None:
    """A budget of 4 experts a layer under a routing that shifts each token: the ranking and
    the shadow run in a real store, its invariants (the policy's ``check`` included) hold,
    and every view read the right bytes (``run_store_with_prefetch`` asserts it)."""
    routed = [[((t + layer) % EXPERTS, (t * 3 + layer + 1) % EXPERTS) for layer in range(LAYERS)]
              for t in range(12)]
    stats = run_store_with_prefetch(st_checkpoint, "default", routed)
    assert stats["policy"] == "default" and stats["policy_fallback"] is None
    assert stats["resident_bytes"] <= stats["budget_bytes"]


def test_its_ranking_is_the_documented_density_expert_by_expert() -> None:
    """The numbers the ranking sorts are ``P(routed within h) x (bytes + B0) / ((d + L x
    extra) x bytes)`` of each resident expert, recomputed here one expert at a time from the
    hazard table (without the size factor when every layer's size is the same: a constant,
    so the same order), with layers of equal and of different sizes."""
    for sizes in ({0: UNIT, 1: UNIT, 2: UNIT, 3: UNIT}, {0: UNIT, 1: 3 * UNIT, 2: 2 * UNIT, 3: UNIT}):
        shape = ModelShape(layers=(0, 1, 2, 3), n_expert=8, experts_per_token=2, expert_bytes=sizes)
        policy = DensityPolicy(0)
        policy.set_shape(shape)
        table = ResidencyTable(shape.token_cycle_bytes, policy)
        drive(table, routed_tokens(12), sizes=sizes)
        phit, extra = policy._hz.density(policy._horizon)
        idx = np.flatnonzero(policy._res)
        assert idx.size >= 4
        for cur in range(4):
            got = policy._densities_of(idx, cur)
            want = []
            for flat in idx.tolist():
                p, e = divmod(flat, 8)
                age = min(int(policy._dv[p]) - 1 - int(policy._last[p, e]), AGE_MAX - 1)
                c = int(count_bin(np.array([policy._count[p, e]]))[0])
                ahead = (p - cur - 1) % 4 + 1
                want.append(phit[age, c] * (sizes[p] + MISS_FIXED_BYTES)
                            / ((ahead + 4 * extra[age, c]) * sizes[p]))
            scale = UNIT / (UNIT + MISS_FIXED_BYTES) if len(set(sizes.values())) == 1 else 1
            np.testing.assert_allclose(got, np.array(want) * scale, rtol=1e-12)
