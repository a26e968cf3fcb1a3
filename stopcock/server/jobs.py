"""One job's record, shared by every engine: its state, the exact stop step, its events and its run.

:class:`Job` holds what the API shows of a job (:meth:`Job.view`) and its event log;
:meth:`Job.request_stop` and :class:`Reached` together make a stop exact (the run ends at the
step it had reached when the stop arrived, or at the one in flight, never later);
:class:`JobContext` is the :class:`~stopcock.server.contract.RunContext` a lane runs with;
:func:`run_lane` and :func:`finish` run a job and record its end. :class:`~stopcock.server.engine.LocalEngine`
keeps its jobs here in one process; the Ray engine keeps one on the model replica that runs the job
and one, fed by the replica's reports (:meth:`Job.put`, :meth:`Job.apply`), in its job registry.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any

from .._callbacks import Callbacks
from .._wake import loop_waker
from ..conditions import Condition
from ..files import png_base64
from ..outcome import Outcome
from ..signal import StopSignal
from ..state import StepState
from .contract import (
    FINAL_STATES,
    HELD_STATES,
    PAUSED,
    PREEMPTED,
    RESPONSE_ID_PREFIXES,
    JobEvent,
    JobSpec,
    JobState,
    JobView,
    Lane,
)

__all__ = [
    "Changes",
    "Ended",
    "Job",
    "JobContext",
    "Reached",
    "checked_grace",
    "events",
    "finish",
    "new_id",
    "run_lane",
    "since",
    "summary_of_end",
    "wait_final",
    "wait_until",
    "INTERRUPTED",
]

log = logging.getLogger("stopcock.server")

#: How a run ended: its final state, reason, Outcome summary (None: build one) and error.
Ended = tuple[JobState, str, dict[str, Any] | None, str | None]
#: The end of a job whose worker was interrupted before its run returned.
INTERRUPTED: Ended = ("failed", "error", None, "the worker was interrupted")


def new_id() -> str:
    """A job id: 144 random bits, unguessable, URL-safe, starting with a letter or a digit (an id
    starting with ``-`` reads as an option to command-line tools) and never with a response prefix
    (so :func:`~stopcock.server.contract.job_id_of` can take one off)."""
    while True:
        job_id = secrets.token_urlsafe(18)
        if job_id[0].isalnum() and not job_id.startswith(RESPONSE_ID_PREFIXES):
            return job_id


class Changes:
    """A version counter that threads and event loops can wait on."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.version = 0
        self._wakers = Callbacks(self._cond)

    def bump(self) -> None:
        with self._cond:
            self.version += 1
            wakers = self._wakers.drain()
            self._cond.notify_all()
        for wake in wakers:
            wake()

    async def wait_past(self, version: int, timeout: float | None = None) -> None:
        """Return once :attr:`version` exceeds ``version`` (or after ``timeout`` seconds)."""
        await wait_any([(self, version)], timeout)

    def waker_past(self, version: int, wake: Callable[[], None]) -> Callable[[], None] | None:
        """Call ``wake()`` at the next change, if :attr:`version` is still ``version``: the function
        that takes ``wake`` back, or None (the version is past already: ``wake`` is not kept)."""
        with self._cond:
            return None if self.version > version else self._wakers.add(wake)


async def wait_any(seen: Iterable[tuple[Changes, int]], timeout: float | None) -> None:
    """Return once any of the counters is past the version it was seen at (or after ``timeout`` seconds)."""
    future, wake = loop_waker()
    removes: list[Callable[[], None]] = []
    try:
        for changes, version in seen:
            remove = changes.waker_past(version, wake)
            if remove is None:
                return
            removes.append(remove)
        await asyncio.wait_for(future, timeout)
    except asyncio.TimeoutError:
        pass
    finally:
        for remove in removes:
            remove()


