"""The default policy (``make_policy("default")``), by parts: docs/default-policy.md.

:class:`DefaultPolicy` is the state machine; its parts are private modules of this package:
where the requests are in the model (``_walk``), the order of use (``_order``), the density
ranking (``_ranking``) and its judge (``_judge``, timed by ``_meter``), S3-FIFO's queues
(``_s3fifo``), the next-layer prefetch (``_prefetch``) and its trial (``_trial``).
"""

from __future__ import annotations

from ._default import DefaultPolicy, Eviction
from ._judge import COST_VERDICT_FROM, GUARD_SIGMAS, MATERIAL_SHARE, MIN_TOKENS
from ._prefetch import REUSE_MEMORY
from ._ranking import MISS_FIXED_BYTES, RANK_FIRST, RERANK_MAX
from ._trial import MIN_OFF_PAIRS, MIN_TRIAL_PAIRS, OFF_SE, T_975, TRIAL_PAIRS

__all__ = [
    "COST_VERDICT_FROM",
    "GUARD_SIGMAS",
    "MATERIAL_SHARE",
    "MIN_OFF_PAIRS",
    "MIN_TOKENS",
    "MIN_TRIAL_PAIRS",
    "MISS_FIXED_BYTES",
    "OFF_SE",
    "RANK_FIRST",
    "RERANK_MAX",
    "REUSE_MEMORY",
    "T_975",
    "TRIAL_PAIRS",
    "DefaultPolicy",
    "Eviction",
]
