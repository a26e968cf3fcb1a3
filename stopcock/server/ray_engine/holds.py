"""The job registry's holds: pause, resume and priority preemption across model replicas (a part of
:class:`~stopcock.server.ray_engine.registry.JobRegistry`).

A held job (``paused`` by its owner, or ``preempted`` by a job of higher priority) keeps its
checkpoint in a :mod:`~stopcock.server.ray_engine.checkpoints` store, and the registry keeps the
store's handle (:class:`~stopcock.server.ray_engine.checkpoints.Stored`). Holding a running job is an
ask handed to its replica with the next poll, like a skip: the replica interrupts the run at its next
step, stores the checkpoint and reports the hold; the registry then releases the claim. A job queued
again (resumed, or preempted) is sent to its kind's deployment again, and whichever replica claims it
resumes it from the checkpoint. Each hold and each queuing again is journaled (:mod:`.hold_log`).
"""

from __future__ import annotations

from typing import Any

from ..contract import FINAL_STATES, HELD_STATES, PAUSED, PREEMPTED, JobEvent, JobView
from ..jobs import wait_until
from ..queueing import Running, RunQueue
from .checkpoints import CheckpointStore, Stored, store_errors
from .dispatch import Dispatcher
from .hold_log import HoldLog
from .journal import Record
from .records import RecordBook
from .replicas import ReplicaSet
from .wire import Refused

__all__ = ["Holds", "ahead", "waiting"]


def waiting(record: Record) -> bool:
    """Whether the job waits for a replica (queued, or preempted and queued again)."""
    return record.claimed_by is None and record.job.state in ("queued", PREEMPTED)


def ahead(first: Record, then: Record) -> bool:
    """Whether ``first`` runs before ``then`` when both wait, as in
    :class:`~stopcock.server.queueing.RunQueue`: it has a higher priority, or the same one and, having
    run before (held and resumed, preempted, or run again after losing its replica), it was taken
    in first. Among jobs that never ran, the order is that of their requests, which Serve's router
    hands out (first in, first out in practice); enforcing it here would send a job back behind the
    others each time the router hands them out of order."""
    if first.job.spec.priority != then.job.spec.priority:
        return first.job.spec.priority > then.job.spec.priority
    return first.job.started is not None and first.number < then.number


