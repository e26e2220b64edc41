"""One progress bar for the tools' long runs: on stderr, so stdout stays one JSON object, and
hidden when stderr is not a terminal (CI logs, pipes)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def run_progress(description: str, total: int, note: str | None = None) -> Iterator[Callable[[str], None]]:
    """Yields ``on_run(label)``: call it as each run starts (the bar advances past the previous
    run and shows ``label``); the bar is completed when the block ends."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    err = Console(stderr=True)
    if note:
        err.print(f"[dim]{note}[/dim]")
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeRemainingColumn(), console=err, disable=not err.is_terminal) as progress:
        task = progress.add_task(description, total=total)
        started = False

        def on_run(label: str) -> None:
            nonlocal started
            if started:
                progress.advance(task)
            started = True
            progress.update(task, description=label)

        yield on_run
        progress.update(task, completed=total)


@contextlib.contextmanager
def bytes_progress(description: str, total: int) -> Iterator[Callable[[int], None]]:
    """Yields ``advance(n)``: call it as each ``n`` bytes are done (``total`` in all); the bar
    shows bytes and the rate, and is completed when the block ends."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    err = Console(stderr=True)
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), console=err, disable=not err.is_terminal) as progress:
        task = progress.add_task(description, total=total)

        def advance(n: int) -> None:
            progress.advance(task, n)

        yield advance
        progress.update(task, completed=total)
