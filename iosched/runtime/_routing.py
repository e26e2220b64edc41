"""Validation of the router output an engine hands to ``ExpertStore.observe_routing``.

Why a module: the store passes the router's choices for a batch of tokens to its policy
(``on_routing``, ``residency/alternatives/moe.py`` learns which experts go together from a prompt's rows),
and bad input must never reach the policy's arrays: a ``StoreError`` names the culprit and the
store stays usable.  Kept out of ``_store.py`` so the store's module stays about serving.

Accepted shapes: ``[tokens, k]`` integers (a numpy array, a CPU tensor's ``.numpy()``, or
nested lists), or ``[k]`` for one token; ``-1`` marks an empty slot (a token that routed
fewer experts).  Every other value must name an expert of ``layer`` in the checkpoint.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from iosched._errors import StoreError, UnknownExpertError
from iosched._layout import CheckpointIndex


def routing_rows(index: CheckpointIndex, layer: Any, experts: Any) -> npt.NDArray[np.int64]:
    """``experts`` as a fresh ``int64 [tokens, k]`` array, after checking that ``layer`` and
    every expert named exist in ``index``; a ``StoreError`` naming what does not."""
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
        raise UnknownExpertError(f"observe_routing: layer must be an int, got {layer!r}")
    layer = int(layer)
    try:
        arr = np.asarray(experts)
    except (TypeError, ValueError) as exc:
        raise StoreError(f"observe_routing: layer {layer}: experts are not an array: {exc}") from None
    if arr.dtype == object or not np.issubdtype(arr.dtype, np.integer) or arr.dtype == np.bool_:
        raise StoreError(f"observe_routing: layer {layer}: experts must be integers "
                         f"(a [tokens, k] array), got dtype {arr.dtype}")
    if arr.ndim == 1:
        arr = arr.reshape(1, -1)
    if arr.ndim != 2:
        raise StoreError(f"observe_routing: layer {layer}: experts must be [tokens, k], got "
                         f"shape {arr.shape}")
    if arr.size and np.issubdtype(arr.dtype, np.unsignedinteger) and int(arr.max()) > np.iinfo(np.int64).max:
        # would wrap negative as int64 (2**64 - 1 would read as -1, an empty slot)
        raise StoreError(f"observe_routing: layer {layer}: expert id {int(arr.max())} is out of range")
    rows = arr.astype(np.int64)  # a copy: the engine may reuse its buffer
    named = [e for e in np.unique(rows).tolist() if e != -1]
    missing = [e for e in named if (layer, e) not in index.experts]
    if missing or not named:  # all padding names no expert, so say whether the layer exists
        if not any(key[0] == layer for key in index.experts):
            raise UnknownExpertError(f"observe_routing: no layer {layer} in {index.root} "
                                     f"(layers {index.layers()[0]}..{index.layers()[-1]})")
    if missing:
        raise UnknownExpertError(f"observe_routing: no expert ({layer}, {missing[0]}) in {index.root}")
    return rows


def layer_sizes(index: CheckpointIndex) -> dict[int, int]:
    """Experts per MoE layer, for :func:`expectation`, when each layer's are numbered from 0
    (a layer whose are not is left out: an estimate for it cannot be indexed by expert)."""
    count: dict[int, int] = {}
    for layer, _ in index.experts:
        count[layer] = count.get(layer, 0) + 1
    return {layer: n for layer, n in count.items() if all((layer, e) in index.experts for e in range(n))}


def expectation(index: CheckpointIndex, sizes: dict[int, int], layer: Any,
                probabilities: Any) -> npt.NDArray[np.float64]:
    """``probabilities`` as a fresh ``float64 [E]`` array (E: the experts ``layer`` has,
    ``sizes`` from :func:`layer_sizes`), after checking the layer and that every value is a
    number in [0, 1]; a ``StoreError`` naming the layer (or the first bad expert) otherwise."""
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
        raise UnknownExpertError(f"expect: layer must be an int, got {layer!r}")
    layer = int(layer)
    n = sizes.get(layer)
    if n is None:
        if any(key[0] == layer for key in index.experts):
            raise UnknownExpertError(f"expect: layer {layer}'s experts are not numbered from 0 in {index.root}")
        raise UnknownExpertError(f"expect: no layer {layer} in {index.root} "
                                 f"(layers {index.layers()[0]}..{index.layers()[-1]})")
    try:
        arr = np.asarray(probabilities)
    except (TypeError, ValueError) as exc:
        raise StoreError(f"expect: layer {layer}: probabilities are not an array: {exc}") from None
    if arr.dtype == object or arr.dtype == np.bool_ or not (np.issubdtype(arr.dtype, np.floating)
                                                             or np.issubdtype(arr.dtype, np.integer)):
        raise StoreError(f"expect: layer {layer}: probabilities must be numbers, got dtype {arr.dtype}")
    if arr.shape != (n,):
        raise StoreError(f"expect: layer {layer} has {n} experts; probabilities must have shape ({n},), "
                         f"got {arr.shape}")
    out = arr.astype(np.float64)  # a copy: the engine may reuse its buffer
    ok = (out >= 0.0) & (out <= 1.0)  # NaN fails both
    if not ok.all():
        e = int(np.flatnonzero(~ok)[0])
        raise StoreError(f"expect: layer {layer}: probability of expert {e} is {arr[e]!r}, not in [0, 1]")
    return out
