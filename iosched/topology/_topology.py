"""Which drive holds a file, its queue settings, and how fast it reads.

Mapping rules (``docs/topology.md`` has the full story):

* a file's ``st_dev`` with a sysfs entry (``/sys/dev/block/MAJ:MIN``) is that block device; a
  partition is reported as its disk (``vda1`` -> ``vda``): queue depth, block size and
  bandwidth are properties of the disk;
* md and dm devices are drives of their own, with ``members``: the disks found by following
  ``slaves/`` down to the leaves (partitions again mapped to their disks); a loop device's
  member is the drive holding its backing file;
* a major-0 ``st_dev`` (overlayfs, btrfs, tmpfs, network filesystems) is resolved through
  ``/proc/self/mountinfo``: the mount with the longest mount point containing the path; for
  overlayfs the layer (upper first, then the lowers) that holds the path, resolved again; for a
  filesystem whose source is a block device (btrfs) that device; anything else is a *virtual*
  drive named after the filesystem (``tmpfs``, ``nfs4:server:/export``).

Facts come from pyudev when it can be imported and find the device, else from plain sysfs
reads; :attr:`Drive.discovery` says which.  The TOML topology schema lives in
:mod:`iosched.topology._topology_toml` (re-exported here).
"""

from __future__ import annotations

import asyncio
import math
import mmap
import os
import random
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

from iosched._errors import StoreError

from ._topology_toml import (
    DEFAULT_QUEUE_DEPTH,
    DEFAULT_ROUTING_POLICY,
    DEFAULT_STRIPE_THRESHOLD,
    ROUTING_POLICIES,
    DeviceConfig,
    Topology,
    TopologyError,
    dump_topology,
    is_topology_file,
    load_topology,
    loads_topology,
)

__all__ = [
    "DEFAULT_QUEUE_DEPTH", "DEFAULT_ROUTING_POLICY", "DEFAULT_STRIPE_THRESHOLD", "ROUTING_POLICIES",
    "DeviceConfig", "Discovery", "Drive", "Mount", "Topology", "TopologyError", "drive_of", "drives_of",
    "dump_topology", "is_topology_file", "load_topology", "loads_topology", "probe_bandwidth",
    "probe_drive", "read_mountinfo", "suggest_queue_depth",
]

MEMORY_FILESYSTEMS = ("tmpfs", "ramfs", "devtmpfs", "hugetlbfs")
_MAX_DEPTH = 8  # overlay over loop over overlay...: resolution recursion bound


@dataclass(frozen=True)
class Drive:
    name: str
    """The disk (``vda``, ``nvme0n1``; a partition's parent), the md/dm/loop device itself, or a
    virtual drive's filesystem (``tmpfs``)."""
    dev: str
    """``major:minor`` of the disk (of the filesystem for a virtual drive)."""
    kind: str
    """``disk``, ``md``, ``dm``, ``loop`` or ``virtual``."""
    rotational: bool | None = None
    logical_block_size: int | None = None
    max_sectors_kb: int | None = None
    nr_requests: int | None = None
    numa_node: int | None = None
    """None when unknown (sysfs says -1 on a machine without NUMA information)."""
    scheduler: str | None = None
    """The active I/O scheduler (the bracketed one in ``queue/scheduler``)."""
    model: str | None = None
    members: tuple[str, ...] = ()
    """The disks a read can land on, for md/dm (through ``slaves/``) and loop devices."""
    virtual: bool = False
    """No block device behind it (tmpfs, network filesystems)."""
    memory_backed: bool = False
    """Reads are served from memory: tmpfs/ramfs, or a loop device without direct I/O (its
    backing file is read through the page cache).  A probe then measures memory, not a drive."""
    discovery: str = "sysfs"
    """How the facts were found: ``pyudev``, ``sysfs`` or ``mountinfo`` (virtual drives)."""

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["members"] = list(self.members)
        return out


# ---------------------------------------------------------------------------------------------
# mountinfo


