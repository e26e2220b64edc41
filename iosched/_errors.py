"""The exception hierarchy.

Every error the store raises on behalf of bad input is a :class:`StoreError` whose message
names the culprit (a file, a key, a setting), so an engine can log it and carry on: the
store stays usable for every other key.
"""

from __future__ import annotations


class StoreError(Exception):
    """Base class of every error raised by iosched on behalf of bad input or failed I/O."""


class CheckpointError(StoreError):
    """A checkpoint file is missing, malformed, or does not hold what its index says."""


class UnknownExpertError(StoreError, KeyError):
    """The key is not a (layer, expert) of this checkpoint, or not a key at all."""

    def __str__(self) -> str:  # KeyError would repr() the message; keep it readable
        return str(self.args[0]) if self.args else ""


class BudgetError(StoreError):
    """A budget is malformed, or an expert can never fit in it."""


class ReadError(StoreError):
    """A read failed or came back short; the message names the file and the extent."""


class ChecksumError(ReadError):
    """With ``verify="reads"``: an extent's bytes matched the manifest on no replica; the
    message names the file, the extent (offset, length) and both checksums."""


class BackendUnavailable(StoreError):
    """The requested backend cannot run here; the message says why."""


class StoreClosed(StoreError):
    """The store was closed."""


class InvariantError(AssertionError):
    """An internal invariant does not hold: a bug in iosched or in a policy, never bad input.

    Raised by the explicit checks (``ResidencyTable.check()``, a policy's ``check()``,
    ``ExpertStore.check_invariants()``) instead of a bare ``assert``, so they still hold under
    ``python -O``.  A subclass of ``AssertionError`` because that is what it reports."""


def require(condition: object, message: str) -> None:
    """Raise :class:`InvariantError` with ``message`` unless ``condition`` holds (a check that
    ``python -O`` does not strip, unlike ``assert``)."""
    if not condition:
        raise InvariantError(message)
