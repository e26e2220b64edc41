"""Leases: what ``acquire`` and ``acquire_many`` return.

A lease holds one reference on a resident entry of the store's residency table; while any
lease is held the entry cannot be evicted nor its buffer reused.  The store's private
methods do the work (``_layout_of``, ``_try_hit``, ``_enter_slow``, ``_release``); a lease
only remembers which entry it holds, so releasing twice is harmless.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import TYPE_CHECKING

from iosched.residency import Entry

from ._errors import StoreError
from ._layout import ExpertKey
from ._view import ExpertView

if TYPE_CHECKING:
    from ._store import ExpertStore


class Lease:
    """``async with store.acquire(key) as view``: holds the expert resident until exit."""

    __slots__ = ("_store", "_key", "_entry")

    def __init__(self, store: ExpertStore, key: ExpertKey) -> None:
        self._store = store
        self._key = key
        self._entry: Entry | None = None

    async def __aenter__(self) -> ExpertView:
        if self._entry is not None:
            raise StoreError(f"lease of {self._key!r} entered twice")
        store = self._store
        layout = store._layout_of(self._key)
        entry = store._try_hit(layout)
        if entry is None:
            entry = await store._enter_slow(layout)
        self._entry = entry
        view: ExpertView = entry.payload.view
        return view

    async def __aexit__(self, *exc_info: object) -> None:
        self.release()

    def release(self) -> None:
        """End the lease (what ``__aexit__`` does); a no-op when not held."""
        entry, self._entry = self._entry, None
        if entry is not None:
            self._store._release(entry)


class LeaseGroup:
    """``async with store.acquire_many(keys) as views``: all of a layer's experts at once.

    The loads run concurrently; the group is entered when every lease is held.  If one
    acquire fails or the caller is cancelled, the leases already taken are released before
    the error propagates, so a group never leaks a lease.
    """

    __slots__ = ("_store", "_keys", "_leases")

    def __init__(self, store: ExpertStore, keys: Iterable[ExpertKey]) -> None:
        self._store = store
        self._keys = list(keys)
        self._leases: list[Lease] = []

    async def __aenter__(self) -> list[ExpertView]:
        store = self._store
        layouts = [store._layout_of(key) for key in self._keys]
        leases = [Lease(store, key) for key in self._keys]
        views: list[ExpertView | None] = [None] * len(leases)
        pending: dict[asyncio.Task[ExpertView], int] = {}
        for i, (lease, layout) in enumerate(zip(leases, layouts, strict=True)):
            entry = store._try_hit(layout)
            if entry is not None:
                lease._entry = entry
                views[i] = entry.payload.view
            else:
                pending[asyncio.ensure_future(lease.__aenter__())] = i
        try:
            if pending:
                await _settle(list(pending))
                failed = [t.exception() for t in pending if t.exception() is not None]
                if failed:
                    raise failed[0]  # type: ignore[misc]
                for task, i in pending.items():
                    views[i] = task.result()
        except BaseException:
            for lease in leases:
                lease.release()
            raise
        self._leases = leases
        store._batch_done()
        return [v for v in views if v is not None]

    async def __aexit__(self, *exc_info: object) -> None:
        leases, self._leases = self._leases, []
        for lease in leases:
            lease.release()


async def _settle(tasks: list[asyncio.Task[ExpertView]]) -> None:
    """Wait until every task is done; on cancellation cancel them, wait again, re-raise."""
    try:
        await asyncio.wait(tasks)
    except asyncio.CancelledError:
        for task in tasks:
            task.cancel()
        while not all(t.done() for t in tasks):
            try:
                await asyncio.wait(tasks)
            except asyncio.CancelledError:
                continue
        for task in tasks:
            if not task.cancelled():
                task.exception()
        raise
