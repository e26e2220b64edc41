"""The topology file: which copies of a checkpoint to read, from which drives, how hard.

``iosched topology --write FILE`` writes one; ``ExpertStore.open("FILE.toml")`` reads one.
The schema, version 1 (every key shown; only ``checkpoint.primary`` is required)::

    version = 1                              # required to be 1 when present

    [checkpoint]
    primary = "/models/qwen"                 # a checkpoint folder or file (.safetensors / .gguf)
    mirrors = ["/mnt/nvme1/qwen"]            # byte-identical copies; default none

    [[device]]                               # one table per drive; default none
    name = "nvme0n1"                         # the drive's name as `iosched topology` reports it
    queue_depth = 8                          # reads in flight on this drive (positive integer)
    weight = 1.0                             # its share of the reads, relative (positive number)
    bandwidth_mbps = 3100.0                  # optional: what `--probe` measured (10^6 bytes/s)
    inflight_bytes = 1769472                 # optional: bytes of reads in flight at most (0: no
                                             # limit; default the setting inflight_bytes)

    [routing]
    policy = "hash"                          # "hash" | "least_pending"; default "hash"
    stripe_threshold_bytes = 4194304         # default 4 MiB (positive integer)

Relative paths (and ``~``) are resolved against the TOML file's folder, so a topology can
travel with its checkpoint.  Unknown keys are errors, not ignored: a misspelt ``queue_dept``
would otherwise silently fall back to the default.  Every problem is a :class:`TopologyError`
(a :class:`StoreError`) naming the file and the field, e.g.
``topo.toml: device[1].queue_depth must be a positive integer, got -3``.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from iosched._errors import StoreError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[import-not-found,unused-ignore]

VERSION = 1
DEFAULT_QUEUE_DEPTH = 8
"""Reads in flight per drive when nothing better is known.  Source: the ``pread_threads``
setting's rationale (NVMe drives commonly saturate at depth 8 for MiB-sized reads) and
``docs/benchmarks.md``'s sweep, where ``odirect``/``uring`` at 1-4 MiB reach the virtual disk's
bandwidth between depth 4 and 16 while p99 keeps growing past it."""
ROUTING_POLICIES = ("hash", "least_pending")
DEFAULT_ROUTING_POLICY = "hash"
DEFAULT_STRIPE_THRESHOLD = 4 << 20


class TopologyError(StoreError):
    """A topology file is missing, not TOML, or breaks the schema; the message names the field."""


@dataclass(frozen=True)
class DeviceConfig:
    queue_depth: int = DEFAULT_QUEUE_DEPTH
    weight: float = 1.0
    bandwidth_mbps: float | None = None
    inflight_bytes: int | None = None
    """Bytes of reads in flight on this drive at most (0: no limit); ``None``: the setting
    ``inflight_bytes`` (``iosched/runtime/_scheduler.py`` says why there is a cap)."""


@dataclass(frozen=True)
class Topology:
    primary: str
    """Absolute path of the primary checkpoint (folder or file)."""
    mirrors: tuple[str, ...] = ()
    """Absolute paths of byte-identical copies."""
    devices: dict[str, DeviceConfig] = field(default_factory=dict)
    routing_policy: str = DEFAULT_ROUTING_POLICY
    stripe_threshold_bytes: int = DEFAULT_STRIPE_THRESHOLD
    source: str = field(default="", compare=False)
    """The TOML file this came from ("" when built in memory); not part of equality."""

    @property
    def paths(self) -> tuple[str, ...]:
        """The primary, then the mirrors."""
        return (self.primary, *self.mirrors)

    def device(self, name: str) -> DeviceConfig:
        """The configuration of drive ``name``; the defaults for a drive the file does not list."""
        return self.devices.get(name, DeviceConfig())


def is_topology_file(path: str | os.PathLike[str]) -> bool:
    """Whether ``ExpertStore.open`` should read ``path`` as a topology (its suffix is ``.toml``)."""
    return os.fspath(path).lower().endswith(".toml")


# ---------------------------------------------------------------------------------------------
# reading


class _Checker:
    def __init__(self, source: str) -> None:
        self.source = source
        self.base = os.path.dirname(os.path.abspath(source)) if source else os.getcwd()

    def fail(self, what: str) -> TopologyError:
        return TopologyError(f"{self.source or '<topology>'}: {what}")

    def table(self, value: object, where: str, allowed: tuple[str, ...]) -> Mapping[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(f"{where} must be a table, got {_show(value)}")
        unknown = sorted(set(value) - set(allowed))
        if unknown:
            raise self.fail(f"unknown key{'s' if len(unknown) > 1 else ''} in {where}: "
                            f"{', '.join(map(repr, unknown))} (allowed: {', '.join(allowed)})")
        return value

    def path(self, value: object, where: str) -> str:
        if not isinstance(value, str) or not value:
            raise self.fail(f"{where} must be a non-empty string (a path), got {_show(value)}")
        return os.path.normpath(os.path.join(self.base, os.path.expanduser(value)))

    def positive_int(self, value: object, where: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise self.fail(f"{where} must be a positive integer, got {_show(value)}")
        return value

    def non_negative_int(self, value: object, where: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise self.fail(f"{where} must be an integer >= 0, got {_show(value)}")
        return value

    def positive_number(self, value: object, where: str) -> float:
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or not math.isfinite(value) or value <= 0):
            raise self.fail(f"{where} must be a positive number, got {_show(value)}")
        return float(value)


def _show(value: object) -> str:
    kind = {bool: "boolean", int: "integer", float: "float", str: "string", list: "array",
            dict: "table"}.get(type(value), type(value).__name__)
    text = repr(value) if not isinstance(value, (dict, list)) or len(repr(value)) < 40 else "..."
    return f"{kind} {text}"


def loads_topology(text: str, source: str = "") -> Topology:
    """Parse a topology from TOML text; relative paths are resolved against ``source``'s folder."""
    c = _Checker(source)
    try:
        doc: dict[str, Any] = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise c.fail(f"not valid TOML: {exc}") from None
    c.table(doc, "the top level", ("version", "checkpoint", "device", "routing"))
    version = doc.get("version", VERSION)
    if isinstance(version, bool) or version != VERSION:
        raise c.fail(f"version must be {VERSION}, got {_show(version)}")
    if "checkpoint" not in doc:
        raise c.fail("missing [checkpoint] table with checkpoint.primary")
    ckpt = c.table(doc["checkpoint"], "[checkpoint]", ("primary", "mirrors"))
    if "primary" not in ckpt:
        raise c.fail("missing checkpoint.primary (the checkpoint folder or file)")
    primary = c.path(ckpt["primary"], "checkpoint.primary")
    raw_mirrors = ckpt.get("mirrors", [])
    if not isinstance(raw_mirrors, list):
        raise c.fail(f"checkpoint.mirrors must be an array of paths, got {_show(raw_mirrors)}")
    mirrors = tuple(c.path(m, f"checkpoint.mirrors[{i}]") for i, m in enumerate(raw_mirrors))
    for i, m in enumerate(mirrors):
        if m == primary or m in mirrors[:i]:
            raise c.fail(f"checkpoint.mirrors[{i}] repeats {m}")

    raw_devices = doc.get("device", [])
    if not isinstance(raw_devices, list):
        raise c.fail(f"device must be an array of tables ([[device]]), got {_show(raw_devices)}")
    devices: dict[str, DeviceConfig] = {}
    for i, raw in enumerate(raw_devices):
        where = f"device[{i}]"
        d = c.table(raw, where, ("name", "queue_depth", "weight", "bandwidth_mbps", "inflight_bytes"))
        name = d.get("name")
        if not isinstance(name, str) or not name:
            raise c.fail(f"{where}.name must be a non-empty string, got {_show(name)}")
        if name in devices:
            raise c.fail(f"{where}.name repeats device {name!r}")
        bw = d.get("bandwidth_mbps")
        cap = d.get("inflight_bytes")
        devices[name] = DeviceConfig(
            queue_depth=c.positive_int(d.get("queue_depth", DEFAULT_QUEUE_DEPTH), f"{where}.queue_depth"),
            weight=c.positive_number(d.get("weight", 1.0), f"{where}.weight"),
            bandwidth_mbps=None if bw is None else c.positive_number(bw, f"{where}.bandwidth_mbps"),
            inflight_bytes=None if cap is None else c.non_negative_int(cap, f"{where}.inflight_bytes"),
        )

    routing = c.table(doc.get("routing", {}), "[routing]", ("policy", "stripe_threshold_bytes"))
    policy = routing.get("policy", DEFAULT_ROUTING_POLICY)
    if policy not in ROUTING_POLICIES:
        raise c.fail(f"routing.policy must be one of {', '.join(map(repr, ROUTING_POLICIES))}, "
                     f"got {_show(policy)}")
    stripe = c.positive_int(routing.get("stripe_threshold_bytes", DEFAULT_STRIPE_THRESHOLD),
                            "routing.stripe_threshold_bytes")
    return Topology(primary=primary, mirrors=mirrors, devices=devices, routing_policy=policy,
                    stripe_threshold_bytes=stripe, source=os.path.abspath(source) if source else "")


