"""The MoE-aware default policy (residency/alternatives/moe.py): cycle-aware eviction, the hazard table,
co-activation prefetch with its eviction guard, and the store driving it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from iosched import ExpertStore, StoreError
from iosched._errors import BudgetError
from iosched.residency import POLICIES, Capability, PrefetchGuard, ResidencyTable, make_policy
from iosched.residency._cooc import CoActivation
from iosched.residency._hazard import AGE_MAX, COUNT_BINS, HazardTable
from iosched.residency._policy import Key, ModelShape
from iosched.residency.alternatives.earned import EarnedPolicy
from iosched.residency.alternatives.moe import MoEPolicy
from iosched.residency.lru import LRUPolicy
from tests.conftest import EXPERTS, LAYERS
from tests.test_store import expected_bytes

UNIT = 1000
SHAPE = ModelShape(layers=(0, 1, 2, 3), n_expert=8, experts_per_token=2,
                   expert_bytes={0: UNIT, 1: UNIT, 2: UNIT, 3: UNIT})
TD = SHAPE.token_cycle_bytes  # 8 units


def drive(table: ResidencyTable, tokens: list[list[list[int]]], prefetch: bool = True,
          wait_s: float | None = None, sizes: Mapping[int, int] | None = None) -> list[bool]:
    """Replay tokens (per token, per layer, the experts) through ``table`` as tools/replay.py
    does: request by request, and after each batch the policy's proposals, speculatively.
    ``wait_s``: each miss is felt as that long (``on_wait``, as the store reports it; the
    replay reports none).  ``sizes``: bytes of an expert by layer (default: ``UNIT`` each)."""
    hits: list[bool] = []
    policy = table.policy
    on_wait = table.hooks.on_wait if wait_s is not None else None
    for token in tokens:
        for layer, experts in enumerate(token):
            nbytes = UNIT if sizes is None else sizes[layer]
            for e in experts:
                key = (layer, e)
                hit = table.get(key) is not None
                hits.append(hit)
                policy.on_request(key, nbytes, hit)
                if not hit:
                    entry = table.reserve(key, nbytes)
                    assert entry is not None
                    table.publish(entry)
                    if entry.transient:
                        table.remove(entry)
                    if on_wait is not None and wait_s is not None:
                        on_wait(key, wait_s)
            end_batch = table.hooks.end_batch
            if end_batch is not None:
                for want in end_batch() or ():
                    if prefetch and table.get(want) is None:
                        want_bytes = UNIT if sizes is None else sizes[want[0]]  # type: ignore[index]
                        entry = table.reserve(want, want_bytes, speculative=True)
                        if entry is not None:
                            table.publish(entry)
            table.check()
    return hits


def moe(width: int | None = None) -> MoEPolicy:
    return MoEPolicy(SHAPE, prefetch_width=width)


def test_moe_and_earned_are_named_and_need_a_shape() -> None:
    # "earned" is moe until its measured cost exceeds its gain (tests/test_earned.py)
    assert POLICIES["earned"] is EarnedPolicy and POLICIES["moe"] is MoEPolicy
    policy = make_policy("earned")
    with pytest.raises(StoreError, match="shape"):
        policy.on_request((0, 1), UNIT, False)


@pytest.mark.parametrize("key", ["A", (9, 1), (0, 8), (0, -1), (0, True), (0, 1, 2), (0, 1.0)])
def test_a_key_outside_the_shape_is_named(key: object) -> None:
    with pytest.raises(StoreError, match="moe") as info:
        moe().on_request(key, UNIT, False)
    assert repr(key) in str(info.value)


def test_bad_prefetch_width_is_refused() -> None:
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(StoreError, match="prefetch_width"):
            MoEPolicy(SHAPE, prefetch_width=bad)  # type: ignore[arg-type]


def test_below_one_cycle_it_keeps_what_lru_evicts() -> None:
    """The same two experts per layer every token, budget half a token cycle: LRU evicts
    exactly the layer that comes next and never hits; the cycle-aware order keeps some."""
    tokens = [[[0, 1]] * 4 for _ in range(30)]
    lru_hits = drive(ResidencyTable(TD // 2, LRUPolicy()), tokens)
    moe_hits = drive(ResidencyTable(TD // 2, moe(width=0)), tokens)
    assert sum(lru_hits) == 0
    assert sum(moe_hits[8 * 5:]) > 0  # after a few tokens of learning


def test_it_evicts_the_layer_just_served_not_the_next() -> None:
    """Full table, a miss in layer 3: the victim is not an expert of layer 0 (next) when an
    equally used one of layer 3 (just served, farthest from its next visit) is there."""
    policy = moe(width=0)
    table = ResidencyTable(TD, policy)
    tokens = [[[0, 1], [0, 1], [0, 1], [0, 1]] for _ in range(6)]
    drive(table, tokens)
    assert len(table) == 8
    policy.on_request((3, 5), UNIT, False)  # layer 3's batch is in progress
    order = [key for key in policy.victims() if isinstance(key, tuple)]
    assert len(order) == 8
    assert order[0][0] in (2, 1)  # served before; layer 0 comes next
    assert all(key[0] != 0 for key in order[:4])


def test_coactivation_learns_a_deterministic_pairing() -> None:
    co = CoActivation(n_layers=2, n_expert=4)
    co.learn_many([(0, [1], [3])] * 5)
    pop = np.full(4, 0.25)
    pi = co.predict(0, [1], 1, pop)
    assert pi is not None and int(np.argmax(pi)) == 3
    assert co.predict(0, [2], 1, pop) is None  # nothing learned from expert 2
    assert co.predict(1, [1], 1, pop) is None


def test_coactivation_predicts_the_shrunk_mean_of_the_conditionals() -> None:
    """``predict`` is the mean over the picks of (counts + k x popularity) / (picks + 1),
    capped at 1, whatever way it is computed (here: one matrix-vector product);
    a pick never seen adds popularity alone, and all picks unseen is ``None``."""
    rng = np.random.default_rng(5)
    co = CoActivation(n_layers=3, n_expert=16)
    co.learn_arrays(rng.integers(0, 2, 200).astype(np.intp), rng.integers(0, 16, (200, 4)).astype(np.intp),
                    rng.integers(0, 16, (200, 4)).astype(np.intp))
    pop = rng.dirichlet(np.ones(16))
    for pos in (0, 1):
        picks = [int(e) for e in rng.choice(16, 4, replace=False)]
        seen = co.picks[pos, picks]
        assert co.counts is not None
        expected = np.minimum(np.mean([(co.counts[pos, i].astype(np.float64) + 4 * pop) / (s + 1.0)
                                       for i, s in zip(picks, seen, strict=True)], axis=0), 1.0)
        got = co.predict(pos, picks, 4, pop)
        assert got is not None and np.allclose(got, expected, rtol=1e-12, atol=0.0)
    assert co.predict(2, [0, 1], 4, pop) is None  # nothing learned from position 2


def test_prefetch_proposes_the_learned_next_layer_experts_and_they_hit() -> None:
    """Layer l's picks decide layer l+1's (expert e -> e+2): after learning, the proposals
    are exactly the next layer's experts, and demand finds them resident."""
    rng = np.random.default_rng(1)
    tokens = []
    for _ in range(60):
        first = [int(rng.integers(0, 4)), int(rng.integers(4, 8))]  # 16 pairs: unpredictable
        layers = [first]
        for _ in range(3):
            layers.append([(e + 2) % 8 for e in layers[-1]])
        tokens.append(layers)
    policy = moe()
    table = ResidencyTable(TD, policy)
    hits = drive(table, tokens)
    late = hits[-8 * 20:]
    layer0 = [h for i, h in enumerate(late) if (i // 2) % 4 == 0]
    later = [h for i, h in enumerate(late) if (i // 2) % 4 != 0]
    assert sum(later) / len(later) > sum(layer0) / len(layer0)
    assert sum(later) / len(later) > 0.9
    # and the same sequence without the prefetch hits far less in the later layers
    plain = drive(ResidencyTable(TD, moe(width=0)), tokens)[-8 * 20:]
    plain_later = [h for i, h in enumerate(plain) if (i // 2) % 4 != 0]
    assert sum(plain_later) < sum(later)


def test_the_eviction_guard_refuses_a_prefetch_worth_less_than_its_victims() -> None:
    """Every resident expert is routed every token; a proposal can only displace one of
    them, so the guard refuses and the table is untouched."""
    policy = moe()
    table = ResidencyTable(TD, policy)
    tokens = [[[0, 1]] * 4 for _ in range(10)]
    drive(table, tokens, prefetch=False)
    before = {e.key for e in table.entries()}
    policy.on_request((0, 0), UNIT, True)
    policy.on_request((0, 1), UNIT, True)
    # (1, 5) never followed layer 0's picks: a weak guess about layer 1
    assert table.reserve((1, 5), UNIT, speculative=True) is None
    assert {e.key for e in table.entries()} == before
    assert table.refused_prefetches == 1
    table.check()


def test_a_prefetched_expert_survives_the_misses_of_its_own_batch() -> None:
    """Layer 0's {0, 1} are always followed by layer 1's {2, 3}.  With those two evicted,
    the proposals after layer 0 bring them back; then layer 1 misses two other experts in
    a full table, and neither miss may take a prefetched expert before it is requested."""
    policy = moe()
    table = ResidencyTable(TD, policy)
    drive(table, [[[0, 1], [2, 3], [4, 5], [6, 7]] for _ in range(6)], prefetch=False)
    for key in ((1, 2), (1, 3)):
        entry = table.get(key)
        assert entry is not None
        table.evict(entry)
    for e in (0, 1):
        policy.on_request((0, e), UNIT, True)
    proposals = policy.end_batch()
    assert proposals[:2] == [(1, 2), (1, 3)]
    for want in proposals[:2]:
        entry = table.reserve(want, UNIT, speculative=True)
        assert entry is not None
        table.publish(entry)
    for e in (0, 1):
        policy.on_request((1, e), UNIT, False)
        got = table.reserve((1, e), UNIT)
        assert got is not None
        table.publish(got)
        assert table.get((1, 2)) is not None and table.get((1, 3)) is not None
    table.check()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, AGE_MAX + 40), st.integers(0, 300), st.booleans()),
                min_size=1, max_size=200))
def test_hazard_is_monotone_and_bounded(obs: list[tuple[int, int, bool]]) -> None:
    table = HazardTable()
    for age, count, routed in obs:
        table.observe(np.array([age]), np.array([float(count)]), np.array([routed]))
    lam = table.hazard()
    assert np.all(lam >= 0) and np.all(lam <= 1.0 + 1e-9)
    assert np.all(np.diff(lam, axis=0) <= 1e-12)  # never likelier after idling longer
    assert np.all(np.diff(lam, axis=1) >= -1e-12)  # never less likely after more uses
    assert np.all(table.used <= table.exposed + 0.01)
    phit, extra = table.density(7)
    assert phit.shape == (AGE_MAX, COUNT_BINS) and np.all((phit >= 0) & (phit <= 1))
    assert np.all(extra >= 0) and np.all(extra <= 6)


def run_store_with_prefetch(st_checkpoint: Path, policy: str,
                            routed: Sequence[Sequence[tuple[int, int]]]) -> dict[str, Any]:
    """Decode ``routed`` (per token, per layer, the two experts) through a store under
    ``policy``, 4 experts a layer of budget, pacing off (it has its own test, and with no
    compute between batches it may leave a busy drive no idle time to prefetch in), an await
    between layers so that the proposals go out; every view, hit, joined or loaded, must have
    the checkpoint's bytes.  The store's ``stats()`` after its invariants are checked."""
    import asyncio

    from iosched import _settings

    async def main() -> dict[str, Any]:
        probe = await ExpertStore.open(st_checkpoint, budget_bytes=1 << 30)
        one = max(layout.nbytes for layout in probe.index.experts.values())
        async with await ExpertStore.open(st_checkpoint, budget_bytes=LAYERS * 4 * one,
                                          policy=policy, experts_per_token=2) as store:
            for token in routed:
                for layer, pair in enumerate(token):
                    keys = [(layer, e) for e in pair]
                    async with store.acquire_many(keys) as views:
                        await asyncio.sleep(0)  # the engine computes: the proposals go out
                        for key, view in zip(keys, views, strict=True):
                            assert view.data.tobytes() == expected_bytes(store.index, key)
                store.token_boundary()
            await asyncio.sleep(0.05)
            store.check_invariants()
            return store.stats()

    with _settings.override(prefetch_pacing="none"):
        return asyncio.run(main())


def test_store_runs_the_moe_policy_and_its_prefetches_read_the_right_bytes(st_checkpoint: Path) -> None:
    """Every proposal is issued, and every view has the checkpoint's bytes."""
    routed = [[((t + layer) % EXPERTS, (t + layer + 1) % EXPERTS) for layer in range(LAYERS)]
              for t in range(12)]
    stats = run_store_with_prefetch(st_checkpoint, "moe", routed)
    assert stats["policy"] == "moe" and stats["policy_fallback"] is None
    assert stats["policy_prefetch_batches"] > 0
    # Every proposal was issued or refused by the guard (which weighs measured waits, so the
    # split varies from run to run); none was lost.
    assert stats["prefetch_issued"] + stats["prefetch_dropped"] > 0
    assert stats["resident_bytes"] <= stats["budget_bytes"]


def test_store_default_falls_back_to_lru_without_k_and_says_why(st_checkpoint: Path) -> None:
    import asyncio

    async def main() -> dict[str, object]:
        async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20) as store:
            async with store.acquire((0, 1)):
                pass
            return store.stats()

    stats = asyncio.run(main())
    assert "lru used instead" in str(stats["policy_fallback"])


def test_store_refuses_an_explicit_moe_without_k(st_checkpoint: Path) -> None:
    import asyncio

    with pytest.raises(StoreError, match="experts_per_token"):
        asyncio.run(ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, policy="moe"))


