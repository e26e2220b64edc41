"""Topology (issue #4): files to drives on this machine's real devices, a fake sysfs for the
layouts it lacks (partitions, md, dm), real loop/overlay/btrfs mounts when root may make them,
the TOML schema, the probe and the ``iosched topology`` command."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from iosched import StoreError
from iosched.tools import _command
from iosched.tools import topology as topology_cli
from iosched.topology._topology import (
    DeviceConfig,
    Discovery,
    Topology,
    TopologyError,
    drive_of,
    drives_of,
    dump_topology,
    is_topology_file,
    load_topology,
    loads_topology,
    mount_of,
    overlay_layers,
    probe_bandwidth,
    read_mountinfo,
    suggest_inflight_bytes,
    suggest_queue_depth,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib  # type: ignore[import-not-found,unused-ignore]


def _expected_disk(path: Path) -> str | None:
    """What /sys/dev/block says holds ``path``: the device, or its parent when a partition."""
    dev = os.stat(path).st_dev
    real = os.path.realpath(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    if os.major(dev) == 0 or not os.path.isdir(real):
        return None
    if os.path.exists(os.path.join(real, "partition")):
        real = os.path.dirname(real)
    return os.path.basename(real)


def _write(path: Path, nbytes: int) -> Path:
    path.write_bytes(os.urandom(nbytes))
    return path


# ---------------------------------------------------------------------------------------------
# this machine


@pytest.mark.parametrize("discovery", ["auto", "sysfs"])
def test_file_on_this_machine(tmp_path: Path, discovery: str) -> None:
    f = _write(tmp_path / "x.bin", 4096)
    drive = drive_of(f, discovery=discovery)
    expected = _expected_disk(f)
    if expected is None:  # tmp on overlay/btrfs/tmpfs: resolved through mountinfo
        assert drive.discovery == "mountinfo" or not drive.virtual
        return
    assert drive.name == expected and not drive.virtual
    assert drive.logical_block_size in (512, 1024, 2048, 4096)
    assert drive.nr_requests is None or drive.nr_requests > 0
    assert drive.max_sectors_kb is None or drive.max_sectors_kb > 0
    assert drive.numa_node is None or drive.numa_node >= 0
    assert drive.discovery in ("pyudev", "sysfs")
    if discovery == "sysfs":
        assert drive.discovery == "sysfs"


def test_pyudev_and_sysfs_agree(tmp_path: Path) -> None:
    pytest.importorskip("pyudev")
    f = _write(tmp_path / "x.bin", 10)
    by_udev = Discovery("pyudev").drive_of(f)
    by_sysfs = Discovery("sysfs").drive_of(f)
    if by_udev.discovery == "mountinfo":
        assert by_udev == by_sysfs
    else:
        assert by_udev.discovery == "pyudev"
        assert {**by_udev.as_dict(), "discovery": "sysfs"} == by_sysfs.as_dict()


def test_vda_root_is_reported_as_vda() -> None:
    root = mount_of("/", read_mountinfo())
    if root is None or root.source != "/dev/vda":
        pytest.skip(f"the root filesystem is not on /dev/vda here ({root and root.source})")
    assert drive_of("/").name == "vda"


def test_tmpfs_is_a_virtual_drive(tmp_path: Path) -> None:
    m = mount_of("/dev/shm", read_mountinfo())
    if m is None or m.fstype != "tmpfs" or not os.access("/dev/shm", os.W_OK):
        pytest.skip("/dev/shm is not a writable tmpfs here")
    f = Path("/dev/shm") / f"iosched-topo-{os.getpid()}"
    try:
        _write(f, 100)
        assert os.major(os.stat(f).st_dev) == 0
        drive = drive_of(f)
        assert (drive.name, drive.kind, drive.virtual, drive.discovery) == ("tmpfs", "virtual", True, "mountinfo")
        assert drive.memory_backed
        assert drive.nr_requests is None
        both = drives_of([f, tmp_path])
        assert both[str(f)] == drive and both[str(tmp_path)].name != "tmpfs"
    finally:
        f.unlink(missing_ok=True)


def test_missing_path_is_a_store_error(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="nope"):
        drive_of(tmp_path / "nope")


# ---------------------------------------------------------------------------------------------
# a fake sysfs: partitions, md over partitions, dm over md, NUMA from the PCI parent


def _fake_sysfs(root: Path) -> None:
    def put(path: Path, text: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")

    def link(at: Path, target: Path) -> None:
        at.parent.mkdir(parents=True, exist_ok=True)
        at.symlink_to(os.path.relpath(target, at.parent))

    def queue(node: Path, rot: str, nr: str, sched: str) -> None:
        for k, v in (("rotational", rot), ("logical_block_size", "512"), ("max_sectors_kb", "128"),
                     ("nr_requests", nr), ("scheduler", sched)):
            put(node / "queue" / k, v)

    for i, numa in ((0, "1"), (1, "1")):
        pci = root / "devices" / "pci0000:00" / f"0000:00:0{i + 1}.0"
        put(pci / "numa_node", numa)
        ctrl = pci / "nvme" / f"nvme{i}"
        put(ctrl / "model", f"Fake NVMe {i}   ")
        disk = ctrl / f"nvme{i}n1"
        put(disk / "dev", f"259:{2 * i}")
        queue(disk, "0", "1023", "[none] mq-deadline")
        link(disk / "device", ctrl)
        (disk / "slaves").mkdir()
        part = disk / f"nvme{i}n1p1"
        put(part / "dev", f"259:{2 * i + 1}")
        put(part / "partition", "1")
        link(root / "dev" / "block" / f"259:{2 * i}", disk)
        link(root / "dev" / "block" / f"259:{2 * i + 1}", part)
    virt = root / "devices" / "virtual" / "block"
    md = virt / "md0"
    put(md / "dev", "9:0")
    put(md / "md" / "level", "raid0")
    queue(md, "0", "", "none")
    for i in (0, 1):
        link(md / "slaves" / f"nvme{i}n1p1", root / "devices" / "pci0000:00" / f"0000:00:0{i + 1}.0" / "nvme"
             / f"nvme{i}" / f"nvme{i}n1" / f"nvme{i}n1p1")
    dm = virt / "dm-0"
    put(dm / "dev", "253:0")
    put(dm / "dm" / "name", "vg-models")
    queue(dm, "0", "", "none")
    link(dm / "slaves" / "md0", md)
    link(root / "dev" / "block" / "9:0", md)
    link(root / "dev" / "block" / "253:0", dm)


def test_partition_md_dm_mapping(tmp_path: Path) -> None:
    _fake_sysfs(tmp_path)
    d = Discovery(sysfs_root=str(tmp_path))
    assert d.method == "sysfs"
    part = d.drive_of_devnum(259, 1)
    assert part is not None
    assert (part.name, part.dev, part.kind, part.members) == ("nvme0n1", "259:0", "disk", ())
    assert part == d.drive_of_devnum(259, 0)  # the partition is its disk
    assert (part.rotational, part.logical_block_size, part.max_sectors_kb, part.nr_requests) == (False, 512, 128, 1023)
    assert (part.scheduler, part.numa_node, part.model) == ("none", 1, "Fake NVMe 0")
    md = d.drive_of_devnum(9, 0)
    assert md is not None
    assert (md.name, md.kind, md.members, md.nr_requests) == ("md0", "md", ("nvme0n1", "nvme1n1"), None)
    assert md.numa_node == 1  # its members agree
    dm = d.drive_of_devnum(253, 0)
    assert dm is not None
    assert (dm.name, dm.kind, dm.members) == ("dm-0", "dm", ("nvme0n1", "nvme1n1"))  # leaves, through md0
    assert d.drive_of_devnum(8, 0) is None


# ---------------------------------------------------------------------------------------------
# mountinfo


MOUNTINFO = r"""27 1 254:0 / / rw,relatime - ext4 /dev/vda rw
30 27 0:27 / /dev/shm rw,relatime - tmpfs tmpfs rw,size=1k
31 27 0:28 / /dev/shm rw,relatime - tmpfs tmpfs rw,size=2k
40 27 0:40 /sub /mnt/my\040models rw - btrfs /dev/loop0 rw,subvolid=256,subvol=/sub
41 27 0:42 / /merged rw - overlay overlay rw,lowerdir=/l1\:x:/l2,upperdir=/up,workdir=/w
42 27 0:43 / /net rw - nfs4 srv:/export rw
"""


def test_mountinfo_parsing(tmp_path: Path) -> None:
    p = tmp_path / "mountinfo"
    p.write_text(MOUNTINFO)
    mounts = read_mountinfo(str(p))
    assert [m.mount_point for m in mounts] == ["/", "/dev/shm", "/dev/shm", "/mnt/my models", "/merged", "/net"]
    m = mount_of("/dev/shm/x", mounts)
    assert m is not None and m.dev == "0:28"  # the later mount on the same point hides the earlier
    m = mount_of("/mnt/my models/a/b", mounts)
    assert m is not None and (m.fstype, m.source, m.root) == ("btrfs", "/dev/loop0", "/sub")
    m = mount_of("/mergedx", mounts)
    assert m is not None and m.mount_point == "/"
    m = mount_of("/merged/f", mounts)
    assert m is not None and overlay_layers(m) == ["/up", "/l1:x", "/l2"]
    d = Discovery(mountinfo=str(p))
    assert d._via_mount("/net/a", "0:43", 0).name == "nfs4:srv:/export"
    assert d._via_mount("/dev/shm/a", "0:28", 0).name == "tmpfs"


# ---------------------------------------------------------------------------------------------
# real loop, overlay and btrfs mounts (root only)


LOOP_DEVICES = pytest.mark.xdist_group("loop_devices")
"""Tests that attach loop devices and mount filesystems (machine state, not a folder of their
own) run one after another on one pytest-xdist worker (--dist loadgroup)."""


def _sh(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=60).stdout.strip()


@contextlib.contextmanager
def _loop_fs(tmp_path: Path, fstype: str, size: int = 64 << 20) -> Iterator[tuple[str, Path]]:
    """A ``fstype`` filesystem on a loop device over a file in ``tmp_path``, mounted; skips with
    the reason when this machine does not allow it."""
    mkfs = shutil.which(f"mkfs.{fstype}")
    if os.geteuid() != 0 or shutil.which("losetup") is None or mkfs is None:
        pytest.skip(f"needs root, losetup and mkfs.{fstype}")
    img, mnt = tmp_path / f"{fstype}.img", tmp_path / f"{fstype}-mnt"
    with open(img, "wb") as f:
        f.truncate(size)
    mnt.mkdir()
    try:
        loop = _sh("losetup", "-f", "--show", str(img))
    except (subprocess.SubprocessError, OSError) as exc:
        pytest.skip(f"losetup is not permitted here: {getattr(exc, 'stderr', exc)}")
    mounted = False
    try:
        try:
            _sh(mkfs, "-q", loop)
            _sh("mount", loop, str(mnt))
            mounted = True
        except (subprocess.SubprocessError, OSError) as exc:
            pytest.skip(f"cannot make or mount {fstype} on {loop}: {getattr(exc, 'stderr', exc)}")
        yield loop, mnt
    finally:
        if mounted:
            subprocess.run(["umount", str(mnt)], check=False, timeout=60)
        subprocess.run(["losetup", "-d", loop], check=False, timeout=60)


@LOOP_DEVICES
def test_loop_device_and_its_backing_drive(tmp_path: Path) -> None:
    with _loop_fs(tmp_path, "ext4") as (loop, mnt):
        f = _write(mnt / "x.bin", 8192)
        drive = drive_of(f)
        backing = drive_of(tmp_path / "ext4.img")
        assert drive.name == os.path.basename(loop) and drive.kind == "loop"
        assert drive.members == (backing.members or (backing.name,))
        assert drive.nr_requests is not None and drive.logical_block_size is not None
        dio = Path(f"/sys/block/{drive.name}/loop/dio").read_text().strip()
        assert drive.memory_backed == (dio == "0")  # buffered loop: reads hit the image's page cache


@LOOP_DEVICES
def test_overlay_resolves_the_layer_holding_the_file(tmp_path: Path) -> None:
    with _loop_fs(tmp_path, "ext4") as (loop, mnt):
        lower, upper, work, merged = tmp_path / "lower", mnt / "upper", mnt / "work", tmp_path / "merged"
        for d in (lower, upper, work, merged):
            d.mkdir()
        _write(lower / "only-lower.bin", 100)
        _write(upper / "only-upper.bin", 100)
        try:
            _sh("mount", "-t", "overlay", "overlay", "-o",
                f"lowerdir={lower},upperdir={upper},workdir={work}", str(merged))
        except (subprocess.SubprocessError, OSError) as exc:
            pytest.skip(f"cannot mount overlayfs here: {getattr(exc, 'stderr', exc)}")
        try:
            assert os.major(os.stat(merged / "only-lower.bin").st_dev) == 0
            assert drive_of(merged / "only-upper.bin").name == os.path.basename(loop)
            assert drive_of(merged / "only-lower.bin").name == drive_of(lower).name
            _write(merged / "new.bin", 10)  # written through the overlay: lands in the upper layer
            assert drive_of(merged / "new.bin").name == os.path.basename(loop)
        finally:
            subprocess.run(["umount", str(merged)], check=False, timeout=60)


@LOOP_DEVICES
def test_btrfs_subvolume_resolves_to_its_device(tmp_path: Path) -> None:
    with _loop_fs(tmp_path, "btrfs", 128 << 20) as (loop, mnt):
        if shutil.which("btrfs") is None:
            pytest.skip("needs the btrfs tool (btrfs-progs)")
        _sh("btrfs", "subvolume", "create", str(mnt / "sv"))
        f = _write(mnt / "sv" / "x.bin", 100)
        assert os.major(os.stat(f).st_dev) == 0
        assert drive_of(f).name == os.path.basename(loop) == drive_of(mnt).name


# ---------------------------------------------------------------------------------------------
# the TOML schema


def _topo(tmp_path: Path) -> Topology:
    return Topology(primary=str(tmp_path / "ckpt"), mirrors=(str(tmp_path / "m1"),),
                    devices={"nvme0n1": DeviceConfig(8, 1.0, 3100.0), "nvme1n1": DeviceConfig(4, 0.5)},
                    routing_policy="least_pending", stripe_threshold_bytes=1 << 20)


def test_round_trip_and_tomllib(tmp_path: Path) -> None:
    topo = _topo(tmp_path)
    path = tmp_path / "topo.toml"
    path.write_text(dump_topology(topo))
    assert tomllib.loads(path.read_text())["device"][0]["queue_depth"] == 8
    loaded = load_topology(path)
    assert loaded == topo and loaded.source == str(path)
    assert loaded.device("nvme1n1").bandwidth_mbps is None
    assert loaded.device("sda") == DeviceConfig()  # unlisted drives get the defaults
    assert loaded.paths == (topo.primary, *topo.mirrors)
    assert is_topology_file(path) and is_topology_file("X.TOML") and not is_topology_file(tmp_path / "m.gguf")


def test_defaults_and_relative_paths(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    path = tmp_path / "sub" / "t.toml"
    path.write_text('[checkpoint]\nprimary = "../ckpt"\nmirrors = ["m"]\n')
    topo = load_topology(path)
    assert topo.primary == str(tmp_path / "ckpt") and topo.mirrors == (str(tmp_path / "sub" / "m"),)
    assert (topo.devices, topo.routing_policy, topo.stripe_threshold_bytes) == ({}, "hash", 4 << 20)


_paths = st.lists(st.text(st.characters(codec="utf-8", exclude_characters="/\0"),
                          min_size=1, max_size=12).filter(lambda s: s not in (".", "..")),
                  min_size=1, max_size=3).map(lambda parts: "/" + "/".join(parts))
_devices = st.dictionaries(
    st.text(st.characters(codec="utf-8"), min_size=1, max_size=10),
    st.builds(DeviceConfig, st.integers(1, 1 << 20),
              st.floats(min_value=1e-6, max_value=1e9, allow_nan=False, allow_infinity=False),
              st.none() | st.floats(min_value=1e-3, max_value=1e9, allow_nan=False, allow_infinity=False),
              st.none() | st.integers(0, 1 << 40)),
    max_size=4)


@settings(max_examples=200, deadline=None)
@given(_paths, st.lists(_paths, max_size=3, unique=True), _devices, st.sampled_from(["hash", "least_pending"]),
       st.integers(1, 1 << 40), st.text())
def test_round_trip_property(primary: str, mirrors: list[str], devices: dict[str, DeviceConfig], policy: str,
                             stripe: int, comment: str) -> None:
    mirrors = [m for m in mirrors if m != primary]
    topo = Topology(primary, tuple(mirrors), devices, policy, stripe)
    text = dump_topology(topo, comment=comment)
    text.encode("utf-8")  # writable as a file
    assert loads_topology(text, "/x/t.toml") == topo


GOOD = '[checkpoint]\nprimary = "/c"\n'
BAD = [
    ("version = 2\n" + GOOD, "version must be 1"),
    ('version = "1"\n' + GOOD, "version must be 1"),
    ("[routing]\n", r"missing \[checkpoint\]"),
    ("[checkpoint]\nmirrors = []\n", "checkpoint.primary"),
    ("[checkpoint]\nprimary = 3\n", "checkpoint.primary must be a non-empty string"),
    ('[checkpoint]\nprimary = ""\n', "checkpoint.primary"),
    (GOOD + 'mirrors = "/m"\n', "checkpoint.mirrors must be an array"),
    (GOOD + 'mirrors = ["/m", 5]\n', r"checkpoint.mirrors\[1\]"),
    (GOOD + 'mirrors = ["/c"]\n', r"checkpoint.mirrors\[0\] repeats"),
    (GOOD + 'mirror = ["/m"]\n', r"unknown key in \[checkpoint\]: 'mirror'"),
    ('colour = 1\n' + GOOD, "unknown key in the top level: 'colour'"),
    (GOOD + '[[device]]\nname = "a"\n[[device]]\nname = "b"\nqueue_depth = -3\n',
     r"device\[1\].queue_depth must be a positive integer, got integer -3"),
    (GOOD + '[[device]]\nname = "a"\nqueue_depth = 2.5\n', r"device\[0\].queue_depth .* got float 2.5"),
    (GOOD + '[[device]]\nname = "a"\nqueue_depth = true\n', r"device\[0\].queue_depth .* got boolean True"),
    (GOOD + '[[device]]\nname = "a"\nweight = 0\n', r"device\[0\].weight must be a positive number"),
    (GOOD + '[[device]]\nname = "a"\nweight = "fast"\n', r"device\[0\].weight .* string 'fast'"),
    (GOOD + '[[device]]\nname = "a"\nweight = inf\n', r"device\[0\].weight"),
    (GOOD + '[[device]]\nname = "a"\nbandwidth_mbps = -1.0\n', r"device\[0\].bandwidth_mbps"),
    (GOOD + '[[device]]\nname = "a"\ninflight_bytes = -1\n', r"device\[0\].inflight_bytes must be an integer >= 0"),
    (GOOD + '[[device]]\nname = "a"\ninflight_bytes = 1.5\n', r"device\[0\].inflight_bytes .* got float 1.5"),
    (GOOD + '[[device]]\nqueue_depth = 4\n', r"device\[0\].name must be a non-empty string"),
    (GOOD + '[[device]]\nname = "a"\n[[device]]\nname = "a"\n', r"device\[1\].name repeats device 'a'"),
    (GOOD + '[[device]]\nname = "a"\nqueue_dept = 4\n', r"unknown key in device\[0\]: 'queue_dept'"),
    (GOOD + '[device]\nname = "a"\n', r"device must be an array of tables"),
    (GOOD + '[routing]\npolicy = "random"\n', r"routing.policy must be one of 'hash', 'least_pending'"),
    (GOOD + '[routing]\nstripe_threshold_bytes = 0\n', "routing.stripe_threshold_bytes must be a positive"),
    ("routing = 3\n" + GOOD, r"\[routing\] must be a table, got integer 3"),
    ('[checkpoint\nprimary = "/c"\n', r"not valid TOML: .*line 1"),
    ('[checkpoint]\nprimary = "/c\n', r"not valid TOML: .*line 2"),
]


@pytest.mark.parametrize("text,message", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_malformed_topology_names_the_field(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "topo.toml"
    path.write_text(text)
    with pytest.raises(TopologyError, match=message) as info:
        load_topology(path)
    assert str(info.value).startswith(f"{path}: ")
    assert isinstance(info.value, StoreError)


def test_unreadable_topology_files(tmp_path: Path) -> None:
    with pytest.raises(TopologyError, match="no such topology file"):
        load_topology(tmp_path / "missing.toml")
    (tmp_path / "bin.toml").write_bytes(b"\xff\xfe[checkpoint]")
    with pytest.raises(TopologyError, match="not UTF-8"):
        load_topology(tmp_path / "bin.toml")


# ---------------------------------------------------------------------------------------------
# the probe


@pytest.mark.asyncio
async def test_probe_is_bounded_and_measures(tmp_path: Path) -> None:
    f = _write(tmp_path / "big.bin", 8 << 20)
    out = await probe_bandwidth(str(f), qd=4, bs=256 << 10, max_bytes=2 << 20, seconds=5.0)
    assert out["mbps"] > 0 and out["reads"] >= 1
    # at most max_bytes issued, plus at most one read per other reader already past the check
    assert out["bytes"] <= (2 << 20) + 3 * (256 << 10)
    assert out["bytes"] == out["reads"] * (256 << 10)
    assert 0 < out["p50_ms"] <= out["p99_ms"]


@pytest.mark.asyncio
async def test_probe_of_a_file_smaller_than_a_read(tmp_path: Path) -> None:
    f = _write(tmp_path / "small.bin", 10_000)
    out = await probe_bandwidth(str(f), qd=2, bs=1 << 20, max_bytes=100_000, seconds=5.0)
    assert out["bs"] == 10_000 and out["bytes"] == out["reads"] * 10_000 and out["reads"] >= 1


@pytest.mark.asyncio
async def test_probe_refuses_empty_files(tmp_path: Path) -> None:
    (tmp_path / "empty").touch()
    with pytest.raises(StoreError, match="empty"):
        await probe_bandwidth(str(tmp_path / "empty"))


def test_suggest_queue_depth() -> None:
    assert suggest_queue_depth(None, None, 8, 256) == 8
    assert suggest_queue_depth(None, None, 8, 4) == 4
    assert suggest_queue_depth(1000.0, 1200.0, 8, 256) == 2  # saturated at depth 1-2
    assert suggest_queue_depth(500.0, 3500.0, 8, 256) == 8  # still scaling at 8
    assert suggest_queue_depth(1000.0, 900.0, 8, None) == 2


def test_suggest_inflight_bytes() -> None:
    """The reads that keep the drive busy, in bytes of the probe's read size; none unprobed."""
    assert suggest_inflight_bytes(None, None, 8, 256, 1 << 20) is None
    assert suggest_inflight_bytes(1312.1, 1847.6, 8, 256, 576 << 10) == 3 * (576 << 10)  # the VM's probe
    assert suggest_inflight_bytes(500.0, 3500.0, 8, 4, 1 << 20) == 4 << 20  # nr_requests caps it too


