"""What the store's parts share about its state: whether it is open, and who waits for room.

:class:`Lifecycle` is the store's open/closed flag, read by every part (an acquire after
``close()`` raises :class:`StoreClosed`; the prefetcher and the budget growth do nothing once
closed).  :class:`Room` is where an acquire whose bytes cannot be reserved now waits, until a
lease or a load ends, the budget grows, or the store closes; each of those wakes every
waiter, and each waiter retries its reservation.
"""

from __future__ import annotations

import asyncio

from ._errors import StoreClosed


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
    """Acquires waiting for bytes to free up."""

    __slots__ = ("waiters",)

    def __init__(self) -> None:
        self.waiters: list[asyncio.Future[None]] = []

    async def wait(self) -> None:
        """Until the next :meth:`wake` (the caller then retries its reservation)."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        try:
            await fut
        finally:
            # A cancelled waiter's future is done (cancelled) but still listed: drop it now
            # rather than at the next wake-up.
            if fut in self.waiters:
                self.waiters.remove(fut)

    def wake(self) -> None:
        """Wake every waiter: something that held bytes let go of them, or the store closed."""
        waiters, self.waiters = self.waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)
