"""Drives and topology files: the supported surface for tools and operators.

Which drive holds a file and its queue settings (:func:`drive_of`, :func:`drives_of`,
:class:`Drive`, :class:`Discovery`), how fast it reads (:func:`probe_bandwidth`,
:func:`probe_drive`, and the queue depth that speed suggests, :func:`suggest_queue_depth`),
and the TOML topology file that ``ExpertStore.open`` accepts as its source (:class:`Topology`, :class:`DeviceConfig`,
:func:`load_topology`, :func:`loads_topology`, :func:`dump_topology`,
:func:`is_topology_file`; a malformed file raises :class:`TopologyError`, a
``StoreError``).  ``iosched topology`` and ``iosched bench`` are built on these names, and
``docs/topology.md`` tells the mapping rules and the file's schema.

The topology room: this package's public names, re-exported from its private modules
(``_topology``: discovery and probes; ``_topology_toml``: the file's schema), so that the
tools need no private module; what is not named here (mount-table parsing, the sysfs
readers) stays internal.  It imports nothing of the runtime nor of the checkpoint formats.
"""

from ._topology import (
    DEFAULT_QUEUE_DEPTH,
    DeviceConfig,
    Discovery,
    Drive,
    Topology,
    TopologyError,
    drive_of,
    drives_of,
    dump_topology,
    is_topology_file,
    load_topology,
    loads_topology,
    probe_bandwidth,
    probe_drive,
    suggest_inflight_bytes,
    suggest_queue_depth,
)

__all__ = [
    "DEFAULT_QUEUE_DEPTH",
    "DeviceConfig",
    "Discovery",
    "Drive",
    "Topology",
    "TopologyError",
    "drive_of",
    "drives_of",
    "dump_topology",
    "is_topology_file",
    "load_topology",
    "loads_topology",
    "probe_bandwidth",
    "probe_drive",
    "suggest_inflight_bytes",
    "suggest_queue_depth",
]
