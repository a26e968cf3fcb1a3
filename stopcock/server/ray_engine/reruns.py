"""What becomes of a lost model replica's jobs, as configured (``on_replica_loss``): they fail (the
default, :meth:`~.replicas.ReplicaSet.lost`), or they run again (a part of
:class:`~stopcock.server.ray_engine.registry.JobRegistry`).

With ``"rerun"``, each unfinished job the lost replica had claimed (a row of a batch too) is
released, journaled as unclaimed, queued again and sent again to its kind's deployment: it runs
from its checkpoint if it has one (it was paused or preempted, then resumed), else from its start,
on whichever replica takes it. Its stream gets a ``requeued`` event, numbered after the events
already sent, that names the replica lost and the step the run starts again from. A job whose stop
was accepted ends ``stopped`` instead (a stop is never lost); a job its owner asked to pause is
held (``paused``) instead; a job re-run ``max_reruns`` times already fails with a reason that says
so (a job that kills every replica it runs on must not take them down one after another forever).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, get_args

from ..contract import PAUSED, JobEvent
from .dispatch import Dispatcher
from .journal import Record, event_entry
from .records import RecordBook
from .replicas import ReplicaSet

__all__ = ["ON_REPLICA_LOSS", "OnReplicaLoss", "Reruns", "checked_loss_policy"]

OnReplicaLoss = Literal["fail", "rerun"]
#: The settings of ``on_replica_loss``: what becomes of a lost replica's unfinished jobs.
ON_REPLICA_LOSS: tuple[str, ...] = get_args(OnReplicaLoss)
#: Events after a hold: the text a job's checkpoint keeps is the text sent before its latest one.
_HOLDS = frozenset({"paused", "preempted"})


def checked_loss_policy(on_replica_loss: str, max_reruns: int) -> None:
    """Refuse a setting that is not one of :data:`ON_REPLICA_LOSS`, or a negative ``max_reruns``."""
    if on_replica_loss not in ON_REPLICA_LOSS:
        choices = ", ".join(ON_REPLICA_LOSS)
        raise ValueError(f"on_replica_loss must be one of {choices}, got {on_replica_loss!r}")
    if isinstance(max_reruns, bool) or not isinstance(max_reruns, int) or max_reruns < 0:
        raise ValueError(f"max_reruns must be a whole number >= 0, got {max_reruns!r}")


class Reruns:
    """Runs a lost replica's jobs again (installed as ``fleet``'s handler of a lost job): each is
    released in ``book``, journaled, and sent again by ``dispatcher``, at most ``max_reruns`` times
    (counted in its record and journaled as a ``rerun`` entry: unlike its ``requeued`` events, the
    count outlives ``journal_events``). ``forget(job_id)`` drops what
    the holds knew of the lost run (a row of a batch, a hold asked of that replica);
    ``preempt(kind)`` makes room for a job queued again of a higher priority than a running one, as
    for a job resumed (:meth:`.holds.Holds.preempt`)."""

    def __init__(
        self,
        book: RecordBook,
        fleet: ReplicaSet,
        dispatcher: Dispatcher,
        max_reruns: int,
        forget: Callable[[str], None],
        preempt: Callable[[str], None],
    ) -> None:
        checked_loss_policy("rerun", max_reruns)
        self.book = book
        self.dispatcher = dispatcher
        self.max_reruns = max_reruns
        self.forget = forget
        self.preempt = preempt
        fleet.orphaned = self.orphaned

    def orphaned(self, record: Record, replica: str, why: str) -> None:
        """``replica``, which had claimed the unfinished job, is gone (``why``): run it again, unless
        it was stopped, is to be paused, or has run again ``max_reruns`` times already."""
        job = record.job
        lost = f"the model replica running this job ({replica}) {why}"
        if record.stop is not None:  # accepted before or during the loss: it ends here, never runs again
            job.request_stop(record.stop)  # its stop_step: the step its lost run reported last
            self.book.end(record, "stopped", record.stop, f"stopped; {lost} before applying the stop")
            return
        reruns = record.reruns
        if reruns >= self.max_reruns:
            times = f"{reruns} time{'s' if reruns != 1 else ''}"
            self.book.fail(
                record,
                f"{lost}; it was run again {times} already, the most allowed (max_reruns={self.max_reruns},"
                " --max-reruns): it is not run again",
            )
            return
        record.reruns = reruns + 1
        self._release(record, replica)
        from_step = 0 if job.checkpoint is None else int(job.checkpoint.steps)
        with job.lock:
            job.step = from_step  # what the lost run computed past it is gone with it
        self._emit(
            record,
            "requeued",
            replica=replica,
            why=why,
            from_step=from_step,
            checkpoint_step=None if job.checkpoint is None else from_step,
            text_kept=_text_kept(record),
            reruns=record.reruns,
            max_reruns=self.max_reruns,
            position=len(self.book.queued) + 1,
        )
        if job.pause_wanted:  # asked to pause before the loss: held now, resumed by its owner
            with job.lock:
                job.state = PAUSED
            self._emit(record, PAUSED, step=job.step, checkpoint_step=job.view().checkpoint_step)
            return
        with job.lock:
            job.state = "queued"
        self.book.queued.add(job.id)
        job.changes.bump()
        self.dispatcher.send(record)  # a send still going sends it again itself (Dispatcher.run)
        self.preempt(job.spec.kind)

    def _release(self, record: Record, replica: str) -> None:
        """The lost replica no longer holds the job, here and in the journal (a restarted registry
        sends it again rather than wait for that replica)."""
        job_id = record.job.id
        record.claimed_by = None
        record.stop_applied = False
        record.asks = []  # meant for the lost run
        self.book.claims.get(replica, set()).discard(job_id)  # no entry made for the lost replica
        self.forget(job_id)
        self.book.write("claim", id=job_id, replica=None)
        self.book.write("rerun", id=job_id, count=record.reruns)

    def _emit(self, record: Record, type_: str, **data: object) -> None:
        """An event of the registry's in the job's stream, journaled (a restart keeps it)."""
        job = record.job
        job.emit(type_, **data)
        with job.lock:
            event = job.events[-1]
        if isinstance(event, JobEvent):
            entry = event_entry(job.id, event)
            entry.pop("op")
            self.book.write("event", **entry)


def _text_kept(record: Record) -> int:
    """The characters of the job's ``text`` events that its re-run keeps: those sent before its
    checkpoint was taken (its latest hold); none when it runs again from its start (the client
    drops the rest: the re-run sends them again)."""
    if record.job.checkpoint is None:
        return 0
    with record.job.lock:
        events = [e for e in record.job.events if e is not None]
    held = max((i for i, e in enumerate(events) if e.type in _HOLDS), default=0)
    return sum(len(str(e.data.get("text", ""))) for e in events[:held] if e.type == "text")
