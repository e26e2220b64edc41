"""``coact``: LRU's eviction plus the default's next-layer prefetch, its guard and its trial.

The default's machine (``residency/default``) without the density ranking: LRU's order evicts
from the start, and once the trial turns the prefetch off, LRU's order alone is kept. What it
measures against ``default`` is what the ranking adds; ``earned`` goes on with it after
``moe``.
"""

from __future__ import annotations

from typing import ClassVar

from ..default import DefaultPolicy


class CoactPolicy(DefaultPolicy):
    """:class:`DefaultPolicy` configured without the ranking (nothing else differs)."""

    name: ClassVar[str] = "coact"

    def __init__(self, prefetch_width: int | None = None) -> None:
        super().__init__(prefetch_width, ranking=False)


__all__ = ["CoactPolicy"]
