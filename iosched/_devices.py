"""The one fact about a file's block device the read path needs at open: O_DIRECT's alignment.

A partition's queue settings are its disk's (``vda1`` -> ``vda``).  Naming drives, and every
other fact about them, is ``iosched.topology._topology``'s (pyudev, mountinfo for major-0 devices).
"""

from __future__ import annotations

import os

DEFAULT_BLOCK_SIZE = 4096
"""Used when sysfs does not say: every common device's logical block size divides it."""


def _sysfs_disk(path: str) -> str | None:
    st = os.stat(path)
    sys_path = f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    real = os.path.realpath(sys_path)
    if real == sys_path or not os.path.exists(real):
        return None
    if os.path.exists(os.path.join(real, "partition")):
        real = os.path.dirname(real)
    return real


def logical_block_size(path: str) -> int:
    """The device's logical block size (O_DIRECT's alignment), :data:`DEFAULT_BLOCK_SIZE` when unknown."""
    disk = _sysfs_disk(path)
    if disk is None:
        return DEFAULT_BLOCK_SIZE
    try:
        with open(os.path.join(disk, "queue", "logical_block_size")) as f:
            return int(f.read().strip()) or DEFAULT_BLOCK_SIZE
    except (OSError, ValueError):
        return DEFAULT_BLOCK_SIZE