@dataclass(frozen=True)
class Mount:
    mount_point: str
    root: str
    """The path inside the filesystem that is mounted there (not "/" for bind mounts)."""
    dev: str
    fstype: str
    source: str
    options: tuple[tuple[str, str], ...]
    """Mount and superblock options, in order, as (key, value) ("" for flags)."""

    def option(self, key: str) -> list[str]:
        return [v for k, v in self.options if k == key]


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline, backslash (and overlay's commas) as ``\\NNN``."""
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1:i + 4].isdigit() and len(field[i + 1:i + 4]) == 3:
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def read_mountinfo(path: str = "/proc/self/mountinfo") -> list[Mount]:
    mounts = []
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields = line.split()
            if "-" not in fields or len(fields) < 6:
                continue
            sep = fields.index("-")
            post = fields[sep + 1:]
            if len(post) < 2:
                continue
            opts = ",".join(x for x in (fields[5], post[2] if len(post) > 2 else "") if x)
            options = tuple((k, v) for k, _, v in (o.partition("=") for o in opts.split(",") if o))
            mounts.append(Mount(mount_point=_unescape(fields[4]), root=_unescape(fields[3]), dev=fields[2],
                                fstype=post[0], source=_unescape(post[1]),
                                options=tuple((k, _unescape(v)) for k, v in options)))
    return mounts


def mount_of(path: str, mounts: Iterable[Mount]) -> Mount | None:
    """The mount holding absolute ``path``: longest mount point, the last mounted on a tie."""
    best: Mount | None = None
    for m in mounts:
        mp = m.mount_point
        if path == mp or mp == "/" or path.startswith(mp.rstrip("/") + "/"):
            if best is None or len(mp) >= len(best.mount_point):
                best = m
    return best


def _split_lowerdir(value: str) -> list[str]:
    parts, cur, i = [], [], 0
    while i < len(value):
        if value[i] == "\\" and i + 1 < len(value):
            cur.append(value[i + 1])
            i += 2
            continue
        if value[i] == ":":
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(value[i])
        i += 1
    parts.append("".join(cur))
    return [p for p in parts if p]


def overlay_layers(m: Mount) -> list[str]:
    """An overlay mount's layer folders, top first: upperdir, then every lower (and data) dir."""
    layers = m.option("upperdir")
    for key in ("lowerdir", "lowerdir+", "datadir+"):
        for value in m.option(key):
            layers += _split_lowerdir(value)
    return layers


# ---------------------------------------------------------------------------------------------
# sysfs and pyudev


class _Sysfs:
    """Facts read from sysfs files; nodes are real sysfs device folders."""

    name = "sysfs"

    def __init__(self, root: str = "/sys") -> None:
        self.root = root

    def lookup(self, major: int, minor: int) -> str | None:
        link = os.path.join(self.root, "dev", "block", f"{major}:{minor}")
        real = os.path.realpath(link)
        return real if real != link and os.path.isdir(real) else None

    def attr(self, node: str, name: str) -> str | None:
        try:
            with open(os.path.join(node, name), encoding="utf-8", errors="replace") as f:
                return f.read().strip()
        except OSError:
            return None

    def is_partition(self, node: str) -> bool:
        return os.path.exists(os.path.join(node, "partition"))

    def parent_disk(self, node: str) -> str:
        return os.path.dirname(node)

    def slaves(self, node: str) -> list[str]:
        folder = os.path.join(node, "slaves")
        try:
            names = sorted(os.listdir(folder))
        except OSError:
            return []
        return [os.path.realpath(os.path.join(folder, n)) for n in names]

    def numa_node(self, node: str) -> int | None:
        for start in (node, os.path.realpath(os.path.join(node, "device"))):
            here = start
            while here.startswith(self.root.rstrip("/") + "/"):
                text = self.attr(here, "numa_node")
                if text is not None:
                    return _numa(text)
                here = os.path.dirname(here)
        return None


