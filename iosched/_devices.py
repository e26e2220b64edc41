"""Which block device holds a file, and the facts about it the read path needs.

A partition is reported as its disk (``vda1`` -> ``vda``): queue depth, block size and
bandwidth are properties of the disk.  Files on devices without a sysfs entry (overlayfs,
tmpfs, btrfs subvolumes: major 0) are reported as ``dev0:N``; issue #4's pyudev topology
resolves those through mountinfo.
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


def device_of(path: str) -> str:
    disk = _sysfs_disk(path)
    if disk is not None:
        return os.path.basename(disk)
    st = os.stat(path)
    return f"dev{os.major(st.st_dev)}:{os.minor(st.st_dev)}"


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