def test_idle_pacer_allows_what_idle_time_could_have_read() -> None:
    """Arithmetic of the pacing: the drive was busy 0.5 s of a 2 s interval reading 100 MB
    (200 MB/s while busy), so the next batch may prefetch about 1.5 s x 200 MB/s."""
    import time as _time

    from iosched.runtime._pacing import IdlePacer

    readings = iter([{"vda": (0.0, 0)}, {"vda": (0.5, 100_000_000)}, {"vda": (0.5, 100_000_000)}])
    pacer = IdlePacer(lambda: next(readings))
    assert pacer.allowance == 0  # nothing measured yet: nothing allowed
    _time.sleep(0.02)
    pacer._mark -= 2.0  # the interval lasted ~2 s
    allowance = pacer.interval_done()
    assert 290_000_000 <= allowance <= 310_000_000
    assert pacer.take(200_000_000) and not pacer.take(200_000_000)
    assert pacer.refused == 1 and pacer.granted_bytes == 200_000_000
    left = pacer.allowance
    pacer.refund(200_000_000)  # the guard refused that prefetch: it read nothing
    assert pacer.allowance == left + 200_000_000 and pacer.granted_bytes == 0
    pacer._mark -= 1.0  # an interval with no reads: idle 1 s at the remembered bandwidth
    assert 190_000_000 <= pacer.interval_done() <= 210_000_000


