"""The job registry's calls for operations and tests (counts, where a job runs, which replicas are
live, what became of a dispatch) and its readiness per kind (the validators handed over,
``/v1/health``, the 503 of a kind with no ready replica): a part of
:class:`~stopcock.server.ray_engine.registry.JobRegistry`."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from .wire import Refused

if TYPE_CHECKING:
    from .dispatch import Dispatcher
    from .records import RecordBook
    from .replicas import ReplicaSet

__all__ = ["Operations"]


class Operations:
    """What :class:`~stopcock.server.ray_engine.registry.JobRegistry` inherits: it sets the attributes."""

    _jobs: dict[str, Any]
    book: RecordBook
    fleet: ReplicaSet
    dispatcher: Dispatcher
    kinds: dict[str, dict[str, Any]]

    @property
    def refused_claims(self) -> int:
        """How many claims were refused (the job was stopped, ended, or claimed by another)."""
        return self.dispatcher.refused_claims

    async def stats(self) -> dict[str, Any]:
        """The counts of jobs and replicas, and each kind's readiness (``kinds``)."""
        counts = {"queued": len(self.book.queued), **self.fleet.counts(len(self.book.jobs))}
        return {**counts, "refused_claims": self.refused_claims, "kinds": self.kinds_ready()}

    async def validator(self, kind: str, timeout: float) -> bytes | Refused | None:
        """The pickled validator of ``kind`` (None: the backend has none), once a replica registered
        one; refused (``unavailable``, naming why) if none did within ``timeout`` seconds."""
        registered = await self.fleet.registered(kind, timeout)
        return self.fleet.validators[kind] if registered else self._unavailable(kind)

    async def placement(self, job_id: str) -> str | None:
        """The replica (its Ray actor name) that claimed the job, if any."""
        record = self._jobs.get(job_id)
        return None if record is None else record.claimed_by

    async def whoami(self) -> str:
        """This registry replica's Ray actor name."""
        import ray

        return str(ray.get_runtime_context().get_actor_name())

    async def replicas(self, kind: str, at_least: int = 0, timeout: float = 0.0) -> list[dict[str, Any]]:
        """The live model replicas of ``kind`` (name, concurrency, peak and current pipelines), once
        there are ``at_least`` of them (or after ``timeout`` seconds)."""
        deadline = time.monotonic() + timeout

        while self.fleet.ready(kind) < at_least and time.monotonic() < deadline:
            self.fleet.changed.clear()
            try:
                await asyncio.wait_for(self.fleet.changed.wait(), deadline - time.monotonic())
            except asyncio.TimeoutError:
                break
        return self.fleet.describe(kind)

    async def settled(self, job_id: str, timeout: float) -> str | None:
        """Once the job's dispatch is over (or after ``timeout`` s): what became of it (``ran``,
        ``refused``: a replica got it and could not start it, ``failed``), or None if it is not known
        (no dispatch of it in this registry, or still going)."""
        task = self.dispatcher.dispatches.get(job_id)
        if task is None:
            return self.dispatcher.settled.get(job_id)
        done, _ = await asyncio.wait({task}, timeout=timeout)
        return task.result() if done else None

    # -- readiness -----------------------------------------------------------------------------------
    def kinds_ready(self) -> dict[str, dict[str, Any]]:
        """Each kind's ready (registered, live) model replicas out of those asked for."""
        return {
            kind: {"ready": self._ready(kind), "asked": about.get("asked")}
            for kind, about in self.kinds.items()
        }

    def _ready(self, kind: str) -> int:
        return self.fleet.ready(kind)

    def _unavailable(self, kind: str) -> Refused:
        about = self.kinds.get(kind, {})
        asked = about.get("asked")
        needs = f"; each needs {about['needs']}" if about.get("needs") else ""
        return Refused(
            "unavailable",
            f"no {about.get('deployment', kind)} replica is ready (0 of {asked or 'the'} asked for{needs}):"
            " they are starting, or the cluster cannot place them (see /v1/health); try again later",
        )