class Job:
    """A job: what the API shows of it, its stop signal and its events.

    ``id`` and ``created`` are new unless given (an engine that keeps a job in several places gives
    them); ``seq`` is the number of events that came before this record's first (they are known
    elsewhere), so that its events continue their numbering. ``listener(event)``, if set, is called
    with each new event, outside the lock.
    """

    def __init__(
        self,
        spec: JobSpec,
        owner: str,
        *,
        id: str | None = None,
        created: float | None = None,
        seq: int = 0,
    ) -> None:
        self.id = id or new_id()
        self.owner = owner
        self.spec = spec
        self.signal = StopSignal()  # the owner's stop: ends the job
        self.interrupt = StopSignal()  # the current run's pause or preemption: holds the job
        self.pause_wanted = False  # the owner asked for a pause (it wins over a preemption)
        self.checkpoint: Any = None  # what a held job resumes from
        self.saved_steps = 0  # steps its resumes did not recompute
        self.preemptions = 0
        self.state: JobState = "queued"
        self.step = 0
        self.total: int | None = None
        self.reason: str | None = None
        self.stop_step: int | None = None  # the step the run had reached when a stop was first requested
        self.created = time.time() if created is None else created
        self.started: float | None = None
        self.finished: float | None = None
        self.outcome: dict[str, Any] | None = None
        self.result: dict[str, Any] | None = None
        self.error: str | None = None
        self.events: list[JobEvent | None] = [None] * seq  # None: an older preview (dropped), or unknown
        self.ended = False  # the done event has been emitted
        self._last_preview: int | None = None
        self.changes = Changes()
        self.lock = threading.Lock()
        self.listener: Callable[[JobEvent], None] | None = None

    def emit(self, type_: str, **data: Any) -> None:
        with self.lock:
            event = JobEvent(len(self.events) + 1, type_, data)
            self._add(event)
        if self.listener is not None:
            self.listener(event)
        self.changes.bump()

    def put(self, event: JobEvent) -> None:
        """Record an event numbered elsewhere, at its ``seq`` (the ones in between stay unknown)."""
        with self.lock:
            if event.seq <= len(self.events):
                return  # already known (a report sent again)
            self.events.extend([None] * (event.seq - 1 - len(self.events)))
            self._add(event)
        self.changes.bump()

    def _add(self, event: JobEvent) -> None:
        if event.type == "preview":
            if self._last_preview is not None:
                self.events[self._last_preview] = None
            self._last_preview = len(self.events)
        self.events.append(event)
        self.ended = self.ended or event.type == "done"

    def reach(self, state: StepState) -> None:
        with self.lock:
            self.step, self.total = state.step, state.total

    def request_stop(self, reason: str) -> None:
        """Stop the job's signal, noting the step reached, under the lock that :class:`Reached` takes:
        the run's next check then either sees the stop or has reached ``stop_step`` first. So the run
        ends at ``stop_step`` or ``stop_step + 1`` (the step in flight), never later."""
        with self.lock:
            if self.state not in FINAL_STATES and self.stop_step is None:
                self.stop_step = self.step
            if self.state == "running":
                self.state = "stopping"
            self.signal.stop(reason)  # its callbacks only forward the stop to the run: no lock taken

    def apply(self, view: Mapping[str, Any]) -> None:
        """Take the state of a view reported by the engine part that runs the job (not its id,
        kind or creation time, which this record knows)."""
        with self.lock:
            for name in (
                "state",
                "step",
                "total",
                "reason",
                "stop_step",
                "started",
                "finished",
                "outcome",
                "error",
            ):
                setattr(self, name, view[name])
        self.changes.bump()

    def view(self) -> JobView:
        with self.lock:
            return JobView(
                id=self.id,
                kind=self.spec.kind,
                state=self.state,
                step=self.step,
                total=self.total,
                reason=self.reason,
                stop_step=self.stop_step,
                created=self.created,
                started=self.started,
                finished=self.finished,
                outcome=self.outcome,
                error=self.error,
                priority=self.spec.priority,
                checkpoint_step=None if self.checkpoint is None else self.checkpoint.steps,
                saved_steps=self.saved_steps,
                preemptions=self.preemptions,
            )


class Reached(Condition):
    """Records the step at each check of the run, before the job's signal is checked (never stops
    on its own): a stop request then reads the step the run has really reached (see
    :meth:`Job.request_stop`), not the one its ``on_step`` reported last."""

    fires_in_forward = False  # it never stops a run

    def __init__(self, job: Job) -> None:
        self._job = job

    def check(self, state: StepState) -> str | None:
        self._job.reach(state)
        return None

    def __repr__(self) -> str:
        return "reached()"


class JobContext:
    """The :class:`~stopcock.server.contract.RunContext` of one job run by an engine."""

    def __init__(self, job: Job, step_delay: float, escalate_after: float | None = None) -> None:
        self._job = job
        self.signal = job.signal
        self.checkpoint = job.checkpoint
        self.step_delay = step_delay
        self.escalate_after = escalate_after

    def stop(self, conditions: Iterable[Condition]) -> list[Condition | StopSignal]:
        """The run's ``stop=``: the step recorder, the job's signal and this run's pause or preemption,
        then the job's own ``conditions``."""
        return [Reached(self._job), self.signal, self._job.interrupt, *conditions]

    def on_step(self, report: Callable[[StepState], None]) -> Callable[[StepState], None]:
        """The ``on_step`` hook for the run: records the step, calls ``report(state)`` (text,
        previews), emits ``progress``, then waits ``step_delay`` seconds (the test-only throttle)
        unless stopped."""
        job = self._job

        def hook(state: StepState) -> None:
            job.reach(state)  # also when a stop before its check kept Reached from running
            report(state)
            job.emit("progress", step=state.step, total=state.total)
            if self.step_delay:
                self.signal.wait(self.step_delay)

        return hook

    def text(self, chunk: str, step: int) -> None:
        if chunk:
            self._job.emit("text", text=chunk, step=step)

    def preview(self, image: Any, step: int) -> None:
        """Publish a PIL image as the job's current preview."""
        self._job.emit("preview", step=step, image=png_base64(image))

    def set_result(self, **result: Any) -> None:
        with self._job.lock:
            self._job.result = result

    def item(self, index: int, prompt: str, outcome: Outcome | None = None) -> None:
        """Emit an ``item`` event: the item started (no ``outcome``), or ended as ``outcome`` says."""
        if outcome is None:
            self._job.emit("item", index=index, prompt=prompt, state="started")
        else:
            reason = outcome.reason if outcome.stopped else "completed"
            self._job.emit("item", index=index, prompt=prompt, state="ended", reason=reason,
                           steps=outcome.steps)


