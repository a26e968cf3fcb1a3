"""Held jobs: paused or preempted, each with its checkpoint and no worker, until resumed or stopped."""

from __future__ import annotations

import threading
from typing import Any

from .contract import PREEMPTED, JobState
from .jobs import Job
from .ledger import Ledger
from .queueing import RunQueue

__all__ = ["Holding", "held_summary"]


class Holding:
    """Holds jobs whose run was interrupted to be held, and ends held jobs that are stopped.

    ``lock`` is the engine's and ``queue`` its queue. Invariants: a held job is ``paused`` (out of
    the queue until its owner resumes it) or ``preempted`` (queued again in its place, its
    ``preemptions`` counted, a worker woken); either way it keeps the checkpoint of its last run, from
    which it resumes. A held job that is stopped ends at once as ``stopped``, with its last run's
    summary (none if it never ran)."""

    def __init__(self, lock: threading.Condition, queue: RunQueue[Job], ledger: Ledger) -> None:
        self._lock = lock
        self._queue = queue
        self._ledger = ledger

    def hold(self, job: Job, state: JobState) -> None:
        """Under the lock: hold ``job`` as ``state`` (paused, or preempted and queued again)."""
        with job.lock:
            job.state = state
        if state == PREEMPTED:
            job.preemptions += 1
            self._queue.put(job)
            self._lock.notify()
        job.emit(state, step=job.step, checkpoint_step=job.view().checkpoint_step)

    def end(self, job: Job, reason: str) -> None:
        """Not under the lock: end a job that is not running (queued, paused, preempted) as stopped
        for ``reason``."""
        self._ledger.finish(job, "stopped", reason, outcome=held_summary(job, reason),
                            detail="stopped while queued: it never ran")


def held_summary(job: Job, reason: str) -> dict[str, Any] | None:
    """The Outcome summary of a held job stopped for ``reason``: its last run's (None if it never ran)."""
    with job.lock:
        state, summary = job.state, job.outcome
    if summary is None:
        return None
    detail = f"stopped while {state}, at step {summary['steps']}"
    return {**summary, "stopped": True, "reason": reason, "detail": detail}
