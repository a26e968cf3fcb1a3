"""The in-process engine: a registry of generation jobs, a bounded queue, worker slots and the stop path.

:class:`LocalEngine` implements :class:`~stopcock.server.contract.Engine` (and
:class:`~stopcock.server.contract.Pausable`) in one process: ``concurrency`` worker threads, each with
its own lane of the models, take jobs from a bounded queue, highest ``priority`` first (in submission
order within a priority). A worker takes the next job only once its current run has returned, so a
stopped job frees its slot when its pipeline has actually stopped, never before, and two runs never
overlap on one lane. Every run is checkpointed: a job can be paused (held with its checkpoint, its
worker free) and resumed, and a job queued while every worker is busy preempts the lowest-priority
running job below its own priority, which is checkpointed at its next step, waits in the queue and
resumes where it was, with the result of an uninterrupted run. The contract (specs, views, events,
states, errors) is in :mod:`stopcock.server.contract`.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import itertools
import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from .._wake import loop_waker
from ..signal import StopSignal
from . import jobs as _jobs
from .batching import Batching
from .contract import (
    FINAL_STATES,
    HELD_STATES,
    PAUSED,
    PREEMPTED,
    Backend,
    JobEvent,
    JobNotFound,
    JobSpec,
    JobState,
    JobStateConflict,
    JobView,
    KindNotServed,
    Lane,
    QueueFull,
)
from .jobs import Job as _Job

__all__ = ["LocalEngine"]

log = logging.getLogger("stopcock.server")


class LocalEngine:
    """In-process engine: ``concurrency`` worker threads and a queue of at most ``queue_size``.

    ``backends`` maps each served kind (``"text"``, ``"image"``) to its backend; each worker gets
    its own lane of each. ``retain`` finished jobs are kept for reading; older ones are forgotten.
    ``stop_wait`` bounds how long a stop request waits for the run to end before answering
    with the job still ``stopping``. Jobs run in finish mode; ``stop_grace`` is how long a stop
    waits for a step to end before it escalates to abort (a slow step never holds a stop: see
    ``escalate_after=`` of :func:`stopcock.run`; None: never). ``step_delay`` is the test-only
    per-step throttle; ``batch_size`` and ``batch_wait``: :class:`~stopcock.server.batching.Batching`.
    """

    def __init__(
        self,
        backends: Mapping[str, Backend],
        *,
        concurrency: int = 1,
        queue_size: int = 16,
        retain: int = 256,
        stop_wait: float = 30.0,
        stop_grace: float | None = 5.0,
        step_delay: float = 0.0,
        batch_size: int = 1,
        batch_wait: float = 0.0,
    ) -> None:
        if concurrency < 1 or queue_size < 0 or retain < 1:
            raise ValueError("concurrency and retain must be >= 1 and queue_size >= 0")
        if not backends:
            raise ValueError("the engine needs at least one kind of model to serve")
        self.backends = dict(backends)
        self.models: Mapping[str, Mapping[str, str]] = {
            kind: {"id": b.name, "description": b.description} for kind, b in backends.items()
        }
        self.queue_size = queue_size
        self.retain = retain
        self.stop_wait = stop_wait
        self.stop_grace = _jobs.checked_grace(stop_grace)
        self.step_delay = step_delay
        self._lock = threading.Condition()
        self._jobs: dict[str, _Job] = {}
        self._queue: list[_Job] = []  # kept in _key order
        self._order: dict[str, int] = {}  # job id -> submission number, the order within a priority
        self._numbers = itertools.count()
        self._active: set[_Job] = set()  # the jobs the workers run
        self._finished: collections.deque[str] = collections.deque()
        self._running = 0
        self._busy = 0  # workers running a job or a batch
        self.batch = Batching(batch_size, batch_wait)
        self._ends = _Ends()
        self._closing = False
        self._workers = [
            threading.Thread(
                target=self._work,
                args=({kind: backend.lane() for kind, backend in backends.items()},),
                name=f"stopcock-worker-{i}",
                daemon=True,
            )
            for i in range(concurrency)
        ]
        for worker in self._workers:
            worker.start()

    # -- the Engine interface ----------------------------------------------------------------------
    async def submit(self, spec: JobSpec, owner: str) -> JobView:
        if spec.kind not in self.backends:
            served = ", ".join(self.backends)
            raise KindNotServed(f"this server has no {spec.kind} model; it serves: {served}")
        self.backends[spec.kind].validate(spec)
        job = _Job(spec, owner)
        with self._lock:
            if self._closing:
                raise QueueFull("the server is shutting down")
            if len(self._queue) >= self.queue_size:
                raise QueueFull(f"the queue is full ({self.queue_size} jobs waiting); try again later")
            self._jobs[job.id] = job
            self._order[job.id] = next(self._numbers)
            position = self._enqueue(job)
        job.emit("queued", position=position)
        return job.view()

    async def get(self, job_id: str, owner: str) -> JobView:
        return self._find(job_id, owner).view()

    async def list(self, owner: str, limit: int = 100) -> list[JobView]:
        """The owner's jobs, newest first (at most ``limit``)."""
        with self._lock:
            mine = [job for job in self._jobs.values() if secrets.compare_digest(job.owner, owner)]
        return [job.view() for job in reversed(mine[-limit:])]

    async def stop(
        self, job_id: str, owner: str, reason: str = "user", wait: bool = True, at: str = "now"
    ) -> JobView:
        """Stop a job; with ``wait``, answer once the stop took effect (or ``stop_wait`` passed).

        A queued job is removed from the queue and never runs; a running job stops at its next
        step, or with ``at="item"`` once its current item is done (answered at once, the job still
        running); a held (paused or preempted) job ends at once, with the result of its last run; a
        finished job is left as it is. Idempotent.
        """
        job = self._find(job_id, owner)
        with self._lock:
            dequeued = job.state in HELD_STATES or (job.state == "queued" and job in self._queue)
            if job in self._queue:
                self._queue.remove(job)
            if at == "item" and not dequeued:
                job.signal.stop_after_item(reason)
                return job.view()
            job.request_stop(reason)
        if dequeued:
            self._finish_held(job, reason)
        elif wait:
            await self._ends.wait(job, self.stop_wait)
        return job.view()

    async def skip(self, job_id: str, owner: str) -> JobView:
        """Skip the running job's current item; a queued or finished job is left as it is."""
        job = self._find(job_id, owner)
        if job.state == "running":
            job.signal.skip()
        return job.view()

    async def pause(self, job_id: str, owner: str) -> JobView:
        """Hold the job with its checkpoint, and answer once it is held (or it ended first).

        A running job is checkpointed at its next step and its worker freed; a queued or preempted
        one leaves the queue. Idempotent for a paused job; a job that has ended (or is being
        stopped) raises :class:`JobStateConflict`.
        """
        job = self._find(job_id, owner)
        with self._lock:
            if job.state in FINAL_STATES or job.state == "stopping":
                raise JobStateConflict(f"job {job_id} is {job.state}: only a queued or running job can pause")
            self.batch.refuse_pause(job)
            job.pause_wanted = True
            if job in self._queue:
                self._queue.remove(job)
                self._hold(job, PAUSED)
            elif job.state == "running":
                job.interrupt.stop(PAUSED)
        await _jobs.wait_until(job, lambda: job.state in FINAL_STATES or job.state == PAUSED, self.stop_wait)
        return job.view()

    async def resume(self, job_id: str, owner: str) -> JobView:
        """Queue a paused job again (it resumes from its checkpoint); idempotent for a job that is
        already queued or running; :class:`JobStateConflict` for one that has ended."""
        job = self._find(job_id, owner)
        with self._lock:
            if job.state in FINAL_STATES:
                raise JobStateConflict(f"job {job_id} is {job.state}: only a paused job can resume")
            if job.state != PAUSED:
                return job.view()
            job.pause_wanted = False
            with job.lock:
                job.state = "queued"
            position = self._enqueue(job)
        job.emit("resumed", position=position, checkpoint_step=job.view().checkpoint_step)
        return job.view()

    async def wait(self, job_id: str, owner: str, timeout: float | None = None) -> JobView:
        """The job's view once it has ended (or after ``timeout`` seconds)."""
        job = self._find(job_id, owner)
        await self._ends.wait(job, timeout)
        return job.view()

    async def events(self, job_id: str, owner: str, after: int = 0) -> AsyncIterator[JobEvent]:
        """The job's events with ``seq > after``, as they come, up to ``done`` (none after it)."""
        async for event in _jobs.events(self._find(job_id, owner), after):
            yield event

    async def result(self, job_id: str, owner: str) -> dict[str, Any]:
        """The job's view and what it generated (None until it has ended)."""
        job = self._find(job_id, owner)
        view = job.view()
        with job.lock:
            result = job.result if view.state in FINAL_STATES else None
        return {"job": view.to_json(), "result": result}

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "queued": len(self._queue),
                "running": self._running,
                "jobs": len(self._jobs),
                "workers_alive": sum(w.is_alive() for w in self._workers),
                **self.batch.counts(),
            }

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    def close(self, timeout: float | None = 60.0) -> None:
        """Stop every job (reason ``"shutdown"``) and join the workers."""
        with self._lock:
            self._closing = True
            queued, self._queue = self._queue, []
            queued += [j for j in self._jobs.values() if j.state == PAUSED]
            running = [j for j in self._jobs.values() if j.state in ("running", "stopping")]
            self._lock.notify_all()
        for job in queued:
            job.request_stop("shutdown")
            self._finish_held(job, "shutdown")
        for job in running:
            job.request_stop("shutdown")
        for worker in self._workers:
            worker.join(timeout)

    # -- internals -----------------------------------------------------------------------------------
    def _find(self, job_id: str, owner: str) -> _Job:
        job = self._jobs.get(job_id)
        if job is None or not secrets.compare_digest(job.owner, owner):
            raise JobNotFound(f"no job {job_id!r} (unknown, expired, or created with another key)")
        return job

    def _key(self, job: _Job) -> tuple[int, int]:
        """Queue order: higher priority first, then submission order."""
        return (-job.spec.priority, self._order[job.id])

    def _enqueue(self, job: _Job) -> int:
        """Queue ``job`` in priority order (under ``_lock``), preempting for it if it has to; its position."""
        bisect.insort(self._queue, job, key=self._key)
        self._lock.notify_all()  # a worker gathering a batch waits for it too
        self._preempt()
        return self._queue.index(job) + 1

    def _preempt(self) -> None:
        """Under ``_lock``: for each queued job that no free (or freeing) worker will take, preempt the
        lowest-priority running job below its priority, the most recently started first."""
        freeing = sum(job.interrupt.stopped for job in self._active)
        free = len(self._workers) - self._busy + freeing
        for waiting in self._queue[max(free, 0) :]:
            victims = [j for j in self._active - self.batch.rows  # a row keeps no checkpoint
                       if not j.interrupt.stopped and j.spec.priority < waiting.spec.priority]
            if not victims:
                return
            victim = min(victims, key=lambda j: (j.spec.priority, -(j.started or 0.0)))
            victim.interrupt.stop(PREEMPTED)

    def _hold(self, job: _Job, state: JobState) -> None:
        """Under ``_lock``: the job is held (paused, or preempted and queued again) with its checkpoint."""
        with job.lock:
            job.state = state
        if state == PREEMPTED:
            job.preemptions += 1
            bisect.insort(self._queue, job, key=self._key)
            self._lock.notify()
        job.emit(state, step=job.step, checkpoint_step=job.view().checkpoint_step)

    def _work(self, lanes: Mapping[str, Lane]) -> None:
        while True:
            with self._lock:
                taken = self.batch.take(self._queue, self._lock, lambda: self._closing, lanes)
                if taken is None:
                    return
                self._running, self._busy = self._running + len(taken), self._busy + 1
                self._active.update(map(_started, taken))
            ended, lane, batched = _jobs.INTERRUPTED, lanes[taken[0].spec.kind], taken[0] in self.batch.rows
            try:
                if batched:  # each job ends as soon as its row does
                    self.batch.run(taken, lane, self._end, self.step_delay)
                else:
                    ended = _jobs.run_lane(taken[0], lane, self.step_delay, self.stop_grace)
            finally:  # the slot is free once the run has returned; then the job's end is told
                with self._lock:
                    self._busy -= 1
                if not batched:
                    self._end(taken[0], ended)

    def _end(self, job: _Job, ended: _jobs.Ended) -> None:
        """The job's run has returned: free its slot, then hold the job or tell its end."""
        state, reason, summary, error = ended
        with self._lock:
            self._running -= 1
            self._active.discard(job)
            self.batch.rows.discard(job)
            held = state in HELD_STATES and not job.signal.stopped and not self._closing
            if held:
                self._hold(job, PAUSED if job.pause_wanted else state)
        if not held and state in HELD_STATES:  # stopped (or shut down) while being held
            self._finish_held(job, job.signal.reason or "shutdown")
        elif not held:
            self._finish(job, state, reason, outcome=summary, error=error)

    def _finish_held(self, job: _Job, reason: str) -> None:
        """End a job that is not running (queued, paused, preempted) as stopped for ``reason``."""
        self._finish(job, "stopped", reason, outcome=_held_summary(job, reason),
                     detail="stopped while queued: it never ran")

    def _finish(
        self,
        job: _Job,
        state: JobState,
        reason: str,
        *,
        outcome: dict[str, Any] | None,
        detail: str | None = None,
        error: str | None = None,
    ) -> None:
        _jobs.finish(job, state, reason, outcome=outcome, detail=detail, error=error)
        self._ends.tell(job)
        with self._lock:
            self._finished.append(job.id)
            while len(self._finished) > self.retain:
                forgotten = self._finished.popleft()
                self._jobs.pop(forgotten, None)
                self._order.pop(forgotten, None)


