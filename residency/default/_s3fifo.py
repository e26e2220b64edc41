"""S3-FIFO queues (Yang et al., "FIFO queues are all you need for cache eviction", SOSP 2023),
with the probationary queue one token cycle long: what the default evicts by when its density
ranking costs more than it saves above one token cycle of budget (``_judge.py``).

Why S3-FIFO: its work is a few dictionary operations a request and a victim, as LRU's, and on
MoE routing it keeps most of what the ranking gains over LRU from two token cycles up (hit-rate
replay, batch leases, 4 TD: qwen 75.3 % of decode requests, LRU 71.8, the ranking 75.6). Below
two cycles it loses (1 TD: 11-13 % against LRU's 35-58 %: probation is the whole budget), so
the default falls back to LRU there. libCacheSim has an S3-FIFO, but as a simulator over its
own request records: the store's policy protocol (a victims iterator, leases, a prefetch
guard) needs these queues in the policy itself.

- **Probation** (``small``): a key that misses enters here, unless the ghost queue remembers
  it.  Its bytes are capped at one token cycle (``small_bytes``): an expert is asked for
  again at the earliest one token later, at its layer's next visit, so a shorter queue
  would evict every new expert before its first chance of reuse; the paper's 10 % of the
  cache is far less than that at a few cycles of budget (measured: qwen 4 TD, 73.4 % with
  10 %, 75.4 % with 20 %, 75.3 % with one cycle; at 2 TD 34-52 % against 51.5 %).
- **Main** (``main``): keys that were hit while on probation, and keys the ghost queue
  remembers; evicted as a CLOCK: the oldest, unless hit since (then it goes round again, its
  count one less).
- **Ghost** (keys only): keys evicted from probation unused, as many as main holds.
- A hit raises the key's count (up to :data:`FREQ_MAX`); a probationary key with a count of at
  least one moves to main when it reaches probation's end (the paper's promotion of keys
  accessed again; two or more measured 43.6 against 75.3 % at qwen 4 TD).

The store's table asks for victims without evicting (``_evictable``) and skips the leased
ones, so :meth:`victims` moves each key it offers to its queue's newest end as it offers it:
a skipped key goes round again, an evicted one leaves through :meth:`remove`.  The queues'
moves (promotions, a CLOCK turn) stay made even when the table then evicts nothing.

Invariants (:meth:`check`): probation and main are disjoint and hold exactly the resident
keys; probation's bytes are the sum of its keys'; every resident key has a count in
``[0, FREQ_MAX]``; the ghost queue holds no resident key.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator

from iosched._errors import require

FREQ_MAX = 3
"""A key's hit count saturates here (the paper's two bits)."""


class S3Fifo:
    """Probation, main and ghost queues over hashable keys with sizes in bytes."""

    __slots__ = ("small", "main", "ghost", "freq", "small_held", "small_bytes")

    def __init__(self, small_bytes: int, resident: Iterable[tuple[Hashable, int]] = ()) -> None:
        """``small_bytes``: probation's cap; ``resident``: keys already held, oldest first, with
        their bytes (they start in main, unhit, in that order)."""
        self.small: OrderedDict[Hashable, int] = OrderedDict()
        self.main: OrderedDict[Hashable, int] = OrderedDict(resident)
        self.ghost: OrderedDict[Hashable, None] = OrderedDict()
        self.freq: dict[Hashable, int] = dict.fromkeys(self.main, 0)
        self.small_held = 0
        self.small_bytes = max(0, int(small_bytes))

    def hit(self, key: Hashable) -> None:
        f = self.freq.get(key)
        if f is not None and f < FREQ_MAX:
            self.freq[key] = f + 1

    def insert(self, key: Hashable, nbytes: int, guess: bool = False) -> None:
        """A key became resident: to main if the ghost queue remembers it, else on probation
        (a prefetch's ``guess`` at probation's oldest end: the first to go if unused)."""
        self.freq[key] = 0
        if self.ghost.pop(key, 0) is None and not guess:
            self.main[key] = nbytes
            return
        self.small[key] = nbytes
        self.small_held += nbytes
        if guess:
            self.small.move_to_end(key, last=False)

    def remove(self, key: Hashable) -> None:
        """A key left the table: one evicted from probation is remembered as a ghost."""
        self.freq.pop(key, None)
        nbytes = self.small.pop(key, None)
        if nbytes is None:
            self.main.pop(key, None)
            return
        self.small_held -= nbytes
        self.ghost[key] = None
        if len(self.ghost) > max(len(self.main), 1):
            self.ghost.popitem(last=False)

    def victims(self) -> Iterator[Hashable]:
        """Keys in S3-FIFO's eviction order, each offered once, and moved to its queue's newest
        end as it is offered (module docstring).  Probation goes first while it holds its cap
        or main is empty or spent; a queue is spent when every key in it was offered.  A key a
        promotion moved to main is offered there (once)."""
        small, main, freq = self.small, self.main, self.freq
        offered: set[Hashable] = set()
        small_spent = main_spent = False
        offered_main = 0
        for _ in range((FREQ_MAX + 2) * (len(small) + len(main)) + 3):  # (a bound: each turn offers,
            # promotes, takes one off a count or spends a queue)
            main_open = bool(main) and not main_spent
            if small and not small_spent and (self.small_held >= self.small_bytes or not main_open):
                key = next(iter(small))
                if key in offered:
                    small_spent = True
                elif freq[key] >= 1:  # hit on probation: promoted, unhit again in main
                    nbytes = small.pop(key)
                    self.small_held -= nbytes
                    main[key] = nbytes
                    freq[key] = 0
                    if main_spent:  # main's every other key was offered: this one's turn is now
                        offered.add(key)
                        offered_main += 1
                        yield key
                else:
                    small.move_to_end(key)
                    offered.add(key)
                    yield key
            elif main_open:
                key = next(iter(main))
                main.move_to_end(key)
                if key in offered:  # (keys leave only after the look: main only grows meanwhile)
                    main_spent = offered_main >= len(main)
                elif freq[key] > 0:  # hit since its last turn: once more round
                    freq[key] -= 1
                else:
                    offered.add(key)
                    offered_main += 1
                    yield key
            else:
                return

    def check(self, keys: set[Hashable]) -> None:
        require(not (self.small.keys() & self.main.keys()), "s3fifo: a key is both on probation and in main")
        require(set(self.small) | set(self.main) == keys, "s3fifo: the queues do not hold the resident keys")
        require(self.small_held == sum(self.small.values()), "s3fifo: probation's bytes are off")
        require(set(self.freq) == keys and all(0 <= f <= FREQ_MAX for f in self.freq.values()),
                "s3fifo: the hit counts do not track the resident keys")
        require(not (self.ghost.keys() & keys), "s3fifo: a ghost is resident")
