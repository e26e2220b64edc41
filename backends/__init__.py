"""Read backends, one a file, behind the protocol in ``_base``.

``create(name)`` builds a backend by name; ``available()`` says which can run here and, for
those that cannot, why; ``resolve(name)`` turns ``auto`` into a name, with the reason.
"""

from __future__ import annotations

# The core first: it imports this package's modules, and they import its leaf modules, so a
# program that starts with ``import backends`` would otherwise meet a half-initialised module.
import iosched  # noqa: F401
from iosched import _settings
from iosched._errors import BackendUnavailable

from ._base import Backend, Caps, ZeroCopyBackend

__all__ = ["Backend", "Caps", "NAMES", "ZeroCopyBackend", "available", "create", "resolve"]

NAMES = ("pread", "odirect", "mmap", "uring")


def _uring_reason() -> str | None:
    from .uring import probe

    return probe()


def available() -> dict[str, str | None]:
    """Each backend name mapped to ``None`` when it can run here, else the reason it cannot."""
    return {"pread": None, "odirect": None, "mmap": None, "uring": _uring_reason()}


def resolve(name: str) -> tuple[str, str | None]:
    """The backend ``name`` stands for, and why ``auto`` chose it (``None`` when asked by name)."""
    if name == "auto":
        return "pread", "auto: pread until the backend sweep measures a better choice"
    if name not in NAMES:
        raise BackendUnavailable(f"unknown backend {name!r}; choose one of auto, {', '.join(NAMES)}")
    reason = available()[name]
    if reason is not None:
        raise BackendUnavailable(f"backend {name!r} is unavailable here: {reason}")
    return name, None


def create(name: str) -> Backend:
    """A new, unopened backend; ``name`` must be one :func:`resolve` accepts (not ``auto``)."""
    threads = int(_settings.get("pread_threads"))
    if name == "pread":
        from .pread import PreadBackend

        return PreadBackend(threads)
    if name == "odirect":
        from .odirect import ODirectBackend

        return ODirectBackend(threads)
    if name == "mmap":
        from .mmap import MmapBackend

        return MmapBackend(threads)
    if name == "uring":
        reason = _uring_reason()
        if reason is not None:
            raise BackendUnavailable(f"backend 'uring' is unavailable here: {reason}")
        from .uring import UringBackend

        return UringBackend(direct=True)
    raise BackendUnavailable(f"unknown backend {name!r}; choose one of {', '.join(NAMES)}")
