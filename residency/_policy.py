"""The policy interface: what a residency policy decides, and nothing else.

After libCacheSim and Caffeine's simulator: a policy sees requests and membership changes
and answers two questions, *admit this?* and *who goes first?*.  The driver
(:class:`iosched.residency.ResidencyTable`) owns bytes, leases, statistics and the budget, and skips
victims it may not evict (leased, loading).  The store and the replay tool drive the very
same policy objects through that table, so there is no second copy of any policy.

Keys are opaque hashables, ``(layer, expert)`` in practice.  Call order for one key:
``on_request`` for every request, then on a miss ``admit``; if admitted ``on_insert``, later
``on_remove`` exactly once (eviction, failed load, or close).

``admit`` is asked with the keys the table would evict to make room for an admitted
``key`` (``victims``, in the policy's own order, already filtered to evictable entries; empty
when the bytes are free), so an admission filter can compare the candidate with what it
would displace (W-TinyLFU, ``residency/wtinylfu.py``).  A rejected miss is served
transiently (see :class:`iosched.residency.ResidencyTable`'s ``transient_bytes``).

Optional hooks, called by the table only when the policy has them (so they are not part of
the structural protocol, and LRU/LFU/Belady need not define them):

* ``set_budget(budget_bytes: int) -> None``: called at table construction with the bytes
  admitted entries may use (the budget less the transient slot), and again when the budget
  grows (``ResidencyTable.grow``); a policy that sizes segments in bytes (W-TinyLFU's window
  and protected region) takes it from here;
* ``uses_admission: bool`` (class attribute): the policy may reject misses, so a driver
  should give the table a transient slot (``tools/replay.py`` does);
* ``set_shape(shape: ModelShape) -> None``: called by the driver (the store from its
  checkpoint index, the replay from the trace's header) before the first request, for a
  policy that exploits the model's structure (``residency/moe.py``);
* ``admit_prefetch(key, nbytes, victims) -> bool``: asked instead of ``admit`` for a
  speculative load (``ResidencyTable.reserve(..., speculative=True)``); refusing leaves the
  table untouched (the eviction guard: a prefetch must not displace what is worth more);
* ``end_batch() -> list[Key]``: the batch of requests just made (one layer of one token) is
  complete; returns the keys the policy wants loaded ahead of demand, best first, which the
  driver issues as speculative loads within its bytes-moved budget;
* ``prepare() -> None``: called by the driver after ``end_batch`` and its speculative loads,
  while the engine computes: precompute what the next batch's misses will ask (``moe``
  ranks its victims for the coming layer here, so no miss waits for that sort);
* ``on_wait(key, seconds) -> None``: the felt wait of a demand miss (time the engine spent
  awaiting it), for a policy that weighs misses by their measured cost;
* ``on_routing(layer, rows) -> None``: the router's output for a batch of tokens at ``layer``,
  ``rows`` an ``int64 [tokens, k]`` array (-1 pads an empty slot), already validated: the
  store forwards ``ExpertStore.observe_routing``, the replay a trace's prompt rows, before
  the batch's requests.  ``moe`` learns which experts go together from it.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

Key = Hashable


@dataclass(frozen=True)
class ModelShape:
    """What a structure-aware policy is told about the model: its MoE layers in visit
    order, experts per layer, experts routed per token and layer, and bytes of one expert
    per layer."""

    layers: tuple[int, ...]
    n_expert: int
    experts_per_token: int
    expert_bytes: Mapping[int, int]

    @property
    def token_cycle_bytes(self) -> int:
        """TD = k x the sum of one expert's bytes over the layers: the bytes a token routes."""
        return self.experts_per_token * sum(self.expert_bytes[layer] for layer in self.layers)


class Policy(Protocol):
    name: ClassVar[str]

    def on_request(self, key: Key, nbytes: int, hit: bool) -> None:
        """A request for ``key``; ``hit`` when it was resident or loading at that moment."""

    def admit(self, key: Key, nbytes: int, victims: Sequence[Key]) -> bool:
        """Whether a missed ``key`` may enter the resident set (else it is served transiently);
        ``victims`` are the keys the table evicts if it does (empty when it fits as is)."""

    def on_insert(self, key: Key, nbytes: int) -> None:
        """``key`` entered the resident set (its bytes are reserved from now on)."""

    def on_remove(self, key: Key) -> None:
        """``key`` left the resident set."""

    def victims(self) -> Iterator[Key]:
        """Resident keys in the order they should be evicted; the driver stops early and
        skips keys it may not evict, and does not change membership while iterating."""

    def check(self, keys: set[Key]) -> None:
        """Raise ``AssertionError`` unless the policy's own state is consistent and tracks
        exactly ``keys`` (the driver's resident set)."""
