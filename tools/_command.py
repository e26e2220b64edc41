"""The command line's conventions, shared by ``iosched`` and by a subcommand run on its own.

The conventions (``tools/cli.py``'s docstring, docs/contract.md): with ``--json`` a command
prints exactly one JSON object on stdout, its result, or ``{"error": ..., "type": ...}`` with
exit status 2 when it fails on bad input (a :class:`~iosched.StoreError`, a usage error
included: :class:`UsageError`); without it the error goes to stderr, with the same status.

Why a module of its own: ``python -m iosched.tools.bench`` (and ``replay``, ``soak``,
``replica_bench``) runs that one subcommand with exactly these conventions.  Were they
reached through ``tools/cli.py``, which registers every subcommand, each such module and the
command line would import each other: the cycle the acyclic contract forbids (docs/design.md,
"Import rules").  Here they sit below both: ``cli.main`` is :func:`run` over the parser of
every subcommand, a module's own ``main`` is :func:`run_one` over its subcommand alone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar, cast

from iosched import StoreError

N = TypeVar("N", int, float)

SubParsers = argparse._SubParsersAction
"""argparse's type of the subcommands' registry (``SubParsers[argparse.ArgumentParser]``), the
``sub`` that each module's ``add_parser(sub)`` registers its subcommand on."""


class UsageError(StoreError):
    """The command line itself is wrong: a missing argument, a value of the wrong type."""

    usage = ""
    """The usage line of the (sub)command that was misused."""


class Parser(argparse.ArgumentParser):
    """argparse, except that a usage error raises :class:`UsageError` instead of exiting, so
    that ``--json`` callers get the one JSON object they were promised for that error too.
    ``add_subparsers`` builds the subcommands' parsers with this class as well."""

    def error(self, message: str) -> NoReturn:
        exc = UsageError(f"{self.prog}: {message}")
        exc.usage = self.format_usage()
        raise exc


def new_parser(description: str | None = None) -> tuple[Parser, SubParsers[argparse.ArgumentParser]]:
    """The ``iosched`` parser and its (required) subcommands, which the modules register on."""
    parser = Parser(prog="iosched", description=description)
    # The subcommands' parsers are Parser too (argparse uses the parent's class); the modules
    # that register them take the plain type.
    sub = cast("SubParsers[argparse.ArgumentParser]", parser.add_subparsers(dest="command", required=True))
    return parser, sub


def run(parser: argparse.ArgumentParser, argv: Sequence[str]) -> int:
    """Parse ``argv`` (the subcommand first), run the subcommand's ``func`` and print its
    result as the conventions say; the exit status (0, or 2 on bad input)."""
    argv = list(argv)
    try:
        args = parser.parse_args(argv)
    except UsageError as exc:
        if "--json" in argv:
            print(json.dumps({"error": str(exc), "type": type(exc).__name__}))
        else:
            print(f"{exc.usage}error: {exc}", file=sys.stderr, end="\n")
        return 2
    func: Callable[[argparse.Namespace], dict[str, Any]] = args.func
    try:
        result = func(args)
    except StoreError as exc:
        if args.json:
            print(json.dumps({"error": str(exc), "type": type(exc).__name__}))
        else:
            print(f"iosched {args.command}: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        try:
            print(json.dumps(result, sort_keys=True), flush=True)
        except BrokenPipeError:  # `iosched ... --json | head`: the reader left; not an error of ours
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def run_one(name: str, add_parser: Callable[[SubParsers[argparse.ArgumentParser]], None],
            argv: Sequence[str] | None = None) -> int:
    """``iosched NAME ARGV...`` with only the subcommand that ``add_parser`` registers (a
    module's own ``main``; ``argv`` excludes ``NAME``, default ``sys.argv[1:]``): the same
    parsing, output and exit status as through ``iosched``."""
    parser, sub = new_parser()
    add_parser(sub)
    return run(parser, [name, *(sys.argv[1:] if argv is None else argv)])


# ------------------------------------------------------------------------- typed option values
# Each option's value is checked when it is parsed: a bad one is a UsageError (so with --json,
# one JSON error object and exit status 2), never a traceback from deep inside the command.
# tests/test_cli.py checks that no numeric option of any subcommand takes a bare int or float.


def _number(text: str, kind: type[int] | type[float]) -> int | float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
    if isinstance(value, float) and value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def _checked(kind: type[N], accepts: Callable[[N], bool], wanted: str, name: str) -> Callable[[str], N]:
    """The converter ``name``: the text as a finite ``kind`` (:func:`_number`), refused with
    "... is not ``wanted``" unless ``accepts(value)``."""

    def convert(text: str) -> N:
        value = kind(_number(text, kind))
        if not accepts(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not {wanted}")
        return value

    convert.__name__ = convert.__qualname__ = name
    convert.__doc__ = f"A command-line value that must be {wanted}."
    return convert


positive_int = _checked(int, lambda v: v > 0, "a positive integer", "positive_int")
non_negative_int = _checked(int, lambda v: v >= 0, "an integer >= 0", "non_negative_int")
positive_float = _checked(float, lambda v: v > 0, "a positive number", "positive_float")
non_negative_float = _checked(float, lambda v: v >= 0, "a number >= 0", "non_negative_float")
fraction = _checked(float, lambda v: 0.0 <= v <= 1.0, "in [0, 1]", "fraction")  # a rate or a share


def int_list(text: str) -> list[int]:
    """Comma-separated positive integers, at least one."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"{text!r} names no number")
    return [positive_int(p) for p in parts]


VALUE_TYPES = (positive_int, non_negative_int, positive_float, non_negative_float, fraction, int_list)
"""The converters above: every numeric option of every subcommand uses one (or a parser of its
own that raises on bad values, such as bench's sizes)."""
