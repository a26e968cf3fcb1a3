"""The job registry's journal read back and kept short (a part of
:class:`~stopcock.server.ray_engine.registry.JobRegistry`).

Invariants: a restored job is in the state its journal entries say, and nowhere else; a job that
never started is sent again; a job stopped while it waited, whose end was never written, ends here
as stopped (it never runs again); a held job comes back held (paused: never run unasked; preempted,
or resumed: sent again), with its checkpoint if that survived, else saying it was lost
(:mod:`.hold_log`); the events of an unfinished job come back numbered as they were. The journal is
rewritten from what was restored, so the entries of forgotten jobs go.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from ..contract import PAUSED, JobEvent
from ..jobs import Job
from .dispatch import Dispatcher
from .hold_log import HoldLog
from .journal import Journal, Record, event_entry
from .records import RecordBook
from .wire import spec_from_json

__all__ = ["compact_if_long", "restore"]

def restore(
    journal: Journal,
    book: RecordBook,
    dispatcher: Dispatcher,
    spawn: Callable[[Awaitable[Any]], asyncio.Task[Any]],
    holds: HoldLog | None = None,
) -> int:
    """Rebuild ``book``'s records from ``journal``; queued jobs are sent again by ``dispatcher`` (they
    never started, or resume from their checkpoint), held ones put back by ``holds`` (without it,
    a held job is queued again). The number of jobs restored."""
    entries, events = journal.by_job(), journal.events()
    told: list[dict[str, Any]] = []  # what restoring the holds added to the journal
    for job_id, parts in entries.items():
        sub = parts["submit"]
        job = Job(spec_from_json(sub["spec"]), sub["owner"], id=job_id, created=sub["created"])
        record = Record(job, sub["position"])
        record.claimed_by = parts.get("claim", {}).get("replica")
        record.stop = parts.get("stop", {}).get("reason")
        record.reruns = int(parts.get("rerun", {}).get("count", 0))
        if record.claimed_by is not None:
            record.job.state = "stopping" if record.stop else "running"
        book.add(record)
        for event in events.get(job_id, ()):  # an unfinished job's events, numbered as they were
            record.job.put(event)
        end = parts.get("end")
        if holds is not None and end is None and "hold" in parts:
            lost = holds.restore(record, parts["hold"])
            parts["hold"] = record.hold or parts["hold"]  # without the checkpoint, if it was lost
            told += [] if lost is None else [event_entry(job_id, lost)]
        if end is not None:
            record.journaled_end = True
            record.job.result = end["result"]
            record.job.apply(end["view"])
            record.job.saved_steps = end["view"].get("saved_steps", 0)
            record.job.preemptions = end["view"].get("preemptions", 0)
            record.job.put(JobEvent(end["done"], "done", end["view"]))
            book.queued.discard(job_id)
            book.finished.append(job_id)
        elif record.claimed_by is not None:
            book.claims[record.claimed_by].add(job_id)
        elif record.stop is not None:  # stopped unclaimed, and the registry died before writing the end
            book.end_stopped(record, record.stop)
        elif record.job.state == PAUSED:  # held until its owner resumes it
            book.queued.discard(job_id)
        else:
            dispatcher.dispatches[job_id] = spawn(dispatcher.run(record))
    kept = [event_entry(job_id, e) for job_id, es in events.items() for e in es] + told
    journal.rewrite([e for p in entries.values() for e in p.values()] + kept)
    return len(entries)


def compact_if_long(journal: Journal, book: RecordBook, retain: int) -> None:
    """Rewrite ``journal`` with only the entries of the jobs ``book`` still has, once it has grown
    past a few entries per job kept (``retain`` finished ones and the unfinished)."""
    jobs = book.jobs
    if journal.due(8 * (retain + len(jobs))):
        journal.rewrite([e for job_id in list(jobs) for e in jobs[job_id].entries(journal.keep_events)])
