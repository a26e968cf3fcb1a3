"""Async runs and streams: cancelling the awaiting task stops the run, and waits until it has.

The run goes on in a worker thread (the model's forward cannot be interrupted by an event loop).
When the task awaiting :func:`arun` or iterating :func:`astream` is cancelled (an asyncio or anyio
cancel scope, a client disconnect in a web framework, ``aclose()``), the run is stopped with reason
``"cancelled"`` at its next step, the task waits without blocking the loop until the worker has
ended, and then the ``CancelledError`` propagates: no compute outlives its task. Works on asyncio
and on anyio's asyncio backend.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import weakref
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from ._wake import loop_waker
from .conditions import StopLike
from .events import Event
from .outcome import Outcome
from .stream import RunHandle, events_for
from .worker import Channel, start_worker

__all__ = ["AsyncStream", "arun", "astream"]


async def arun(target: Any, *args: Any, stop: StopLike | None = None, **kwargs: Any) -> Outcome:
    """``stopcock.run`` in a worker thread, awaited; cancelling the awaiting task stops the run.

    On cancellation the run is stopped (reason ``"cancelled"``), ``arun`` waits for the worker to
    end, then re-raises ``CancelledError`` (the partial result is not returned: to keep it, stop a
    :class:`~stopcock.StopSignal` passed in ``stop=`` instead of cancelling).
    """
    channel, _ = start_worker(target, args, kwargs, stop=stop)
    try:
        await _until(channel, lambda: channel.finished)
    except asyncio.CancelledError:
        await _abandon(channel)
        raise
    return channel.result()


class AsyncStream(RunHandle, AsyncIterator[Event]):
    """The async form of :class:`stopcock.stream.Stream`; ``aclose()`` or cancelling ends the run.

    The run starts at the first ``__anext__``: a stream never iterated (its consuming task
    cancelled before it ran, a response whose client left before its body started) runs nothing.
    """

    def __init__(self, channel: Channel, thread: threading.Thread) -> None:
        self._channel = channel
        self._thread = thread
        # Dropped without aclose(): the run is stopped, without waiting (a finaliser cannot await).
        self._dropped: weakref.ref[AsyncStream] | None = channel.attach(self, channel.abandon)

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> Event:
        channel = self._channel
        if self._thread.ident is None and not channel.finished:
            self._thread.start()
        try:
            while True:
                try:
                    event = channel.get_nowait()
                except StopIteration:
                    raise StopAsyncIteration from None
                if event is not None:
                    return event
                await _until(channel, channel.ready)
        except asyncio.CancelledError:
            await self.aclose()
            raise

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop the run (reason ``"cancelled"``) and wait, without blocking the loop, until it ended.

        Events not read yet are dropped; an exception the run raised and the consumer has not
        received is raised here. A stream closed before its first iteration never runs (its
        ``outcome`` stays None).
        """
        self._dropped = None  # closed here, not when the stream is dropped
        if self._thread.ident is None:  # never started: there is no run to stop
            self._channel.finish(None, None)
        await _abandon(self._channel)
        self._channel.raise_error()


def astream(
    target: Any,
    *args: Any,
    stop: StopLike | None = None,
    tokenizer: Any = None,
    preview: str | None = None,
    preview_every: int = 1,
    buffer: int = 64,
    **kwargs: Any,
) -> AsyncStream:
    """``stopcock.stream`` as an async iterator: ``async for event in stopcock.astream(...)``.

    Same arguments and events as :func:`stopcock.stream`, but the run starts at the first
    iteration. Prefer ``async with stopcock.astream(...) as events:`` so that leaving the block
    ends the run at once.
    """
    events = events_for(tokenizer, preview, preview_every)
    return AsyncStream(
        *start_worker(target, args, kwargs, stop=stop, buffer=buffer, events=events, started=False)
    )


async def _until(channel: Channel, ready: Callable[[], bool]) -> None:
    """Wait, without blocking the loop, until ``ready()``; the worker wakes us after each event."""
    while not ready():
        woken, wake = loop_waker()
        remove = channel.add_waker(wake)
        try:
            if not ready():
                await woken
        finally:
            remove()


async def _abandon(channel: Channel) -> None:
    """Stop the run and wait until its worker has ended, even through further cancellations.

    A cancellation that arrives meanwhile is raised once the worker has ended, never lost.
    """
    channel.abandon()
    cancelled: asyncio.CancelledError | None = None
    with _shield():
        while not channel.finished:
            try:
                await _until(channel, lambda: channel.finished)
            except asyncio.CancelledError as exc:
                cancelled = exc
    if cancelled is not None:
        raise cancelled


def _shield() -> AbstractContextManager[object]:
    """A shielded anyio cancel scope when anyio is in use, else nothing.

    anyio re-delivers a cancellation at every pass of the loop until the task leaves the cancelled
    scope; inside a shield the wait for the worker does not spin. asyncio's own cancellations are
    handled by the loop in :func:`_abandon`.
    """
    anyio = sys.modules.get("anyio")
    if anyio is None:
        return nullcontext()
    return anyio.CancelScope(shield=True)  # type: ignore[no-any-return]
