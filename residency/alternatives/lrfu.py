"""``lrfu``: evict the expert least likely to be routed per byte, by a decaying routing rate.

Why: the engine's objective is critical-path time per token, and in a run bound by the drive
that is the bytes its misses move.  Each expert of a layer gets one chance per token to be
routed, so the value of holding an expert for the next token is its probability of being
routed then, per byte it takes.  That probability is estimated by an exponentially decaying
rate of the expert's routings per token (the CRF of LRFU, Lee et al., IEEE Trans. Computers
2001, which spans LRU at fast decay and LFU at none): recently routed experts come back
(routing is 36-38 % the same from one token to the next on the bundled traces), and
popular ones come back often (routers are skewed).  Evicting the lowest rate per byte over
all layers at once gives each layer the bytes its experts' rates are worth.

What it was measured to do (docs/residency.md, ``lrfu`` and "The critical path"): in the
hit-rate replay it moves 0.85-0.93x LRU's bytes at 0.5-4 token cycles on both bundled
traces, about what ``moe`` does without prefetch, at a CPU cost per request near LRU's (one
dict lookup, two ``math`` calls, a heap push); on the critical path (the store itself) the
gain mostly vanishes, 0.77-1.07x ``lru``'s tokens/s, so it is an option, not the default.
It proposes no prefetches of its own; an engine's lookahead (``ExpertStore.expect``) is
taken through :meth:`on_expect` and :meth:`admit_prefetch` (on the critical path with a
0.7-recall synthetic predictor: 1.08-1.14x ``lru``).

Time is in tokens: one MoE layer's batch is 1/L of a token (L from the model's shape), so
the decay is the same in prefill and decode and under any layer count.  The half-life,
:data:`HALF_LIFE_TOKENS`, was measured (hit-rate replay, both bundled traces, 0.5-4 TD):
decode hits rise from a half-life of 1 to 8 tokens and are flat within 0.3 points from 8 to
16; 16 leans to frequency, which a budget below one token cycle needs most.

Structure: a key's score is ``log(rate at its last request) + t_last x ln2 / half-life``
minus ``log(bytes)``: the rate decays the same for every key, so the order of scores is
the order of rates per byte at any later time and a score changes only when its key is
requested.  A binary heap with lazy deletion holds them (an entry is current while its
version is the key's); :meth:`victims` pops in order and pushes back what the table did not
take.  Rates survive eviction (as LFU's counts do here): the keys are the checkpoint's
experts, a few thousand.

Invariants (:meth:`check`): the resident set is exactly the table's; every resident key has
exactly one current heap entry, with its score; rates are positive; a lookahead boost is
held only by a resident key of the layer it was expected for.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import ClassVar

import numpy as np
import numpy.typing as npt

from iosched._errors import StoreError, require

from .. import _history
from .._policy import Capability, HistoryKeeper, Key, LookaheadAware, ModelShape, PrefetchGuard, ShapeAware

HALF_LIFE_TOKENS = 16.0
"""Tokens after which an expert's routing rate has halved (module docstring: measured)."""

_LAMBDA = math.log(2.0) / HALF_LIFE_TOKENS
_GAIN = 1.0 - math.exp(-_LAMBDA)  # what one routing adds to the rate (the EWMA's weight)
_FLOOR = math.log(1e-12)  # the log-rate of an expert never requested (a prefetch's, say)
_COMPACT = 4
"""The heap is rebuilt when it holds more than this many entries per resident key."""


