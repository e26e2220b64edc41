"""``iosched manifest CHECKPOINT``: write the checkpoint's per-extent checksums (the sidecar
``ExpertStore.open(verify="reads")`` checks every read against).

Reads every expert extent once, in file order, with plain reads (not the store's read path),
hashes each with XXH3 and writes the manifest atomically (a temporary file in the same folder,
renamed over): by default ``iosched.manifest.json`` inside the checkpoint folder
(``NAME.iosched.manifest.json`` beside a single-file checkpoint), or ``--out PATH`` (the
checkpoint's folder may be read-only: a Hugging Face cache).  An existing manifest there is
replaced; any other file is refused (exit status 2).  A progress bar goes to stderr.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from iosched import load_index, write_manifest

from . import _command
from ._progress import bytes_progress

HASH_NAMES = ("xxh3_128", "xxh3_64")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("manifest", help="write per-expert checksums for verify='reads'")
    p.add_argument("checkpoint", help="a checkpoint folder or file (.safetensors / .gguf)")
    p.add_argument("--out", default=None, metavar="PATH",
                   help="where to write it (default: iosched.manifest.json in the checkpoint folder)")
    p.add_argument("--hash", default=HASH_NAMES[0], choices=HASH_NAMES, help="the checksum (default xxh3_128)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=cmd)


def cmd(args: argparse.Namespace) -> dict[str, Any]:
    index = load_index(args.checkpoint)
    total = sum(ext.length for layout in index.experts.values() for ext in layout.extents)
    with bytes_progress("hashing experts", total) as advance:
        summary = write_manifest(args.checkpoint, args.out, hash_name=args.hash, on_bytes=advance)
    out = summary.as_dict()
    out["mb_per_s"] = summary.bytes / summary.seconds / 1e6 if summary.seconds > 0 else 0.0
    if not args.json:
        print(f"wrote {summary.manifest}: {summary.experts} experts, {summary.extents} extents, "
              f"{summary.bytes / (1 << 20):.1f} MiB hashed ({summary.hash}) in {summary.seconds:.2f} s "
              f"({out['mb_per_s']:.0f} MB/s)")
    return out


def main(argv: Sequence[str] | None = None) -> int:  # pragma: no cover - via tools.cli
    return _command.run_one("manifest", add_parser, argv)
