"""``history=``: a policy's usage-history file, read when the store opens, written when it closes.

The file format and the decay are the residency package's (``residency/_history.py``); this
is the store's side: only a policy that declares ``Capability.HISTORY`` keeps one; a file
that exists is loaded at open (the policy starts from what the last run learned) and a file
that could not be read is never overwritten; at ``close()`` what the run learned is saved,
atomically.
"""

from __future__ import annotations

import asyncio
import os

from iosched._errors import StoreError
from iosched.residency import HistoryKeeper, load_history_file, save_history_file


class UsageHistory:
    """One store's usage-history file (``stats()``'s ``history`` and ``history_loaded``)."""

    __slots__ = ("path", "loaded", "_keeper")

    def __init__(self, keeper: HistoryKeeper, path: str) -> None:
        self._keeper = keeper
        self.path = path
        self.loaded = False

    @classmethod
    async def open(cls, keeper: HistoryKeeper | None, path: str, policy: str) -> UsageHistory:
        """The history at ``path`` for ``keeper``, loaded when the file exists; a
        :class:`StoreError` naming the file when the policy keeps none (``policy`` says which
        is in use) or the file does not fit it."""
        if keeper is None:
            raise StoreError(f"history={path}: the policy in use ({policy}) keeps no usage history")
        history = cls(keeper, path)
        if os.path.exists(path):
            arrays = await asyncio.to_thread(load_history_file, path)
            keeper.load_history(arrays, path)
            history.loaded = True
        return history

    async def save(self) -> None:
        """Write what the run learned (with what was loaded), replacing the file atomically;
        a :class:`StoreError` naming the file when it cannot be written (its folder went
        away, the disk is full)."""
        arrays = self._keeper.history()
        try:
            await asyncio.to_thread(save_history_file, self.path, arrays)
        except OSError as exc:
            raise StoreError(f"history={self.path}: cannot save the usage history: {exc.strerror or exc}") from None
