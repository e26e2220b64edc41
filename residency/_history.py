"""Saved usage history: what one run of the ``moe`` policy learned, carried to the next, and
the pins it implies.

Why: a cold policy spends its first tokens learning which experts a model routes, how reuse
decays with age and which experts follow which; an engine that restarts on the same model
need not (the replay's seeded arm measures what seeding gives: ``docs/tried-and-dropped.md``).  The
file is a plain ``numpy.savez`` archive (no pickle) of the learned arrays and the model's
shape; loading checks the shape and names the file and the field that do not fit.

Decay: a loaded history is multiplied by :data:`HISTORY_DECAY` (one half), so each earlier
run weighs half the one after it and the current run soon outweighs them all.

Pins: an expert the history saw routed at more than half of its layer's visits (the usage
rate over the history and the run, decayed counts over decayed visits) is *pinned*: it goes
last among victims, after the batch in progress.  It stays pinned until its rate falls below
a quarter (hysteresis: an expert near the threshold does not flap in and out), and pinned
experts hold at most half the budget, the most used first, so the rest still follows the
run.  Pins come only from a loaded history: a cold run's own counts already rank its experts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import numpy.typing as npt

from iosched._errors import StoreError

F64 = npt.NDArray[np.float64]

FORMAT = 1
HISTORY_DECAY = 0.5
PIN_ON = 0.5
PIN_OFF = 0.25
PINNED_SHARE = 0.5
"""Pinned experts hold at most this share of the budget."""


def save(path: str | os.PathLike[str], arrays: Mapping[str, npt.NDArray[np.generic]]) -> None:
    """Write ``arrays`` atomically (a temporary file in the same folder, then a rename)."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            fields = {name: value for name, value in arrays.items() if name != "format"}
            np.savez(f, format=np.array(FORMAT), **fields)  # type: ignore[arg-type]
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a half-written temporary file helps nobody
        raise


def load(path: str | os.PathLike[str]) -> dict[str, npt.NDArray[np.generic]]:
    """The arrays of the history file ``path``; a :class:`StoreError` naming it when it is not
    one (not an ``.npz`` archive of ours: a lone ``.npy`` array, another archive, garbage)."""
    try:
        data = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise StoreError(f"usage history {path}: not a readable history file ({exc})") from None
    if not isinstance(data, np.lib.npyio.NpzFile):
        raise StoreError(f"usage history {path}: not a history file (a numpy {type(data).__name__}, "
                         "not an .npz archive)")
    try:
        with data:
            arrays = {name: data[name] for name in data.files}
    except (OSError, ValueError, EOFError) as exc:
        raise StoreError(f"usage history {path}: not a readable history file ({exc})") from None
    if int(arrays.get("format", np.array(-1))) != FORMAT:
        raise StoreError(f"usage history {path}: format {arrays.get('format')!r}, expected {FORMAT}")
    return arrays


def require_fits(arrays: Mapping[str, npt.NDArray[np.generic]], source: str,
                 fields: Mapping[str, tuple[int, ...]], layers: tuple[int, ...], n_expert: int,
                 k: int) -> None:
    """A :class:`StoreError` naming ``source`` unless the history ``arrays`` hold each of
    ``fields`` with its shape and were saved for this model (its layers, experts and k): the
    check every policy that loads a history makes before it reads one."""
    for name, shape in fields.items():
        if name not in arrays or arrays[name].shape != shape:
            got = arrays[name].shape if name in arrays else "missing"
            raise StoreError(f"usage history {source}: field {name!r} is {got}, this model needs {shape}")
    if (tuple(int(x) for x in arrays["layers"]) != layers
            or int(arrays.get("n_expert", -1)) != n_expert or int(arrays.get("k", -1)) != k):
        raise StoreError(f"usage history {source}: saved for another model shape (layers, "
                         f"experts or k differ from {len(layers)} layers x {n_expert} experts, k={k})")


class Pins:
    """Decayed history counts and visits, and the pinned set with its hysteresis."""

    def __init__(self, n_layers: int, n_expert: int) -> None:
        self.visits: F64 = np.zeros(n_layers)
        """Decayed visits of each layer in the loaded history (0 when none was loaded)."""
        self.pinned = np.zeros((n_layers, n_expert), dtype=bool)

    @property
    def seeded(self) -> bool:
        return bool(self.visits.any())

    def update(self, count: F64, run_visits: npt.NDArray[np.int64], size: F64,
               budget: int | None) -> None:
        """Re-pin from the usage rates (once per token cycle): ``count`` is each expert's
        decayed history count plus this run's, ``run_visits`` the visits of this run."""
        if not self.seeded:
            return
        rate = count / np.maximum(self.visits + run_visits, 1.0)[:, None]
        pinned = (self.pinned | (rate >= PIN_ON)) & ~(rate < PIN_OFF)
        if budget is not None and pinned.any():
            idx = np.flatnonzero(pinned)
            order = idx[np.argsort(-rate.ravel()[idx], kind="stable")]
            keep = order[np.cumsum(size.ravel()[order]) <= PINNED_SHARE * budget]
            pinned = np.zeros_like(pinned)
            pinned.ravel()[keep] = True
        self.pinned = pinned
