"""The Ray engine's job registry (one Serve replica): where a job's start and its stop are ordered."""

from __future__ import annotations

import asyncio
import collections
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..contract import FINAL_STATES, JobEvent, JobSpec, JobState, JobView
from ..jobs import Job, finish, since, summary_of_end, wait_final
from .journal import Journal, Record
from .operations import Operations
from .wire import POLL_S, SILENT_S, Refused, detached, spec_from_json, spec_to_json

__all__ = ["JobRegistry"]


@dataclass
class _Replica:
    name: str
    kind: str
    concurrency: int
    seen: float
    peak: int = 0
    busy: int = 0


class JobRegistry(Operations):
    """The job registry (one Serve replica): records, queue bound, dispatch, claims, stops, journal.

    ``models`` maps each kind to the handle of its model deployment. Everything here runs on one
    event loop, so each method is atomic up to its first ``await``: a claim and a stop of the same
    job are ordered, and a job stopped before any replica claimed it never starts. At most
    ``queue_size`` jobs wait for a replica; ``retain`` finished jobs are kept; a stop with ``wait``
    answers once the run returned, or after ``stop_wait`` seconds with the job still ``stopping``.
    ``journal`` is the path of the journal, or ``journal_dir`` the folder of one named after the
    Serve application (None: none, and a restart forgets everything). ``kinds`` says, for each kind,
    its model deployment's name, the replicas asked for and what each needs (``/v1/health`` and the
    answer to a submission for a kind with no ready replica name them).
    """

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
        alive: Callable[[str], bool] | None = None,
        kinds: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        if queue_size < 0 or retain < 1:
            raise ValueError("queue_size must be >= 0 and retain >= 1")
        self.models = dict(models)
        self.kinds = {kind: dict((kinds or {}).get(kind, {})) for kind in self.models}
        self.queue_size = queue_size
        self.retain = retain
        self.stop_wait = stop_wait
        self._alive = alive or _actor_alive
        self._jobs: dict[str, Record] = {}
        self._queued: set[str] = set()
        self._finished: collections.deque[str] = collections.deque()
        self._claims: dict[str, set[str]] = collections.defaultdict(set)  # replica -> its unfinished jobs
        self._pollers: dict[str, asyncio.Event] = {}
        self._replicas: dict[str, _Replica] = {}
        self._validators: dict[str, bytes | None] = {}
        self._kind_ready: dict[str, asyncio.Event] = collections.defaultdict(asyncio.Event)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._dispatches: dict[str, asyncio.Task[Any]] = {}  # job -> its dispatch, while it runs
        self._settled: dict[str, str] = {}  # job -> what its dispatch came to
        self._replicas_changed = asyncio.Event()
        self._closing = False
        self.refused_claims = 0
        self._started = time.monotonic()
        if journal is None and journal_dir is not None:  # one journal per application, named after it
            from ray import serve

            journal = str(Path(journal_dir) / f"{serve.get_replica_context().app_name}.jsonl")
        self.journal = None if journal is None else Journal(journal, fsync=fsync)
        self.restored = self._restore() if self.journal is not None else 0
        self._spawn(self._watch())

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
        known = self._jobs.get(job_id)
        if known is not None:
            return known.job.view() if secrets.compare_digest(known.job.owner, owner) else _not_found(job_id)
        if self._closing:
            return Refused("queue_full", "the server is shutting down")
        if spec.kind not in self.models:
            served = ", ".join(self.models)
            return Refused("kind", f"this server has no {spec.kind} model; it serves: {served}")
        if ready_only and not self._ready(spec.kind):
            return self._unavailable(spec.kind)
        if len(self._queued) >= self.queue_size:
            message = f"the queue is full ({self.queue_size} jobs waiting); try again later"
            return Refused("queue_full", message)
        record = Record(Job(spec, owner, id=job_id, created=created), len(self._queued) + 1)
        self._write(
            "submit",
            id=job_id,
            owner=owner,
            spec=spec_to_json(spec),
            created=created,
            position=record.position,
        )
        self._add(record)
        self._dispatches[job_id] = self._spawn(self._dispatch(record))
        return record.job.view()

    async def get(self, job_id: str, owner: str) -> JobView | Refused:
        record = self._find(job_id, owner)
        return record if isinstance(record, Refused) else record.job.view()

    async def jobs_of(self, owner: str, limit: int = 100) -> list[JobView]:
        """The owner's jobs, newest first (at most ``limit``)."""
        mine = [r.job for r in self._jobs.values() if secrets.compare_digest(r.job.owner, owner)]
        return [job.view() for job in reversed(mine[-limit:])]

    async def stop(
        self, job_id: str, owner: str, reason: str = "user", wait: bool = True
    ) -> JobView | Refused:
        """Stop a job: a job no replica has claimed ends ``stopped`` now and never starts (a tombstone);
        a claimed one is stopped by its replica at its next step. Written to the journal before the
        answer. With ``wait``, answers once the run returned (or after ``stop_wait`` seconds)."""
        record = self._find(job_id, owner)
        if isinstance(record, Refused):
            return record
        if not record.final:
            if record.stop is None:
                record.stop = reason
                self._write("stop", id=job_id, reason=reason)
            if record.claimed_by is None:
                record.job.request_stop(record.stop)  # its stop_step: the step it reached, none
                self._end_here(record, "stopped", record.stop, "stopped while queued: it never ran")
            else:
                with record.job.lock:
                    if record.job.state == "running":
                        record.job.state = "stopping"
                record.job.changes.bump()
                self._wake(record.claimed_by)
                if wait:
                    await wait_final(record.job, self.stop_wait)
        return record.job.view()

    async def ask(self, job_id: str, owner: str, action: str, reason: str) -> JobView | Refused:
        """Skip the current item (``action="skip"``) or stop after it (``"after_item"``), answered at
        once. A job no replica has claimed has no current item: a skip leaves it as it is, a stop
        after the item stops it now. Delivered to the replica with its next poll (not journaled)."""
        record = self._find(job_id, owner)
        if isinstance(record, Refused):
            return record
        if record.final:
            return record.job.view()
        if record.claimed_by is None:
            return record.job.view() if action == "skip" else await self.stop(job_id, owner, reason, False)
        record.asks.append((action, reason))
        self._wake(record.claimed_by)
        return record.job.view()

    async def wait(self, job_id: str, owner: str, timeout: float | None) -> JobView | Refused:
        record = self._find(job_id, owner)
        if isinstance(record, Refused):
            return record
        await wait_final(record.job, timeout)
        return record.job.view()

    async def events(
        self, job_id: str, owner: str, after: int, timeout: float
    ) -> tuple[list[JobEvent], int, bool] | Refused:
        """The job's events after ``after`` (waiting up to ``timeout`` for one), the new cursor, and
        whether ``done`` is among them."""
        record = self._find(job_id, owner)
        if isinstance(record, Refused):
            return record
        version = record.job.changes.version
        new, cursor, ended = since(record.job, after)
        if not new and not ended:
            await record.job.changes.wait_past(version, timeout)
            new, cursor, ended = since(record.job, after)
        return new, cursor, ended

    async def result(self, job_id: str, owner: str) -> dict[str, Any] | Refused:
        record = self._find(job_id, owner)
        if isinstance(record, Refused):
            return record
        view = record.job.view()
        with record.job.lock:
            result = record.job.result if view.state in FINAL_STATES else None
        return {"job": view.to_json(), "result": result}

    async def stats(self) -> dict[str, Any]:
        replicas = list(self._replicas.values())
        return {
            "queued": len(self._queued),
            "running": sum(len(jobs) for jobs in self._claims.values()),
            "jobs": len(self._jobs),
            "workers_alive": sum(r.concurrency for r in replicas),
            "replicas": len(replicas),
            "pipelines_peak": max((r.peak for r in replicas), default=0),
            "concurrency": min((r.concurrency for r in replicas), default=0),
            "refused_claims": self.refused_claims,
            "kinds": self.kinds_ready(),
        }

    async def validator(self, kind: str, timeout: float) -> bytes | Refused | None:
        """The pickled validator of ``kind`` (None: the backend has none), once a replica registered
        one; refused (``unavailable``, naming why) if none did within ``timeout`` seconds."""
        if kind not in self._validators:
            try:
                await asyncio.wait_for(self._kind_ready[kind].wait(), timeout)
            except asyncio.TimeoutError:
                return self._unavailable(kind)
        return self._validators[kind]

    async def stop_all(self, reason: str = "shutdown", timeout: float = 60.0) -> int:
        """Refuse new jobs, stop every job, wait (up to ``timeout`` s) for them to end; returns how many.

        (Not ``shutdown``: a Serve handle's own ``shutdown`` would hide it.)"""
        self._closing = True
        open_ = [r for r in self._jobs.values() if not r.final]
        for record in open_:
            await self.stop(record.job.id, record.job.owner, reason, wait=False)
        for record in open_:
            await wait_final(record.job, timeout)
        return len(open_)

    # -- the model replicas' calls -------------------------------------------------------------------
    async def register(self, kind: str, replica: str, concurrency: int, validator: bytes | None) -> None:
        """A model replica of ``kind`` has started (or finds a restarted registry)."""
        self._replicas[replica] = _Replica(replica, kind, concurrency, time.monotonic())
        self._replicas_changed.set()
        if kind not in self._validators:
            self._validators[kind] = validator
            self._kind_ready[kind].set()

    async def claim(self, job_id: str, replica: str) -> int | None:
        """May ``replica`` start the job? The number of events before its first if so (it numbers
        its events from there), None if not: stopped, ended, forgotten, or claimed by another."""
        record = self._jobs.get(job_id)
        if record is None or record.final or record.claimed_by not in (None, replica):
            self.refused_claims += 1
            return None
        self._seen(replica)
        if record.claimed_by is None:
            self._write("claim", id=job_id, replica=replica)
            record.claimed_by = replica
            self._queued.discard(job_id)
            self._claims[replica].add(job_id)
            with record.job.lock:
                record.job.state = "running"
            record.job.changes.bump()
        return len(record.job.events)

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

    async def poll(
        self, replica: str, applied: list[str], running: list[str], peak: int, busy: int, timeout: float
    ) -> tuple[dict[str, str], bool, list[tuple[str, str, str]]]:
        """A replica's long poll: the stops asked for its jobs that it has not applied yet, as
        ``{job_id: reason}`` (waiting up to ``timeout`` for one), whether this registry knows the
        replica (False after a registry restart: it then registers again), and the other asks for
        its jobs as ``(job_id, action, reason)`` (see :meth:`ask`)."""
        self._seen(replica, peak, busy)
        for job_id in applied:
            record = self._jobs.get(job_id)
            if record is not None and record.claimed_by == replica:
                record.stop_applied = True
        for job_id in running:  # after a restart: the replica still runs them
            record = self._jobs.get(job_id)
            if record is not None and record.claimed_by == replica and not record.final:
                self._claims[replica].add(job_id)
        pending = self._pending(replica)
        if not pending and not self._asks(replica, take=False):
            event = self._pollers[replica] = asyncio.Event()
            try:
                await asyncio.wait_for(event.wait(), timeout)
            except asyncio.TimeoutError:
                pass
            pending = self._pending(replica)
        return pending, replica in self._replicas, self._asks(replica, take=True)

    # -- internals ---------------------------------------------------------------------------------
    def _find(self, job_id: str, owner: str) -> Record | Refused:
        record = self._jobs.get(job_id)
        if record is None or not secrets.compare_digest(record.job.owner, owner):
            return _not_found(job_id)
        return record

    def _add(self, record: Record) -> None:
        self._jobs[record.job.id] = record
        if not record.final and record.claimed_by is None:
            self._queued.add(record.job.id)
        record.job.emit("queued", position=record.position)

    def _seen(self, replica: str, peak: int | None = None, busy: int | None = None) -> None:
        known = self._replicas.get(replica)
        if known is not None:
            known.seen = time.monotonic()
            if peak is not None and busy is not None:
                known.peak, known.busy = max(known.peak, peak), busy

    def _wake(self, replica: str) -> None:
        poller = self._pollers.get(replica)
        if poller is not None:
            poller.set()

    def _asks(self, replica: str, *, take: bool) -> list[tuple[str, str, str]]:
        """The asks waiting for ``replica``'s jobs; ``take`` hands them over (cleared here)."""
        found = []
        for job_id in self._claims.get(replica, ()):
            record = self._jobs[job_id]
            found += [(job_id, action, reason) for action, reason in record.asks]
            if take:
                record.asks = []
        return found

    def _pending(self, replica: str) -> dict[str, str]:
        pending = {}
        for job_id in self._claims.get(replica, ()):
            record = self._jobs[job_id]
            if record.stop is not None and not record.stop_applied and not record.final:
                pending[job_id] = record.stop
        return pending

    def _end_here(
        self, record: Record, state: JobState, reason: str, detail: str, error: str | None = None
    ) -> None:
        """End a job from the registry: it never started (a tombstone), or its replica is gone."""
        job = record.job
        finish(
            job,
            state,
            reason,
            outcome=summary_of_end(state, reason, job.step, job.total, job.started, detail),
            error=error,
        )
        self._ended(record)

    def _ended(self, record: Record) -> None:
        job_id = record.job.id
        self._queued.discard(job_id)
        if record.claimed_by is not None:
            self._claims[record.claimed_by].discard(job_id)
        if not record.journaled_end:
            record.journaled_end = True
            with record.job.lock:
                done = len(record.job.events)
                result = record.job.result
            self._write("end", id=job_id, view=record.job.view().to_json(), result=result, done=done)
            self._finished.append(job_id)
            while len(self._finished) > self.retain:
                old = self._finished.popleft()
                self._jobs.pop(old, None)
                self._write("forget", id=old)
            self._compact_if_long()

    def _lost(self, replica: str, why: str) -> None:
        """``replica`` is gone: its unfinished jobs fail (they are not run again)."""
        self._replicas.pop(replica, None)
        self._replicas_changed.set()
        for job_id in list(self._claims.pop(replica, ())):
            record = self._jobs[job_id]
            if not record.final:
                message = f"the model replica running this job ({replica}) {why}; the job was not run again"
                self._end_here(record, "failed", "error", message, error=message)

    async def _dispatch(self, record: Record) -> str:
        """Send the job to its model deployment, and learn there if the replica that runs it dies;
        returns what became of it: ``ran``, ``refused`` (the replica may not start it), ``failed``."""
        outcome = "failed"
        try:
            outcome = await self._send(record)
            return outcome
        finally:
            self._dispatches.pop(record.job.id, None)
            self._settled[record.job.id] = outcome
            while len(self._settled) > 4 * self.retain:
                self._settled.pop(next(iter(self._settled)))

    async def _send(self, record: Record) -> str:
        from ray.exceptions import ActorDiedError, RayActorError, RayError
        from ray.serve.exceptions import RayServeException

        job = record.job
        for attempt in range(3):
            if record.final:
                return "refused"
            try:
                # "ran": the replica reported the job's end before answering; "refused": not claimed there
                answer: str = await self.models[job.spec.kind].run.remote(job.id, job.owner, job.spec)
                return answer
            except RayActorError as exc:
                if record.claimed_by is None and attempt < 2:
                    continue  # the replica it went to died before claiming it: it never started, send again
                if record.claimed_by is not None:
                    replica = record.claimed_by
                    if isinstance(exc, ActorDiedError) or not await asyncio.to_thread(self._alive, replica):
                        self._lost(replica, f"died ({type(exc).__name__})")
                    # else: unreachable for now, not dead; the watch decides if it stays silent
                else:
                    self._end_here(
                        record,
                        "failed",
                        "error",
                        "no model replica could take it",
                        error=f"{type(exc).__name__}: {exc}",
                    )
                return "failed"
            except (RayError, RayServeException) as exc:  # the call itself failed, not the pipeline
                if not record.final:
                    message = f"the model deployment could not run it: {type(exc).__name__}: {exc}"
                    self._end_here(record, "failed", "error", message, error=message)
                return "failed"
        return "failed"

    async def _watch(self) -> None:
        """Every few seconds: a replica that has been silent for a while, and that Ray says is gone,
        takes its unfinished jobs with it (this catches the replicas whose jobs no dispatch call
        watches, after a registry restart, and the replicas that were scaled away)."""
        while True:
            await asyncio.sleep(POLL_S)  # a period, not a synchronisation
            now = time.monotonic()
            for replica in [r for r in self._replicas.values() if now - r.seen > SILENT_S]:
                if not await asyncio.to_thread(self._alive, replica.name):
                    self._lost(replica.name, "is gone")
            # claimed by a replica this registry never heard of (restored from the journal)
            for name in [n for n, jobs in self._claims.items() if jobs and n not in self._replicas]:
                if now - self._started > SILENT_S and not await asyncio.to_thread(self._alive, name):
                    self._lost(name, "is gone")

    def _restore(self) -> int:
        """Rebuild the records from the journal; queued jobs are sent again (they never started)."""
        assert self.journal is not None
        entries = self.journal.by_job()
        for job_id, parts in entries.items():
            sub = parts["submit"]
            job = Job(spec_from_json(sub["spec"]), sub["owner"], id=job_id, created=sub["created"])
            record = Record(job, sub["position"])
            record.claimed_by = parts.get("claim", {}).get("replica")
            record.stop = parts.get("stop", {}).get("reason")
            if record.claimed_by is not None:
                record.job.state = "stopping" if record.stop else "running"
            self._add(record)
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
        self.journal.rewrite([e for p in entries.values() for e in p.values()])
        return len(entries)

    def _compact_if_long(self) -> None:
        if self.journal is not None and self.journal.written > 8 * (self.retain + len(self._jobs)):
            keep = set(self._jobs)
            self.journal.rewrite([e for job_id in keep for e in self._jobs[job_id].entries()])


def _not_found(job_id: str) -> Refused:
    return Refused("not_found", f"no job {job_id!r} (unknown, expired, or created with another key)")


def _actor_alive(name: str) -> bool:
    """Whether the Serve replica actor ``name`` is alive (Ray frees a dead actor's name)."""
    import ray

    try:
        ray.get_actor(name, namespace="serve")
    except ValueError:
        return False
    return True
