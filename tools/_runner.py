"""Running the tools' coroutines: uvloop when installed (setting ``loop``), else asyncio."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from iosched import settings

T = TypeVar("T")


def loop_factory() -> tuple[str, Callable[[], asyncio.AbstractEventLoop]]:
    """The event loop the tools run on, by name, and how to make one."""
    choice = str(settings.get("loop"))
    if choice in ("auto", "uvloop"):
        try:
            import uvloop
        except ImportError:
            if choice == "uvloop":
                from iosched import StoreError

                raise StoreError("IOSCHED_LOOP=uvloop but uvloop is not installed (pip install uvloop)") from None
        else:
            return "uvloop", uvloop.new_event_loop
    return "asyncio", asyncio.new_event_loop


def run(main: Callable[[], Coroutine[Any, Any, T]],
        factory: Callable[[], asyncio.AbstractEventLoop] | None = None) -> T:
    make = factory or loop_factory()[1]
    loop = make()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main())
    finally:
        try:
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()
