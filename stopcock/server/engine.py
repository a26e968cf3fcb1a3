"""The in-process engine: a registry of generation jobs, a bounded queue, worker slots and the stop path.

:class:`LocalEngine` implements :class:`~stopcock.server.contract.Engine` in one process:
``concurrency`` worker threads, each with its own lane of the models, take jobs from a bounded FIFO
queue. A worker takes the next job only once its current run has returned, so a stopped job frees
its slot when its pipeline has actually stopped, never before, and two runs never overlap on one
lane. The contract (specs, views, events, states, errors) is in :mod:`stopcock.server.contract`.
"""

from __future__ import annotations

import asyncio
import collections
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
    Backend,
    Engine,
    Event,
    InvalidJob,
    JobNotFound,
    JobSpec,
    JobView,
    KindNotServed,
    Lane,
    QueueFull,
    RunContext,
)

__all__ = ["LocalEngine"]
# The contract's names, importable from here as before (``stopcock.server.engine.Engine``).
__all__ += ["FINAL_STATES", "Backend", "Engine", "Event", "InvalidJob", "JobNotFound", "JobSpec", "JobView",
            "KindNotServed", "Lane", "QueueFull", "RunContext"]

log = logging.getLogger("stopcock.server")

class _Changes:
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
        future, wake = loop_waker()
        with self._cond:
            if self.version > version:
                return
            remove = self._wakers.add(wake)
        try:
            await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            remove()


class _Job:
    def __init__(self, spec: JobSpec, owner: str) -> None:
        self.id = secrets.token_urlsafe(18)  # 144 random bits: unguessable
        self.owner = owner
        self.spec = spec
        self.signal = StopSignal()
        self.state = "queued"
        self.step = 0
        self.total: int | None = None
        self.reason: str | None = None
        self.stop_step: int | None = None  # the step the run had reached when a stop was first requested
        self.created = time.time()
        self.started: float | None = None
        self.finished: float | None = None
        self.outcome: dict[str, Any] | None = None
        self.result: dict[str, Any] | None = None
        self.error: str | None = None
        self.events: list[Event | None] = []  # None: an older preview, dropped to bound memory
        self.ended = False  # the done event has been emitted
        self._last_preview: int | None = None
        self.changes = _Changes()
        self.lock = threading.Lock()

    def emit(self, type_: str, **data: Any) -> None:
        with self.lock:
            if type_ == "preview":
                if self._last_preview is not None:
                    self.events[self._last_preview] = None
                self._last_preview = len(self.events)
            self.events.append(Event(len(self.events) + 1, type_, data))
            self.ended = self.ended or type_ == "done"
        self.changes.bump()

    def reach(self, state: StepState) -> None:
        with self.lock:
            self.step, self.total = state.step, state.total

    def request_stop(self, reason: str) -> None:
        """Stop the job's signal, noting the step reached, under the lock that :class:`_Reached` takes:
        the run's next check then either sees the stop or has reached ``stop_step`` first. So the run
        ends at ``stop_step`` or ``stop_step + 1`` (the step in flight), never later."""
        with self.lock:
            if self.state not in FINAL_STATES and self.stop_step is None:
                self.stop_step = self.step
            if self.state == "running":
                self.state = "stopping"
            self.signal.stop(reason)  # its callbacks only forward the stop to the run: no lock taken

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
            )


class _Reached(Condition):
    """Records the step at each check of the run, before the job's signal is checked (never stops
    on its own): a stop request then reads the step the run has really reached (see
    :meth:`_Job.request_stop`), not the one its ``on_step`` reported last."""

    def __init__(self, job: _Job) -> None:
        self._job = job

    def check(self, state: StepState) -> str | None:
        self._job.reach(state)
        return None

    def __repr__(self) -> str:
        return "reached()"


class _JobContext:
    """The :class:`~stopcock.server.contract.RunContext` of one job run by this engine."""

    def __init__(self, job: _Job, step_delay: float) -> None:
        self._job = job
        self.signal = job.signal
        self.step_delay = step_delay

    def stop(self, conditions: Iterable[Condition]) -> list[Condition | StopSignal]:
        """The run's ``stop=``: the step recorder, the job's signal, then the job's own ``conditions``."""
        return [_Reached(self._job), self.signal, *conditions]

    def on_step(self, report: Callable[[StepState], None]) -> Callable[[StepState], None]:
        """The ``on_step`` hook for the run: records the step, calls ``report(state)`` (text,
        previews), emits ``progress``, then waits ``step_delay`` seconds (the test-only throttle)
        unless stopped."""
        job = self._job

        def hook(state: StepState) -> None:
            job.reach(state)  # also when a stop before its check kept _Reached from running
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
        if outcome is None:
            self._job.emit("item", index=index, prompt=prompt, state="started")
        else:
            reason = outcome.reason if outcome.stopped else "completed"
            self._job.emit("item", index=index, prompt=prompt, state="ended", reason=reason,
                           steps=outcome.steps)