def _numa(text: str | None) -> int | None:
    try:
        value = int(text or "")
    except ValueError:
        return None
    return value if value >= 0 else None


class _Udev(_Sysfs):
    """The same facts through pyudev (libudev): device lookup, attributes, parents."""

    name = "pyudev"

    def __init__(self) -> None:
        super().__init__("/sys")
        import pyudev

        self._pyudev = pyudev
        self._ctx = pyudev.Context()

    def _device(self, node: str) -> Any:
        return self._pyudev.Devices.from_sys_path(self._ctx, node)

    def lookup(self, major: int, minor: int) -> str | None:
        try:
            device = self._pyudev.Devices.from_device_number(self._ctx, "block", os.makedev(major, minor))
        except (self._pyudev.DeviceNotFoundError, ValueError):
            return None
        return str(device.sys_path)

    def attr(self, node: str, name: str) -> str | None:
        try:
            return str(self._device(node).attributes.asstring(name)).strip()
        except (KeyError, UnicodeDecodeError, self._pyudev.DeviceNotFoundError):
            return None

    def is_partition(self, node: str) -> bool:
        return bool(self._device(node).device_type == "partition")

    def parent_disk(self, node: str) -> str:
        parent = self._device(node).find_parent("block", "disk")
        return str(parent.sys_path) if parent is not None else super().parent_disk(node)

    def numa_node(self, node: str) -> int | None:
        device = self._device(node)
        for d in (device, *device.ancestors):
            try:
                return _numa(d.attributes.asstring("numa_node"))
            except KeyError:
                continue
        return _numa(self.attr(node, "device/numa_node"))


def _source(discovery: str, sysfs_root: str) -> _Sysfs:
    if discovery not in ("auto", "pyudev", "sysfs"):
        raise StoreError(f"discovery must be auto, pyudev or sysfs, got {discovery!r}")
    if discovery == "sysfs" or sysfs_root != "/sys":
        return _Sysfs(sysfs_root)
    try:
        return _Udev()
    except Exception as exc:  # ImportError, or libudev missing (ImportError/OSError inside pyudev)
        if discovery == "pyudev":
            raise StoreError(f"pyudev is unavailable: {exc} (pip install pyudev)") from None
        return _Sysfs(sysfs_root)


# ---------------------------------------------------------------------------------------------
# resolution


