"""Which block device holds a file: the name the per-device statistics are keyed by.

A partition is reported as its disk (``vda1`` -> ``vda``): queue depth and bandwidth are
properties of the disk.  Files on devices without a sysfs entry (overlayfs, tmpfs, btrfs
subvolumes: major 0) are reported as ``dev0:N``; issue #4's pyudev topology resolves those
through mountinfo.
"""

from __future__ import annotations

import os


def device_of(path: str) -> str:
    st = os.stat(path)
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    sys_path = f"/sys/dev/block/{major}:{minor}"
    try:
        real = os.path.realpath(sys_path)
        if not os.path.exists(real) or real == sys_path:
            raise FileNotFoundError(sys_path)
        if os.path.exists(os.path.join(real, "partition")):
            real = os.path.dirname(real)
        return os.path.basename(real)
    except OSError:
        return f"dev{major}:{minor}"
