"""The job registry's stops and asks: a stop is a tombstone for a job no replica has claimed, and is
routed to the replica's long poll for a claimed one (a part of
:class:`~stopcock.server.ray_engine.registry.JobRegistry`)."""

from __future__ import annotations

from ..contract import JobView
from ..jobs import wait_final
from .records import RecordBook
from .replicas import ReplicaSet
from .wire import Refused

__all__ = ["Stops"]

class Stops:
    """Stops and asks (skip the item, stop after it) of the jobs in ``book``, handed to their
    replicas through ``fleet``; a stop that waits answers after ``stop_wait`` seconds at most."""

    def __init__(self, book: RecordBook, fleet: ReplicaSet, stop_wait: float) -> None:
        self.book = book
        self.fleet = fleet
        self.stop_wait = stop_wait

    async def stop(self, job_id: str, owner: str, reason: str, wait: bool) -> JobView | Refused:
        """Stop a job: a job no replica has claimed ends ``stopped`` now and never starts (a tombstone);
        a claimed one is stopped by its replica at its next step. Written to the journal before the
        answer. With ``wait``, answers once the run returned (or after ``stop_wait`` seconds)."""
        record = self.book.find(job_id, owner)
        if isinstance(record, Refused):
            return record
        if not record.final:
            if record.stop is None:
                record.stop = reason
                self.book.write("stop", id=job_id, reason=reason)
            if record.claimed_by is None:
                self.book.end_stopped(record, record.stop)
            else:
                with record.job.lock:
                    if record.job.state == "running":
                        record.job.state = "stopping"
                record.job.changes.bump()
                self.fleet.wake(record.claimed_by)
                if wait:
                    await wait_final(record.job, self.stop_wait)
        return record.job.view()

    async def ask(self, job_id: str, owner: str, action: str, reason: str) -> JobView | Refused:
        """Skip the current item (``action="skip"``) or stop after it (``"after_item"``), answered at
        once. A job no replica has claimed has no current item: a skip leaves it as it is, a stop
        after the item stops it now. Delivered to the replica with its next poll (not journaled)."""
        record = self.book.find(job_id, owner)
        if isinstance(record, Refused):
            return record
        if record.final:
            return record.job.view()
        if record.claimed_by is None:
            return record.job.view() if action == "skip" else await self.stop(job_id, owner, reason, False)
        record.asks.append((action, reason))
        self.fleet.wake(record.claimed_by)
        return record.job.view()

    async def stop_all(self, reason: str, timeout: float) -> int:
        """Stop every job and wait (up to ``timeout`` s) for them to end; returns how many."""
        open_ = self.book.open()
        for record in open_:
            await self.stop(record.job.id, record.job.owner, reason, wait=False)
        for record in open_:
            await wait_final(record.job, timeout)
        return len(open_)