class Discovery:
    """Maps paths to drives, caching per device number; one object per command or store open."""

    def __init__(self, discovery: str = "auto", *, sysfs_root: str = "/sys",
                 mountinfo: str = "/proc/self/mountinfo") -> None:
        self.source = _source(discovery, sysfs_root)
        self._mountinfo_path = mountinfo
        self._mounts: list[Mount] | None = None
        self._by_node: dict[str, Drive] = {}
        self._by_devnum: dict[tuple[int, int], Drive | None] = {}

    @property
    def method(self) -> str:
        """``pyudev`` or ``sysfs``."""
        return self.source.name

    def mounts(self) -> list[Mount]:
        if self._mounts is None:
            try:
                self._mounts = read_mountinfo(self._mountinfo_path)
            except OSError:
                self._mounts = []
        return self._mounts

    def drive_of(self, path: str | os.PathLike[str], _depth: int = 0) -> Drive:
        path = os.fspath(path)
        try:
            st = os.stat(path)
        except OSError as exc:
            raise StoreError(f"{path}: cannot stat: {exc.strerror or exc}") from None
        major, minor = os.major(st.st_dev), os.minor(st.st_dev)
        if major != 0:
            drive = self.drive_of_devnum(major, minor, _depth)
            if drive is not None:
                return drive
        return self._via_mount(os.path.realpath(path), f"{major}:{minor}", _depth)

    def drive_of_devnum(self, major: int, minor: int, _depth: int = 0) -> Drive | None:
        """The drive of block device ``major:minor``; None when sysfs does not know it."""
        key = (major, minor)
        if key not in self._by_devnum:
            node = self.source.lookup(major, minor)
            self._by_devnum[key] = None if node is None else self._drive_of_node(node, _depth)
        return self._by_devnum[key]

    def _via_mount(self, real: str, dev: str, depth: int) -> Drive:
        m = mount_of(real, self.mounts())
        if m is None:
            return Drive(name=f"dev{dev}", dev=dev, kind="virtual", virtual=True, discovery="mountinfo")
        if depth < _MAX_DEPTH and m.fstype == "overlay":
            rel = os.path.relpath(real, m.mount_point)
            inside = os.path.normpath(os.path.join(m.root.lstrip("/"), rel))
            layers = overlay_layers(m)
            for layer in layers:  # the layer that holds the path; whiteouts hide lower copies
                cand = os.path.join(layer, inside)
                try:
                    cst = os.lstat(cand)
                except OSError:
                    continue
                if stat.S_ISCHR(cst.st_mode) and cst.st_rdev == 0:
                    break
                return self.drive_of(cand, depth + 1)
            for layer in layers:
                if os.path.isdir(layer):
                    return self.drive_of(layer, depth + 1)
        if depth < _MAX_DEPTH and m.source.startswith("/dev/"):
            try:
                rdev = os.stat(m.source).st_rdev
            except OSError:
                rdev = 0
            if rdev:
                drive = self.drive_of_devnum(os.major(rdev), os.minor(rdev), depth + 1)
                if drive is not None:
                    return drive
        name = m.fstype if m.fstype in MEMORY_FILESYSTEMS or m.source in ("", "none", m.fstype) \
            else f"{m.fstype}:{m.source}"
        return Drive(name=name, dev=m.dev, kind="virtual", virtual=True,
                     memory_backed=m.fstype in MEMORY_FILESYSTEMS, discovery="mountinfo")

    def _drive_of_node(self, node: str, depth: int) -> Drive:
        src = self.source
        if src.is_partition(node):
            node = src.parent_disk(node)
        cached = self._by_node.get(node)
        if cached is not None:
            return cached
        name = os.path.basename(node)
        kind = next((k for k in ("dm", "md", "loop") if os.path.isdir(os.path.join(node, k))), "disk")
        members: list[str] = []
        memory = False
        numa = src.numa_node(node)
        if kind in ("dm", "md"):
            for slave in src.slaves(node):
                sub = self._drive_of_node(slave, depth + 1)
                for disk in sub.members or (sub.name,):
                    if disk not in members:
                        members.append(disk)
        elif kind == "loop" and depth < _MAX_DEPTH:
            backing = src.attr(node, "loop/backing_file")
            if backing and os.path.exists(backing):
                sub = self.drive_of(backing, depth + 1)
                members = list(sub.members or (sub.name,))
                memory = sub.memory_backed or src.attr(node, "loop/dio") == "0"
        if numa is None and members:
            nodes = {self._by_name_numa(m) for m in members}
            numa = nodes.pop() if len(nodes) == 1 else None
        sched = src.attr(node, "queue/scheduler")
        if sched and "[" in sched:
            sched = sched[sched.index("[") + 1:sched.index("]")]
        drive = Drive(
            name=name, dev=src.attr(node, "dev") or "?", kind=kind,
            rotational=_bool(src.attr(node, "queue/rotational")),
            logical_block_size=_int(src.attr(node, "queue/logical_block_size")),
            max_sectors_kb=_int(src.attr(node, "queue/max_sectors_kb")),
            nr_requests=_int(src.attr(node, "queue/nr_requests")),
            numa_node=numa, scheduler=sched or None,
            model=src.attr(node, "device/model") or None,
            members=tuple(members), memory_backed=memory, discovery=src.name,
        )
        self._by_node[node] = drive
        return drive

    def _by_name_numa(self, name: str) -> int | None:
        for drive in self._by_node.values():
            if drive.name == name:
                return drive.numa_node
        return None


