"""The Ray engine's job registry (one Serve replica): where a job's start and its stop are ordered.

:class:`JobRegistry` holds the calls Serve makes (the engine's, owner-scoped, and the model
replicas'); its parts do the bookkeeping: the record book (:class:`~.records.RecordBook`: records,
queue bound, claims, ends, retention), the replica set (:class:`~.replicas.ReplicaSet`:
registrations, long polls, liveness), the dispatcher (:class:`~.dispatch.Dispatcher`: intake, sends
and claims), the stops (:class:`~.stops.Stops`) and the journal (:class:`~.journal.Journal`).

``models`` maps each kind to the handle of its model deployment. Everything runs on one event
loop, so each call is atomic up to its first ``await``: a claim and a stop of the same job are
ordered, and a job stopped before any replica claimed it never starts. At most ``queue_size`` jobs
wait for a replica; ``retain`` finished jobs are kept; a stop with ``wait`` answers once the run
returned, or after ``stop_wait`` seconds with the job still ``stopping``. ``journal`` is the path of
the journal, or ``journal_dir`` the folder of one named after the Serve application (None: none,
and a restart forgets everything); it keeps the latest ``journal_events`` events of each
unfinished job. ``kinds`` says, for each kind, its model deployment's name, the
replicas asked for and what each needs (``/v1/health`` and the answer to a submission for a kind
with no ready replica name them). ``alive(name)`` says whether a replica actor lives (Ray's answer
by default).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from ..contract import FINAL_STATES, JobEvent, JobSpec, JobState, JobView
from ..jobs import Job
from .dispatch import Dispatcher
from .journal import EVENTS_KEPT, Journal, Record, event_entry
from .operations import Operations
from .records import RecordBook
from .replicas import ReplicaSet
from .stops import Stops
from .wire import Refused, detached, spec_from_json

__all__ = ["JobRegistry"]


class JobRegistry(Operations):
    """The job registry (one Serve replica): records, queue bound, dispatch, claims, stops, journal
    (see the module's documentation for what each argument means)."""

    async def __init__(  # type: ignore[misc]
        self,
        models: Mapping[str, Any],
        *,
        queue_size: int = 16,
        retain: int = 256,
        stop_wait: float = 30.0,
        journal: str | None = None,
        journal_dir: str | None = None,
        fsync: bool = False,
        journal_events: int = EVENTS_KEPT,
        alive: Callable[[str], bool] | None = None,
        kinds: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        self.models = dict(models)
        self.kinds = {kind: dict((kinds or {}).get(kind, {})) for kind in self.models}
        self.retain = retain
        self._tasks: set[asyncio.Task[Any]] = set()
        self.book = RecordBook(queue_size, retain, self._write, self._compact_if_long)
        self.fleet = ReplicaSet(self.book, alive or _actor_alive)
        self.dispatcher = Dispatcher(self.models, self.book, self.fleet, self._spawn)
        self.stops = Stops(self.book, self.fleet, stop_wait)
        # the containers the journal's methods read (the parts' own, never rebound)
        self._jobs, self._queued, self._finished = self.book.jobs, self.book.queued, self.book.finished
        self._claims, self._dispatches = self.book.claims, self.dispatcher.dispatches
        self.journal = _open_journal(journal, journal_dir, fsync, journal_events)
        self.restored = self._restore() if self.journal is not None else 0
        self._spawn(self.fleet.watch())

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        return detached(lambda: coro, self._tasks)

    def _write(self, op: str, **fields: Any) -> None:
        if self.journal is not None:
            self.journal.write(op, **fields)

    # -- the engine's calls (owner-scoped) --------------------------------------------------------
    async def submit(
        self, job_id: str, spec: JobSpec, owner: str, created: float, ready_only: bool = False
    ) -> JobView | Refused:
        """Queue a job (idempotent by ``job_id``: the ingress may ask again after a registry restart);
        with ``ready_only``, refuse it at once when no replica of its kind is ready."""
        unready = self._unavailable(spec.kind) if ready_only and not self._ready(spec.kind) else None
        return self.dispatcher.submit(job_id, spec, owner, created, unready)

    async def get(self, job_id: str, owner: str) -> JobView | Refused:
        record = self.book.find(job_id, owner)
        return record if isinstance(record, Refused) else record.job.view()

    async def jobs_of(self, owner: str, limit: int = 100) -> list[JobView]:
        """The owner's jobs, newest first (at most ``limit``)."""
        return self.book.of(owner, limit)

    async def stop(
        self, job_id: str, owner: str, reason: str = "user", wait: bool = True
    ) -> JobView | Refused:
        """Stop a job (see :meth:`.stops.Stops.stop`)."""
        return await self.stops.stop(job_id, owner, reason, wait)

    async def ask(self, job_id: str, owner: str, action: str, reason: str) -> JobView | Refused:
        """Skip the current item or stop after it (see :meth:`.stops.Stops.ask`)."""
        return await self.stops.ask(job_id, owner, action, reason)

    async def wait(self, job_id: str, owner: str, timeout: float | None) -> JobView | Refused:
        return await self.book.wait(job_id, owner, timeout)

    async def events(
        self, job_id: str, owner: str, after: int, timeout: float
    ) -> tuple[list[JobEvent], int, bool] | Refused:
        return await self.book.events(job_id, owner, after, timeout)

    async def result(self, job_id: str, owner: str) -> dict[str, Any] | Refused:
        return self.book.result(job_id, owner)

    async def stop_all(self, reason: str = "shutdown", timeout: float = 60.0) -> int:
        """Refuse new jobs, stop every job, wait (up to ``timeout`` s) for them to end; returns how many.

        (Not ``shutdown``: a Serve handle's own ``shutdown`` would hide it.)"""
        self.dispatcher.closing = True
        return await self.stops.stop_all(reason, timeout)

    # -- the model replicas' calls -------------------------------------------------------------------
    async def register(self, kind: str, replica: str, concurrency: int, validator: bytes | None) -> None:
        """A model replica of ``kind`` has started (or finds a restarted registry)."""
        self.fleet.register(kind, replica, concurrency, validator)

    async def claim(self, job_id: str, replica: str) -> int | None:
        """May ``replica`` start the job? (see :meth:`.dispatch.Dispatcher.claim`)."""
        return self.dispatcher.claim(job_id, replica)

    async def report(
        self,
        replica: str,
        events: list[tuple[str, JobEvent]],
        views: Mapping[str, Mapping[str, Any]],
        results: Mapping[str, Any],
    ) -> None:
        """A batch of a replica's news: events (in order), the current views of its jobs, and the
        results of those that ended (whose ``done`` event is in ``events``)."""
        self._seen(replica)
        if self.journal is not None:  # on disk before any follower sees them: a restart keeps them
            self.journal.write_events(
                (job_id, event)
                for job_id, event in events
                if (r := self._jobs.get(job_id)) is not None and r.claimed_by == replica and not r.job.ended
            )
        for job_id, view in views.items():
            record = self._jobs.get(job_id)
            if record is not None and record.claimed_by == replica and not record.final:
                if view["state"] not in FINAL_STATES:  # the end comes with the done event
                    state = view["state"]
                    if record.stop is not None and state == "running":
                        state = "stopping"  # asked here, not yet applied there
                    record.job.apply({**view, "state": state})
        for job_id, event in events:
            record = self._jobs.get(job_id)
            if record is None or record.claimed_by != replica or record.job.ended:
                continue
            if event.type == "done":
                with record.job.lock:
                    record.job.result = results.get(job_id)
                record.job.apply(event.data)
            record.job.put(event)
            if event.type == "done":
                self._ended(record)
        self._compact_if_long()

    async def poll(
        self, replica: str, applied: list[str], running: list[str], peak: int, busy: int, timeout: float
    ) -> tuple[dict[str, str], bool, list[tuple[str, str, str]]]:
        """A replica's long poll (see :meth:`.replicas.ReplicaSet.poll`)."""
        return await self.fleet.poll(replica, applied, running, peak, busy, timeout)

    # -- what the journal's methods call ------------------------------------------------------------
    def _add(self, record: Record) -> None:
        self.book.add(record)

    def _seen(self, replica: str) -> None:
        self.fleet.seen(replica)

    def _dispatch(self, record: Record) -> Awaitable[str]:
        return self.dispatcher.run(record)

    def _end_here(self, record: Record, state: JobState, reason: str, detail: str) -> None:
        self.book.end(record, state, reason, detail)

    def _ended(self, record: Record) -> None:
        self.book.ended(record)

    def _restore(self) -> int:
        """Rebuild the records from the journal; queued jobs are sent again (they never started)."""
        assert self.journal is not None
        entries, events = self.journal.by_job(), self.journal.events()
        for job_id, parts in entries.items():
            sub = parts["submit"]
            job = Job(spec_from_json(sub["spec"]), sub["owner"], id=job_id, created=sub["created"])
            record = Record(job, sub["position"])
            record.claimed_by = parts.get("claim", {}).get("replica")
            record.stop = parts.get("stop", {}).get("reason")
            if record.claimed_by is not None:
                record.job.state = "stopping" if record.stop else "running"
            self._add(record)
            for event in events.get(job_id, ()):  # an unfinished job's events, numbered as they were
                record.job.put(event)
            end = parts.get("end")
            if end is not None:
                record.journaled_end = True
                record.job.result = end["result"]
                record.job.apply(end["view"])
                record.job.put(JobEvent(end["done"], "done", end["view"]))
                self._queued.discard(job_id)
                self._finished.append(job_id)
            elif record.claimed_by is not None:
                self._claims[record.claimed_by].add(job_id)
            elif record.stop is not None:  # stopped unclaimed, and the registry died before writing the end
                record.job.request_stop(record.stop)
                self._end_here(record, "stopped", record.stop, "stopped while queued: it never ran")
            else:
                self._dispatches[job_id] = self._spawn(self._dispatch(record))
        kept = [event_entry(job_id, e) for job_id, es in events.items() for e in es]
        self.journal.rewrite([e for p in entries.values() for e in p.values()] + kept)
        return len(entries)

    def _compact_if_long(self) -> None:
        journal = self.journal
        if journal is not None and journal.due(8 * (self.retain + len(self._jobs))):
            keep = set(self._jobs)
            journal.rewrite([e for job_id in keep for e in self._jobs[job_id].entries(journal.keep_events)])


def _open_journal(journal: str | None, journal_dir: str | None, fsync: bool, events: int) -> Journal | None:
    """The journal at ``journal``, or one named after the Serve application in ``journal_dir``."""
    if journal is None and journal_dir is not None:
        from ray import serve

        journal = str(Path(journal_dir) / f"{serve.get_replica_context().app_name}.jsonl")
    return None if journal is None else Journal(journal, fsync=fsync, events=events)


def _actor_alive(name: str) -> bool:
    """Whether the Serve replica actor ``name`` is alive (Ray frees a dead actor's name)."""
    import ray

    try:
        ray.get_actor(name, namespace="serve")
    except ValueError:
        return False
    return True
