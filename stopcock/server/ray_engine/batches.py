"""Batches of greedy text jobs on a Ray model replica: a part of
:class:`~stopcock.server.ray_engine.replica.ModelReplica` (see its module)."""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Callable
from typing import Any

from ..batching import Batching, batchable
from ..contract import Backend, JobEvent, JobSpec, Lane
from ..jobs import Ended, Job, finish
from .wire import call, detached

__all__ = ["Batches"]


class Batches:
    """What :class:`~stopcock.server.ray_engine.replica.ModelReplica` inherits (it sets the
    attributes): a job that :meth:`_batches` accepts runs as a row of a batch (:meth:`_batched`)."""

    backend: Backend
    registry: Any
    name: str
    step_delay: float
    busy: int
    peak: int
    _loop: asyncio.AbstractEventLoop
    _lanes: asyncio.Queue[Lane]
    _jobs: dict[str, Job]
    _reported: dict[str, asyncio.Future[None]]
    _processes: set[asyncio.Task[Any]]
    _count_lock: threading.Lock
    _post: Callable[[str, JobEvent], None]
    _give_back: Callable[[Lane], None]

    def _init_batching(self, size: int, wait: float) -> None:
        self.batching = Batching(size, wait)
        self._gathered: list[tuple[Job, asyncio.Future[bool]]] = []  # waiting for a batch, in arrival order
        self._arrived = asyncio.Event()
        self._gathering = False  # a gatherer is waiting for a lane or for the batch to fill
        lane = self._lanes.get_nowait()  # every lane is alike: whether one can run a batch
        self._lanes.put_nowait(lane)
        self._lane_batches = hasattr(lane, "execute_batch")

    def _batches(self, spec: JobSpec) -> bool:
        """Whether the job runs as a row of a batch. Only for a backend with a validator: the ingress
        has checked its jobs (a row's lane does not check them again)."""
        checked = callable(getattr(self.backend, "validator", None))
        return self.batching.size > 1 and self._lane_batches and checked and batchable(spec)

    async def _batched(self, job_id: str, owner: str, spec: JobSpec) -> str:
        """Run one job as a row of a batch: ``"ran"`` once its end was reported, ``"refused"`` if it
        may not start (stopped while it waited for its batch)."""
        job = Job(spec, owner, id=job_id)
        self._jobs[job_id] = job
        taken: asyncio.Future[bool] = self._loop.create_future()
        try:
            self._gathered.append((job, taken))
            self._arrived.set()
            if not self._gathering:
                self._gathering = True
                detached(self._gather, self._processes)
            if not await taken:
                return "refused"
            await self._reported[job_id]
            return "ran"
        finally:
            self._reported.pop(job_id, None)
            self._jobs.pop(job_id, None)

    async def _gather(self) -> None:
        """Take a lane, wait up to ``batch_wait`` for the batch to fill, claim its jobs and run those
        granted on the lane, in a thread that gives the lane back once ``generate`` has returned."""
        taken: list[tuple[Job, asyncio.Future[bool]]] = []
        lane: Lane | None = None
        try:
            lane = await self._lanes.get()  # in turn with the jobs that run alone
            deadline = self._loop.time() + self.batching.wait
            while len(self._gathered) < self.batching.size and (left := deadline - self._loop.time()) > 0:
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), left)
                except asyncio.TimeoutError:
                    break
            taken, self._gathered = self._gathered[: self.batching.size], self._gathered[self.batching.size :]
            self._gathering = bool(self._gathered)
            if self._gathering:  # more than a batch waits: the next one gathers for the next lane
                detached(self._gather, self._processes)
            row = True  # a row keeps no checkpoint: the registry never holds it
            claims = [call(self.registry, "claim", job.id, self.name, row, retry_for=None)
                      for job, _ in taken]
            answers = await asyncio.gather(*claims)
            rows = [job for (job, _), seq in zip(taken, answers, strict=True) if self._start_row(job, seq)]
            if rows:
                worker = threading.Thread(target=self._work_batch, args=(rows, lane), daemon=True,
                                          name=f"stopcock-ray-batch-{rows[0].id[:8]}")
                worker.start()
                lane = None  # the worker gives it back once the batch has returned
            for job, future in taken:
                future.set_result(job in rows)
        except BaseException as exc:  # the jobs taken fail with it (their dispatch reports the error)
            for _, future in taken:
                if not future.done():
                    future.cancel() if isinstance(exc, asyncio.CancelledError) else future.set_exception(exc)
            raise
        finally:
            if lane is not None:
                self._lanes.put_nowait(lane)
            if not taken:  # ended before it took any job: the next arrival starts a gatherer
                self._gathering = False

    def _start_row(self, job: Job, seq: int | None) -> bool:
        """Mark a job of the batch started if the registry granted its claim (``seq`` events before
        its first); whether it did."""
        if seq is None:
            return False
        with job.lock:
            job.events.extend([None] * seq)  # the registry's events come first
            job.state = "stopping" if job.signal.stopped else "running"
            job.started = time.time()
        job.listener = functools.partial(self._post, job.id)
        self._reported[job.id] = self._loop.create_future()
        self.batching.rows.add(job)
        return True

    def _work_batch(self, jobs: list[Job], lane: Lane) -> None:
        with self._count_lock:
            self.busy += 1
            self.peak = max(self.peak, self.busy)
        try:
            self.batching.run(jobs, lane, self._row_ended, self.step_delay)
        finally:  # generate has returned (every row's job has ended): the lane is free for the next
            with self._count_lock:
                self.busy -= 1
            self._give_back(lane)

    def _row_ended(self, job: Job, ended: Ended) -> None:
        """A row has ended (its batch goes on): the job's end is told at once."""
        self.batching.rows.discard(job)
        state, reason, summary, error = ended
        finish(job, state, reason, outcome=summary, error=error)

