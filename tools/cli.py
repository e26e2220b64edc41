"""The ``iosched`` command line.

Every subcommand takes ``--json`` and then prints exactly one JSON object on stdout (an
``{"error": ...}`` object, with exit status 2, when it fails on bad input); without it,
a human-readable table.  Progress goes to stderr so stdout stays clean.  Those conventions
live in ``tools/_command.py``, which the modules that run their subcommand on their own
(``python -m iosched.tools.bench``) share with this one.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from iosched import StoreError

from . import _command, _runner
from ._replay_policies import HANDWRITTEN
from .compute import NUMPY, add_compute_arguments


def _add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def build_parser() -> argparse.ArgumentParser:
    parser, sub = _command.new_parser(description=__doc__.splitlines()[0])

    demo = sub.add_parser("demo", help="replay a bundled real routing trace through the store")
    demo.add_argument("--trace", default="qwen", help="bundled trace: qwen or gemma (default qwen)")
    demo.add_argument("--budget-cycles", type=_command.positive_float, default=4.0,
                      help="budget in token cycles (k x bytes of one expert per layer, summed); default 4")
    add_compute_arguments(demo)
    demo.add_argument("--backend", default="auto")
    demo.add_argument("--policy", default="default")
    demo.add_argument("--compare", default="lru,handwritten",
                      help="arms run beside --policy on the same trace and budget, comma list of "
                           "policies and handwritten (an LRU of bytes and 8 threads of pread); "
                           "'none': --policy alone (default lru,handwritten)")
    demo.add_argument("--rounds", type=_command.positive_int, default=1,
                      help="rounds of every arm, interleaved; medians reported (default 1)")
    demo.add_argument("--tokens", type=_command.positive_int, default=None, help="stop after this many decode tokens")
    demo.add_argument("--scale", type=_command.positive_int, default=16,
                      help="experts this many times smaller than Qwen3-30B-A3B's in each dimension "
                           "(default 16: 36 KiB; 2: 2.25 MiB, a real Q4 expert's size)")
    demo.add_argument("--warm", action="store_true",
                      help="keep the checkpoint in the page cache (default: drop it first, a cold start)")
    demo.add_argument("--telemetry", metavar="FILE", default=None,
                      help="write one JSON line per token to FILE (docs/telemetry.md)")
    _add_json(demo)
    demo.set_defaults(func=_cmd_demo)

    from . import (
        bench,
        contention,
        inspect_checkpoint,
        manifest,
        pack,
        pack_bench,
        readpath_bench,
        replay,
        replica_bench,
        soak,
        topology,
        verify_bench,
    )

    bench.add_parser(sub)
    contention.add_parser(sub)
    inspect_checkpoint.add_parser(sub)
    manifest.add_parser(sub)
    pack.add_parser(sub)
    pack_bench.add_parser(sub)
    readpath_bench.add_parser(sub)
    replay.add_parser(sub)
    replica_bench.add_parser(sub)
    soak.add_parser(sub)
    topology.add_parser(sub)
    verify_bench.add_parser(sub)

    hit = sub.add_parser("hitpath", help="median cost of acquire on a resident expert, per event loop")
    hit.add_argument("--n", type=_command.positive_int, default=20000,
                     help="acquires per repetition (default 20000)")
    hit.add_argument("--reps", type=_command.positive_int, default=7,
                     help="repetitions, interleaved across loops (default 7)")
    hit.add_argument("--policy", default="default",
                     help="residency policy (default: default, which is density: eviction by "
                          "learned hit density under an LRU shadow, and coact's prefetch)")
    _add_json(hit)
    hit.set_defaults(func=_cmd_hitpath)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``iosched ARGV...`` (default ``sys.argv[1:]``): every subcommand, with the conventions
    of ``tools/_command.py``; the exit status."""
    return _command.run(build_parser(), sys.argv[1:] if argv is None else argv)


def _cmd_demo(args: argparse.Namespace) -> dict[str, Any]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from .demo import DemoConfig, run_demo
    from .report import demo_table

    compare = tuple(a.strip() for a in args.compare.split(",") if a.strip() and a.strip() != "none")
    if args.policy == HANDWRITTEN:
        raise StoreError("--policy handwritten: the hand-written arm runs beside a policy (--compare)")
    if args.compute_ms is not None and args.compute is not NUMPY:
        raise StoreError("give --compute or --compute-ms (the same as --compute sleep:MS), not both")
    config = DemoConfig(
        trace=args.trace, budget_cycles=args.budget_cycles, compute_ms=args.compute_ms,
        compute=args.compute, compute_on=args.compute_on, awaits=args.engine_awaits, compare=compare,
        rounds=args.rounds,
        backend=args.backend, policy=args.policy, cold=not args.warm, max_tokens=args.tokens,
        scale=args.scale, telemetry=args.telemetry,
    )
    if args.budget_cycles <= 0 or (args.tokens is not None and args.tokens <= 0):
        raise StoreError("--budget-cycles and --tokens must be positive")
    err = Console(stderr=True)
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("tokens"), TimeRemainingColumn(), console=err,
                  disable=not err.is_terminal) as progress:
        err.print("[dim]building or reusing the demo checkpoint, then replaying the trace...[/dim]")
        result = _runner.run(lambda: run_demo(config, progress))
    out = result.as_dict()
    if not args.json:
        Console().print(demo_table(out))
    return out


def _cmd_hitpath(args: argparse.Namespace) -> dict[str, Any]:
    from rich.console import Console

    from .hitpath import measure_hit_path

    out = measure_hit_path(n=args.n, reps=args.reps, policy=args.policy)
    if not args.json:
        console = Console()
        for loop, row in out["loops"].items():
            console.print(f"{loop:8s} acquire+release of a resident expert: "
                          f"median {row['median_us']:.2f} µs (p90 {row['p90_us']:.2f} µs); "
                          f"acquire_many of {out['k']}: {row['group_of_k_median_us']:.2f} µs; "
                          f"with an await between layers, as an engine: "
                          f"{row['group_awaited_median_us']:.2f} µs (the await: "
                          f"{row['between_median_us']:.2f} µs); acquire_as_ready so: "
                          f"{row['as_ready_awaited_median_us']:.2f} µs")
    return out


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