def test_store_paces_policy_prefetch_by_idle_drive_time(st_checkpoint: Path) -> None:
    """With idle time between batches (the engine computing), the policy's prefetches are
    issued and counted as paced; with pacing off they are issued without the account."""
    import asyncio

    from iosched import _settings

    async def run(pacing: str) -> dict[str, Any]:
        with _settings.override(prefetch_pacing=pacing):
            probe = await ExpertStore.open(st_checkpoint, budget_bytes=1 << 30)
            one = max(layout.nbytes for layout in probe.index.experts.values())
            await probe.close()
            async with await ExpertStore.open(st_checkpoint, budget_bytes=LAYERS * 4 * one,
                                              experts_per_token=2, policy="moe") as store:
                for t in range(12):
                    for layer in range(LAYERS):
                        keys = [(layer, (t + layer) % EXPERTS), (layer, (t + layer + 1) % EXPERTS)]
                        async with store.acquire_many(keys):
                            await asyncio.sleep(0.002)  # compute: the drive idles
                    store.token_boundary()
                return store.stats()

    paced = asyncio.run(run("idle"))
    assert paced["prefetch_paced_bytes"] > 0  # granted by the pacer (the guard may still refuse)
    free = asyncio.run(run("none"))
    assert free["prefetch_paced_bytes"] is None
    assert free["prefetch_issued"] + free["prefetch_dropped"] > 0


