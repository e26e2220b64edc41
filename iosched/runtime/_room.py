"""What the store's parts share about its state: whether it is open, and who waits for room.

:class:`Lifecycle` is the store's open/closed flag, read by every part (an acquire after
``close()`` raises :class:`StoreClosed`; the prefetcher and the budget growth do nothing once
closed).  :class:`Room` is where an acquire whose bytes cannot be reserved now waits, until a
lease or a load ends, the budget grows, or the store closes.

Waking passes one wake-up along instead of waking every waiter.  (An acquire whose expert
starts loading meanwhile, by another acquire or a prefetch, is woken at once to join that load:
:meth:`Room.loading`.)  :meth:`Room.wake` wakes the
longest-waiting acquire; it retries its reservation and passes the wake-up on: to the oldest
waiter (:meth:`Room.pass_on`) when it did not find the room short (it reserved its bytes, and
there may be room for the next; it found its expert loading or loaded meanwhile; it was
cancelled first), and to the oldest waiter needing *fewer* bytes (:meth:`Room.pass_below`) when
it did, itself waiting again at the head of its line.  Why that is enough: whether
``ResidencyTable.reserve`` finds room depends on the bytes asked, not on the key, and
monotonically (more bytes need a superset of victims; with a transient slot, a miss that fails
has failed the slot's path, which needs no more than the admitted path's victims), so when an
acquire needing ``n`` bytes fails, every one needing ``n`` or more would fail too.  A chain
therefore ends only when nobody in line could reserve now, as when every waiter was woken and
retried, and it costs one wake-up per reservation plus one per distinct size that fails: O(1)
per event with an expert size per layer, not O(waiters).  Waking everyone made N waiters cost
O(N) retries per event, O(N²) in all: 20,000 concurrent acquires on a two-expert budget took
85x the time of 2,000 (``iosched contention``, docs/reliability.md).  :meth:`Room.wake_all`
(at close) wakes everyone: each then finds the store closed.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
from collections.abc import Hashable

from iosched._errors import StoreClosed


class Lifecycle:
    """The store's open/closed state; closing is final."""

    __slots__ = ("closed", "_root")

    def __init__(self, root: str) -> None:
        self.closed = False
        self._root = root

    def check_open(self) -> None:
        """:class:`StoreClosed` naming the checkpoint once the store is closed."""
        if self.closed:
            raise StoreClosed(f"the store over {self._root} is closed")


class Room:
    """Acquires waiting for bytes to free up: one line per size needed, oldest first, and an
    index by key, so that an acquire whose expert another acquire (or a prefetch) starts
    loading meanwhile joins that load at once instead of waiting for room it no longer needs."""

    __slots__ = ("_lines", "_by_key", "_seq")

    def __init__(self) -> None:
        self._lines: dict[int, collections.deque[tuple[int, asyncio.Future[bool]]]] = {}
        """Bytes needed -> ``(ticket, future)`` of the acquires needing that many, oldest first;
        futures of woken or cancelled waiters stay until a wake-up passes them (skipped)."""
        self._by_key: dict[Hashable, dict[asyncio.Future[bool], None]] = {}
        """Key -> the futures of the acquires waiting for room to load it (a dict: O(1) removal)."""
        self._seq = itertools.count()

    @property
    def waiters(self) -> list[asyncio.Future[bool]]:
        """Every future in line (done ones not yet passed included)."""
        return [fut for line in self._lines.values() for _, fut in line]

    def __bool__(self) -> bool:
        """Whether anyone may be in line (O(sizes), not O(waiters))."""
        return bool(self._lines)

    def ticket(self) -> int:
        """An acquire's place in line, taken when it first waits and kept when it waits again."""
        return next(self._seq)

    async def wait(self, key: Hashable, need: int, ticket: int, *, again: bool = False) -> bool:
        """Until woken, for an acquire of ``key`` needing ``need`` bytes.  ``True``: it holds
        the wake-up, and after its retry it either passes it on (:meth:`pass_on`, it did not
        find the room short) or waits ``again`` (it did: back at the head of its line, and the
        chain goes on only to smaller needs, :meth:`pass_below`); ``False``: its key started
        loading (:meth:`loading`), it holds no wake-up and joins that load."""
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        line = self._lines.setdefault(need, collections.deque())
        if again:
            line.appendleft((ticket, fut))  # it was its line's head: order by ticket holds
        else:
            line.append((ticket, fut))
        self._by_key.setdefault(key, {})[fut] = None
        try:
            return await fut
        except asyncio.CancelledError:
            # cancelled in line: its future is cancelled too, and wake-ups skip it (removing
            # it now would cost O(waiters)); cancelled holding a wake-up: pass that on
            if not fut.cancelled() and fut.result():
                self.pass_on()
            raise
        finally:
            same = self._by_key.get(key)
            if same is not None:
                same.pop(fut, None)
                if not same:
                    del self._by_key[key]

    def loading(self, key: Hashable) -> None:
        """``key``'s expert started loading: its waiters join that load."""
        for fut in self._by_key.pop(key, {}):
            if not fut.done():
                fut.set_result(False)

    def wake(self, below: int | None = None) -> None:
        """Wake the oldest acquire in line (needing fewer than ``below`` bytes, if given)."""
        best: collections.deque[tuple[int, asyncio.Future[bool]]] | None = None
        for need in list(self._lines):
            line = self._lines[need]
            while line and line[0][1].done():
                line.popleft()
            if not line:
                del self._lines[need]
            elif (below is None or need < below) and (best is None or line[0][0] < best[0][0]):
                best = line
        if best is not None:
            best.popleft()[1].set_result(True)

    def pass_on(self) -> None:
        """A woken acquire that did not find the room short passes the wake-up to the oldest."""
        self.wake()

    def pass_below(self, need: int) -> None:
        """A woken acquire needing ``need`` bytes found the room short: every acquire needing
        as much or more would too, so the wake-up goes on to smaller needs only."""
        self.wake(below=need)

    def wake_all(self) -> None:
        """Wake every acquire in line (the store is closing)."""
        lines, self._lines = self._lines, {}
        self._by_key = {}
        for line in lines.values():
            for _, fut in line:
                if not fut.done():
                    fut.set_result(True)
