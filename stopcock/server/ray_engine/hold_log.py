"""The job registry's holds in its journal: a paused or preempted job, and one queued again after a
hold, survives a registry restart (a part of :class:`~stopcock.server.ray_engine.holds.Holds`,
read back by :mod:`~stopcock.server.ray_engine.restore`).

Each change of a held job (held, paused while it waited, queued again) writes a ``hold`` entry: the
job's view (its state, the step it reached, ``checkpoint_step``, ``saved_steps``, ``preemptions``)
and where its checkpoint is when that outlives the registry (a file of a
:class:`~stopcock.server.ray_engine.checkpoints.FolderStore`). The latest one is what counts: it
is kept on the record for compaction (:meth:`~stopcock.server.ray_engine.journal.Record.entries`).
A checkpoint that did not survive (the Ray object store's, owned by the registry that died; a file
gone) is said to be lost, in the job's events, and the job runs from its start.
"""

from __future__ import annotations

import logging
from typing import Any

from ..contract import PAUSED, PREEMPTED, JobEvent
from .checkpoints import CheckpointStore, Stored
from .journal import Record
from .records import RecordBook

__all__ = ["HoldLog"]

log = logging.getLogger("stopcock.server.ray")

#: The event that tells a restored held job's state: held, or queued again.
_EVENTS = {PAUSED: PAUSED, PREEMPTED: PREEMPTED, "queued": "resumed"}


class HoldLog:
    """Writes the holds of the jobs in ``book`` to its journal, and reads them back, their
    checkpoints' handles given and found by ``store``."""

    def __init__(self, book: RecordBook, store: CheckpointStore) -> None:
        self.book = book
        self.store = store

    def put(self, record: Record, state: str, released: bool = False) -> None:
        """The job is now in ``state`` (held, or queued again): set it and journal it; ``released``:
        its replica's claim was let go (journaled after the hold, so a registry that dies between
        the two still knows the replica that reports the hold again)."""
        job = record.job
        with job.lock:
            job.state = state  # type: ignore[assignment]
        handle = None if job.checkpoint is None else self.store.lasting(job.checkpoint.handle)
        record.hold = {"op": "hold", "id": job.id, "view": job.view().to_json(), "handle": handle}
        self.book.write(**record.hold)
        if released:
            self.book.write("claim", id=job.id, replica=None)

    def restore(self, record: Record, entry: dict[str, Any]) -> JobEvent | None:
        """Put the hold that ``entry`` journaled back on ``record`` (restored, its events put back):
        a job no replica has claimed takes the journaled view and state; its checkpoint comes back
        if it is still there, else the job runs from its start and an event says so (returned, to be
        journaled). A claimed job (resumed since) keeps only its checkpoint and counts."""
        job, view = record.job, entry["view"]
        steps = view.get("checkpoint_step")
        handle = None if steps is None else self.store.found(entry.get("handle"))
        job.saved_steps, job.preemptions = view.get("saved_steps", 0), view.get("preemptions", 0)
        job.checkpoint = None if handle is None else Stored(int(steps), handle)
        if record.claimed_by is not None:
            record.hold = entry
            return None
        job.apply(view)
        job.pause_wanted = job.state == PAUSED
        record.hold = entry
        if steps is None or handle is not None or record.stop is not None:  # nothing lost, or it ends
            return None
        why = (
            "it was in the Ray object store, which a restarted registry has lost"
            " (serve with checkpoint_dir to keep checkpoints across a restart)"
            if entry.get("handle") is None
            else f"its file {entry['handle']} is gone"
        )
        lost = f"its checkpoint at step {steps} was lost with the registry: it will run from its start; {why}"
        log.warning("job %s: %s", job.id, lost)
        job.emit(_EVENTS.get(job.state, PAUSED), step=job.step, checkpoint_step=None, checkpoint_lost=lost)
        self.put(record, job.state)  # journaled without the checkpoint: a later restart says nothing more
        with job.lock:
            return job.events[-1]
