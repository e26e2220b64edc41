"""The policies that only the replay tool builds, beside the registry's (``make_policy``).

``OFFLINE``: references that read the future of the trace (Belady), which neither the store
nor the registry can build; ``tools/replay.py`` builds them from the request sequence, and
the real-I/O replay (``tools/engine_replay.py``) refuses them.  ``VARIANTS``: registered
policy classes under other settings, for the simulation only.  ``EXPERIMENTAL``: the names
among those that are kept only for the negative results in docs/tried-and-dropped.md; the command
accepts them only with ``--experimental`` and marks their result rows.

Why a module of its own: both the simulation (``tools/replay.py``, whose command runs the
real-I/O replay) and the real-I/O replay need these names; kept here, below both, neither
imports the other in a cycle (docs/design.md, "Import rules").
"""

from __future__ import annotations

from collections.abc import Callable

from iosched.residency import Policy
from iosched.residency.alternatives.lfu import LFUPolicy

OFFLINE: dict[str, bool] = {"belady": False, "belady-bypass": True}
"""Offline policies this tool builds from the trace, and whether they bypass (see
``residency/alternatives/belady.py``)."""

VARIANTS: dict[str, Callable[[], Policy]] = {"lfu-incache": lambda: LFUPolicy(history=False)}
"""Replay-only variants of registered policies (the same classes, other settings), kept for
the negative results in docs/tried-and-dropped.md; the store does not offer them."""

EXPERIMENTAL: frozenset[str] = frozenset({"belady-bypass", "lfu-incache"})
"""Experiment-only policies: ``belady-bypass`` (Belady with "OPT with bypass" admission through
the table) and ``lfu-incache`` (LFU that forgets a key's count on eviction, libCacheSim's), both
measured worse than what they vary and kept only so docs/tried-and-dropped.md's negative results can be
rerun.  ``iosched replay --policy`` accepts them only with ``--experimental``, its help lists
them apart from the normal choices, and each result row of one carries ``"experimental": true``.
Every name here is in ``OFFLINE`` or ``VARIANTS``, which say how the replay builds it."""

HANDWRITTEN = "handwritten"
"""The hand-written arm's name in a ``--policy`` list (``tools/handwritten.py``): not a residency
policy but an LRU of bytes with its own pread pool, in the real-I/O replay only."""