class Holds:
    """Pauses, resumes and preemptions of the jobs in ``book``, asked of their replicas through
    ``fleet``; a job queued again is sent by ``dispatcher`` (whose claims this refuses to a job
    outranked by a waiting one, and whose sends go on while a job waits again). ``store`` drops
    the checkpoints no longer needed; a pause answers once the job is held, or after ``hold_wait``
    seconds. ``asked`` holds the jobs whose replica was asked to hold them, until the hold or the end."""

    def __init__(
        self,
        book: RecordBook,
        fleet: ReplicaSet,
        store: CheckpointStore,
        dispatcher: Dispatcher,
        hold_wait: float,
    ) -> None:
        self.book = book
        self.fleet = fleet
        self.store = store
        self.dispatcher = dispatcher
        self.hold_wait = hold_wait
        self.log = HoldLog(book, store)  # the holds in the journal: they survive a restart
        self.asked: set[str] = set()
        self.rows: set[str] = set()  # jobs running as rows of a batch: no checkpoint, never held
        book.on_end, dispatcher.outranked, dispatcher.waiting = self.ended, self.outranked, waiting

    async def pause(self, job_id: str, owner: str) -> JobView | Refused:
        """Hold the job with its checkpoint, answered once it is held (or it ended first). A job no
        replica runs is held at once; a running one at its next step (its lane then free)."""
        record = self.book.find(job_id, owner)
        if isinstance(record, Refused):
            return record
        job = record.job
        if record.final or job.state == "stopping" or record.stop is not None:
            return _conflict(job_id, job.state, "only a queued or running job can pause")
        if job_id in self.rows:
            return Refused(
                "conflict",
                f"job {job_id} runs as a row of a batch, which keeps no checkpoint: stop it instead,"
                " or serve with --batch-size 1 to pause running text jobs",
            )
        job.pause_wanted = True
        if waiting(record):
            self.book.queued.discard(job_id)
            self.log.put(record, PAUSED)
            job.emit(PAUSED, step=job.step, checkpoint_step=job.view().checkpoint_step)
        elif job.state == "running":
            self._ask(record, PAUSED)
            await wait_until(job, lambda: job.state in FINAL_STATES or job.state == PAUSED, self.hold_wait)
        return job.view()

    async def resume(self, job_id: str, owner: str) -> JobView | Refused:
        """Queue a paused job again, to resume from its checkpoint on any replica of its kind."""
        record = self.book.find(job_id, owner)
        if isinstance(record, Refused):
            return record
        job = record.job
        if record.final:
            return _conflict(job_id, job.state, "only a paused job can resume")
        if job.state != PAUSED:
            return job.view()
        job.pause_wanted = False
        self.log.put(record, "queued")
        self.book.queued.add(job_id)
        job.emit("resumed", position=len(self.book.queued), checkpoint_step=job.view().checkpoint_step)
        self.dispatcher.send(record)
        self.preempt(job.spec.kind)
        return job.view()

    def reported(self, record: Record, replica: str, event: JobEvent, news: Any) -> None:
        """A replica reported ``event`` of the job (after its view), with ``news`` (a hold's: the
        stored checkpoint): a hold releases the claim (the job waits for a replica again, or stays
        paused); the end brings the steps the resumes saved."""
        job = record.job
        if event.type == "done":
            self.asked.discard(job.id)
            job.saved_steps = int(event.data.get("saved_steps", job.saved_steps))
        if event.type not in HELD_STATES or news is None:
            return
        self.asked.discard(job.id)
        if job.checkpoint is not None:  # held before: that checkpoint is behind this one
            self.store.drop(job.checkpoint.handle)
            job.checkpoint = None
        try:
            job.checkpoint = Stored(int(news["steps"]), self.store.keep(news["parcel"]))
        except store_errors() as exc:
            self.book.fail(record, f"its checkpoint could not be kept: {type(exc).__name__}: {exc}")
            return
        if record.stop is not None:  # stopped while it was being held: it ends here, never runs again
            job.request_stop(record.stop)  # its stop_step: the step it was held at
            self.book.end(record, "stopped", record.stop, f"stopped while being held, at step {job.step}")
            return
        job.saved_steps = int(news["saved_steps"])
        record.claimed_by = None
        self.book.claims[replica].discard(job.id)
        state = PAUSED if job.pause_wanted else event.type
        if state == PREEMPTED:
            job.preemptions += 1
            self.book.queued.add(job.id)
        self.log.put(record, state, released=True)  # a restarted registry holds it as it is now
        if state == PAUSED and event.type != PAUSED:  # preempted there, but paused here: the pause wins
            job.emit(PAUSED, step=job.step, checkpoint_step=news["steps"])
        job.changes.bump()

    def ended(self, record: Record) -> None:
        """The job has ended: its checkpoint, if it was held, is no longer needed."""
        self.asked.discard(record.job.id)
        self.rows.discard(record.job.id)
        if record.job.checkpoint is not None:
            self.store.drop(record.job.checkpoint.handle)
            record.job.checkpoint = None

    # -- priority --------------------------------------------------------------------------------------
    def preempt(self, kind: str) -> None:
        """For each waiting job of ``kind`` that no free lane will take, preempt the lowest-priority
        running job of the kind below its priority (the most recently started first), as the local
        engine does: the policy is :class:`~stopcock.server.queueing.RunQueue`'s. Rows of a batch keep
        no checkpoint, so they are never preempted; a replica running rows counts one lane for them
        (it may run more batches: then a lane is thought free when it is not, and a preemption waits
        for the next submission or resume rather than hitting a job wrongly)."""
        claimed = [r for r in self._claimed(kind) if not r.final]
        rows = [r for r in claimed if r.job.id in self.rows]
        running = [r for r in claimed if r not in rows]
        lanes = sum(r.concurrency for r in self.fleet.replicas.values() if r.kind == kind)
        lanes -= len({r.claimed_by for r in rows})
        freeing = [r for r in running if r.job.state != "running" or r.job.id in self.asked]
        queue: RunQueue[Record] = RunQueue(lambda r: r.job.spec.priority)
        for record in sorted(self._waiting(kind), key=lambda r: r.number):
            queue.put(record)
        candidates = [
            Running(r, r.job.spec.priority, r.job.started or 0.0) for r in running if r not in freeing
        ]
        for victim in queue.preempted(candidates, lanes - len(running) + len(freeing)):
            self._ask(victim, PREEMPTED)

    def outranked(self, record: Record) -> bool:
        """Whether a job that runs before ``record`` (:func:`ahead`) waits for a replica of the same
        kind (and is being sent): then a replica asking to claim ``record`` is refused, and the lane
        goes to that job."""
        return any(
            ahead(r, record) and r.job.id in self.dispatcher.dispatches
            for r in self._waiting(record.job.spec.kind)
        )

    def _waiting(self, kind: str) -> list[Record]:
        jobs = self.book.jobs
        return [jobs[j] for j in self.book.queued if jobs[j].job.spec.kind == kind and waiting(jobs[j])]

    def _claimed(self, kind: str) -> list[Record]:
        jobs = self.book.jobs
        return [jobs[j] for held in self.book.claims.values() for j in held if jobs[j].job.spec.kind == kind]

    def _ask(self, record: Record, state: str) -> None:
        """Ask the replica that runs the job to hold it (``state``: why) at its next step (once)."""
        assert record.claimed_by is not None
        if record.job.id not in self.asked:
            self.asked.add(record.job.id)
            record.asks.append(("hold", state))
            self.fleet.wake(record.claimed_by)


def _conflict(job_id: str, state: str, what: str) -> Refused:
    return Refused("conflict", f"job {job_id} is {state}: {what}")
