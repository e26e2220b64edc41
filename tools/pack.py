"""``iosched pack SRC DST``: copy a checkpoint so that every expert is one aligned read.

``iosched.pack_checkpoint`` does the work (its module docstring, and docs/formats.md
"Packing", say what the copy holds); this is its command line: a progress bar on a terminal
(stderr), then a summary, or with ``--json`` the report as one JSON object: experts, bytes,
extents before and after, per expert where its bytes were and are, seconds, verified.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from iosched import pack_checkpoint

from . import _command


def add_parser(sub: _command.SubParsers[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("pack", help="copy a checkpoint with every expert one aligned extent (safetensors)")
    p.add_argument("src", help="the checkpoint: a safetensors folder or file, or a .gguf")
    p.add_argument("dst", help="the new folder to write (must not exist, or be empty)")
    p.add_argument("--align", type=_command.positive_int, default=4096,
                   help="each expert starts at a multiple of this many bytes: a power of two from 8 (default 4096)")
    p.add_argument("--max-shard-size", default="4G",
                   help="data bytes per shard file, at most, e.g. 4G or 500M (default 4G)")
    p.add_argument("--no-verify", action="store_true",
                   help="skip reading the copy back against the source (not recommended)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=cmd)


@contextmanager
def _progress() -> Iterator[Callable[[str, int, int], None]]:
    """``progress(phase, done, total)`` drawing one bar per phase on stderr (hidden when
    stderr is not a terminal)."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    err = Console(stderr=True)
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), console=err, disable=not err.is_terminal) as bars:
        tasks: dict[str, Any] = {}

        def update(phase: str, done: int, total: int) -> None:
            if phase not in tasks:
                tasks[phase] = bars.add_task(phase, total=total)
            bars.update(tasks[phase], completed=done)

        yield update


def cmd(args: argparse.Namespace) -> dict[str, Any]:
    from .bench import parse_size

    shard = parse_size(args.max_shard_size)
    with _progress() as progress:
        report = pack_checkpoint(args.src, args.dst, align=args.align, progress=progress, max_shard_bytes=shard,
                                 verify=not args.no_verify)
    out = report.as_dict()
    if not args.json:
        from rich.console import Console

        mb = 1e6
        Console().print(
            f"packed {out['experts']} experts ({out['expert_bytes'] / mb:.1f} MB) and {out['other_tensors']} other "
            f"tensors ({out['other_bytes'] / mb:.1f} MB) into {out['dest']} ({', '.join(out['files'])}): "
            f"{out['extents_before']} extents -> {out['extents_after']}, each at a multiple of {out['align']} bytes, "
            f"{out['padding_bytes']} bytes of padding; {out['seconds']:.1f} s "
            f"({'verified against the source' if out['verified'] else 'NOT verified'})")
        for note in out["notes"]:
            Console().print(f"[dim]note: {note}[/dim]")
    return out


def main(argv: Sequence[str] | None = None) -> int:  # pragma: no cover - via tools.cli
    return _command.run_one("pack", add_parser, argv)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
