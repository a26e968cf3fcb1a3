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

The engine answers the contract's calls and delegates: the queue order and the preemption policy to
:class:`~stopcock.server.queueing.RunQueue`, the workers' loop to
:class:`~stopcock.server.workers.Workers`, holding paused and preempted jobs to
:class:`~stopcock.server.held.Holding`, the jobs by id and their ends to
:class:`~stopcock.server.ledger.Ledger` (whose :class:`~stopcock.server.waiters.Waiters` wake the
requests waiting for an end). The queue, the workers, the holding and the ledger change under the
engine's one lock, so a job is never both queued and run by a worker.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Mapping
from typing import Any

from . import jobs as _jobs
from .batching import Batching
from .contract import (
    FINAL_STATES,
    HELD_STATES,
    PAUSED,
    Backend,
    JobEvent,
    JobSpec,
    JobStateConflict,
    JobView,
    KindNotServed,
    QueueFull,
)
from .held import Holding
from .jobs import Job
from .ledger import Ledger
from .queueing import RunQueue
from .workers import Workers

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
        self.batch = Batching(batch_size, batch_wait)
        self._lock = threading.Condition()  # the one lock of the queue, the ledger and the workers
        self._queue: RunQueue[Job] = RunQueue(lambda job: job.spec.priority)
        self._ledger = Ledger(self._lock, retain, forget=self._queue.forget)
        self._jobs = self._ledger.jobs  # by id
        self._holding = Holding(self._lock, self._queue, self._ledger)
        lanes = [{kind: backend.lane() for kind, backend in backends.items()} for _ in range(concurrency)]
        self._workers = Workers(self._lock, self._queue, self.batch, self._holding, self._ledger, lanes,
                                step_delay=step_delay, stop_grace=self.stop_grace)

    # -- the Engine interface ----------------------------------------------------------------------
    async def submit(self, spec: JobSpec, owner: str) -> JobView:
        if spec.kind not in self.backends:
            served = ", ".join(self.backends)
            raise KindNotServed(f"this server has no {spec.kind} model; it serves: {served}")
        self.backends[spec.kind].validate(spec)
        job = Job(spec, owner)
        with self._lock:
            if self._workers.closing:
                raise QueueFull("the server is shutting down")
            if len(self._queue) >= self.queue_size:
                raise QueueFull(f"the queue is full ({self.queue_size} jobs waiting); try again later")
            self._ledger.add(job)
            position = self._workers.offer(job)
        job.emit("queued", position=position)
        return job.view()

    async def get(self, job_id: str, owner: str) -> JobView:
        return self._ledger.find(job_id, owner).view()

    async def list(self, owner: str, limit: int = 100) -> list[JobView]:
        """The owner's jobs, newest first (at most ``limit``)."""
        return [job.view() for job in reversed(self._ledger.of(owner)[-limit:])]

    async def stop(
        self, job_id: str, owner: str, reason: str = "user", wait: bool = True, at: str = "now"
    ) -> JobView:
        """Stop a job; with ``wait``, answer once the stop took effect (or ``stop_wait`` passed).

        A queued job is removed from the queue and never runs; a running job stops at its next
        step, or with ``at="item"`` once its current item is done (answered at once, the job still
        running); a held (paused or preempted) job ends at once, with the result of its last run; a
        finished job is left as it is. Idempotent.
        """
        job = self._ledger.find(job_id, owner)
        with self._lock:
            dequeued = job.state in HELD_STATES or (job.state == "queued" and job in self._queue)
            self._queue.remove(job)
            if at == "item" and not dequeued:
                job.signal.stop_after_item(reason)
                return job.view()
            job.request_stop(reason)
        if dequeued:
            self._holding.end(job, reason)
        elif wait:
            await self._ledger.waiters.wait(job, self.stop_wait)
        return job.view()

    async def skip(self, job_id: str, owner: str) -> JobView:
        """Skip the running job's current item; a queued or finished job is left as it is."""
        job = self._ledger.find(job_id, owner)
        if job.state == "running":
            job.signal.skip()
        return job.view()

    async def pause(self, job_id: str, owner: str) -> JobView:
        """Hold the job with its checkpoint, and answer once it is held (or it ended first).

        A running job is checkpointed at its next step and its worker freed; a queued or preempted
        one leaves the queue. Idempotent for a paused job; a job that has ended (or is being
        stopped) raises :class:`JobStateConflict`.
        """
        job = self._ledger.find(job_id, owner)
        with self._lock:
            if job.state in FINAL_STATES or job.state == "stopping":
                raise JobStateConflict(f"job {job_id} is {job.state}: only a queued or running job can pause")
            self.batch.refuse_pause(job)
            job.pause_wanted = True
            if self._queue.remove(job):
                self._holding.hold(job, PAUSED)
            elif job.state == "running":
                job.interrupt.stop(PAUSED)
        await _jobs.wait_until(job, lambda: job.state in FINAL_STATES or job.state == PAUSED, self.stop_wait)
        return job.view()

    async def resume(self, job_id: str, owner: str) -> JobView:
        """Queue a paused job again (it resumes from its checkpoint); idempotent for a job that is
        already queued or running; :class:`JobStateConflict` for one that has ended."""
        job = self._ledger.find(job_id, owner)
        with self._lock:
            if job.state in FINAL_STATES:
                raise JobStateConflict(f"job {job_id} is {job.state}: only a paused job can resume")
            if job.state != PAUSED:
                return job.view()
            job.pause_wanted = False
            with job.lock:
                job.state = "queued"
            position = self._workers.offer(job)
        job.emit("resumed", position=position, checkpoint_step=job.view().checkpoint_step)
        return job.view()

    async def wait(self, job_id: str, owner: str, timeout: float | None = None) -> JobView:
        """The job's view once it has ended (or after ``timeout`` seconds)."""
        job = self._ledger.find(job_id, owner)
        await self._ledger.waiters.wait(job, timeout)
        return job.view()

    async def events(self, job_id: str, owner: str, after: int = 0) -> AsyncIterator[JobEvent]:
        """The job's events with ``seq > after``, as they come, up to ``done`` (none after it)."""
        async for event in _jobs.events(self._ledger.find(job_id, owner), after):
            yield event

    async def result(self, job_id: str, owner: str) -> dict[str, Any]:
        """The job's view and what it generated (None until it has ended)."""
        job = self._ledger.find(job_id, owner)
        view = job.view()
        with job.lock:
            result = job.result if view.state in FINAL_STATES else None
        return {"job": view.to_json(), "result": result}

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "queued": len(self._queue),
                "running": self._workers.running,
                "jobs": len(self._jobs),
                "workers_alive": self._workers.alive(),
                **self.batch.counts(),
            }

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    def close(self, timeout: float | None = 60.0) -> None:
        """Stop every job (reason ``"shutdown"``) and join the workers."""
        with self._lock:
            self._workers.closing = True
            held = self._queue.take_all() + [j for j in self._jobs.values() if j.state == PAUSED]
            running = [j for j in self._jobs.values() if j.state in ("running", "stopping")]
            self._lock.notify_all()
        for job in held:
            job.request_stop("shutdown")
            self._holding.end(job, "shutdown")
        for job in running:
            job.request_stop("shutdown")
        self._workers.join(timeout)
