"""The job registry's calls for operations and tests (where a job runs, which replicas are live,
what became of a dispatch) and its readiness per kind (``/v1/health``, the 503 of a kind with no
ready replica): a part of :class:`~stopcock.server.ray_engine.registry.JobRegistry`."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from .wire import Refused

__all__ = ["Operations"]


class Operations:
    """What :class:`~stopcock.server.ray_engine.registry.JobRegistry` inherits: it sets the attributes."""

    _jobs: dict[str, Any]
    _replicas: dict[str, Any]
    _replicas_changed: asyncio.Event
    _dispatches: dict[str, asyncio.Task[Any]]
    _settled: dict[str, str]
    kinds: dict[str, dict[str, Any]]

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

        def live() -> list[dict[str, Any]]:
            return [dict(r.__dict__) for r in self._replicas.values() if r.kind == kind]

        while len(live()) < at_least and time.monotonic() < deadline:
            self._replicas_changed.clear()
            try:
                await asyncio.wait_for(self._replicas_changed.wait(), deadline - time.monotonic())
            except asyncio.TimeoutError:
                break
        return live()

    async def settled(self, job_id: str, timeout: float) -> str | None:
        """Once the job's dispatch is over (or after ``timeout`` s): what became of it (``ran``,
        ``refused``: a replica got it and could not start it, ``failed``), or None if it is not known
        (no dispatch of it in this registry, or still going)."""
        task = self._dispatches.get(job_id)
        if task is None:
            return self._settled.get(job_id)
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
        return sum(1 for r in self._replicas.values() if r.kind == kind)

    def _unavailable(self, kind: str) -> Refused:
        about = self.kinds.get(kind, {})
        asked = about.get("asked")
        needs = f"; each needs {about['needs']}" if about.get("needs") else ""
        return Refused(
            "unavailable",
            f"no {about.get('deployment', kind)} replica is ready (0 of {asked or 'the'} asked for{needs}):"
            " they are starting, or the cluster cannot place them (see /v1/health); try again later",
        )
