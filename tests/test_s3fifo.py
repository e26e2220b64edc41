"""S3-FIFO's queues (residency/default/_s3fifo.py): probation, main as a CLOCK, the ghost queue, and
victims offered the way the table takes them (leased ones skipped, nothing evicted while it
looks)."""

from __future__ import annotations

from collections.abc import Hashable

from hypothesis import given, settings
from hypothesis import strategies as st

from iosched.residency.default._s3fifo import FREQ_MAX, S3Fifo


def test_a_new_key_goes_on_probation_and_leaves_first_unless_hit() -> None:
    s3 = S3Fifo(small_bytes=2, resident=[("m1", 1), ("m2", 1)])
    s3.insert("a", 1)
    s3.insert("b", 1)
    assert list(s3.small) == ["a", "b"] and s3.small_held == 2
    s3.hit("b")
    order = list(s3.victims())
    # probation holds its cap: its oldest first; b, hit there, is promoted on its way out,
    # which leaves probation under its cap, so main's keys follow, b last among them
    assert order == ["a", "m1", "m2", "b"]
    assert "b" in s3.main and s3.freq["b"] == 0


def test_an_offered_key_the_table_kept_goes_round_again() -> None:
    """The table skips a leased key: it was moved to its queue's newest end as it was offered."""
    s3 = S3Fifo(small_bytes=1)
    s3.insert("a", 1)
    s3.insert("b", 1)
    assert next(s3.victims()) == "a"  # (leased, say: kept)
    assert next(s3.victims()) == "b" and list(s3.small) == ["a", "b"]


def test_a_key_evicted_from_probation_comes_back_into_main() -> None:
    s3 = S3Fifo(small_bytes=1, resident=[("m", 1)])
    s3.insert("a", 1)
    s3.remove("a")  # evicted unused: remembered
    assert "a" in s3.ghost and s3.small_held == 0
    s3.insert("a", 1)
    assert "a" in s3.main and "a" not in s3.ghost and "a" not in s3.small


def test_main_is_a_clock_hit_keys_go_round_again() -> None:
    s3 = S3Fifo(small_bytes=10, resident=[("x", 1), ("y", 1), ("z", 1)])
    s3.hit("x")
    s3.hit("x")
    order = list(s3.victims())
    assert order == ["y", "z", "x"]  # x went round twice, its count spent
    assert s3.freq["x"] == 0


def test_each_key_is_offered_once_even_when_the_table_skips_it() -> None:
    """The table skips leased keys and asks for the next: every resident key is offered once,
    probation first while it holds its cap, and the generator ends."""
    s3 = S3Fifo(small_bytes=2, resident=[(f"m{i}", 1) for i in range(4)])
    for key in ("a", "b", "c"):
        s3.insert(key, 1)
    s3.hit("m1")
    order = list(s3.victims())
    assert set(order) == {"a", "b", "c", "m0", "m1", "m2", "m3"} and len(order) == 7
    assert order[:3] == ["a", "b", "c"]


def test_a_prefetch_guess_is_probations_first_victim() -> None:
    s3 = S3Fifo(small_bytes=1)
    s3.insert("a", 1)
    s3.insert("guess", 1, guess=True)
    assert next(s3.victims()) == "guess"


def test_the_hit_count_saturates() -> None:
    s3 = S3Fifo(small_bytes=1)
    s3.insert("a", 1)
    for _ in range(FREQ_MAX + 5):
        s3.hit("a")
    assert s3.freq["a"] == FREQ_MAX
    s3.hit("absent")  # a key it does not hold: nothing
    assert "absent" not in s3.freq


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["get", "evict", "scan"]), st.integers(0, 11)), max_size=300),
       st.integers(1, 8), st.integers(2, 10))
def test_the_queues_track_a_cache_driven_through_them(ops: list[tuple[str, int]], small_bytes: int,
                                                      capacity: int) -> None:
    """A cache of ``capacity`` unit keys driven by random gets (a miss evicts the first victim
    when full), evictions and partial scans of the victims: the invariants hold after every
    step, and every victim offered is resident."""
    s3 = S3Fifo(small_bytes)
    held: set[Hashable] = set()
    for op, n in ops:
        key = f"k{n}"
        if op == "get":
            if key in held:
                s3.hit(key)
                continue
            if len(held) >= capacity:
                victim = next(s3.victims())
                assert victim in held
                s3.remove(victim)
                held.discard(victim)
            s3.insert(key, 1, guess=n % 5 == 0)
            held.add(key)
        elif op == "evict" and held:
            victim = next(s3.victims())
            s3.remove(victim)
            held.discard(victim)
        else:
            seen = []
            for victim in s3.victims():
                seen.append(victim)
                if len(seen) > n:
                    break
            assert set(seen) <= held and len(seen) == len(set(seen))
        s3.check(set(held))
