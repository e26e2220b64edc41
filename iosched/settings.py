"""The settings table and its run-time override: the supported surface for tools and operators.

Every knob of iosched is one :class:`Setting` in :data:`SETTINGS`, with an ``IOSCHED_*``
environment variable read once when first needed; :func:`get` answers the value in force
(the innermost :func:`override`, else the environment, else the default) and
:func:`override` changes settings for the duration of a ``with`` block.  ``docs/settings.md``
is generated from :data:`SETTINGS` (``python -m iosched.tools.settings_doc``).

This module only re-exports ``iosched._settings``, where the table is defined, so that the
command-line tools and operators' scripts need no private module; ``iosched.override_settings``
is the same function as :func:`override`.  The core, the backends and the residency
policies keep importing ``iosched._settings`` (a leaf module: docs/design.md, "Import rules").
"""

from ._settings import SETTINGS, Setting, get, override

__all__ = ["SETTINGS", "Setting", "get", "override"]
