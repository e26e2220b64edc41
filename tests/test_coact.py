"""``coact`` (residency/alternatives/coact.py): the default's machine without the ranking, so
LRU's eviction plus the next-layer prefetch whose guard never displaces a fresh expert
(residency/default/_prefetch.py) and its trial (residency/default/_trial.py); and ``earned``'s
switch to it (residency/alternatives/earned.py)."""

from __future__ import annotations

from collections.abc import Hashable
from pathlib import Path

import numpy as np
import pytest

from iosched import StoreError
from iosched._errors import InvariantError
from iosched.residency import POLICIES, Capability, ResidencyTable, bind, make_policy
from iosched.residency._cooc import CoActivation
from iosched.residency.alternatives.coact import CoactPolicy
from iosched.residency.alternatives.earned import EarnedPolicy
from iosched.residency.default import MIN_OFF_PAIRS, MIN_TRIAL_PAIRS, TRIAL_PAIRS, DefaultPolicy
from iosched.residency.default._prefetch import NextLayerPrefetch
from iosched.residency.default._trial import PrefetchTrial
from iosched.residency.lru import LRUPolicy
from tests.conftest import EXPERTS, LAYERS
from tests.test_earned import StepClock, routed_tokens
from tests.test_moe import SHAPE, TD, UNIT, drive, run_store_with_prefetch


def prefetch_of(policy: DefaultPolicy) -> NextLayerPrefetch:
    """The policy's next-layer prefetch (white box: its proposals, estimates and tables)."""
    assert policy._prefetch is not None
    return policy._prefetch


def trial_of(policy: DefaultPolicy) -> PrefetchTrial:
    assert policy._trial is not None
    return policy._trial


def coact(width: int | None = None, budget: int | None = None) -> CoactPolicy:
    policy = CoactPolicy(width)
    policy.set_shape(SHAPE)
    if budget is not None:
        policy.set_budget(budget)
    return policy


def paired_tokens(n: int, seed: int = 1) -> list[list[list[int]]]:
    """Layer 0's picks are random; each later layer's are the previous layer's + 2 (mod 8):
    exactly predictable from the layer before, not from the token before."""
    rng = np.random.default_rng(seed)
    tokens = []
    for _ in range(n):
        layers = [[int(rng.integers(0, 4)), int(rng.integers(4, 8))]]
        for _ in range(3):
            layers.append([(e + 2) % 8 for e in layers[-1]])
        tokens.append(layers)
    return tokens


