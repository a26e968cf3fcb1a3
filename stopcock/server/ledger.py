"""The jobs an engine knows: registered when submitted, found by id and owner, ended once, forgotten
once ``retain`` jobs have ended after them."""

from __future__ import annotations

import collections
import secrets
import threading
from collections.abc import Callable
from typing import Any

from . import jobs as _jobs
from .contract import JobNotFound, JobState
from .jobs import Job
from .waiters import Waiters

__all__ = ["Ledger"]


class Ledger:
    """An engine's jobs by id, and the record of their ends.

    ``lock`` is the engine's; :attr:`jobs` changes under it. ``forget(job)`` is called (under
    ``lock``) for each job the ledger forgets. Invariants: a job is found only with the owner it was
    submitted with; :meth:`finish` records a job's end and wakes its waiters (the end is recorded
    first); at most ``retain`` ended jobs are kept, the oldest ends forgotten first; a job not yet
    ended is never forgotten."""

    def __init__(self, lock: threading.Condition, retain: int, forget: Callable[[Job], None]) -> None:
        self.jobs: dict[str, Job] = {}
        self.waiters = Waiters()
        self._lock = lock
        self._retain = retain
        self._forget = forget
        self._ended: collections.deque[str] = collections.deque()

    def add(self, job: Job) -> None:
        """Under the lock: know ``job``."""
        self.jobs[job.id] = job

    def find(self, job_id: str, owner: str) -> Job:
        """The job ``job_id`` of ``owner``; :class:`JobNotFound` for another owner's, as for no job."""
        job = self.jobs.get(job_id)
        if job is None or not secrets.compare_digest(job.owner, owner):
            raise JobNotFound(f"no job {job_id!r} (unknown, expired, or created with another key)")
        return job

    def of(self, owner: str) -> list[Job]:
        """The owner's jobs, oldest first."""
        with self._lock:
            return [job for job in self.jobs.values() if secrets.compare_digest(job.owner, owner)]

    def finish(
        self,
        job: Job,
        state: JobState,
        reason: str,
        *,
        outcome: dict[str, Any] | None,
        detail: str | None = None,
        error: str | None = None,
    ) -> None:
        """Not under the lock: record the end of ``job`` and wake whoever waits for it."""
        _jobs.finish(job, state, reason, outcome=outcome, detail=detail, error=error)
        self.waiters.tell(job)
        with self._lock:
            self._ended.append(job.id)
            while len(self._ended) > self._retain:
                forgotten = self.jobs.pop(self._ended.popleft(), None)
                if forgotten is not None:
                    self._forget(forgotten)
