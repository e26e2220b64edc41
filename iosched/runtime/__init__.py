"""The runtime: what an engine awaits, from ``acquire`` to the bytes on the drive.

The store and its parts: leases and the acquire path, loads into slabs, prefetch and its
pacing, per-drive queues and the read path over replicas, the budget's sizing and growth,
statistics and telemetry.  It sits above the checkpoint formats and the topology, and drives
``iosched.residency`` and ``iosched.backends`` (docs/design.md, "Where things live").  Empty
on purpose: importing one module of the room does not import the rest.
"""
