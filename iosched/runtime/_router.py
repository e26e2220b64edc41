"""Which replica serves a read: weighted rendezvous hashing, or least pending; failover.

Replicas are byte-identical copies of one checkpoint file on different drives (the primary and
its mirrors).  Two routing policies:

* ``hash`` (default): weighted rendezvous hashing of (layer, expert) over the replicas holding
  the file (Schindelhauer and Schomaker, "Weighted distributed hash tables", SPAA 2005: the
  replica maximising ``-weight / ln(u)``, ``u`` a uniform hash of (key, replica), is chosen with
  probability proportional to its weight).  Deterministic, so a prefetch and the demand read of
  one expert go to the same drive, and adding a mirror moves only the experts it wins.
* ``least_pending`` (md RAID1's read balancing): the replica with the fewest reads in flight
  (each replica is one drive in production; counting per replica also keeps two replicas that
  share a drive in a test apart), ties broken by weight, then by the hash order.

A replica that fails :data:`DEGRADE_AFTER` reads in a row is *degraded*: skipped for
:data:`RETRY_AFTER_S` seconds, then tried again (one success clears it).  A degraded replica is
still used when no healthy one holds the file.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

DEGRADE_AFTER = 3
"""Consecutive failed reads that mark a replica degraded: one error can be a bad sector, three
in a row a failing drive (md marks a member faulty on the first failed write it cannot repair;
reads are cheaper to retry, so we allow a few)."""
RETRY_AFTER_S = 30.0
"""How long a degraded replica is skipped before it is probed with real reads again."""

POLICIES = ("hash", "least_pending")


@dataclass
class Replica:
    path: str
    device: str
    file: int
    """The backend's index of this path."""
    weight: float = 1.0
    failures: int = 0
    degraded_until: float = 0.0

    def healthy(self, now: float) -> bool:
        return self.degraded_until <= now


def _unit_hash(key: Hashable, path: str) -> float:
    digest = hashlib.blake2b(f"{key!r}|{path}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") + 0.5) / 2.0**64  # in (0, 1)


@dataclass
class Router:
    replicas: list[list[Replica]]
    """Per logical checkpoint file, its replicas, primary first."""
    policy: str = "hash"
    pending: Callable[[Replica], int] = field(default=lambda replica: 0)
    """Reads in flight on a replica (the core's counters), for ``least_pending``."""
    clock: Callable[[], float] = time.monotonic

    def order(self, key: Hashable, file: int) -> list[Replica]:
        """The replicas of ``file`` to try for ``key``, best first: healthy ones ordered by
        the policy, then degraded ones (a last resort rather than a failure)."""
        candidates = self.replicas[file]
        if len(candidates) == 1:
            return candidates
        now = self.clock()
        scored = sorted(candidates, key=lambda r: -r.weight / math.log(_unit_hash(key, r.path)),
                        reverse=True)
        if self.policy == "least_pending":
            scored.sort(key=lambda r: (self.pending(r), -r.weight))  # stable: hash order breaks ties
        return [r for r in scored if r.healthy(now)] + [r for r in scored if not r.healthy(now)]

    def succeeded(self, replica: Replica) -> None:
        replica.failures = 0
        replica.degraded_until = 0.0

    def failed(self, replica: Replica) -> bool:
        """Count a failed read; True when it just made the replica degraded."""
        replica.failures += 1
        if replica.failures >= DEGRADE_AFTER and replica.healthy(self.clock()):
            replica.degraded_until = self.clock() + RETRY_AFTER_S
            return True
        return False

    def degraded(self) -> list[str]:
        now = self.clock()
        return sorted({r.path for rs in self.replicas for r in rs if not r.healthy(now)})
