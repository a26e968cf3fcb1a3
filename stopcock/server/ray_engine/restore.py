"""The job registry's journal read back and kept short (a part of
:class:`~stopcock.server.ray_engine.registry.JobRegistry`).

Invariants: a restored job is in the state its journal entries say, and nowhere else; a job that
never started is sent again; a job stopped while it waited, whose end was never written, ends here
as stopped (it never runs); the events of an unfinished job come back numbered as they were. The
journal is rewritten from what was restored, so the entries of forgotten jobs go.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from ..contract import JobEvent
from ..jobs import Job
from .dispatch import Dispatcher
from .journal import Journal, Record, event_entry
from .records import RecordBook
from .wire import spec_from_json

__all__ = ["compact_if_long", "restore"]


def restore(
    journal: Journal,
    book: RecordBook,
    dispatcher: Dispatcher,
    spawn: Callable[[Awaitable[Any]], asyncio.Task[Any]],
) -> int:
    """Rebuild ``book``'s records from ``journal``; queued jobs are sent again by ``dispatcher`` (they
    never started). The number of jobs restored."""
    entries, events = journal.by_job(), journal.events()
    for job_id, parts in entries.items():
        sub = parts["submit"]
        job = Job(spec_from_json(sub["spec"]), sub["owner"], id=job_id, created=sub["created"])
        record = Record(job, sub["position"])
        record.claimed_by = parts.get("claim", {}).get("replica")
        record.stop = parts.get("stop", {}).get("reason")
        if record.claimed_by is not None:
            record.job.state = "stopping" if record.stop else "running"
        book.add(record)
        for event in events.get(job_id, ()):  # an unfinished job's events, numbered as they were
            record.job.put(event)
        end = parts.get("end")
        if end is not None:
            record.journaled_end = True
            record.job.result = end["result"]
            record.job.apply(end["view"])
            record.job.put(JobEvent(end["done"], "done", end["view"]))
            book.queued.discard(job_id)
            book.finished.append(job_id)
        elif record.claimed_by is not None:
            book.claims[record.claimed_by].add(job_id)
        elif record.stop is not None:  # stopped unclaimed, and the registry died before writing the end
            record.job.request_stop(record.stop)
            book.end(record, "stopped", record.stop, "stopped while queued: it never ran")
        else:
            dispatcher.dispatches[job_id] = spawn(dispatcher.run(record))
    kept = [event_entry(job_id, e) for job_id, es in events.items() for e in es]
    journal.rewrite([e for p in entries.values() for e in p.values()] + kept)
    return len(entries)


def compact_if_long(journal: Journal, book: RecordBook, retain: int) -> None:
    """Rewrite ``journal`` with only the entries of the jobs ``book`` still has, once it has grown
    past a few entries per job kept (``retain`` finished ones and the unfinished)."""
    jobs = book.jobs
    if journal.due(8 * (retain + len(jobs))):
        journal.rewrite([e for job_id in set(jobs) for e in jobs[job_id].entries(journal.keep_events)])