def _int(text: str | None) -> int | None:
    try:
        return int(text or "")
    except ValueError:
        return None


def _bool(text: str | None) -> bool | None:
    value = _int(text)
    return None if value is None else bool(value)


def drive_of(path: str | os.PathLike[str], *, discovery: str = "auto") -> Drive:
    """The drive holding ``path`` (a :class:`StoreError` naming it when it cannot be stat'ed)."""
    return Discovery(discovery).drive_of(path)


def drives_of(paths: Iterable[str | os.PathLike[str]], *, discovery: str = "auto") -> dict[str, Drive]:
    """Each path (as given, ``os.fspath``'d) mapped to its drive, sharing one lookup cache."""
    d = Discovery(discovery)
    return {os.fspath(p): d.drive_of(p) for p in paths}


# ---------------------------------------------------------------------------------------------
# probing


def _percentile(sorted_ms: list[float], q: float) -> float:
    if not sorted_ms:
        return 0.0
    return sorted_ms[max(0, min(len(sorted_ms) - 1, math.ceil(q * len(sorted_ms)) - 1))]


def _probe_target(path: str, qd: int, bs: int, max_bytes: int, seconds: float) -> int:
    """The size of the file a probe reads; a ``StoreError`` for bad arguments or a file that
    is not a non-empty regular file."""
    if qd < 1 or bs < 1 or max_bytes < 1 or seconds <= 0:
        raise StoreError(f"probe needs qd, bs, max_bytes and seconds > 0, got {qd}, {bs}, {max_bytes}, {seconds}")
    try:
        size = os.path.getsize(path)
    except OSError as exc:
        raise StoreError(f"{path}: cannot stat: {exc.strerror or exc}") from None
    if size == 0 or not os.path.isfile(path):
        raise StoreError(f"{path}: probe needs a non-empty regular file")
    return size


