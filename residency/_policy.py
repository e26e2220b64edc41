"""The policy interface: what a residency policy decides, and nothing else.

After libCacheSim and Caffeine's simulator: a policy sees requests and membership changes
and answers two questions, *admit this?* and *who goes first?*.  The driver
(:class:`iosched.residency.ResidencyTable`) owns bytes, leases, statistics and the budget,
and skips victims it may not evict (leased, pinned, loading).  The store and the replay tool
drive the very same policy objects through that table, so there is no second copy of any
policy.

Keys are opaque hashables, ``(layer, expert)`` in practice.  Call order for one key:
``on_request`` for every request, then on a miss ``admit``; if admitted ``on_insert``, later
``on_remove`` exactly once (eviction, failed load, or close).

``admit`` is asked with the keys the table would evict to make room for an admitted ``key``
(``victims``, in the policy's own order, already filtered to evictable entries; empty when
the bytes are free), so an admission filter can compare the candidate with what it would
displace (W-TinyLFU, ``residency/alternatives/wtinylfu.py``).  A rejected miss is served transiently
(see :class:`iosched.residency.ResidencyTable`'s ``transient_bytes``).

**Optional abilities are declared, not discovered** (Caffeine's "characteristics").  A
policy lists what it can do in its ``capabilities`` class attribute, a :class:`Capability`
flag set, and implements the small protocol that goes with each flag; it declares nothing
it does not implement and implements no hook it does not declare.  :func:`bind` checks both
directions once, when the table is built, and hands the drivers a :class:`Hooks` record of
typed callables (``None`` for an ability the policy lacks): the hot path never asks a
policy what it can do.  Policies subclass the protocols they implement, so mypy checks each
hook's signature against the protocol's.

=================  =========================  ==============================================
flag               protocol                   hooks, and who calls them when
=================  =========================  ==============================================
``BUDGET``         :class:`BudgetAware`       ``set_budget(budget_bytes)``: the table, when
                                              built and whenever the budget grows
                                              (``ResidencyTable.grow``), with the bytes
                                              admitted entries may use (the budget less the
                                              transient slot); W-TinyLFU sizes its segments
                                              from it
``REJECTS``        (none: a promise)          ``admit`` may refuse a miss, so the driver
                                              gives the table a transient slot
``SHAPE``          :class:`ShapeAware`        ``set_shape(shape)``: the driver (the store
                                              from its checkpoint index, the replay from the
                                              trace's header), before the first request; a
                                              policy that declares it cannot run without it
``BATCHES``        :class:`BatchAware`        ``end_batch() -> keys``: the batch of requests
                                              just made (one layer of one token) is
                                              complete; returns the keys worth loading ahead
                                              of demand, best first, which the driver issues
                                              as speculative loads within its budgets.
                                              ``prepare()``: after ``end_batch`` and its
                                              loads, while the engine computes: precompute
                                              what the next batch's misses will ask (``moe``
                                              ranks its victims for the coming layer)
``PREFETCH_GUARD`` :class:`PrefetchGuard`     ``admit_prefetch(key, nbytes, victims)``:
                                              asked instead of ``admit`` for a speculative
                                              load; refusing leaves the table untouched (a
                                              prefetch must not displace what is worth more)
``WAIT_COST``      :class:`WaitCostAware`     ``on_wait(key, seconds)``: the store, with the
                                              felt wait of each acquire that waited (a miss
                                              or a join of a load in flight; one that failed
                                              or was cancelled too): the time the engine
                                              spent awaiting it
``ROUTING``        :class:`RoutingAware`      ``on_routing(layer, rows)``: the router's
                                              output of a batch of tokens, ``rows`` an
                                              ``int64 [tokens, k]`` array (-1 pads a slot),
                                              validated; the store forwards
                                              ``ExpertStore.observe_routing``, the replay a
                                              trace's prompt rows, before the batch's requests
``HISTORY``        :class:`HistoryKeeper`     ``history() -> arrays`` (what the run learned,
                                              saved at the store's ``close()``),
                                              ``load_history(arrays, source)`` (seeding, at
                                              ``open``; a ``StoreError`` naming ``source``
                                              when it does not fit), ``pinned_experts`` (a
                                              gauge in ``stats()``)
``LOOKAHEAD``      :class:`LookaheadAware`    ``on_expect(layer, probabilities)``: the
                                              engine's own estimate, per expert of ``layer``,
                                              of its being routed at that layer's next batch
                                              (``ExpertStore.expect``: a ``float64 [E]``
                                              array in [0, 1], validated), so the policy can
                                              weigh it with its own prediction and its guard
``COST``           :class:`CostAware`         ``set_clock(now)``: the store, once, with its
                                              clock (``iosched/runtime/_clock.py``: real time, or the
                                              critical-path replay's virtual time), so that
                                              the policy can time its own hooks against the
                                              felt wait they save; ``cost_verdict``: what it
                                              concluded (``stats()["policy_verdict"]``).  The
                                              hit-rate replay gives no clock: there the
                                              policy measures nothing
``FELT_WAIT``      :class:`FeltWaitAware`     ``set_felt_wait(felt)``: the store, once, with
                                              ``felt() -> seconds``, the engine's felt wait
                                              so far (``stats()["felt_wait_s"]``, on the
                                              store's clock, with a wait in progress and a
                                              compute thread's block for its next batch)
                                              less the policy's own batch-end work that ran
                                              inside it (an engine computing on the loop
                                              waits while it runs),
                                              so that the policy can weigh
                                              its own CPU against what the misses cost the
                                              engine (``default``'s cost verdict)
``STATE``          :class:`StateReporting`    ``state``: a policy that changes how it decides
                                              (``default``: its eviction and its prefetch,
                                              each kept while it pays) says which mode it is
                                              in, why, and since which decode token
                                              (``stats()["policy_state"]``, the replay's
                                              rows)
=================  =========================  ==============================================
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

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


class Capability(enum.Flag):
    """The optional abilities a policy declares (the module docstring's table)."""

    NONE = 0
    BUDGET = enum.auto()
    REJECTS = enum.auto()
    SHAPE = enum.auto()
    BATCHES = enum.auto()
    PREFETCH_GUARD = enum.auto()
    WAIT_COST = enum.auto()
    ROUTING = enum.auto()
    HISTORY = enum.auto()
    LOOKAHEAD = enum.auto()
    COST = enum.auto()
    FELT_WAIT = enum.auto()
    STATE = enum.auto()


class Policy(Protocol):
    """What every policy implements (libCacheSim-sized), and what it declares."""

    name: ClassVar[str]
    capabilities: ClassVar[Capability]

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
        """Raise :class:`iosched.InvariantError` unless the policy's own state is consistent
        and tracks exactly ``keys`` (the driver's resident set)."""


@runtime_checkable
class BudgetAware(Protocol):
    """``Capability.BUDGET``."""

    def set_budget(self, budget_bytes: int) -> None:
        """The bytes admitted entries may use together, now and after each growth."""


@runtime_checkable
class ShapeAware(Protocol):
    """``Capability.SHAPE``."""

    def set_shape(self, shape: ModelShape) -> None:
        """The model's shape, before the first request (a second call must give the same)."""


@runtime_checkable
class BatchAware(Protocol):
    """``Capability.BATCHES``."""

    def end_batch(self) -> list[Key] | None:
        """The batch just made is complete; the keys worth loading ahead, best first.
        ``None``: no batch-end work from now on (the store stops calling ``end_batch`` and
        ``prepare``, which saves its scheduling on every batch)."""

    def prepare(self) -> None:
        """Precompute for the next batch, after ``end_batch``'s loads were issued."""


@runtime_checkable
class PrefetchGuard(Protocol):
    """``Capability.PREFETCH_GUARD``."""

    def admit_prefetch(self, key: Key, nbytes: int, victims: Sequence[Key]) -> bool:
        """Whether a speculative load of ``key`` may displace ``victims``."""


@runtime_checkable
class WaitCostAware(Protocol):
    """``Capability.WAIT_COST``."""

    def on_wait(self, key: Key, seconds: float) -> None:
        """How long an acquire of ``key`` that did not hit waited (miss or join, whatever
        its outcome)."""


@runtime_checkable
class RoutingAware(Protocol):
    """``Capability.ROUTING``."""

    def on_routing(self, layer: int, rows: npt.NDArray[np.int64]) -> None:
        """The router's ``[tokens, k]`` output at ``layer`` (validated, -1 pads)."""


@runtime_checkable
class LookaheadAware(Protocol):
    """``Capability.LOOKAHEAD``."""

    def on_expect(self, layer: int, probabilities: npt.NDArray[np.float64]) -> None:
        """The engine's probability of each expert of ``layer`` being routed at its next batch."""


@runtime_checkable
class CostAware(Protocol):
    """``Capability.COST``."""

    def set_clock(self, now: Callable[[], float]) -> None:
        """The store's clock, in seconds, to time the policy's own work with."""

    @property
    def cost_verdict(self) -> str | None:
        """What the policy concluded from its measured cost (``None``: nothing yet)."""


@runtime_checkable
class FeltWaitAware(Protocol):
    """``Capability.FELT_WAIT``."""

    def set_felt_wait(self, felt: Callable[[], float]) -> None:
        """``felt()``: the seconds the engine has spent awaiting acquires so far."""


@dataclass(frozen=True)
class PolicyState:
    """Where a policy that changes how it decides is now: ``mode`` (what decides, in words),
    ``why`` (the reason of its last change), ``since_token`` (the decode tokens it had seen
    at that change)."""

    mode: str
    why: str
    since_token: int

    def as_dict(self) -> dict[str, object]:
        return {"mode": self.mode, "why": self.why, "since_token": self.since_token}


@runtime_checkable
class StateReporting(Protocol):
    """``Capability.STATE``."""

    @property
    def state(self) -> PolicyState:
        """Its state now."""


@runtime_checkable
class HistoryKeeper(Protocol):
    """``Capability.HISTORY``."""

    def history(self) -> dict[str, npt.NDArray[np.generic]]:
        """What the run learned, as arrays ``residency/_history.py`` saves."""

    def load_history(self, arrays: Mapping[str, npt.NDArray[np.generic]], source: str) -> None:
        """Seed from a saved history; a ``StoreError`` naming ``source`` when it does not fit."""

    @property
    def pinned_experts(self) -> int:
        """Experts the seeded history pins resident (a gauge)."""


_PROTOCOLS: tuple[tuple[Capability, type], ...] = (
    (Capability.BUDGET, BudgetAware),
    (Capability.SHAPE, ShapeAware),
    (Capability.BATCHES, BatchAware),
    (Capability.PREFETCH_GUARD, PrefetchGuard),
    (Capability.WAIT_COST, WaitCostAware),
    (Capability.ROUTING, RoutingAware),
    (Capability.HISTORY, HistoryKeeper),
    (Capability.LOOKAHEAD, LookaheadAware),
    (Capability.COST, CostAware),
    (Capability.FELT_WAIT, FeltWaitAware),
    (Capability.STATE, StateReporting),
)


@dataclass(frozen=True)
class Hooks:
    """A policy bound to its drivers: one typed callable per declared ability, ``None`` for
    the others (``admit_prefetch`` falls back to ``admit``).  Made once by :func:`bind`."""

    policy: Policy
    capabilities: Capability
    set_budget: Callable[[int], None] | None = None
    set_shape: Callable[[ModelShape], None] | None = None
    end_batch: Callable[[], list[Key] | None] | None = None
    prepare: Callable[[], None] | None = None
    admit_prefetch: Callable[[Key, int, Sequence[Key]], bool] | None = None
    on_wait: Callable[[Key, float], None] | None = None
    on_routing: Callable[[int, npt.NDArray[np.int64]], None] | None = None
    history: HistoryKeeper | None = None
    on_expect: Callable[[int, npt.NDArray[np.float64]], None] | None = None
    costed: CostAware | None = None
    set_felt_wait: Callable[[Callable[[], float]], None] | None = None
    stateful: StateReporting | None = None

    @property
    def rejects_misses(self) -> bool:
        """``Capability.REJECTS``: the table wants a transient slot."""
        return Capability.REJECTS in self.capabilities


def bind(policy: Policy) -> Hooks:
    """Check ``policy``'s declared capabilities against the hooks it implements, both ways,
    and return its :class:`Hooks`; a ``TypeError`` naming the policy and the hook when a
    declared ability is missing a hook or a hook is there undeclared (a bug in the policy:
    it would otherwise be called, or not, by accident)."""
    caps = policy.capabilities
    if not isinstance(caps, Capability):
        raise TypeError(f"policy {type(policy).__name__}: capabilities must be a Capability flag "
                        f"set, got {caps!r}")
    for flag, protocol in _PROTOCOLS:
        declared, implemented = flag in caps, isinstance(policy, protocol)
        if declared != implemented:
            hooks = ", ".join(sorted(n for n in vars(protocol) if not n.startswith("_")))
            raise TypeError(
                f"policy {type(policy).__name__} {'declares' if declared else 'does not declare'} "
                f"Capability.{flag.name} but {'lacks' if declared else 'implements'} "
                f"its hooks ({hooks})")
    return Hooks(
        policy=policy,
        capabilities=caps,
        set_budget=policy.set_budget if isinstance(policy, BudgetAware) else None,
        set_shape=policy.set_shape if isinstance(policy, ShapeAware) else None,
        end_batch=policy.end_batch if isinstance(policy, BatchAware) else None,
        prepare=policy.prepare if isinstance(policy, BatchAware) else None,
        admit_prefetch=policy.admit_prefetch if isinstance(policy, PrefetchGuard) else None,
        on_wait=policy.on_wait if isinstance(policy, WaitCostAware) else None,
        on_routing=policy.on_routing if isinstance(policy, RoutingAware) else None,
        history=policy if isinstance(policy, HistoryKeeper) else None,
        on_expect=policy.on_expect if isinstance(policy, LookaheadAware) else None,
        costed=policy if isinstance(policy, CostAware) else None,
        set_felt_wait=policy.set_felt_wait if isinstance(policy, FeltWaitAware) else None,
        stateful=policy if isinstance(policy, StateReporting) else None,
    )