def checked_grace(seconds: float | None) -> float | None:
    """An engine's ``stop_grace`` checked: seconds >= 0, or None (never escalate)."""
    if seconds is not None and not 0 <= seconds < float("inf"):
        raise ValueError(f"stop_grace must be seconds >= 0 or None, got {seconds!r}")
    return seconds


def run_lane(job: Job, lane: Lane, step_delay: float = 0.0, escalate_after: float | None = None) -> Ended:
    """Run the job on ``lane`` (or resume it from its checkpoint), a stop escalating to abort after
    ``escalate_after`` seconds (None: never); returns its final state, reason, Outcome summary and
    error. A run stopped to be held (paused, preempted) with a checkpoint returns that state
    instead, and the job keeps the checkpoint.

    The job must be marked started (``state``, ``started``) by the caller."""
    job.emit("started", **({} if job.checkpoint is None else {"resumed_from": job.checkpoint.steps}))
    try:
        outcome = lane.execute(job.spec, JobContext(job, step_delay, escalate_after))
    except Exception as exc:  # the job reports it as failed; the worker lives on
        log.exception("job %s failed", job.id)
        return "failed", "error", None, f"{type(exc).__name__}: {exc}"
    held = outcome.stopped and outcome.reason in HELD_STATES and outcome.checkpoint is not None
    with job.lock:
        job.step = outcome.steps
        job.total = outcome.total_steps
        job.saved_steps += (outcome.resumed or {}).get("saved_steps", 0)
        job.checkpoint = outcome.checkpoint if held else None
        job.outcome = outcome.summary()
        if held:
            job.stop_step = None  # a later stop is measured against the resumed run's own steps
    state: JobState = "stopped" if outcome.stopped else "completed"
    if held:
        state = PAUSED if outcome.reason == PAUSED else PREEMPTED
    return state, outcome.reason, outcome.summary(), None


def summary_of_end(
    state: JobState, reason: str, step: int, total: int | None, started: float | None, detail: str | None
) -> dict[str, Any]:
    """The Outcome summary of a job that never ran, or failed: the same shape as a run's."""
    return Outcome.without_output(
        StepState(step=step, total=total),
        reason=reason,
        stopped=state == "stopped",
        elapsed=0.0 if started is None else time.time() - started,
        detail=detail,
    ).summary()


def finish(
    job: Job,
    state: JobState,
    reason: str,
    *,
    outcome: dict[str, Any] | None,
    detail: str | None = None,
    error: str | None = None,
) -> None:
    """Record the job's end and emit its ``done`` event (the final view)."""
    with job.lock:
        if outcome is None:  # it never ran, or failed: say so in the same shape
            outcome = summary_of_end(state, reason, job.step, job.total, job.started, detail or error)
        job.state, job.reason, job.finished = state, reason, time.time()
        job.outcome, job.error = outcome, error
    job.emit("done", **job.view().to_json())


async def wait_final(job: Job, timeout: float | None) -> None:
    """Return once the job is in a final state (or after ``timeout`` seconds)."""
    await wait_until(job, lambda: job.state in FINAL_STATES, timeout)


async def wait_until(job: Job, done: Callable[[], bool], timeout: float | None) -> None:
    """Return once ``done()`` holds, checked at each change of the job (or after ``timeout`` seconds)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        version = job.changes.version
        if done():
            return
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return
        await job.changes.wait_past(version, left)


def since(job: Job, after: int) -> tuple[list[JobEvent], int, bool]:
    """The job's known events with ``seq > after``, the new cursor, and whether ``done`` is among them."""
    with job.lock:
        return [e for e in job.events[after:] if e is not None], len(job.events), job.ended


async def events(job: Job, after: int = 0) -> AsyncIterator[JobEvent]:
    """The job's events with ``seq > after``, as they come, up to ``done`` (none after it)."""
    while True:
        version = job.changes.version
        new, after, ended = since(job, after)
        for event in new:
            yield event
        if ended:
            return
        await job.changes.wait_past(version)