async def probe_bandwidth(path_on_drive: str, qd: int = DEFAULT_QUEUE_DEPTH, bs: int = 1 << 20,
                          max_bytes: int = 256 << 20, seconds: float = 3.0, *,
                          progress: Callable[[int], None] | None = None, seed: int = 1) -> dict[str, Any]:
    """Random O_DIRECT reads of ``bs`` bytes from a real file, ``qd`` in flight at once.

    Stops when the next read would pass ``max_bytes`` or ``seconds`` have passed (the first read
    always runs); reads already in flight then finish.  Offsets are uniform random multiples of
    the alignment (at least 4 KiB) in ``[0, size - bs]``; a file smaller than ``bs`` is read
    whole, each time.  Returns ``mbps`` (10^6 bytes/s), ``reads``, ``bytes``, ``seconds``,
    ``p50_ms``, ``p99_ms``, and ``direct``: False when the filesystem refused O_DIRECT and the
    numbers are the page cache's.  ``progress`` is called with the bytes of each finished read.
    """
    from iosched import _settings, backends

    size = _probe_target(path_on_drive, qd, bs, max_bytes, seconds)
    with _settings.override(pread_threads=qd):
        backend = backends.create("odirect")
    backend.open([path_on_drive])
    buffers: list[mmap.mmap] = []
    try:
        align = max(4096, backend.alignment(0))
        want = min(bs, size)
        length = -(-want // align) * align
        slots = max(0, (size - want) // align)
        buffers = [mmap.mmap(-1, length) for _ in range(qd)]
        latencies: list[float] = []
        state = {"issued": 0, "bytes": 0}
        t0 = time.perf_counter()

        async def reader(i: int) -> None:
            rng = random.Random(seed * 1000 + i)
            view = memoryview(buffers[i])
            while True:
                if state["issued"] and (state["issued"] + want > max_bytes or time.perf_counter() - t0 >= seconds):
                    return
                state["issued"] += want
                offset = rng.randint(0, slots) * align if slots else 0
                start = time.perf_counter()
                n = await backend.read(0, offset, length, view)
                latencies.append((time.perf_counter() - start) * 1e3)
                state["bytes"] += min(n, want)
                if progress is not None:
                    progress(min(n, want))

        await asyncio.gather(*(reader(i) for i in range(qd)))
        elapsed = time.perf_counter() - t0
        info = backend.info()
    finally:
        backend.close()
        for b in buffers:
            b.close()
    latencies.sort()
    return {
        "file": path_on_drive, "file_bytes": size, "backend": "odirect",
        "direct": not info.get("buffered_fallbacks"), "qd": qd, "bs": want,
        "reads": len(latencies), "bytes": state["bytes"], "seconds": round(elapsed, 4),
        "mbps": round(state["bytes"] / elapsed / 1e6, 1) if elapsed > 0 else 0.0,
        "p50_ms": round(_percentile(latencies, 0.50), 3), "p99_ms": round(_percentile(latencies, 0.99), 3),
    }


def suggest_queue_depth(mbps_qd1: float | None, mbps_qd: float | None, qd: int, nr_requests: int | None) -> int:
    """Reads in flight to give a drive, from a probe at depth 1 and at depth ``qd``.

    Little's law: if ``qd`` reads in flight deliver ``ratio`` times the bandwidth of one, about
    ``ratio`` reads in flight already keep the drive busy, and deeper queues only add latency.
    Rule: ``ceil(1.5 * ratio)`` (headroom for the probe's noise) clamped to ``[1, qd]``; without
    a probe, ``qd`` (default :data:`DEFAULT_QUEUE_DEPTH`).  Capped by ``nr_requests``: deeper
    than the block layer's queue, reads only wait in the kernel.
    """
    depth = qd
    if mbps_qd1 and mbps_qd and mbps_qd1 > 0:
        depth = max(1, min(qd, math.ceil(1.5 * mbps_qd / mbps_qd1)))
    if nr_requests:
        depth = min(depth, nr_requests)
    return max(1, depth)


def suggest_inflight_bytes(mbps_qd1: float | None, mbps_qd: float | None, qd: int,
                           nr_requests: int | None, bs: int) -> int | None:
    """Bytes of reads in flight to give a drive (the store's per-drive cap, ``inflight_bytes``),
    from the same probe: the reads :func:`suggest_queue_depth` finds keep it busy, at the
    probe's read size ``bs``.  Little's law again, in bytes: that many bytes in flight already
    move the drive's bandwidth, and more only share it, so that reads finish together instead
    of one after another (``iosched/runtime/_scheduler.py``).  ``None`` without a probe (the setting
    then applies).  docs/topology.md: a 576 KiB probe of 1,312 MB/s at depth 1 and 1,848 at 8
    gives 3 x 576 KiB, the cap that read 576 KiB experts fastest on that drive."""
    if not (mbps_qd1 and mbps_qd and mbps_qd1 > 0):
        return None
    return suggest_queue_depth(mbps_qd1, mbps_qd, qd, nr_requests) * bs


async def probe_drive(path_on_drive: str, qd: int = DEFAULT_QUEUE_DEPTH, bs: int = 1 << 20,
                      max_bytes: int = 256 << 20, seconds: float = 3.0, *,
                      progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """The probe ``iosched topology --probe`` runs: a quarter of the byte and time budget at
    depth 1, the rest at depth ``qd``; the result is the depth-``qd`` run with ``qd1`` (the
    depth-1 run's mbps, p50_ms, p99_ms) added.  At most ``max_bytes`` (+ the reads in flight at
    the end) and about ``seconds`` in all."""
    one = await probe_bandwidth(path_on_drive, 1, bs, max(1, max_bytes // 4), seconds / 4, progress=progress)
    deep = await probe_bandwidth(path_on_drive, qd, bs, max(1, max_bytes - one["bytes"]), seconds * 3 / 4,
                                 progress=progress, seed=2)
    deep["qd1"] = {k: one[k] for k in ("mbps", "p50_ms", "p99_ms", "reads", "bytes")}
    return deep