def test_usage_history_is_saved_loaded_and_pins_the_busiest(st_checkpoint: Path, tmp_path: Path) -> None:
    """Run 1 routes expert 0 of every layer at every token and writes its history at close;
    run 2 loads it (decayed), pins those experts, and a bad or foreign file is refused by
    name without being overwritten.  (``moe`` itself; ``coact``, the default, writes the same
    format without the hazard fields, tests/test_coact.py.)"""
    import asyncio

    from iosched.residency import _history

    path = tmp_path / "usage.npz"

    async def run(tokens: int) -> dict[str, Any]:
        probe = await ExpertStore.open(st_checkpoint, budget_bytes=1 << 30)
        one = max(layout.nbytes for layout in probe.index.experts.values())
        await probe.close()
        async with await ExpertStore.open(st_checkpoint, budget_bytes=LAYERS * 3 * one,
                                          experts_per_token=2, history=path, policy="moe") as store:
            for t in range(tokens):
                for layer in range(LAYERS):
                    async with store.acquire_many([(layer, 0), (layer, 1 + t % (EXPERTS - 1))]):
                        pass
                store.token_boundary()
            return store.stats()

    first = asyncio.run(run(10))
    assert first["history"] == str(path) and not first["history_loaded"] and path.exists()
    saved = _history.load(path)
    assert saved["count"][:, 0].min() >= 10 and int(saved["k"]) == 2
    second = asyncio.run(run(1))
    assert second["history_loaded"] and second["pinned_experts"] >= LAYERS  # expert 0 everywhere

    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a history")
    with pytest.raises(StoreError, match="bad.npz"):
        asyncio.run(ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, experts_per_token=2,
                                     history=bad))
    assert bad.read_bytes() == b"not a history"  # refused, not overwritten

    foreign = dict(saved)
    foreign["k"] = np.array(3)
    _history.save(tmp_path / "foreign.npz", foreign)
    with pytest.raises(StoreError, match="another model shape"):
        asyncio.run(ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, experts_per_token=2,
                                     history=tmp_path / "foreign.npz"))
    with pytest.raises(StoreError, match="keeps no usage history"):
        asyncio.run(ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, policy="lru",
                                     history=path))