class LocalEngine:
    """In-process engine: ``concurrency`` worker threads and a queue of at most ``queue_size``.

    ``backends`` maps each served kind (``"text"``, ``"image"``) to its backend; each worker gets
    its own lane of each. ``retain`` finished jobs are kept for reading; older ones are forgotten.
    ``stop_wait`` bounds how long a stop request waits for the run to end before answering
    with the job still ``stopping``. ``step_delay`` is the test-only per-step throttle.
    """

    def __init__(
        self,
        backends: Mapping[str, Backend],
        *,
        concurrency: int = 1,
        queue_size: int = 16,
        retain: int = 256,
        stop_wait: float = 30.0,
        step_delay: float = 0.0,
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
        self.step_delay = step_delay
        self._lock = threading.Condition()
        self._jobs: dict[str, _Job] = {}
        self._queue: collections.deque[_Job] = collections.deque()
        self._finished: collections.deque[str] = collections.deque()
        self._running = 0
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
            self._queue.append(job)
            position = len(self._queue)
            self._lock.notify()
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
        running); a finished job is left as it is. Idempotent.
        """
        job = self._find(job_id, owner)
        with self._lock:
            dequeued = job.state == "queued" and job in self._queue
            if dequeued:
                self._queue.remove(job)
            if at == "item" and not dequeued:
                job.signal.stop_after_item(reason)
                return job.view()
            job.request_stop(reason)
        if dequeued:
            self._finish(job, "stopped", reason, outcome=None, detail="stopped while queued: it never ran")
        elif wait:
            await self._wait_final(job, self.stop_wait)
        return job.view()

    async def skip(self, job_id: str, owner: str) -> JobView:
        """Skip the running job's current item; a queued or finished job is left as it is."""
        job = self._find(job_id, owner)
        if job.state == "running":
            job.signal.skip()
        return job.view()

    async def wait(self, job_id: str, owner: str, timeout: float | None = None) -> JobView:
        """The job's view once it has ended (or after ``timeout`` seconds)."""
        job = self._find(job_id, owner)
        await self._wait_final(job, timeout)
        return job.view()

    async def events(self, job_id: str, owner: str, after: int = 0) -> AsyncIterator[Event]:
        """The job's events with ``seq > after``, as they come, up to ``done`` (none after it)."""
        job = self._find(job_id, owner)
        while True:
            version = job.changes.version
            with job.lock:
                new = [e for e in job.events[after:] if e is not None]
                after, ended = len(job.events), job.ended
            for event in new:
                yield event
            if ended:
                return
            await job.changes.wait_past(version)

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
            }

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    def close(self, timeout: float | None = 60.0) -> None:
        """Stop every job (reason ``"shutdown"``) and join the workers."""
        with self._lock:
            self._closing = True
            queued, self._queue = list(self._queue), collections.deque()
            running = [j for j in self._jobs.values() if j.state in ("running", "stopping")]
            self._lock.notify_all()
        for job in queued:
            job.request_stop("shutdown")
            self._finish(
                job, "stopped", "shutdown", outcome=None, detail="stopped while queued: it never ran"
            )
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

    async def _wait_final(self, job: _Job, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            version = job.changes.version
            if job.state in FINAL_STATES:
                return
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            await job.changes.wait_past(version, left)

    def _work(self, lanes: Mapping[str, Lane]) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closing:
                    self._lock.wait()
                if self._closing and not self._queue:
                    return
                job = self._queue.popleft()
                self._running += 1
                with job.lock:
                    job.state = "stopping" if job.signal.stopped else "running"
                    job.started = time.time()
            ended: tuple[str, str, dict[str, Any] | None, str | None] | None = None
            try:
                ended = self._run(job, lanes[job.spec.kind])
            finally:  # the slot is free once the run has returned; then the job's end is told
                with self._lock:
                    self._running -= 1
                state, reason, summary, error = ended or (
                    "failed",
                    "error",
                    None,
                    "the worker was interrupted",
                )
                self._finish(job, state, reason, outcome=summary, error=error)

    def _run(self, job: _Job, lane: Lane) -> tuple[str, str, dict[str, Any] | None, str | None]:
        """Run the job; returns its final state, reason, Outcome summary and error."""
        job.emit("started")
        try:
            outcome = lane.execute(job.spec, _JobContext(job, self.step_delay))
        except Exception as exc:  # the job reports it as failed; the worker lives on
            log.exception("job %s failed", job.id)
            return "failed", "error", None, f"{type(exc).__name__}: {exc}"
        with job.lock:
            job.step = outcome.steps
            job.total = outcome.total_steps
        return "stopped" if outcome.stopped else "completed", outcome.reason, outcome.summary(), None

    def _finish(
        self,
        job: _Job,
        state: str,
        reason: str,
        *,
        outcome: dict[str, Any] | None,
        detail: str | None = None,
        error: str | None = None,
    ) -> None:
        with job.lock:
            if outcome is None:  # it never ran, or failed: say so in the same shape
                outcome = Outcome.without_output(
                    StepState(step=job.step, total=job.total),
                    reason=reason,
                    stopped=state == "stopped",
                    elapsed=0.0 if job.started is None else time.time() - job.started,
                    detail=detail or error,
                ).summary()
            job.state, job.reason, job.finished = state, reason, time.time()
            job.outcome, job.error = outcome, error
        job.emit("done", **job.view().to_json())
        with self._lock:
            self._finished.append(job.id)
            while len(self._finished) > self.retain:
                self._jobs.pop(self._finished.popleft(), None)