def load_topology(path: str | os.PathLike[str]) -> Topology:
    """Read and check a topology file; a :class:`TopologyError` naming the file and field if bad.

    Only the schema is checked here: whether the checkpoint paths exist and hold the same
    bytes is the store's to check when it opens them (a ``CheckpointError`` naming the file).
    """
    source = os.fspath(path)
    try:
        with open(source, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise TopologyError(f"{source}: no such topology file") from None
    except OSError as exc:
        raise TopologyError(f"{source}: cannot read: {exc.strerror or exc}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TopologyError(f"{source}: not valid TOML: not UTF-8 (byte {exc.start})") from None
    return loads_topology(text, source)


# ---------------------------------------------------------------------------------------------
# writing


def _toml_str(text: str) -> str:
    out = ['"']
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        elif 0xD800 <= ord(ch) <= 0xDFFF:
            raise TopologyError(f"cannot write {text!r} to TOML: it is not valid Unicode")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _toml_float(value: float) -> str:
    if not math.isfinite(value):
        raise TopologyError(f"cannot write {value!r}: topology numbers are finite")
    return repr(float(value))  # repr round-trips exactly and is valid TOML ("1.0", "3.1e-05")


def dump_topology(topology: Topology, comment: str = "") -> str:
    """The TOML text of ``topology`` (absolute paths); ``loads_topology`` of it gives it back.
    ``comment`` (any number of lines) goes on top, each line as a ``#`` comment."""
    clean = "".join(ch if ch in "\t\n" or (ord(ch) >= 0x20 and ord(ch) != 0x7F and not 0xD800 <= ord(ch) <= 0xDFFF)
                    else "?" for ch in comment)
    lines = [("# " + line).rstrip() for line in clean.splitlines()]
    lines += [f"version = {VERSION}", "", "[checkpoint]", f"primary = {_toml_str(topology.primary)}"]
    lines.append("mirrors = [" + ", ".join(_toml_str(m) for m in topology.mirrors) + "]")
    for name, dev in topology.devices.items():
        lines += ["", "[[device]]", f"name = {_toml_str(name)}", f"queue_depth = {int(dev.queue_depth)}",
                  f"weight = {_toml_float(dev.weight)}"]
        if dev.bandwidth_mbps is not None:
            lines.append(f"bandwidth_mbps = {_toml_float(dev.bandwidth_mbps)}")
        if dev.inflight_bytes is not None:
            lines.append(f"inflight_bytes = {int(dev.inflight_bytes)}")
    lines += ["", "[routing]", f"policy = {_toml_str(topology.routing_policy)}",
              f"stripe_threshold_bytes = {int(topology.stripe_threshold_bytes)}", ""]
    return "\n".join(lines)