def test_pins_have_hysteresis_and_a_byte_cap() -> None:
    from iosched.residency._history import Pins

    pins = Pins(1, 4)
    pins.visits[:] = 10.0
    size = np.full((1, 4), 10.0)
    count = np.array([[9.0, 6.0, 3.0, 1.0]])
    pins.update(count, np.array([0]), size, budget=100)
    assert pins.pinned.tolist() == [[True, True, False, False]]
    count = np.array([[9.0, 4.0, 4.5, 1.0]])  # 0.4: below PIN_ON, above PIN_OFF
    pins.update(count, np.array([0]), size, budget=100)
    assert pins.pinned.tolist() == [[True, True, False, False]]  # stays pinned, not re-pinned
    count = np.array([[9.0, 2.0, 9.0, 9.0]])
    pins.update(count, np.array([0]), size, budget=25)  # room for two experts' half-budget
    assert pins.pinned.sum() == 1 and pins.pinned[0, 0]


def test_reserving_a_batch_of_prefetches_matches_one_at_a_time() -> None:
    """Under LRU (which admits every prefetch) the batch call evicts and inserts exactly what
    a loop of single speculative reservations does; keys already in the table and keys
    larger than the main region get None."""
    def table_with(keys: list[str]) -> ResidencyTable:
        table = ResidencyTable(4 * UNIT, LRUPolicy())
        for key in keys:
            entry = table.reserve(key, UNIT)
            assert entry is not None
            table.publish(entry)
        return table

    one, many = table_with(["a", "b", "c", "d"]), table_with(["a", "b", "c", "d"])
    items: list[tuple[Key, int]] = [("x", UNIT), ("b", UNIT), ("y", 2 * UNIT)]
    singles = [None if one.get(k) is not None else one.reserve(k, n, speculative=True)
               for k, n in items]
    batch = many.reserve_speculative_many(items)
    assert [e is None for e in singles] == [e is None for e in batch] == [False, True, False]
    assert sorted(map(str, (e.key for e in one.entries()))) == sorted(map(str, (e.key for e in many.entries())))
    with pytest.raises(BudgetError, match="'z'"):  # larger than the budget: named, nothing reserved
        many.reserve_speculative_many([("w", UNIT), ("z", 5 * UNIT)])
    assert many.get("w") is None
    many.check()


