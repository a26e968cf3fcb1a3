"""Wake an event loop from any thread: the bridge every async wait in stopcock uses."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

__all__ = ["loop_waker"]


def loop_waker() -> tuple[asyncio.Future[None], Callable[[], None]]:
    """A future of the running loop, and ``wake()``, which resolves it from any thread.

    ``wake()`` may be called any number of times, also after the loop has closed (then there is
    nobody left to wake, and it does nothing).
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[None] = loop.create_future()

    def resolve() -> None:
        if not future.done():
            future.set_result(None)

    def wake() -> None:
        try:
            loop.call_soon_threadsafe(resolve)
        except RuntimeError:  # the loop is closed
            pass

    return future, wake
