"""``lrfu`` (residency/alternatives/lrfu.py): a decaying routing rate per byte, and the engine's lookahead.

What is checked, and why:

* the victim order is the order of the rates per byte, computed here independently (a
  brute-force reference over the request history), after random request sequences through
  a real :class:`ResidencyTable`, and the policy's invariants hold after every step: the
  heap with lazy deletion must never lose or duplicate a resident key;
* a victims walk the table stops early leaves the order intact (what it popped goes back);
* recency and frequency both count: an expert routed often outlives one routed once, and
  one routed just now outlives one routed long ago;
* the lookahead: an expected expert is admitted ahead over experts of lower rate and not
  over higher ones, holds its estimate until its layer's batch has passed, then goes back
  to its own rate; the policy refuses to run without the model's shape.
"""

from __future__ import annotations

import math
from collections.abc import Generator, Hashable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from iosched import StoreError
from iosched.residency import ModelShape, ResidencyTable, make_policy
from iosched.residency.alternatives.lrfu import HALF_LIFE_TOKENS, LRFUPolicy

L, E = 3, 6
SHAPE = ModelShape(layers=tuple(range(L)), n_expert=E, experts_per_token=2,
                   expert_bytes={layer: 100 for layer in range(L)})


def _policy() -> LRFUPolicy:
    policy = make_policy("lrfu")
    assert isinstance(policy, LRFUPolicy)
    policy.set_shape(SHAPE)
    return policy


def _serve(table: ResidencyTable, key: tuple[int, int], nbytes: int = 100) -> None:
    """What the store does on an acquire: a hit, or a miss loaded and published."""
    entry = table.get(key)
    table.policy.on_request(key, nbytes, entry is not None)
    if entry is None:
        entry = table.reserve(key, nbytes)
        assert entry is not None
        table.publish(entry)


def _reference_rates(history: list[tuple[int, int]]) -> dict[tuple[int, int], float]:
    """Each key's rate now, from scratch: every batch start is 1/L of a token, each request
    adds the EWMA weight, rates decay by half every HALF_LIFE_TOKENS tokens."""
    lam = math.log(2.0) / HALF_LIFE_TOKENS
    gain = 1.0 - math.exp(-lam)
    now, layer = 0.0, None
    last: dict[tuple[int, int], float] = {}
    rate: dict[tuple[int, int], float] = {}
    for key in history:
        if key[0] != layer:
            now += 1.0 / L
            layer = key[0]
        if key in rate:
            rate[key] = rate[key] * math.exp(-lam * (now - last[key])) + gain
        else:
            rate[key] = gain
        last[key] = now
    return {k: r * math.exp(-lam * (now - last[k])) for k, r in rate.items()}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, L - 1), st.lists(st.integers(0, E - 1), min_size=1, max_size=2,
                                                            unique=True)), min_size=1, max_size=40),
       st.integers(2, 10))
def test_victim_order_is_the_rate_order_and_invariants_hold(batches: list[tuple[int, list[int]]],
                                                              capacity: int) -> None:
    table = ResidencyTable(capacity * 100, _policy())
    history: list[tuple[int, int]] = []
    for layer, experts in batches:
        for e in experts:
            _serve(table, (layer, e))
            history.append((layer, e))
        table.check()
    rates: dict[Hashable, float] = dict(_reference_rates(history))
    order = list(table.policy.victims())
    assert set(order) == {e.key for e in table.entries()}
    got = [rates[k] for k in order]
    assert all(a <= b * (1 + 1e-9) for a, b in zip(got, got[1:], strict=False)), (order, got)
    # a walk stopped early loses nothing
    walk = table.policy.victims()
    assert isinstance(walk, Generator)
    next(walk, None)
    walk.close()
    assert list(table.policy.victims()) == order


def test_frequency_and_recency_both_count() -> None:
    table = ResidencyTable(300, _policy())
    for token in range(5):  # (0, 0) routed in five tokens, (1, t) once each
        _serve(table, (0, 0))
        _serve(table, (1, token))
        _serve(table, (2, 0))
    ranks = list(table.policy.victims())
    assert set(ranks) == {(0, 0), (1, 4), (2, 0)}
    assert ranks[0] == (1, 4)  # routed once: the least likely, although the most recent of all
    _serve(table, (0, 5))  # a miss: evicts (1, 4)
    assert table.get((1, 4)) is None and table.get((0, 0)) is not None
    # recency: of two experts routed as often, the one routed longer ago goes first
    table.grow(500)
    _serve(table, (1, 3))  # its second routing: (1, 3) was routed at token 3 too
    _serve(table, (1, 2))  # and (1, 2) at token 2, longer ago
    ranks = list(table.policy.victims())
    assert ranks.index((1, 2)) < ranks.index((1, 3)) < ranks.index((0, 0))


def test_the_engine_estimate_admits_ahead_then_expires() -> None:
    policy = _policy()
    table = ResidencyTable(200, policy)
    for _ in range(3):
        _serve(table, (0, 0))
        _serve(table, (1, 1))
    probs = np.zeros(E)
    probs[3] = 0.9
    policy.on_expect(2, probs)
    # (2, 3) expected at 0.9 beats both residents' rates (each well below 0.9 per token)
    assert policy.admit_prefetch((2, 3), 100, [(0, 0)])
    [entry] = table.reserve_speculative_many([((2, 3), 100)])
    assert entry is not None
    table.publish(entry)
    table.check()
    assert next(iter(policy.victims())) != (2, 3)  # held on its estimate
    low = np.zeros(E)
    low[4] = 1e-6
    policy.on_expect(2, low)
    assert not policy.admit_prefetch((2, 4), 100, [(1, 1)])  # worth less than what it displaces
    # layer 2's batch comes without (2, 3): while it lasts, the estimate still holds it ...
    _serve(table, (2, 5))
    assert table.get((2, 3)) is not None and table.get((1, 1)) is None
    # ... and once it has passed, (2, 3) is back to its own (never requested) rate: evicted first
    _serve(table, (0, 0))
    table.check()
    assert table.get((2, 3)) is None and table.get((2, 5)) is not None


def test_lrfu_needs_the_shape() -> None:
    with pytest.raises(StoreError, match="shape"):
        LRFUPolicy().on_request((0, 0), 1, False)