def test_a_refused_prefetch_leaves_its_victims_to_the_next() -> None:
    class Picky(LRUPolicy, PrefetchGuard):
        capabilities = Capability.PREFETCH_GUARD

        def admit_prefetch(self, key: Key, nbytes: int, victims: Sequence[Key] = ()) -> bool:
            return key != "no"

    table = ResidencyTable(2 * UNIT, Picky())
    for key in ("a", "b"):
        entry = table.reserve(key, UNIT)
        assert entry is not None
        table.publish(entry)
    got = table.reserve_speculative_many([("no", UNIT), ("yes", UNIT)])
    assert got[0] is None and got[1] is not None
    assert table.get("a") is None and table.get("b") is not None  # "yes" took a, the first victim
    assert table.refused_prefetches == 1
    table.check()


def test_victims_name_every_resident_expert_once_after_an_order_made_between_batches() -> None:
    """An order ranked between batches (a prefetch's victims, or ``prepare``) counts distances
    from the layer just served; once the next layer's requests move the cursor it is stale.
    Whatever happened between batches, ``victims`` must name every resident expert exactly
    once (a walk that skipped the current layer's experts could find no room)."""
    policy = moe()
    table = ResidencyTable(4 * TD, policy)
    drive(table, [[[0, 1], [2, 3], [4, 5], [6, 7]]] * 2)  # everything fits: 16 experts, 32 units
    resident = {e.key for e in table.entries()}
    for between in ("victims", "prepare", "both"):
        policy.on_request((0, 0), UNIT, True)
        policy.on_request((0, 1), UNIT, True)
        policy.end_batch()
        if between in ("victims", "both"):
            assert set(policy.victims()) == resident  # ranked for the layer just served
        if between in ("prepare", "both"):
            policy.prepare()  # ranked for the layer to come
        policy.on_request((1, 2), UNIT, True)  # the next batch moves the cursor
        named = list(policy.victims())
        assert len(named) == len(set(named)) and set(named) == resident, between
        policy.on_request((1, 3), UNIT, True)
        named = list(policy.victims())
        assert len(named) == len(set(named)) and set(named) == resident, between
        # the batch in progress goes last
        assert set(named[-2:]) == {(1, 2), (1, 3)}
        policy.end_batch()
        for layer, (a, b) in ((2, (4, 5)), (3, (6, 7))):
            policy.on_request((layer, a), UNIT, True)
            policy.on_request((layer, b), UNIT, True)
            policy.end_batch()
    policy.check(resident)


