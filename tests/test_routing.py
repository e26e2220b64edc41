"""The router's per-token output (a prompt's rows): read from both trace formats, handed to the
policy by the replay and by ``ExpertStore.observe_routing``, and learned as co-activation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from iosched import ExpertStore, StoreError
from iosched._errors import UnknownExpertError
from iosched.residency import ResidencyTable
from iosched.residency._cooc import CoActivation
from iosched.residency._policy import ModelShape
from iosched.residency.alternatives.moe import MoEPolicy
from iosched.tools.calltrace import format_call_trace, load_call_trace_text
from iosched.tools.replay import Requests, budget_for, drive, simulate
from iosched.tools.trace import load_bundled_trace
from tests.conftest import EXPERTS, LAYERS

SHAPE = ModelShape(layers=(0, 1, 2), n_expert=8, experts_per_token=2,
                   expert_bytes={0: 100, 1: 100, 2: 100})


def test_learn_rows_pairs_each_token_with_itself_and_skips_padding() -> None:
    co = CoActivation(3, 8)
    rows = np.array([[0, 1], [2, -1]])
    nxt = np.array([[5, 6], [7, 5]])
    co.learn_rows(0, rows, nxt)
    assert co.counts is not None
    want = np.zeros((8, 8))
    for i, j in ((0, 5), (0, 6), (1, 5), (1, 6), (2, 7), (2, 5)):
        want[i, j] += 1
    assert np.array_equal(co.counts[0], want)  # token 0's experts never pair with token 1's
    assert co.picks[0].tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    co.learn_rows(1, rows, nxt[:1])  # rows of different batches: nothing learned
    assert not co.counts[1].any() and not co.picks[1].any()


def test_learn_rows_adds_what_learn_many_adds_token_by_token() -> None:
    rng = np.random.default_rng(3)
    a, b = CoActivation(2, 16), CoActivation(2, 16)
    rows = np.stack([rng.choice(16, 4, replace=False) for _ in range(30)])
    nxt = np.stack([rng.choice(16, 4, replace=False) for _ in range(30)])
    a.learn_rows(0, rows, nxt)
    b.learn_many([(0, r.tolist(), n.tolist()) for r, n in zip(rows, nxt, strict=True)])
    assert a.counts is not None and b.counts is not None
    assert np.array_equal(a.counts, b.counts) and np.array_equal(a.picks, b.picks)


def _policy() -> MoEPolicy:
    p = MoEPolicy(SHAPE)
    p.set_budget(10_000)
    return p


def _request_batch(p: MoEPolicy, layer: int, experts: list[int]) -> None:
    for e in experts:
        p.on_request((layer, e), 100, False)
        p.on_insert((layer, e), 100)
    p.end_batch()


def test_moe_learns_a_prompts_rows_once_and_a_single_row_from_its_batch() -> None:
    p = _policy()
    prompt = [np.array([[0, 1], [2, 3], [0, 3]]), np.array([[4, 5], [6, 7], [4, 7]])]
    for layer, rows in enumerate(prompt):
        p.on_routing(layer, rows)
        _request_batch(p, layer, sorted(set(rows.ravel().tolist())))
    p.history()  # folds the deferred observations in
    counts = p._coact.counts
    assert counts is not None
    assert counts[0, 0, 4] == 2 and counts[0, 0, 6] == 0 and counts[0, 2, 6] == 1
    assert p._coact.picks[0].tolist() == [2, 1, 1, 2, 0, 0, 0, 0]
    # a routed prefill batch with no more distinct experts than k is not paired again
    q = _policy()
    for layer in (0, 1):
        rows = np.array([[1, 2], [2, 1]])
        q.on_routing(layer, rows)
        _request_batch(q, layer, [1, 2])
    q.history()
    assert q._coact.counts is not None and q._coact.counts[0, 1, 2] == 2
    # one token's routing is what its batch says: ignored, the batch is paired at its end
    r = _policy()
    for layer in (0, 1):
        r.on_routing(layer, np.array([[3, 4]]))
        _request_batch(r, layer, [3, 4])
    r.history()
    assert r._coact.counts is not None and r._coact.counts[0, 3, 4] == 1


def test_moe_routing_errors_name_the_layer_or_expert() -> None:
    p = _policy()
    with pytest.raises(StoreError, match="layer 7"):
        p.on_routing(7, np.array([[0, 1], [1, 2]]))
    with pytest.raises(StoreError, match="0..7"):
        p.on_routing(1, np.array([[0, 8], [1, 2]]))
    p.check(set())


def test_traces_keep_the_prompts_rows_and_call_text_round_trips_them() -> None:
    trace = load_bundled_trace("gemma")
    assert trace.routing, "the bundled prompt has batches of several tokens"
    starts = np.flatnonzero(np.diff(trace.req_batch, prepend=-1))
    for batch, rows in trace.routing.items():
        assert rows.shape[1] == trace.k and rows.shape[0] > 1 and not rows.flags.writeable
        lo = starts[batch]
        hi = starts[batch + 1] if batch + 1 < starts.size else trace.req_batch.size
        requested = trace.req_expert[lo:hi].tolist()
        assert sorted(set(rows[rows >= 0].tolist())) == sorted(requested)  # the union is the batch
        assert trace.req_phase[lo] == 0
    calls = load_call_trace_text(format_call_trace(trace), "gemma.calls")
    assert calls.routing.keys() == trace.routing.keys()
    for batch, rows in trace.routing.items():
        assert np.array_equal(calls.routing[batch], rows)


def test_replay_hands_the_rows_to_the_policy_unless_keys_only() -> None:
    trace = load_bundled_trace("gemma")
    with_rows, keys_only = Requests.of(trace), Requests.of(trace, routing=False)
    assert keys_only.routing == {} and len(with_rows.routing) == len(trace.routing)
    assert with_rows.keys == keys_only.keys  # the request sequence is the same
    budget = budget_for(trace, 2)
    learned = []
    for reqs in (with_rows, keys_only):
        policy = MoEPolicy()
        policy.set_budget(budget)
        policy.set_shape(reqs.shape)
        prefill = sum(1 for d in reqs.decode if not d)
        head = Requests(**{**reqs.__dict__, "keys": reqs.keys[:prefill], "ids": reqs.ids[:prefill],
                           "sizes": reqs.sizes[:prefill], "decode": reqs.decode[:prefill],
                           "batch_end": reqs.batch_end[:prefill]})
        drive(ResidencyTable(budget, policy), head, check_every=500)
        policy.history()
        learned.append(float(policy._coact.picks.sum()))
    assert learned[0] > 0 and learned[1] == 0  # the prompt alone: only its rows teach pairs
    # lru has no use for rows: the same hits either way
    a = simulate(with_rows, "lru", 2, budget)
    b = simulate(keys_only, "lru", 2, budget)
    assert a["hits"] == b["hits"]


@pytest.mark.asyncio
async def test_store_observe_routing_validates_and_reaches_the_policy(st_checkpoint: Path) -> None:
    async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, policy="moe",
                                      experts_per_token=2) as store:
        rows = np.array([[0, 1], [2, 3], [1, 3]])
        store.observe_routing(0, rows)
        store.observe_routing(1, rows.tolist())
        store.observe_routing(2, np.array([4, 5]))  # one token
        bad_calls: list[tuple[Any, Any, str]] = [
            (LAYERS + 3, rows, f"layer {LAYERS + 3}"),
            (0, [[0, EXPERTS]], f"\\(0, {EXPERTS}\\)"),
            (0, np.zeros((2, 2), dtype=np.float32), "integers"),
            (0, np.zeros((2, 2, 2), dtype=np.int64), "tokens, k"),
            ("0", rows, "layer must be an int"),
            (LAYERS + 3, [[-1, -1]], f"layer {LAYERS + 3}"),  # padding only: the layer still checked
        ]
        for layer, experts, match in bad_calls:
            with pytest.raises(StoreError, match=match):
                store.observe_routing(layer, experts)
        assert store.stats()["routing_rows"] == 7
        policy = store._table.policy
        assert isinstance(policy, MoEPolicy)
        policy.history()
        assert policy._coact.counts is not None and policy._coact.counts[0, 0, 1] == 1
        async with store.acquire_many([(0, 0), (0, 1)]) as views:  # still serves
            assert len(views) == 2
        store.check_invariants()
    async with await ExpertStore.open(st_checkpoint, budget_bytes=1 << 20, policy="lru") as store:
        store.observe_routing(0, rows)  # nothing to learn, nothing wrong
        with pytest.raises(UnknownExpertError):
            store.observe_routing(0, [[0, -2]])
        assert store.stats()["routing_rows"] == 3  # token rows, counted whatever the policy


# ---------------------------------------------------------------------------------------------
# the context lift (residency/alternatives/_lift.py)


def test_lift_is_one_until_predicted_and_calibrates_on_the_stale_prediction() -> None:
    from iosched.residency.alternatives._lift import ContextLift

    lift = ContextLift(2, 8)
    assert np.array_equal(lift.factor(0), np.ones(8)) and lift.factor(slice(None)).shape == (2, 8)
    probs = np.array([0.9, 0.5, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1])
    lift.predict(0, probs)
    assert lift.stale_bins(0) is None  # one prediction: nothing to calibrate yet
    routed = np.array([True, True, False, False, False, False, False, False])
    for _ in range(20):  # the favoured experts come back, the others do not
        lift.predict(0, probs)
        bins = lift.stale_bins(0)
        assert bins is not None
        lift.observe(bins, np.full(8, 0.25), routed)
    f = lift.factor(0)
    assert f[0] > 1 > f[2] and f[2] == f[7]  # same lift, same factor
    assert np.array_equal(lift.factor(1), np.ones(8))  # layer 1: still nothing predicted
    lift.check()
    lift.current[1, 3] = 1.5
    with pytest.raises(AssertionError):
        lift.check()


def test_lift_without_information_stays_near_one() -> None:
    from iosched.residency.alternatives._lift import ContextLift

    rng = np.random.default_rng(7)
    lift = ContextLift(1, 64)
    for _ in range(3000):
        lift.predict(0, np.minimum(rng.dirichlet(np.ones(64)) * 4, 1.0))  # unrelated to the outcome
        bins = lift.stale_bins(0)
        if bins is not None:
            lift.observe(bins, np.full(64, 4 / 64), rng.random(64) < 4 / 64)
    f = lift.factor(0)
    assert np.all((f > 0.75) & (f < 1.25)), f  # the factors in use: 0.95-1.03, noise, no trend


def test_replay_calibrates_the_lift_and_keeps_the_invariants() -> None:
    trace = load_bundled_trace("gemma")
    reqs = Requests.of(trace)
    budget = budget_for(trace, 4)
    policy = MoEPolicy()
    policy.set_budget(budget)
    policy.set_shape(reqs.shape)
    drive(ResidencyTable(budget, policy), reqs, check_every=2000)
    assert policy._lift.observed.sum() > 0 and policy._lift.expected.sum() > 0


def test_replay_cli_keys_only_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from iosched.tools import replay

    argv = ["gemma", "--simulate", "--cycles", "1", "--policy", "lru,default"]
    assert replay.main([*argv, "--json"]) == 0
    with_rows = json.loads(capsys.readouterr().out)
    assert replay.main([*argv, "--keys-only", "--json"]) == 0
    keys_only = json.loads(capsys.readouterr().out)
    assert with_rows["routing"] is True and keys_only["routing"] is False
    lru = [r["hits"] for out in (with_rows, keys_only) for r in out["results"] if r["policy"] == "lru"]
    assert lru[0] == lru[1]  # the request sequence is the same
    assert replay.main([*argv, "--keys-only"]) == 0
    assert "saw no router rows" in capsys.readouterr().out


def test_moe_never_pairs_a_prompts_first_layer_with_the_previous_prompts_last() -> None:
    p = _policy()
    rows = np.array([[0, 1], [2, 3]])
    for turn in range(2):  # two prompts of two tokens each, same row count
        for layer in range(3):
            p.on_routing(layer, rows + turn * 4)
            _request_batch(p, layer, sorted(set((rows + turn * 4).ravel().tolist())))
    p.history()
    counts = p._coact.counts
    assert counts is not None
    assert not counts[2].any()  # last layer -> first layer: nothing learned from rows
    assert counts[0, 0, 1] == 1 and counts[0, 4, 5] == 1  # within each prompt: learned


def test_a_two_turn_call_trace_replays_with_rows_and_invariants() -> None:
    """Two prompts (several rows per layer) each followed by decode tokens: each prompt's rows
    reach the policy, and the replay keeps every invariant."""
    rng = np.random.default_rng(11)
    lines, call = [], 0
    for _turn in range(2):
        for _fwd in range(1 + 6):  # a prompt of 4 tokens, then 6 decode tokens
            rows = 4 if _fwd == 0 else 1
            for layer in range(3):
                for r in range(rows):
                    picks = rng.choice(8, 2, replace=False).tolist()
                    lines.append(f"{call} {r} {layer} " + " ".join(f"{e}:0.5" for e in picks))
                call += 1
    trace = load_call_trace_text("\n".join(lines) + "\n", "two-turns.calls")
    assert trace.turns == (0, 1) and len(trace.routing) == 6
    reqs = Requests.of(trace)
    for cycles in (0.5, 2.0):
        budget = budget_for(trace, cycles)
        policy = MoEPolicy()
        policy.set_budget(budget)
        policy.set_shape(reqs.shape)
        drive(ResidencyTable(budget, policy), reqs, check_every=1)
        policy.history()
        assert policy._coact.counts is not None and policy._coact.counts[0].sum() > 0
