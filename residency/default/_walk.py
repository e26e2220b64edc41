"""Where the request stream is in the model: the batch in progress and each layer's visits.

A *batch* is the requests of one layer for one token (a decode batch routes at most ``k``
experts; a prompt's batch routes more).  The store tells the policy a batch's hits first,
then its misses, so a batch ends when a request names another layer position or repeats an
expert of the batch in progress.  Every part of the default policy reads its position,
its experts and the visit counts from here, so that no part keeps a copy.

Invariants: ``batch`` holds no expert twice; ``batch_pos`` is -1 exactly when no batch is in
progress; ``visit_now`` is ``visits[batch_pos]`` while one is.
"""

from __future__ import annotations

from iosched._errors import StoreError

from .._policy import Key, ModelShape


class LayerWalk:
    """The model's MoE layers in visit order, the keys validated so far, and the batch in
    progress (:meth:`begin`, :meth:`close`)."""

    def __init__(self, owner: str, shape: ModelShape | None = None) -> None:
        """``owner``: the policy's name, for errors; without ``shape`` every key is refused
        (a policy needs the model's shape before its first request)."""
        self.owner = owner
        self.layers: tuple[int, ...] = tuple(shape.layers) if shape is not None else ()
        self.pos = {layer: i for i, layer in enumerate(self.layers)}
        """Layer number -> position in visit order."""
        self.L = len(self.layers)
        self.E = shape.n_expert if shape is not None else 0
        self.k = shape.experts_per_token if shape is not None else 0
        self.expert_bytes = [shape.expert_bytes[layer] for layer in self.layers] if shape is not None else []
        self.where: dict[Key, tuple[int, int]] = {}
        """Keys validated so far: their layer position and expert."""
        self.visits = [0] * self.L
        """Per layer position: its batches begun so far."""
        self.missed = [True] * self.L
        """Per layer position: whether its last visit had a miss."""
        self.batch_pos = -1
        self.batch: list[int] = []
        self.visit_now = 0
        """The visit count of the batch in progress (its layer's)."""

    def locate(self, key: Key) -> tuple[int, int]:
        """Validate ``key`` once: its layer position and expert, remembered; a ``StoreError``
        naming the key when it is not ``(layer, expert)`` of this model."""
        if not self.pos:
            raise StoreError(f"policy '{self.owner}' needs the model's shape (set_shape) before requests")
        try:
            p = self.pos[key[0]]  # type: ignore[index]
        except (KeyError, TypeError, IndexError):
            raise StoreError(f"policy '{self.owner}': key {key!r} is not (layer, expert) of a MoE "
                             f"layer of the model's shape") from None
        expert = key[1] if isinstance(key, tuple) and len(key) == 2 else None
        if type(expert) is not int or not 0 <= expert < self.E:
            raise StoreError(f"policy '{self.owner}': key {key!r} is not (layer, expert) with an expert "
                             f"in 0..{self.E - 1}")
        self.where[key] = (p, expert)
        return p, expert

    def position_of(self, key: Key) -> int:
        where = self.where.get(key)
        return (where if where is not None else self.locate(key))[0]

    def begin(self, p: int) -> None:
        """A batch at position ``p`` begins (the one in progress was closed)."""
        self.batch_pos = p
        self.visits[p] += 1
        self.visit_now = self.visits[p]
        self.missed[p] = False

    def close(self) -> tuple[int, list[int], bool]:
        """End the batch in progress: its position, its experts and whether it was a decode
        batch (at most ``k`` experts)."""
        batch, pos = self.batch, self.batch_pos
        self.batch, self.batch_pos = [], -1
        return pos, batch, bool(batch) and len(batch) <= self.k

    def drop(self) -> None:
        """Forget the batch in progress without closing it (nothing will read it)."""
        self.batch, self.batch_pos = [], -1