class LRFUPolicy(ShapeAware, PrefetchGuard, LookaheadAware, HistoryKeeper):
    name: ClassVar[str] = "lrfu"
    capabilities: ClassVar[Capability] = (Capability.SHAPE | Capability.PREFETCH_GUARD | Capability.LOOKAHEAD
                                          | Capability.HISTORY)

    def __init__(self, shape: ModelShape | None = None) -> None:
        self._layers = 1
        self._log_rate: dict[Key, float] = {}
        """Every key seen: ``log(rate) + t x lambda`` at its last request (time-invariant)."""
        self._bytes: dict[Key, int] = {}  # resident keys
        self._version: dict[Key, int] = {}
        self._heap: list[tuple[float, int, Key]] = []
        self._now = 0.0  # tokens
        self._layer: object = None
        self._expected: dict[object, npt.NDArray[np.float64]] = {}
        """Per layer, the engine's last estimate (``on_expect``), until that layer's batch."""
        self._boosted: dict[Key, object] = {}
        """Resident keys loaded on the engine's estimate, not yet requested: their layer."""
        self._shape: ModelShape | None = None
        if shape is not None:
            self.set_shape(shape)

    def set_shape(self, shape: ModelShape) -> None:
        self._layers = max(1, len(shape.layers))
        self._shape = shape

    # ------------------------------------------------------------------ the policy

    def on_request(self, key: Key, nbytes: int, hit: bool) -> None:
        if self._shape is None:
            raise StoreError("policy 'lrfu' needs the model's shape before its first request: "
                             "call set_shape(ModelShape(...)) (the store and iosched replay do)")
        layer = key[0] if isinstance(key, tuple) else None
        if layer != self._layer:  # a new batch: 1/L of a token passes
            self._batch_starts(layer)
        now = self._now * _LAMBDA
        old = self._log_rate.get(key)
        rate = _GAIN if old is None else math.exp(old - now) + _GAIN
        score = math.log(rate) + now
        self._log_rate[key] = score
        if self._boosted.pop(key, None) is not None or key in self._bytes:
            self._push(key)

    def admit(self, key: Key, nbytes: int, victims: Sequence[Key] = ()) -> bool:
        return True  # a demand miss's bytes are held while the engine computes on it anyway

    def admit_prefetch(self, key: Key, nbytes: int, victims: Sequence[Key] = ()) -> bool:
        """Load ahead only what is likelier to be routed per byte than everything it displaces:
        the engine's estimate for ``key`` against the victims' rates."""
        if not victims:
            return True
        mine = self._log_value(key) - math.log(max(nbytes, 1))
        return all(mine > self._log_value(v) - math.log(max(self._bytes.get(v, 1), 1)) for v in victims)

    def on_insert(self, key: Key, nbytes: int) -> None:
        require(key not in self._bytes, f"lrfu: insert of {key!r}, which is already resident")
        self._bytes[key] = nbytes
        layer = key[0] if isinstance(key, tuple) else None
        if layer != self._layer and layer in self._expected:  # loaded ahead on the estimate
            self._boosted[key] = layer
        self._push(key)

    def on_remove(self, key: Key) -> None:
        del self._bytes[key]
        self._boosted.pop(key, None)
        self._version[key] = self._version.get(key, 0) + 1  # its heap entry is stale now

    def victims(self) -> Iterator[Key]:
        """Resident keys, lowest rate per byte first (the engine's estimate standing in for
        the rate of a key loaded on it, until its layer's batch)."""
        popped: list[tuple[float, int, Key]] = []
        heap, version = self._heap, self._version
        try:
            while heap:
                item = heapq.heappop(heap)
                if version.get(item[2]) != item[1] or item[2] not in self._bytes:
                    continue  # stale
                popped.append(item)
                yield item[2]
        finally:
            for item in popped:
                heapq.heappush(heap, item)

    def on_expect(self, layer: int, probabilities: npt.NDArray[np.float64]) -> None:
        self._expected[layer] = probabilities
        for e in np.flatnonzero(probabilities > 0).tolist():  # resident ones: re-rank
            key = (layer, e)
            if key in self._bytes:
                self._boosted[key] = layer
                self._push(key)

    def check(self, keys: set[Key]) -> None:
        require(set(self._bytes) == keys, "lrfu: resident set does not track the table's")
        current = {item[2] for item in self._heap
                   if self._version.get(item[2]) == item[1] and item[2] in self._bytes}
        require(current == keys, "lrfu: a resident key has no current heap entry")
        require(all(math.isfinite(v) for v in self._log_rate.values()), "lrfu: a rate is not finite")
        for key, layer in self._boosted.items():
            require(key in self._bytes and isinstance(key, tuple) and key[0] == layer,
                    f"lrfu: boost of {key!r} held for layer {layer!r}")

    # ------------------------------------------------------------------ usage history

    @property
    def pinned_experts(self) -> int:
        return 0  # rates rank every expert; nothing needs pinning

    def history(self) -> dict[str, npt.NDArray[np.generic]]:
        """Every expert's routing rate now (``[L, E]``; 0 for one never requested), with the
        model's shape: what ``history=`` saves at ``close()``."""
        shape = self._require_shape()
        pos = {layer: i for i, layer in enumerate(shape.layers)}
        rate = np.zeros((len(shape.layers), shape.n_expert))
        now = self._now * _LAMBDA
        for key, score in self._log_rate.items():
            if isinstance(key, tuple) and key[0] in pos and isinstance(key[1], int) and 0 <= key[1] < shape.n_expert:
                rate[pos[key[0]], key[1]] = math.exp(score - now)
        return {"layers": np.array(shape.layers, dtype=np.int64), "n_expert": np.array(shape.n_expert),
                "k": np.array(shape.experts_per_token), "rate": rate}

    def load_history(self, arrays: Mapping[str, npt.NDArray[np.generic]], source: str) -> None:
        """Seed each expert's rate with a saved one, decayed by half (``residency/_history.py``)
        and added to what this run saw; a ``StoreError`` naming ``source`` and the field when
        it does not fit this model."""
        shape = self._require_shape()
        want = (len(shape.layers), shape.n_expert)
        got = arrays["rate"].shape if "rate" in arrays else "missing"
        if got != want:
            raise StoreError(f"usage history {source}: field 'rate' is {got}, this model needs {want} "
                             "(a history saved by another policy?)")
        if (tuple(int(x) for x in arrays.get("layers", np.zeros(0))) != tuple(shape.layers)
                or int(arrays.get("n_expert", -1)) != shape.n_expert):
            raise StoreError(f"usage history {source}: saved for another model shape")
        rate = np.asarray(arrays["rate"], dtype=np.float64)
        if not np.all(np.isfinite(rate) & (rate >= 0)):
            raise StoreError(f"usage history {source}: field 'rate' holds a negative or non-finite value")
        now = self._now * _LAMBDA
        for i, layer in enumerate(shape.layers):
            for e in np.flatnonzero(rate[i]).tolist():
                key = (layer, e)
                old = self._log_rate.get(key)
                mine = 0.0 if old is None else math.exp(old - now)
                self._log_rate[key] = math.log(mine + _history.HISTORY_DECAY * float(rate[i, e])) + now
                if key in self._bytes:
                    self._push(key)

    def _require_shape(self) -> ModelShape:
        if self._shape is None:
            raise StoreError("policy 'lrfu' needs the model's shape before a history")
        return self._shape

    # ------------------------------------------------------------------ internals

    def _batch_starts(self, layer: object) -> None:
        previous = self._layer
        self._layer = layer
        self._now += 1.0 / self._layers
        if previous is not None:
            # the visit the estimate was for has passed: what it loaded and was not routed
            # goes back to its own rate
            self._expected.pop(previous, None)
            stale = [k for k, lay in self._boosted.items() if lay == previous]
            for k in stale:
                del self._boosted[k]
                self._push(k)

    def _log_value(self, key: Key) -> float:
        """``log(rate) + now x lambda`` for ranking: the engine's estimate while boosted."""
        own = self._log_rate.get(key, _FLOOR + self._now * _LAMBDA)
        layer = key[0] if isinstance(key, tuple) else None
        expected = self._expected.get(layer)
        if expected is not None and (key in self._boosted or key not in self._bytes):
            e = key[1] if isinstance(key, tuple) else -1
            if isinstance(e, int) and 0 <= e < expected.shape[0] and expected[e] > 0:
                own = max(own, math.log(float(expected[e])) + self._now * _LAMBDA)
        return own

    def _push(self, key: Key) -> None:
        v = self._version[key] = self._version.get(key, 0) + 1
        score = self._log_value(key) - math.log(max(self._bytes.get(key, 1), 1))
        heapq.heappush(self._heap, (score, v, key))
        if len(self._heap) > _COMPACT * len(self._bytes) + 64:
            self._heap = [item for item in self._heap
                          if self._version.get(item[2]) == item[1] and item[2] in self._bytes]
            heapq.heapify(self._heap)
