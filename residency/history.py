"""Reading and writing a saved usage history: the supported surface for the store.

A usage history is what one run of the ``moe`` policy learned (``ExpertStore.open(...,
history=PATH)``), a plain ``numpy.savez`` archive without pickle; the policy itself builds
and checks the arrays (``history()`` / ``load_history()``), and these two functions move them
to and from a file: :func:`save` writes atomically (a temporary file, then a rename),
:func:`load` checks the format version and names the file in the ``StoreError`` it raises.

This module only re-exports ``iosched.residency._history``, where the format, the decay and
the pinning rules live, so that the core imports no private module of this package
(docs/design.md, "Import rules").
"""

from ._history import load, save

__all__ = ["load", "save"]
