"""Helpers shared by backends."""

from __future__ import annotations

import asyncio
from typing import TypeVar

T = TypeVar("T")


async def run_to_completion(fut: asyncio.Future[T]) -> T:
    """Await ``fut``; if the caller is cancelled, still wait for ``fut`` before re-raising.

    A read handed to a thread or a ring keeps writing into its buffer after the awaiting task
    is cancelled; returning early would let the core recycle a buffer that is still being
    written.  The cancellation is delivered once the read is over.
    """
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        while not fut.done():
            try:
                await asyncio.shield(fut)
            except asyncio.CancelledError:
                continue
            except BaseException:
                break
        if not fut.cancelled():
            fut.exception()  # mark retrieved: the cancellation is what we report
        raise