def test_coact_is_named_and_declares_what_it_does() -> None:
    assert POLICIES["coact"] is CoactPolicy and isinstance(POLICIES["default"](), DefaultPolicy)
    assert POLICIES["earned"] is EarnedPolicy
    policy = make_policy("coact", prefetch_width=3)
    assert isinstance(policy, CoactPolicy) and policy.eviction == "lru"
    # the default's abilities: the felt wait is told, and read only by a ranking it does not have
    assert CoactPolicy.capabilities == DefaultPolicy.capabilities == (
        Capability.BUDGET | Capability.SHAPE | Capability.BATCHES | Capability.PREFETCH_GUARD
        | Capability.ROUTING | Capability.COST | Capability.FELT_WAIT | Capability.HISTORY
        | Capability.LOOKAHEAD | Capability.STATE)
    hooks = bind(policy)
    assert hooks.end_batch is not None and hooks.admit_prefetch is not None
    assert hooks.costed is policy


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_a_bad_prefetch_width_is_refused(bad: object) -> None:
    with pytest.raises(StoreError, match="prefetch_width"):
        CoactPolicy(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("key", [(9, 0), "x", (None,), (0, 8), (0, -1), (0, True), (0, 1, 2), (0, 1.0)])
def test_a_key_outside_the_shape_is_named(key: object) -> None:
    with pytest.raises(StoreError, match="coact"):
        coact().on_request(key, UNIT, False)


def test_without_prefetch_it_decides_exactly_as_lru() -> None:
    tokens = routed_tokens(40)
    for budget in (TD // 2, TD, 2 * TD):
        lru_table = ResidencyTable(budget, LRUPolicy())
        coact_table = ResidencyTable(budget, coact(width=0))
        assert drive(lru_table, tokens) == drive(coact_table, tokens)
        assert list(lru_table.policy.victims()) == list(coact_table.policy.victims())


def test_it_proposes_the_learned_next_layer_and_the_proposals_hit() -> None:
    """Two token cycles of budget: the older token's experts are stale, and guesses may
    displace them."""
    tokens = paired_tokens(60)
    policy = coact()
    table = ResidencyTable(2 * TD, policy)
    hits = drive(table, tokens)
    late = hits[-8 * 20:]
    later = [h for i, h in enumerate(late) if (i // 2) % 4 != 0]  # layers 1-3
    plain = drive(ResidencyTable(2 * TD, coact(width=0)), tokens)[-8 * 20:]
    plain_later = [h for i, h in enumerate(plain) if (i // 2) % 4 != 0]
    # (measured 0.73 against 0.43: the guesses that would displace a fresh expert are refused)
    assert sum(later) / len(later) > sum(plain_later) / len(plain_later) + 0.2
    assert prefetch_of(policy).calibration > 0.5  # the guesses were used about as often as predicted


def test_the_guard_never_displaces_a_fresh_expert() -> None:
    """Every resident expert was routed at its layer's last visit: a proposal over any of them
    is refused, and the table is untouched; into free bytes it is admitted."""
    policy = coact(budget=TD)
    table = ResidencyTable(TD, policy)
    drive(table, [[[0, 1], [2, 3], [4, 5], [6, 7]] for _ in range(6)], prefetch=False)
    policy.on_request((0, 0), UNIT, True)
    policy.on_request((0, 1), UNIT, True)
    prefetch_of(policy).proposed[(1, 5)] = (0.99, 0.99)  # a confident guess
    before = {e.key for e in table.entries()}
    assert table.reserve((1, 5), UNIT, speculative=True) is None
    assert {e.key for e in table.entries()} == before
    assert policy.end_batch() == []  # nothing could be admitted: nothing is computed
    roomy = coact(budget=2 * TD)
    roomy_table = ResidencyTable(2 * TD, roomy)
    drive(roomy_table, [[[0, 1], [2, 3], [4, 5], [6, 7]] for _ in range(6)], prefetch=False)
    prefetch_of(roomy).proposed[(1, 5)] = (0.99, 0.99)
    assert roomy_table.reserve((1, 5), UNIT, speculative=True) is not None


def test_over_stale_victims_a_guess_must_beat_their_measured_reuse() -> None:
    policy = coact(budget=2 * TD)
    table = ResidencyTable(2 * TD, policy)
    # token 1 routes {0,1} everywhere, token 2 {2,3}, token 3 {4,5}: two tokens are held,
    # and token 2's experts are stale (their layer's last visit routed others)
    for picks in ([0, 1], [2, 3], [4, 5]):
        drive(table, [[picks] * 4], prefetch=False)
    prefetch = prefetch_of(policy)
    stale = [k for k in policy.victims() if not policy._order.fresh(k)]
    assert stale and stale == list(policy.victims())[:len(stale)]
    prefetch.proposed[(1, 7)] = (prefetch.stale_reuse / 2, 0.01)
    assert not policy.admit_prefetch((1, 7), UNIT, stale[:1])
    prefetch.proposed[(1, 7)] = (min(1.0, prefetch.stale_reuse + 0.3), 0.5)
    assert policy.admit_prefetch((1, 7), UNIT, stale[:1])
    # an expert nobody estimated takes free bytes only
    assert not policy.admit_prefetch((1, 6), UNIT, stale[:1])
    assert policy.admit_prefetch((1, 6), UNIT, [])
    # the engine's lookahead is weighed by its own probability, with the same guard
    probs = np.zeros(8)
    probs[5] = 0.9
    policy.on_expect(1, probs)
    assert policy.admit_prefetch((1, 5), UNIT, stale[:1])
    fresh = [k for k in policy.victims() if k not in stale][:1]
    assert not policy.admit_prefetch((1, 5), UNIT, fresh)
    assert prefetch.calibration == 1.0  # the engine's guesses stay out of the calibration
    policy.on_request((1, 0), UNIT, False)  # layer 1's batch begins: the estimate is spent
    assert not policy.admit_prefetch((1, 5), UNIT, stale[:1])


def test_a_prefetch_waits_at_the_oldest_end_until_it_is_used() -> None:
    policy = coact(budget=2 * TD)
    table = ResidencyTable(2 * TD, policy)
    drive(table, [[[0, 1], [2, 3], [4, 5], [6, 7]]], prefetch=False)
    policy.on_request((0, 0), UNIT, True)
    prefetch_of(policy).proposed[(1, 6)] = (0.9, 0.9)
    entry = table.reserve((1, 6), UNIT, speculative=True)
    assert entry is not None
    table.publish(entry)
    assert next(iter(policy.victims())) == (1, 6)  # unused: the first to go
    policy.on_request((1, 6), UNIT, True)
    assert list(policy.victims())[-1] == (1, 6)  # used: the newest
    assert prefetch_of(policy).calibration == pytest.approx((1 + 1) / (0.9 + 1))
    table.check()


def test_prompt_rows_teach_the_pairs_and_bad_rows_are_named() -> None:
    policy = coact()
    rows0 = np.array([[0, 1], [2, 3], [0, 1]], dtype=np.int64)
    rows1 = np.array([[4, 5], [6, 7], [4, 5]], dtype=np.int64)
    policy.on_routing(0, rows0)
    policy.on_routing(1, rows1)
    pi = prefetch_of(policy).coact.predict(0, [0, 1], 2, np.full(8, 1 / 8))
    assert pi is not None and set(np.argsort(-pi)[:2].tolist()) == {4, 5}
    with pytest.raises(StoreError, match="layer 9"):
        policy.on_routing(9, rows0)
    with pytest.raises(StoreError, match="outside"):
        policy.on_routing(1, np.array([[0, 8], [1, 2]], dtype=np.int64))


def test_adopt_refuses_a_state_of_another_shape() -> None:
    policy = coact()
    with pytest.raises(InvariantError, match="another shape"):
        policy.adopt([], [0] * 3, CoActivation(3, 8), np.ones((3, 8)), {})
    with pytest.raises(InvariantError, match="before set_shape"):
        CoactPolicy().adopt([], [], CoActivation(4, 8), np.ones((4, 8)), {})


def test_the_default_switches_to_coact_with_moes_order_and_table() -> None:
    """A moe that costs more than it saves: the default goes on as coact, with moe's resident
    set oldest first, its co-activation table, and its own proposals from then on."""
    policy = EarnedPolicy(SHAPE)
    policy.set_clock(StepClock(0.01))
    table = ResidencyTable(2 * TD, policy)
    tokens = paired_tokens(40)
    drive(table, tokens[:20], wait_s=1e-4)
    assert policy.switched and str(policy.cost_verdict).startswith("coact after")
    after = policy._after
    assert after is not None and prefetch_of(after).coact is policy._moe._coact
    assert set(after.victims()) == {e.key for e in table.entries()}
    drive(table, tokens[20:], wait_s=1e-4)
    assert prefetch_of(after)._guessed_used > 0  # the learned pairing still prefetches, and hits
    table.check()


def test_store_runs_coact_and_its_prefetches_read_the_right_bytes(st_checkpoint: Path) -> None:
    # a token's first picks are random; each later layer's follow them (+2 mod E), which the
    # co-activation learns
    rng = np.random.default_rng(5)
    routed = []
    for _ in range(12):
        a, b = int(rng.integers(0, EXPERTS // 2)), int(rng.integers(EXPERTS // 2, EXPERTS))
        routed.append([((a + 2 * layer) % EXPERTS, (b + 2 * layer) % EXPERTS) for layer in range(LAYERS)])
    stats = run_store_with_prefetch(st_checkpoint, "coact", routed)
    assert stats["policy"] == "coact" and stats["policy_fallback"] is None
    assert stats["policy_prefetch_batches"] > 0
    assert stats["prefetch_issued"] > 0
    assert stats["resident_bytes"] <= stats["budget_bytes"]


def run_timed_tokens(policy: CoactPolicy, n: int, extra_s: float, seed: int = 3,
                     wait_s: float = 0.0, extra_wait_s: float = 0.0,
                     extra_miss: bool = False, admit: bool = True, prompt_s: float = 0.0,
                     admit_until: int | None = None, restart_at: int | None = None) -> list[bool]:
    """``n`` decode tokens through ``policy`` on a hand-moved clock, as the store drives it:
    each layer's requests (all misses, ``wait_s`` each, plus ``extra_wait_s / L`` a layer when
    the token's arm prefetches: its reads in the demand reads' way), its batch end, then the
    engine's compute until the next layer: 2.5 ms a layer (+-0.25 ms, seeded), plus
    ``extra_s / L`` when the token's arm prefetches (what reader threads and the loop would
    take from a compute thread).  ``extra_miss``: the tokens without prefetch find their
    second expert a layer resident (a routing that happens to miss less).  ``admit``: the
    proposals are admitted (free bytes); ``False``: none ever is.  ``prompt_s``: a prompt
    taking that long first, whose last layer routes k experts.  ``admit_until``: none is
    admitted from that token on; ``restart_at``: the trial's count of admissions starts again
    before that token (``PrefetchTrial.restart_admissions``, as the default does when its
    eviction turns to LRU's above one token cycle).  The arms."""
    rng = np.random.default_rng(seed)
    clock = [0.0]
    policy.set_clock(lambda: clock[0])
    arms = []
    L = len(SHAPE.layers)
    if prompt_s:
        # a prompt of 4 tokens: a batch of up to 8 experts a layer, but the last layer only
        # the last token's 2 (k), as an engine computes it for the logits it needs
        for layer in SHAPE.layers:
            experts = range(2) if layer == SHAPE.layers[-1] else range(8)
            for e in experts:
                policy.on_request((layer, e), UNIT, False)
            policy.end_batch()
            clock[0] += prompt_s / L
    for t in range(n):
        if t == restart_at:
            trial_of(policy).restart_admissions("the test's restart")
        admitting = admit and (admit_until is None or t < admit_until)
        for layer in SHAPE.layers:
            policy.on_request((layer, (t + layer) % 8), UNIT, False)
            if layer == 0:
                arms.append(policy.prefetching)
            second_hits = extra_miss and not arms[-1]
            policy.on_request((layer, (t + layer + 3) % 8), UNIT, second_hits)
            misses = 1 if second_hits else 2
            clock[0] += misses * wait_s + (extra_wait_s / L if arms[-1] else 0.0)
            for key in (policy.end_batch() or []) if admitting else []:
                policy.admit_prefetch(key, UNIT, ())  # into free bytes, as the store would
            clock[0] += 0.0025 + float(rng.uniform(-2.5e-4, 2.5e-4)) + (extra_s / L if arms[-1] else 0.0)
    return arms


def test_the_trial_alternates_tokens_abba_and_ends_after_its_pairs() -> None:
    """A prefetch that neither costs nor saves: never kept early.  The burden of proof is on
    the prefetch, so noise may turn it off early (``MIN_OFF_PAIRS``, ``OFF_SE``: from 3 pairs
    on); otherwise it is off after all the pairs, the saving not told from noise; from then on
    the arm is constant."""
    full = early = 0
    for seed in range(6):
        policy = coact()
        arms = run_timed_tokens(policy, 2 * TRIAL_PAIRS + 6, extra_s=0.0, seed=seed)
        assert arms[:4] == [True, False, False, True]
        assert len(set(arms[2 * TRIAL_PAIRS + 1:])) == 1  # decided
        verdict = str(policy.cost_verdict)
        assert f"after {TRIAL_PAIRS} pairs" in verdict or verdict.startswith("prefetch off"), verdict
        if f"after {TRIAL_PAIRS} pairs" in verdict:
            full += 1
            assert arms[:2 * TRIAL_PAIRS] == [True, False, False, True] * (TRIAL_PAIRS // 2)
            assert verdict.startswith("prefetch off") and not any(arms[2 * TRIAL_PAIRS:])
        early += f"after {MIN_OFF_PAIRS} pairs" in verdict
    assert full >= 3 and early >= 1  # seeds 0, 1, 2, 4 the whole trial, 3 and 5 off after 3 pairs


def test_the_trial_keeps_a_prefetch_whose_tokens_are_faster() -> None:
    policy = coact()
    arms = run_timed_tokens(policy, 2 * TRIAL_PAIRS + 6, extra_s=-0.005)
    assert str(policy.cost_verdict).startswith(f"prefetch on after {MIN_TRIAL_PAIRS} pairs")
    assert all(arms[2 * MIN_TRIAL_PAIRS + 1:]) and policy.prefetching


def test_a_prompt_whose_last_layer_looks_like_decode_is_not_a_trial_token() -> None:
    """The qwen trace's prompt routes only k experts at its last layer (the last token's, for
    its logits).  Counted as the first decode token, a prompt many tokens long made the
    trial's first pair seconds of noise, and that pair decided the verdict."""
    for prompt_s in (0.0, 10.0):
        policy = coact()
        arms = run_timed_tokens(policy, 2 * TRIAL_PAIRS + 6, extra_s=-0.005, prompt_s=prompt_s)
        assert arms[:6] == [True, False, False, True, True, False]
        assert str(policy.cost_verdict).startswith(f"prefetch on after {MIN_TRIAL_PAIRS} pairs"), prompt_s


def test_the_trial_turns_off_a_prefetch_that_slows_the_tokens() -> None:
    policy = coact()
    arms = run_timed_tokens(policy, 2 * TRIAL_PAIRS + 6, extra_s=0.005)  # +50 %
    verdict = str(policy.cost_verdict)
    assert verdict.startswith(f"prefetch off after {MIN_OFF_PAIRS} pairs")  # both pairs slower
    measured = float(verdict.split("took ")[1].split(" ms")[0])  # no prefetch was used here
    assert measured == pytest.approx(5.0, abs=1.0)  # the 5 ms, within the +-1 ms of jitter
    assert not any(arms[2 * MIN_OFF_PAIRS + 1:]) and not policy.prefetching
    assert verdict.endswith("LRU alone from here on") and policy.end_batch() is None  # retired


def test_once_no_guess_can_be_admitted_no_stale_victim_is_remembered() -> None:
    """The stale victims' reuse is the guard's measure, and the guard weighs only guesses:
    ``density`` keeps its ranking after the trial turned the prefetch off, and then stops
    remembering stale victims, until the engine passes its own lookahead."""
    policy = make_policy("default")
    assert isinstance(policy, DefaultPolicy)
    policy.set_shape(SHAPE)
    table = ResidencyTable(TD, policy)
    drive(table, routed_tokens(6))
    ghosts = prefetch_of(policy).ghosts
    assert policy._guessing and ghosts  # the prefetch on: stale evictions counted
    policy._end_trial(False, "prefetch off (the test's verdict)")
    assert not policy._guessing and not ghosts
    assert policy.end_batch() is not None and not policy.lru_alone  # the ranking goes on
    drive(table, routed_tokens(4, seed=3))
    assert not ghosts
    policy.check(set(table._entries))
    policy.on_expect(SHAPE.layers[0], np.full(SHAPE.n_expert, 0.5))
    assert policy._guessing


def test_a_token_whose_batch_ends_did_not_run_prices_no_miss() -> None:
    """An engine computing on the loop gives the loop no turn after a batch of hits, so its
    batch-end work (where the time between batches starts) does not run there: the token's
    compute would count as its misses' time.  Tokens with and without the prefetch taking
    the same time, the prefetch's used loads must then not look like misses it saved."""
    policy = coact()
    clock = [0.0]
    policy.set_clock(lambda: clock[0])
    rng = np.random.default_rng(3)
    for t in range(2 * TRIAL_PAIRS + 4):
        on = policy.prefetching
        for layer in SHAPE.layers:
            policy.on_request((layer, t % 8), UNIT, True)
            second = (layer, (t + 3) % 8)
            if layer % 2:  # a miss, felt 1 ms; the engine awaits it: the batch-end work runs
                policy.on_request(second, UNIT, False)
                clock[0] += 0.001
                policy.end_batch()
            elif on:  # a used prefetch (a hit): no await, no batch-end work
                prefetch_of(policy).proposed[second] = (0.5, 0.5)
                assert policy.admit_prefetch(second, UNIT, ())  # into free bytes
                policy.on_request(second, UNIT, True)
            else:  # resident anyway
                policy.on_request(second, UNIT, True)
            clock[0] += 0.005 + float(rng.uniform(-1e-4, 1e-4))  # the compute, on the loop
    verdict = str(policy.cost_verdict)
    assert verdict.startswith("prefetch "), verdict
    measured = float(verdict.split("took ")[1].split(" ms")[0])
    assert abs(measured) < 0.5, verdict  # the tokens' own difference: none


def test_the_trial_turns_off_a_prefetch_that_slows_the_demand_reads() -> None:
    """The time between batches unchanged, but each layer's misses wait longer on the tokens
    that prefetch (the prefetch's reads ahead of the demand reads on the drive): off."""
    policy = coact()
    arms = run_timed_tokens(policy, 2 * TRIAL_PAIRS + 6, extra_s=0.0, wait_s=5e-4, extra_wait_s=0.005)
    verdict = str(policy.cost_verdict)
    assert verdict.startswith(f"prefetch off after {MIN_OFF_PAIRS} pairs"), verdict
    assert not any(arms[2 * MIN_OFF_PAIRS + 1:]) and not policy.prefetching


def test_the_trial_prices_out_a_routing_that_misses_more_on_the_tokens_with_prefetch() -> None:
    """The tokens that prefetch happen to miss one expert more a layer (the others find it
    resident), each miss costing what the others do: they take longer, but their routing
    explains all of it, so there is no clear answer: the prefetch is never kept early, and
    turned off early no more often than a prefetch that changes nothing."""
    for seed in range(6):
        policy = coact()
        run_timed_tokens(policy, 2 * TRIAL_PAIRS + 2, extra_s=0.0, wait_s=5e-3, extra_miss=True, seed=seed)
        verdict = str(policy.cost_verdict)
        if seed in (0, 1, 2, 4):  # as the tokens without the extra misses (above)
            assert f"after {TRIAL_PAIRS} pairs" in verdict, verdict
        assert f"after {TRIAL_PAIRS} pairs" in verdict or verdict.startswith("prefetch off"), verdict


def test_without_a_clock_there_is_no_trial() -> None:
    policy = coact()
    for layer in SHAPE.layers:
        policy.on_request((layer, 0), UNIT, False)
    assert policy.prefetching and policy.cost_verdict is None
    assert coact(width=0).prefetching is False


def test_a_layer_whose_last_visit_missed_nothing_is_not_predicted() -> None:
    """With room to spare and a learned pairing: after layer 1's visit found everything it
    routed, the batch end of layer 0 computes no proposal; after a miss there, it does."""
    policy = coact(budget=3 * TD)
    table = ResidencyTable(3 * TD, policy)
    tokens = paired_tokens(30)
    drive(table, tokens)
    # one more token whose layers all hit (they route what is resident)
    resident = [policy._walk.where[e.key] for e in table.entries()]
    picks = [sorted(e for (layer, e) in resident if layer == p)[:2] for p in range(4)]
    drive(table, [picks], prefetch=False)
    assert not any(policy._walk.missed)
    for e in picks[0]:
        policy.on_request((0, e), UNIT, True)
    assert policy.end_batch() == []
    assert policy._order.resident_in[1] < 8  # not for want of room: for want of a miss
    policy._walk.missed[1] = True  # as if layer 1's last visit had missed
    assert prefetch_of(policy)._could_admit(1, 2, 3 * TD) or policy._order.held >= 3 * TD


def _request_token(policy: CoactPolicy, picks: list[list[int]], history_after: int | None = None) -> None:
    for pos, experts in enumerate(picks):
        for e in experts:
            policy.on_request((SHAPE.layers[pos], e), UNIT, False)
        policy.end_batch()
        if history_after == pos:
            policy.history()


def test_a_tokens_learning_pairs_neighbouring_layers_only_and_a_mid_token_history_changes_nothing() -> None:
    """The co-activation table gains one count per (pick at a layer, pick at the next) of
    each token, nothing across tokens and nothing across a prompt's batch; the pick counts one
    per decode pick; and reading the history mid-token leaves the same tables."""
    L = len(SHAPE.layers)
    tokens = [[[(t + p) % 8, (t + p + 3) % 8] for p in range(L)] for t in range(3)]
    plain, peeked = coact(), coact()
    for t, picks in enumerate(tokens):
        _request_token(plain, picks)
        _request_token(peeked, picks, history_after=1 if t == 1 else None)
    for policy in (plain, peeked):  # the next token's first request closes the last batch
        policy.on_request((SHAPE.layers[0], 7), UNIT, False)
    for name in ("counts", "picks"):
        assert np.array_equal(getattr(prefetch_of(plain).coact, name), getattr(prefetch_of(peeked).coact, name)), name
    assert np.array_equal(prefetch_of(plain).popular, prefetch_of(peeked).popular)
    counts = prefetch_of(plain).coact.counts
    assert counts is not None
    expected = np.zeros_like(counts)
    for picks in tokens:
        for p in range(L - 1):
            for i in picks[p]:
                for j in picks[p + 1]:
                    expected[p, i, j] += 1
    assert np.array_equal(counts, expected)  # and nothing from the last layer to the first
    popular = prefetch_of(plain).popular
    assert popular.sum() == popular.size + 2 * L * len(tokens)
    # a prompt's batch (more than k experts) between two decode batches pairs nothing
    cut = coact()
    for e in tokens[0][0]:
        cut.on_request((SHAPE.layers[0], e), UNIT, False)
    for e in range(8):
        cut.on_request((SHAPE.layers[0], e), UNIT, False)  # repeats: a batch of its own
    cut.on_request((SHAPE.layers[1], 0), UNIT, False)
    cut.on_request((SHAPE.layers[1], 1), UNIT, False)
    cut.history()
    cut_counts = prefetch_of(cut).coact.counts
    assert cut_counts is not None and not cut_counts.any()


def test_a_trial_with_nothing_to_prefetch_ends_early_and_leaves_lru_alone() -> None:
    """No proposal is ever admitted (at one token cycle every victim is fresh): the trial
    ends after its fewest pairs, off, and the policy retires to LRU's order, whatever the
    tokens' times said; an engine's lookahead takes its bookkeeping up again."""
    policy = coact()
    run_timed_tokens(policy, 2 * TRIAL_PAIRS + 2, extra_s=-0.005, admit=False)  # "faster", but empty
    verdict = str(policy.cost_verdict)
    assert verdict.startswith(f"prefetch off after {MIN_TRIAL_PAIRS} pairs"), verdict
    assert "admitted no prefetch" in verdict and verdict.endswith("LRU alone from here on")
    assert policy.end_batch() is None and not policy.prefetching
    keys = [(layer, e) for layer in SHAPE.layers for e in range(3)]
    for key in keys:
        policy.on_insert(key, UNIT)
    policy.on_request(keys[0], UNIT, True)  # a hit moves to the newest end, as in LRU
    assert list(policy.victims()) == [*keys[1:], keys[0]]
    policy.on_remove(keys[1])
    policy.check(set[Hashable](keys) - {keys[1]})
    visits = list(policy._walk.visits)
    policy.on_request(keys[2], UNIT, True)
    assert policy._walk.visits == visits  # LRU alone: no batch bookkeeping
    policy.on_expect(SHAPE.layers[1], np.full(SHAPE.n_expert, 0.5))
    policy.check(set[Hashable](keys) - {keys[1]})  # the bookkeeping the retired hooks skipped, rebuilt
    policy.on_request(keys[3], UNIT, True)  # the next layer's batch: counted again
    assert policy._walk.visits[1] == visits[1] + 1 and policy.end_batch() is not None


@pytest.mark.parametrize(("restart_at", "ends_after"),
                         [(None, TRIAL_PAIRS), (4, MIN_TRIAL_PAIRS), (5, MIN_TRIAL_PAIRS + 1)])
def test_a_trial_restarted_ends_at_the_first_pair_after_with_nothing_admitted(
        restart_at: int | None, ends_after: int) -> None:
    """Prefetches admitted in the first two pairs, none from token 4 on (the guard's victims
    became fresh: ``density`` turned to LRU's order above one token cycle).  Without a restart
    the trial counts the early admissions and runs its pairs.  Restarted before token 4 (two
    pairs done), it ends as one with nothing to prefetch at pair 3, the first wholly after;
    restarted before token 5, in the middle of pair 3 (whose first token admitted), at pair
    4, not earlier."""
    policy = coact()
    run_timed_tokens(policy, 2 * TRIAL_PAIRS + 2, extra_s=0.0, seed=0, admit_until=4, restart_at=restart_at)
    verdict = str(policy.cost_verdict)
    assert verdict.startswith(f"prefetch off after {ends_after} pairs"), verdict
    assert ("admitted no prefetch in the pairs since the test's restart" in verdict) == (restart_at is not None)
    assert policy.lru_alone and policy.end_batch() is None


def test_a_stopped_trial_leaves_lrus_order_unless_the_engine_passes_its_lookahead() -> None:
    """``_stop_trial`` (the default's turn to LRU's order at one token cycle or less): the
    trial ends at once with the prefetch off, the verdict saying why after how many pairs, and
    the policy retires.  Where the engine passes its lookahead the trial is left to run: the
    engine's own estimates may still displace what the guard would not."""
    policy = coact()
    run_timed_tokens(policy, 3, extra_s=0.0, seed=0)
    assert len(trial_of(policy).pairs) == 1
    policy._stop_trial("the test's reason")
    assert policy.cost_verdict == ("prefetch off after 1 pairs of decode tokens: the test's reason; "
                                   "LRU alone from here on")
    assert policy._trial is None and not policy.prefetching
    assert policy.lru_alone and policy.end_batch() is None
    assert policy.state.why.startswith("prefetch off after 1 pairs")
    engine = coact()
    engine.on_expect(SHAPE.layers[1], np.full(EXPERTS, 1.0 / EXPERTS))
    run_timed_tokens(engine, 3, extra_s=0.0, seed=0)
    engine._stop_trial("the test's reason")
    assert engine._trial is not None and not engine.lru_alone and engine.cost_verdict is None


def test_the_store_stops_the_batch_end_work_of_a_retired_policy(st_checkpoint: Path) -> None:
    """In the store: a budget of one expert a layer leaves ``coact`` nothing to prefetch, its
    trial ends so, and the store stops scheduling its batch-end work (``end_batch`` answered
    ``None``) and LRU's own membership hooks serve it (``LRUPolicy``); every hit and miss is
    still served, with the checkpoint's bytes, and the order stays the resident set.
    (``default`` keeps it: its ranking runs there, tests/test_density.py.)"""
    import asyncio

    from iosched import ExpertStore
    from tests.test_store import expected_bytes

    async def main() -> tuple[dict[str, object], bool, bool]:
        async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 30) as probe:
            one = max(layout.nbytes for layout in probe.index.experts.values())
        async with await ExpertStore.open(st_checkpoint, budget_bytes=LAYERS * 2 * one, policy="coact",
                                          experts_per_token=2) as store:
            for t in range(4 * MIN_TRIAL_PAIRS + 4):
                store.token_boundary()
                for layer in range(LAYERS):
                    keys = [(layer, (t + layer) % EXPERTS), (layer, (3 * t + layer + 1) % EXPERTS)]
                    async with store.acquire_many(keys) as views:
                        await asyncio.sleep(0)
                        for key, view in zip(keys, views, strict=True):
                            assert view.data.tobytes() == expected_bytes(store.index, key)
            store.check_invariants()
            policy = store._table.policy
            assert isinstance(policy, CoactPolicy)
            handed = policy.lru_alone and isinstance(policy._alone, LRUPolicy)
            return store.stats(), store._prefetcher.proposing, handed

    stats, proposing, handed = asyncio.run(main())
    assert "admitted no prefetch" in str(stats["policy_verdict"]), stats["policy_verdict"]
    assert proposing is False and stats["prefetch_issued"] == 0 and handed
