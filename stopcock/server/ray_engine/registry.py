"""The Ray engine's job registry (one Serve replica): where a job's start and its stop are ordered.

:class:`JobRegistry` holds the calls Serve makes (the engine's, owner-scoped, and the model
replicas'); its parts do the bookkeeping: the record book (:class:`~.records.RecordBook`: records,
queue bound, claims, ends, retention), the replica set (:class:`~.replicas.ReplicaSet`:
registrations, long polls, liveness), the dispatcher (:class:`~.dispatch.Dispatcher`: intake, sends
and claims), the stops (:class:`~.stops.Stops`), the holds (:class:`~.holds.Holds`: pause, resume,
preemption), the journal (:class:`~.journal.Journal`) and its reading back (:mod:`~.restore`).

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
by default). ``on_replica_loss``: what becomes of the unfinished jobs of a replica that is lost
(``"fail"``, or ``"rerun"``: run again, at most ``max_reruns`` times each; see :mod:`.reruns`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from ..contract import FINAL_STATES, JobEvent, JobSpec, JobView
from .checkpoints import store_for
from .dispatch import Dispatcher
from .holds import Holds
from .journal import EVENTS_KEPT, Journal, Record
from .operations import Operations
from .records import RecordBook
from .replicas import ReplicaSet
from .reruns import Reruns, checked_loss_policy
from .restore import compact_if_long, restore
from .stops import Stops
from .wire import Refused, detached

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
        checkpoint_dir: str | None = None,
        on_replica_loss: str = "fail",
        max_reruns: int = 1,
    ) -> None:
        checked_loss_policy(on_replica_loss, max_reruns)
        self.models = dict(models)
        self.kinds = {kind: dict((kinds or {}).get(kind, {})) for kind in self.models}
        self.retain = retain
        self._tasks: set[asyncio.Task[Any]] = set()
        self.book = RecordBook(queue_size, retain, self._write, self._compact_if_long)
        self.fleet = ReplicaSet(self.book, alive or _actor_alive)
        self.dispatcher = Dispatcher(self.models, self.book, self.fleet, self._spawn)
        self.stops = Stops(self.book, self.fleet, stop_wait)
        self.holds = Holds(self.book, self.fleet, store_for(checkpoint_dir), self.dispatcher, stop_wait)
        self.reruns = (  # None: a lost replica's jobs fail (ReplicaSet.lost)
            Reruns(self.book, self.fleet, self.dispatcher, max_reruns, self._forget_run, self.holds.preempt)
            if on_replica_loss == "rerun"
            else None
        )
        self._jobs, self._dispatches = self.book.jobs, self.dispatcher.dispatches  # never rebound
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
        view = self.dispatcher.submit(job_id, spec, owner, created, unready)
        if not isinstance(view, Refused):
            self.holds.preempt(spec.kind)  # a job of a higher priority than a running one, no lane free
        return view

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

    async def pause(self, job_id: str, owner: str) -> JobView | Refused:
        """Hold the job with its checkpoint (see :meth:`.holds.Holds.pause`)."""
        return await self.holds.pause(job_id, owner)

    async def resume(self, job_id: str, owner: str) -> JobView | Refused:
        """Queue a paused job again (see :meth:`.holds.Holds.resume`)."""
        return await self.holds.resume(job_id, owner)

    async def wait(self, job_id: str, owner: str, timeout: float | None) -> JobView | Refused:
        return await self.book.wait(job_id, owner, timeout)

    async def events(
        self, job_id: str, owner: str, after: int, timeout: float
    ) -> tuple[list[JobEvent], int, bool] | Refused:
        return await self.book.events(job_id, owner, after, timeout)

    async def feed(
        self, wants: list[tuple[str, str, str, int]], timeout: float
    ) -> dict[str, tuple[list[JobEvent], int, bool] | Refused]:
        """The events of every job an ingress replica streams, in one long poll (see
        :meth:`.records.RecordBook.feed`)."""
        return await self.book.feed(wants, timeout)

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

    async def claim(self, job_id: str, replica: str, row: bool = False) -> int | None:
        """May ``replica`` start the job (``row``: as a row of a batch, which keeps no checkpoint, so
        it is never held)? (see :meth:`.dispatch.Dispatcher.claim`)."""
        seq = self.dispatcher.claim(job_id, replica)
        if seq is not None and row:
            self.holds.rows.add(job_id)
        return seq

    async def report(
        self,
        replica: str,
        events: list[tuple[str, JobEvent]],
        views: Mapping[str, Mapping[str, Any]],
        results: Mapping[str, Any],
        batch: Mapping[str, int] | None = None,
    ) -> None:
        """A batch of a replica's news: events (in order), the current views of its jobs, the results
        of those that ended or were held (whose ``done`` or hold event is in ``events``), and its batch
        occupancy."""
        self._seen(replica)
        if batch is not None and replica in self.fleet.replicas:
            self.fleet.replicas[replica].batch = dict(batch)
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
            self.holds.reported(record, replica, event, results.get(job_id))
            if event.type == "done":
                self._ended(record)
        self._compact_if_long()

    async def poll(
        self, replica: str, applied: list[str], running: list[str], peak: int, busy: int, timeout: float
    ) -> tuple[dict[str, str], bool, list[tuple[str, str, str]]]:
        """A replica's long poll (see :meth:`.replicas.ReplicaSet.poll`)."""
        return await self.fleet.poll(replica, applied, running, peak, busy, timeout)

    # -- what the report calls ----------------------------------------------------------------------
    def _seen(self, replica: str) -> None:
        self.fleet.seen(replica)

    def _forget_run(self, job_id: str) -> None:
        """A job's run was lost with its replica: it is no row of a batch, and no hold is asked of it."""
        self.holds.rows.discard(job_id)
        self.holds.asked.discard(job_id)

    def _ended(self, record: Record) -> None:
        self.book.ended(record)

    def _restore(self) -> int:
        """Rebuild the records from the journal (see :func:`.restore.restore`)."""
        assert self.journal is not None
        return restore(self.journal, self.book, self.dispatcher, self._spawn, self.holds.log)

    def _compact_if_long(self) -> None:
        if self.journal is not None:
            compact_if_long(self.journal, self.book, self.retain)


def _open_journal(journal: str | None, journal_dir: str | None, fsync: bool, events: int) -> Journal | None:
    """The journal at ``journal``, or one named after the Serve application in ``journal_dir``."""
    if journal is None and journal_dir is not None:
        from ray import serve

        journal = str(Path(journal_dir) / f"{serve.get_replica_context().app_name}.jsonl")
    return None if journal is None else Journal(journal, fsync=fsync, events=events)


def _actor_alive(name: str) -> bool:
    """Whether the Serve replica actor ``name`` is alive (Ray frees a dead actor's name); outside a
    Ray process (the engine's parts wired in one process) there is no Ray to ask, and nothing to
    start one for: alive."""
    import ray

    if not ray.is_initialized():
        return True
    try:
        ray.get_actor(name, namespace="serve")
    except ValueError:
        return False
    return True