# ---------------------------------------------------------------------------------------------
# the command


def _cli(*argv: str) -> dict[str, Any]:
    parser, sub = _command.new_parser()  # a bad value is a UsageError (a StoreError), as in iosched
    topology_cli.add_parser(sub)
    args = parser.parse_args(["topology", *argv])
    out: dict[str, Any] = args.func(args)
    json.dumps(out)  # one JSON object
    return out


def test_cli_json_shape(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    _write(ckpt / "a.safetensors", 5000)
    _write(ckpt / "b.safetensors", 7000)
    (ckpt / "sub").mkdir()  # folders inside are not files of the checkpoint
    out = _cli(str(ckpt), str(ckpt / "a.safetensors"), "--json")
    assert capsys.readouterr().out == ""  # the caller (cli.main) prints the JSON
    assert set(out) == {"paths", "drives", "files", "discovery", "written"}
    name = drive_of(ckpt).name
    assert out["paths"] == {str(ckpt): name, str(ckpt / "a.safetensors"): name}
    assert out["files"][str(ckpt)] == {name: {"files": 2, "bytes": 12000}}
    facts = out["drives"][name]
    for key in ("name", "dev", "kind", "rotational", "logical_block_size", "max_sectors_kb", "nr_requests",
                "numa_node", "scheduler", "model", "members", "virtual", "memory_backed", "discovery", "probe"):
        assert key in facts
    assert facts["probe"] is None and out["written"] is None


def test_cli_table(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # rich shortens cells to fit the terminal
    _write(tmp_path / "a.bin", 10)
    _cli(str(tmp_path / "a.bin"))
    text = capsys.readouterr().out
    assert drive_of(tmp_path).name in text and "nr_req" in text


def test_cli_probe_and_write(tmp_path: Path) -> None:
    ckpt, mirror = tmp_path / "ckpt", tmp_path / "mirror"
    ckpt.mkdir()
    mirror.mkdir()
    _write(ckpt / "model.safetensors", 4 << 20)
    shutil.copy(ckpt / "model.safetensors", mirror / "model.safetensors")
    dest = tmp_path / "topo.toml"
    out = _cli(str(ckpt), str(mirror), "--probe", "--qd", "4", "--bs", "256K", "--probe-mb", "4",
               "--probe-seconds", "2", "--write", str(dest), "--json")
    name = out["paths"][str(ckpt)]
    probe = out["drives"][name]["probe"]
    assert probe["mbps"] > 0 and probe["qd"] == 4 and probe["qd1"]["mbps"] > 0
    assert probe["bytes"] + probe["qd1"]["bytes"] <= (4 << 20) + 4 * (256 << 10)
    assert out["written"] == str(dest)
    raw = tomllib.loads(dest.read_text())
    assert raw["checkpoint"]["primary"] == str(ckpt) and raw["checkpoint"]["mirrors"] == [str(mirror)]
    topo = load_topology(dest)
    assert topo.device(name).weight == 1.0 and 1 <= topo.device(name).queue_depth <= 4
    assert topo.device(name).bandwidth_mbps == probe["mbps"]
    assert topo.device(name).inflight_bytes == topo.device(name).queue_depth * (256 << 10)


def test_cli_write_without_probe(tmp_path: Path) -> None:
    f = _write(tmp_path / "m.gguf", 100)
    out = _cli(str(f), "--write", str(tmp_path / "t.toml"))
    topo = load_topology(tmp_path / "t.toml")
    (name,) = out["drives"]
    nr = out["drives"][name]["nr_requests"]
    assert topo.primary == str(f) and topo.mirrors == ()
    assert topo.devices == {name: DeviceConfig(min(8, nr or 8), 1.0, None)}


def test_cli_errors_name_the_path(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="nothere"):
        _cli(str(tmp_path / "nothere"), "--json")
    with pytest.raises(StoreError, match="--qd"):
        _cli(str(tmp_path), "--qd", "0", "--json")
