"""Read backends, one a file, behind the protocol in ``_base``.

``create(name)`` builds a backend by name; ``available()`` says which can run here and, for
those that cannot, why.
"""

from __future__ import annotations

# The core first: it imports this package's modules, and they import its leaf modules, so a
# program that starts with ``import backends`` would otherwise meet a half-initialised module.
import iosched  # noqa: F401

from iosched import _settings
from iosched._errors import BackendUnavailable

from ._base import Backend, Caps
from .pread import PreadBackend

__all__ = ["Backend", "Caps", "available", "create", "resolve"]

_NAMES = ("pread", "odirect", "mmap", "uring")


def available() -> dict[str, str | None]:
    """Each backend name mapped to ``None`` when it can run here, else the reason it cannot."""
    reasons: dict[str, str | None] = {name: "not implemented yet (issue #3)" for name in _NAMES}
    reasons["pread"] = None
    return reasons


def resolve(name: str) -> tuple[str, str | None]:
    """The backend ``name`` stands for, and why ``auto`` chose it (``None`` when asked by name)."""
    if name == "auto":
        return "pread", "auto: pread is the only backend implemented so far"
    if name not in _NAMES:
        raise BackendUnavailable(f"unknown backend {name!r}; choose one of auto, {', '.join(_NAMES)}")
    reason = available()[name]
    if reason is not None:
        raise BackendUnavailable(f"backend {name!r} is unavailable here: {reason}")
    return name, None


def create(name: str) -> Backend:
    if name == "pread":
        return PreadBackend(threads=int(_settings.get("pread_threads")))
    raise BackendUnavailable(f"backend {name!r} is unavailable here: {available().get(name)}")
