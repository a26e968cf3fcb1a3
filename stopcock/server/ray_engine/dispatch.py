"""The job registry's intake, dispatch and claims: each job queued, sent to its kind's model
deployment, what became of the send, and the claim a replica must be granted before it starts a
job (a part of :class:`~stopcock.server.ray_engine.registry.JobRegistry`)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from ..contract import PAUSED, JobSpec, JobView
from ..jobs import Job
from .journal import Record
from .records import RecordBook
from .replicas import ReplicaSet
from .wire import Refused, spec_to_json

__all__ = ["Dispatcher"]


class Dispatcher:
    """Queues jobs, sends them to ``models`` (kind -> the model deployment's handle) and grants claims.

    ``dispatches`` holds each job's send while it is in flight (a task made by ``spawn``),
    ``settled`` what the last ``4 * retain`` came to. Once ``closing``, new jobs are refused.
    """

    def __init__(
        self,
        models: dict[str, Any],
        book: RecordBook,
        fleet: ReplicaSet,
        spawn: Callable[[Awaitable[Any]], asyncio.Task[Any]],
    ) -> None:
        self.models = models
        self.book = book
        self.fleet = fleet
        self.spawn = spawn
        self.dispatches: dict[str, asyncio.Task[Any]] = {}  # job -> its dispatch, while it runs
        self.settled: dict[str, str] = {}  # job -> what its dispatch came to
        self.refused_claims = 0
        self.closing = False
        self.outranked: Callable[[Record], bool] = lambda record: False  # see Holds.outranked
        self.waiting: Callable[[Record], bool] = lambda record: False  # see holds.waiting

    def submit(
        self, job_id: str, spec: JobSpec, owner: str, created: float, unready: Refused | None
    ) -> JobView | Refused:
        """Queue a job (idempotent by ``job_id``); ``unready``: the refusal of a kind with no ready
        replica, when the caller asked for one (given before the queue bound)."""
        if job_id in self.book.jobs:
            known = self.book.find(job_id, owner)
            return known if isinstance(known, Refused) else known.job.view()
        if self.closing:
            return Refused("queue_full", "the server is shutting down")
        if spec.kind not in self.models:
            served = ", ".join(self.models)
            return Refused("kind", f"this server has no {spec.kind} model; it serves: {served}")
        refused = unready or self.book.full()
        if refused is not None:
            return refused
        record = Record(Job(spec, owner, id=job_id, created=created), len(self.book.queued) + 1)
        self.book.write(
            "submit",
            id=job_id,
            owner=owner,
            spec=spec_to_json(spec),
            created=created,
            position=record.position,
        )
        self.book.add(record)
        self.dispatches[job_id] = self.spawn(self.run(record))
        return record.job.view()

    def claim(self, job_id: str, replica: str) -> int | None:
        """May ``replica`` start the job? The number of events before its first if so (it numbers
        its events from there), None if not: stopped, ended, paused, forgotten, or claimed by
        another; or a job of a higher priority waits for a replica (it is sent again)."""
        record = self.book.jobs.get(job_id)
        if (
            record is None
            or record.final
            or record.claimed_by not in (None, replica)
            or record.job.state == PAUSED
        ):
            self.refused_claims += 1
            return None
        if record.claimed_by is None and self.outranked(record):
            return None
        self.fleet.seen(replica)
        if record.claimed_by is None:
            self.book.write("claim", id=job_id, replica=replica)
            record.claimed_by = replica
            self.book.queued.discard(job_id)
            self.fleet.claims[replica].add(job_id)
            with record.job.lock:
                record.job.state = "running"
            record.job.changes.bump()
        return len(record.job.events)

    def send(self, record: Record) -> None:
        """Send a job queued again (resumed) to its deployment, unless a send of it is still going
        (which sends it again itself)."""
        if record.job.id not in self.dispatches:
            self.dispatches[record.job.id] = self.spawn(self.run(record))

    async def run(self, record: Record) -> str:
        """Send the job to its model deployment, and learn there if the replica that runs it dies;
        returns what became of it: ``ran``, ``refused`` (the replica may not start it), ``failed``,
        ``lost`` (its replica died, and it was released to run again). A job that waits for a
        replica again after the answer (held and queued again, refused for a job of a higher
        priority, or released by its lost replica) is sent again, by this send only."""
        outcome = "failed"
        try:
            outcome = await self._send(record)
            while outcome != "failed" and self.waiting(record):
                outcome = await self._send(record)
            return outcome
        finally:
            self.dispatches.pop(record.job.id, None)
            self.settled[record.job.id] = outcome
            while len(self.settled) > 4 * self.book.retain:
                self.settled.pop(next(iter(self.settled)))

    async def _send(self, record: Record) -> str:
        from ray.exceptions import ActorDiedError, RayActorError, RayError
        from ray.serve.exceptions import RayServeException

        job = record.job
        for attempt in range(3):
            if record.final:
                return "refused"
            try:
                # "ran": the replica reported the job's end before answering; "refused": not claimed there
                held = _held(record)
                answer: str = await self.models[job.spec.kind].run.remote(job.id, job.owner, job.spec, *held)
                return answer
            except RayActorError as exc:
                if record.claimed_by is None and attempt < 2:
                    continue  # the replica it went to died before claiming it: it never started, send again
                if record.claimed_by is not None:
                    replica = record.claimed_by
                    dead = isinstance(exc, ActorDiedError)
                    if dead or not await asyncio.to_thread(self.fleet.alive, replica):
                        self.fleet.lost(replica, f"died ({type(exc).__name__})")
                    # else: unreachable for now, not dead; the watch decides if it stays silent
                    if record.claimed_by is None and not record.final:
                        return "lost"  # released to run again (Reruns): Dispatcher.run sends it again
                else:
                    self.book.fail(record, "no model replica could take it", f"{type(exc).__name__}: {exc}")
                return "failed"
            except (RayError, RayServeException) as exc:  # the call itself failed, not the pipeline
                if not record.final:
                    message = f"the model deployment could not run it: {type(exc).__name__}: {exc}"
                    self.book.fail(record, message)
                return "failed"
        return "failed"


def _held(record: Record) -> tuple[dict[str, Any], ...]:
    """The extra argument of a replica's ``run`` for a held job: where its checkpoint is, and its
    counts (none for a job that has no checkpoint)."""
    job = record.job
    if job.checkpoint is None:
        return ()
    return (
        {"handle": job.checkpoint.handle, "saved_steps": job.saved_steps, "preemptions": job.preemptions},
    )
