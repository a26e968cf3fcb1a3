"""The job registry's record book: every job's :class:`~stopcock.server.ray_engine.journal.Record`
by id, the queue bound, the jobs each replica has claimed, a job's end and how many finished jobs
are kept (a part of :class:`~stopcock.server.ray_engine.registry.JobRegistry`)."""

from __future__ import annotations

import collections
import itertools
import secrets
import time
from collections.abc import Callable
from typing import Any

from ..contract import FINAL_STATES, JobEvent, JobState, JobView
from ..jobs import finish, since, summary_of_end, wait_any, wait_final
from .journal import Record
from .wire import Refused

__all__ = ["RecordBook", "not_found"]

_NEVER = "stopped while queued: it never ran"


class RecordBook:
    """The records (``jobs``), the ids of those waiting for a replica (``queued``, at most
    ``queue_size``), the unfinished jobs each replica has claimed (``claims``) and the finished
    ones, oldest first (``finished``: the ``retain`` newest are kept). A record is found only with
    its owner's key. ``write(op, **fields)`` journals an entry; ``compact()`` is called after each
    journaled end."""

    def __init__(
        self, queue_size: int, retain: int, write: Callable[..., None], compact: Callable[[], None]
    ) -> None:
        if queue_size < 0 or retain < 1:
            raise ValueError("queue_size must be >= 0 and retain >= 1")
        self.queue_size = queue_size
        self.retain = retain
        self.write = write
        self.compact = compact
        self.jobs: dict[str, Record] = {}
        self.queued: set[str] = set()
        self.claims: dict[str, set[str]] = collections.defaultdict(set)  # replica -> its unfinished jobs
        self.finished: collections.deque[str] = collections.deque()
        self.on_end: Callable[[Record], None] = lambda record: None  # called once per job's end
        self._numbers = itertools.count()

    def full(self) -> Refused | None:
        """The refusal of a new job while ``queue_size`` jobs wait, else None."""
        if len(self.queued) < self.queue_size:
            return None
        return Refused("queue_full", f"the queue is full ({self.queue_size} jobs waiting); try again later")

    def add(self, record: Record) -> None:
        """Take in a new record (or one restored, in the journal's order): numbered after those
        taken before it, the order its job keeps when it is queued again (see
        :meth:`.holds.Holds.outranked`)."""
        record.number = next(self._numbers)
        self.jobs[record.job.id] = record
        if not record.final and record.claimed_by is None:
            self.queued.add(record.job.id)
        record.job.emit("queued", position=record.position)

    def find(self, job_id: str, owner: str) -> Record | Refused:
        record = self.jobs.get(job_id)
        if record is None or not secrets.compare_digest(record.job.owner, owner):
            return not_found(job_id)
        return record

    def open(self) -> list[Record]:
        """The records of the jobs not ended yet."""
        return [r for r in self.jobs.values() if not r.final]

    def of(self, owner: str, limit: int) -> list[JobView]:
        """The owner's jobs, newest first (at most ``limit``)."""
        mine = [r.job for r in self.jobs.values() if secrets.compare_digest(r.job.owner, owner)]
        return [job.view() for job in reversed(mine[-limit:])]

    def end(
        self, record: Record, state: JobState, reason: str, detail: str, error: str | None = None
    ) -> None:
        """End a job from the registry: it never started (a tombstone), or its replica is gone."""
        job = record.job
        outcome = summary_of_end(state, reason, job.step, job.total, job.started, detail)
        finish(job, state, reason, outcome=outcome, error=error)
        self.ended(record)

    def end_stopped(self, record: Record, reason: str) -> None:
        """End a job no replica holds ``stopped`` for ``reason``: it never ran (a tombstone), or it
        was held (paused, or preempted and queued again) at the step it reached, its stop_step."""
        job = record.job
        detail = _NEVER if job.started is None else f"stopped while {job.state}, at step {job.step}"
        job.request_stop(reason)
        self.end(record, "stopped", reason, detail)

    def fail(self, record: Record, detail: str, error: str | None = None) -> None:
        """End a job ``failed`` from the registry (``error``: ``detail`` unless given)."""
        self.end(record, "failed", "error", detail, error=detail if error is None else error)

    def ended(self, record: Record) -> None:
        """The job has ended: journaled once, kept among the ``retain`` newest finished."""
        job_id = record.job.id
        self.queued.discard(job_id)
        if record.claimed_by is not None:
            self.claims[record.claimed_by].discard(job_id)
        if not record.journaled_end:
            record.journaled_end = True
            self.on_end(record)
            with record.job.lock:
                done = len(record.job.events)
                result = record.job.result
            self.write("end", id=job_id, view=record.job.view().to_json(), result=result, done=done)
            self.finished.append(job_id)
            while len(self.finished) > self.retain:
                old = self.finished.popleft()
                self.jobs.pop(old, None)
                self.write("forget", id=old)
            self.compact()

    async def wait(self, job_id: str, owner: str, timeout: float | None) -> JobView | Refused:
        """The job's view once it has ended, or after ``timeout`` seconds."""
        record = self.find(job_id, owner)
        if isinstance(record, Refused):
            return record
        await wait_final(record.job, timeout)
        return record.job.view()

    async def events(
        self, job_id: str, owner: str, after: int, timeout: float
    ) -> tuple[list[JobEvent], int, bool] | Refused:
        """The job's events after ``after`` (waiting up to ``timeout`` for one), the new cursor, and
        whether ``done`` is among them."""
        record = self.find(job_id, owner)
        if isinstance(record, Refused):
            return record
        version = record.job.changes.version
        new, cursor, ended = since(record.job, after)
        if not new and not ended:
            await record.job.changes.wait_past(version, timeout)
            new, cursor, ended = since(record.job, after)
        return new, cursor, ended

    async def feed(
        self, wants: list[tuple[str, str, str, int]], timeout: float
    ) -> dict[str, tuple[list[JobEvent], int, bool] | Refused]:
        """The news of several followed jobs at once (``wants``: a key, the job's id, its owner and
        the follower's cursor), by key: the events after the cursor, the new cursor and whether
        ``done`` is among them, for each job that has some; a refusal for a job not found. Answered
        once there is news (or after ``timeout`` seconds, with none)."""
        deadline = time.monotonic() + timeout
        while True:
            news: dict[str, tuple[list[JobEvent], int, bool] | Refused] = {}
            seen = []
            for key, job_id, owner, after in wants:
                record = self.find(job_id, owner)
                if isinstance(record, Refused):
                    news[key] = record
                    continue
                seen.append((record.job.changes, record.job.changes.version))  # before the look
                new, cursor, ended = since(record.job, after)
                if new or ended:
                    news[key] = (new, cursor, ended)
            left = deadline - time.monotonic()
            if news or left <= 0:
                return news
            await wait_any(seen, left)

    def result(self, job_id: str, owner: str) -> dict[str, Any] | Refused:
        """The job's view and its result (None until it has ended)."""
        record = self.find(job_id, owner)
        if isinstance(record, Refused):
            return record
        view = record.job.view()
        with record.job.lock:
            result = record.job.result if view.state in FINAL_STATES else None
        return {"job": view.to_json(), "result": result}


def not_found(job_id: str) -> Refused:
    return Refused("not_found", f"no job {job_id!r} (unknown, expired, or created with another key)")