def test_store_runs_the_policys_batch_end_while_the_engine_computes(st_checkpoint: Path) -> None:
    """The policy's batch-end work (learning, prediction, its prefetches, ranking the next
    layer's victims) is not on the engine's path: ``acquire_many`` hands out the views first,
    the work runs at the engine's next await; a batch the engine never awaited after is still
    learned at ``close``."""
    import asyncio

    async def main() -> None:
        async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 30, policy="moe",
                                          experts_per_token=2) as store:
            policy = store._table.policy
            assert isinstance(policy, MoEPolicy)
            async with store.acquire_many([(0, 0), (0, 1)]):
                pass
            for t in range(3):
                for layer in range(LAYERS):
                    async with store.acquire_many([(layer, t % EXPERTS), (layer, (t + 1) % EXPERTS)]):
                        visits = policy._visits.copy()
                        await asyncio.sleep(0)  # the engine computes
                        assert policy._visits.sum() == visits.sum() + 1  # this batch was learned
            async with store.acquire_many([(0, 2), (0, 3)]):
                pass  # the engine stops here: no await before close
            visits_before_close = policy._visits.sum()
        assert policy._visits.sum() == visits_before_close + 1  # that batch too, at close

    asyncio.run(main())


def test_prepare_leaves_the_next_batch_no_ranking_to_do() -> None:
    """After ``prepare`` the coming batch's misses walk ready orders: neither the sort of every
    layer nor the ranking of the layer after it runs on the engine's path (a full table: the
    coming misses must evict)."""
    policy = moe()
    table = ResidencyTable(TD, policy)
    drive(table, [[[0, 1], [2, 3], [4, 5], [6, 7]], [[1, 2], [3, 4], [5, 6], [7, 0]]])
    calls: list[str] = []
    sort, rank = policy._sort_victims, policy._rank_next_layer

    def counted_sort(cursor: int) -> None:
        calls.append("sort")
        sort(cursor)

    def counted_rank(cursor: int, predicted: Any, key: Any) -> None:
        calls.append("rank")
        rank(cursor, predicted, key)

    policy._sort_victims = counted_sort  # type: ignore[method-assign]
    policy._rank_next_layer = counted_rank  # type: ignore[method-assign]
    policy.prepare()
    assert calls == ["sort", "rank"]
    calls.clear()
    policy.on_request((0, 3), UNIT, False)  # the next token's first layer: a miss
    entry = table.reserve((0, 3), UNIT)
    assert entry is not None and calls == []
    table.check()


def test_prepare_with_room_ranks_only_when_asked_and_as_it_would_have() -> None:
    """With room for the coming batch's misses ``prepare`` defers its ranking; the first walk
    (or change to the resident set) does it then, and every walk is what ranking at once
    would have given: the order, and so every decision, is the same."""
    tokens = [[[0, 1], [2, 3], [4, 5], [6, 7]], [[1, 2], [3, 4], [5, 6], [7, 0]]]
    lazy, eager = moe(), moe()
    tables = [ResidencyTable(3 * TD, lazy), ResidencyTable(3 * TD, eager)]
    for table in tables:
        drive(table, tokens)
    sorts: list[int] = []
    sort = lazy._sort_victims

    def counted_sort(cursor: int) -> None:
        sorts.append(cursor)
        sort(cursor)

    lazy._sort_victims = counted_sort  # type: ignore[method-assign]
    lazy.prepare()
    assert sorts == []  # deferred: 16 of 24 units held, the next batch needs at most 2
    eager._prepare((eager._cursor() + 1) % 4)  # what prepare did before it deferred
    for step, (key, miss) in enumerate([((0, 3), True), ((0, 1), False), ((1, 6), True)]):
        for policy, table in zip((lazy, eager), tables, strict=True):
            policy.on_request(key, UNIT, not miss)
            if miss:
                entry = table.reserve(key, UNIT)
                assert entry is not None
                table.publish(entry)
        assert list(lazy.victims()) == list(eager.victims()), step
        assert sorts, "the walk ranked"
    assert {e.key for e in tables[0].entries()} == {e.key for e in tables[1].entries()}
    for table in tables:
        table.check()
