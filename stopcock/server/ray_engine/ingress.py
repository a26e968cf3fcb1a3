"""The ingress side of the Ray engine: :class:`RayEngine`, the contract's engine over the registry."""

from __future__ import annotations

import asyncio
import functools
import pickle
import threading
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from ..contract import FINAL_STATES, JobEvent, JobSpec, JobView, KindNotServed
from ..jobs import new_id
from .followers import Followers
from .wire import POLL_S, Refused, call, detached

__all__ = ["RayEngine"]


class RayEngine:
    """The :class:`~stopcock.server.contract.Engine` (and :class:`~stopcock.server.contract.Pausable`)
    of an ingress replica: every call goes to the job registry (a Serve handle), so every ingress
    replica sees every job.

    ``models`` maps each served kind to ``{"id", "description"}``. Jobs are checked before they are
    queued with the model's validator (e.g. the prompt's length in tokens), which the model replicas
    hand to the registry when they start; it is fetched once per kind and run in a thread.
    """

    def __init__(self, registry: Any, models: Mapping[str, Mapping[str, str]], *, retry_for: float = 60.0):
        self.registry = registry
        self.models: Mapping[str, Mapping[str, str]] = {kind: dict(m) for kind, m in models.items()}
        self.retry_for = retry_for
        self._validators: dict[str, Any] = {}
        self._validating = threading.Lock()
        self._detached: set[asyncio.Task[Any]] = set()
        self._followers = Followers(self._ask)

    async def _ask(self, method: str, *args: Any) -> Any:
        answer = await call(self.registry, method, *args, retry_for=self.retry_for)
        if isinstance(answer, Refused):
            raise answer.error()
        return answer

    def warm(self) -> None:
        """Fetch each kind's validator in the background, from now on (called as the ingress replica
        starts, in its event loop): unpickling a tokenizer imports its library, which would otherwise
        hold up the first submission this replica receives."""
        for kind in self.models:
            detached(functools.partial(self._fetch, kind), self._detached)

    async def _fetch(self, kind: str) -> None:
        while kind not in self._validators:  # until a model replica of the kind has registered
            blob = await call(self.registry, "validator", kind, POLL_S, retry_for=None)
            if not isinstance(blob, Refused):
                validator = None if blob is None else await asyncio.to_thread(pickle.loads, blob)
                self._validators.setdefault(kind, validator)

    async def _validator(self, kind: str) -> Any:
        if kind not in self._validators:
            blob = await self._ask("validator", kind, 0.0)  # no replica ready: Unavailable, at once
            # pickled by our own model replicas (a tokenizer can take a while to unpickle: not on the loop)
            self._validators[kind] = None if blob is None else await asyncio.to_thread(pickle.loads, blob)
        return self._validators[kind]

    def _validate(self, validator: Any, spec: JobSpec) -> None:
        with self._validating:  # one check at a time: a tokenizer is not meant for several threads
            validator.validate(spec)

    async def submit(self, spec: JobSpec, owner: str) -> JobView:
        if spec.kind not in self.models:
            served = ", ".join(self.models)
            raise KindNotServed(f"this server has no {spec.kind} model; it serves: {served}")
        validator = await self._validator(spec.kind)
        if validator is not None:
            await asyncio.to_thread(self._validate, validator, spec)
        view: JobView = await self._ask("submit", new_id(), spec, owner, time.time(), True)
        return view

    async def get(self, job_id: str, owner: str) -> JobView:
        view: JobView = await self._ask("get", job_id, owner)
        return view

    async def list(self, owner: str, limit: int = 100) -> list[JobView]:
        views: list[JobView] = await self._ask("jobs_of", owner, limit)
        return views

    async def stop(
        self, job_id: str, owner: str, reason: str = "user", wait: bool = True, at: str = "now"
    ) -> JobView:
        """Stop a job (see :meth:`JobRegistry.stop`; ``at="item"``: :meth:`JobRegistry.ask`). The call
        to the registry runs on its own, so a client that goes away before the answer does not take
        the stop with it."""
        if at == "item":
            ask = lambda: self._ask("ask", job_id, owner, "after_item", reason)  # noqa: E731
        else:
            ask = lambda: self._ask("stop", job_id, owner, reason, wait)  # noqa: E731
        view: JobView = await asyncio.shield(detached(ask, self._detached))
        return view

    async def skip(self, job_id: str, owner: str) -> JobView:
        """Skip the running job's current item (see :meth:`JobRegistry.ask`)."""
        view: JobView = await self._ask("ask", job_id, owner, "skip", "skipped")
        return view

    async def pause(self, job_id: str, owner: str) -> JobView:
        """Hold the job with its checkpoint, answered once it is held (see :meth:`JobRegistry.pause`);
        :class:`~stopcock.server.contract.JobStateConflict` for a job that has ended."""
        view: JobView = await self._ask("pause", job_id, owner)
        return view

    async def resume(self, job_id: str, owner: str) -> JobView:
        """Queue a paused job again, to resume from its checkpoint on any replica of its kind."""
        view: JobView = await self._ask("resume", job_id, owner)
        return view

    async def wait(self, job_id: str, owner: str, timeout: float | None = None) -> JobView:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = POLL_S if deadline is None else min(POLL_S, max(0.0, deadline - time.monotonic()))
            view: JobView = await self._ask("wait", job_id, owner, left)
            if view.state in FINAL_STATES or (deadline is not None and time.monotonic() >= deadline):
                return view

    async def events(self, job_id: str, owner: str, after: int = 0) -> AsyncIterator[JobEvent]:
        """The job's events after ``after``, as they come, up to ``done``: every stream of this
        ingress replica is fed by one long poll of the registry (:class:`~.followers.Followers`)."""
        async for event in self._followers.events(job_id, owner, after):
            yield event

    async def result(self, job_id: str, owner: str) -> dict[str, Any]:
        found: dict[str, Any] = await self._ask("result", job_id, owner)
        return found

    async def stats(self) -> dict[str, Any]:  # type: ignore[override]
        """Counts across the cluster (an awaitable, unlike ``LocalEngine``'s: they live in the registry),
        with each kind's ready model replicas out of those asked for (``kinds``)."""
        counts: dict[str, Any] = await self._ask("stats")
        return counts

    async def aclose(self) -> None:
        """Nothing to close: an ingress replica holds no job (stop them with :meth:`JobRegistry.stop_all`)."""