class _Ends:
    """Waits for jobs to end, woken once at the end and not at each event as a wait on the job's
    changes is: a batch of rows makes two events per row and token, and each wake-up of a waiting
    request takes the event loop (and the interpreter) from the batch."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wakers: dict[str, list[Callable[[], None]]] = {}

    async def wait(self, job: _Job, timeout: float | None) -> None:
        """Return once ``job`` is in a final state (or after ``timeout`` seconds)."""
        future, wake = loop_waker()
        with self._lock:  # the state is final before tell() takes the lock: no end is missed
            if job.state in FINAL_STATES:
                return
            self._wakers.setdefault(job.id, []).append(wake)
        try:
            await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            with self._lock:
                waiting = self._wakers.get(job.id, [])
                if wake in waiting:
                    waiting.remove(wake)
                if not waiting:
                    self._wakers.pop(job.id, None)

    def tell(self, job: _Job) -> None:
        """``job`` has ended: wake whoever waits for it."""
        with self._lock:
            wakers = self._wakers.pop(job.id, [])
        for wake in wakers:
            wake()


def _started(job: _Job) -> _Job:
    """Mark a job the engine takes from its queue as running (or stopping, if stopped meanwhile)."""
    with job.lock:
        job.state = "stopping" if job.signal.stopped else "running"
        job.started = job.started or time.time()
        job.interrupt = StopSignal()
    return job


def _held_summary(job: _Job, reason: str) -> dict[str, Any] | None:
    """The Outcome summary of a held job stopped for ``reason``: its last run's (None if it never ran)."""
    with job.lock:
        state, summary = job.state, job.outcome
    if summary is None:
        return None
    detail = f"stopped while {state}, at step {summary['steps']}"
    return {**summary, "stopped": True, "reason": reason, "detail": detail}
