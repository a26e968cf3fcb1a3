"""The event streams of an ingress replica: one long poll of the registry for all of them.

Each stream (:meth:`Followers.events`) is a follower: a job, its owner and a cursor (the last event
it was given). One poll at a time asks the registry for the news of every follower
(:meth:`~stopcock.server.ray_engine.registry.JobRegistry.feed`), so the registry answers one call
per batch of news instead of one per stream and event.

Invariants: a cursor moves only when an answer arrives, so an answer lost with a cancelled poll is
asked for again and no event is skipped or given twice; a new follower cancels the poll in flight
(which did not ask for it) and the next poll includes it; the poll runs outside any request's
context, so the request that started it going away does not cancel it.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from ..contract import JobEvent
from .wire import POLL_S, Refused, detached

__all__ = ["Followers"]


@dataclass
class _Follower:
    job_id: str
    owner: str
    after: int  # the cursor: the events up to this one were given
    news: asyncio.Queue[tuple[list[JobEvent], bool] | BaseException] = field(default_factory=asyncio.Queue)


class Followers:
    """The event streams of an ingress replica, fed by one long poll: ``ask(method, *args)`` calls
    the registry (raising what it raises once it gives up)."""

    def __init__(self, ask: Callable[..., Awaitable[Any]]) -> None:
        self._ask = ask
        self._followers: dict[str, _Follower] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loop: asyncio.Task[Any] | None = None
        self._poll: asyncio.Future[Any] | None = None  # the poll in flight

    async def events(self, job_id: str, owner: str, after: int = 0) -> AsyncIterator[JobEvent]:
        """The job's events after ``after``, as they come, up to ``done``."""
        key = secrets.token_hex(8)
        follower = self._followers[key] = _Follower(job_id, owner, after)
        self._ask_again()
        try:
            while True:
                news = await follower.news.get()
                if isinstance(news, BaseException):
                    raise news
                new, ended = news
                for event in new:
                    yield event
                if ended:
                    return
        finally:
            self._followers.pop(key, None)

    def _ask_again(self) -> None:
        """Make the next poll include every follower: start the loop, or cancel the poll in flight."""
        if self._loop is None or self._loop.done():
            self._loop = detached(self._run, self._tasks)
        elif self._poll is not None:
            self._poll.cancel()

    async def _run(self) -> None:
        while self._followers:
            wants = [(key, f.job_id, f.owner, f.after) for key, f in self._followers.items()]
            self._poll = poll = asyncio.ensure_future(self._ask("feed", wants, POLL_S))
            await asyncio.wait([poll])  # returns when the poll ends, also cancelled (then: ask again)
            self._poll = None
            if poll.cancelled():
                continue
            error = poll.exception()
            if error is not None:  # the registry could not be reached: every stream asked for ends with it
                for key, *_ in wants:
                    follower = self._followers.pop(key, None)
                    if follower is not None:
                        follower.news.put_nowait(error)
                continue
            self._deliver(poll.result())

    def _deliver(self, answers: dict[str, tuple[list[JobEvent], int, bool] | Refused]) -> None:
        for key, answer in answers.items():
            follower = self._followers.get(key)
            if follower is None:  # its stream has closed meanwhile
                continue
            if isinstance(answer, Refused):
                del self._followers[key]
                follower.news.put_nowait(answer.error())
                continue
            new, cursor, ended = answer
            follower.after = cursor
            if ended:
                del self._followers[key]
            follower.news.put_nowait((new, ended))
