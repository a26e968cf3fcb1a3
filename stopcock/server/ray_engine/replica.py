"""The Ray engine's model replicas: the backend, its lanes (the device lease), the stop poll and the
report loop.

:meth:`ModelReplica.run` is the deployment's only request: the registry sends each job there and
Serve routes it to a replica with a free request slot (``max_ongoing_requests``: ``concurrency``, see below).
The job's whole life runs in a task of its own, so a cancelled request (Serve frees its slot)
neither stops the job nor frees its lane: the lane comes back only when the pipeline has returned.

With ``batch_size`` > 1, greedy text jobs (those :func:`~stopcock.server.batching.batchable` accepts)
run as the rows of one padded ``generate`` on one lane, as on ``LocalEngine``: such a job waits
here for a batch (:meth:`.batches.Batches._gather`), which takes a lane, waits up to ``batch_wait``
seconds for more such jobs, claims them all and runs them (``Batching.run``); each row ends, and its
job is reported, on its own (:mod:`.batches`). Serve then hands a replica up to
``concurrency * batch_size`` jobs.

A job is held (paused, preempted) when the registry asks: its run is checkpointed at its next step,
and the hold is reported with the checkpoint's parcel: a file in ``checkpoint_dir`` (a folder every
replica can read), or else its bytes, which the registry puts in the Ray object store (it owns them).
A held job sent again resumes from it, on whichever replica took it
(:mod:`~stopcock.server.ray_engine.checkpoints`).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import pickle
import threading
import time
from typing import Any

from ..contract import HELD_STATES, Backend, JobEvent, JobSpec, Lane
from ..jobs import INTERRUPTED, Job, checked_grace, run_lane
from .batches import Batches
from .checkpoints import Keeper, store_for
from .wire import POLL_S, ModelSpec, call, detached

__all__ = ["ModelReplica"]


class _Checked:
    """A lane that checks the job first: for a backend without a validator, whose jobs the ingress
    could not check (an invalid job then fails, instead of being refused with a 400)."""

    def __init__(self, lane: Lane, backend: Backend) -> None:
        self.lane, self.backend = lane, backend

    def execute(self, spec: JobSpec, ctx: Any) -> Any:
        self.backend.validate(spec)
        return self.lane.execute(spec, ctx)


class ModelReplica(Batches):
    """A model replica: the backend, ``concurrency`` lanes (the device lease), the stop poll, the
    report loop and the batches (:class:`~.batches.Batches`, ``batch_size``, ``batch_wait``).
    ``registry``: the registry's handle (None: looked up in the replica's Serve application);
    ``name``: the replica's (None: its Ray actor name)."""

    async def __init__(  # type: ignore[misc]
        self,
        spec: ModelSpec,
        *,
        concurrency: int = 1,
        step_delay: float = 0.0,
        stop_grace: float | None = 5.0,
        torch_threads: int | None = 1,
        registry: Any = None,
        name: str | None = None,
        registry_name: str = "JobRegistry",
        batch_size: int = 1, batch_wait: float = 0.0,
        checkpoint_dir: str | None = None,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if torch_threads is not None:
            import torch

            torch.set_num_threads(torch_threads)
        self.kind = spec.kind
        self.concurrency = concurrency
        self.step_delay = step_delay
        self.stop_grace = checked_grace(stop_grace)  # as LocalEngine's: a slow step's stop escalates
        if registry is None:
            from ray import serve

            registry = serve.get_deployment_handle(registry_name, serve.get_replica_context().app_name)
        self.registry = registry
        if name is None:
            import ray

            name = str(ray.get_runtime_context().get_actor_name())
        self.name = name
        self._loop = asyncio.get_running_loop()
        self.backend = await asyncio.to_thread(spec.load)
        self._lanes: asyncio.Queue[Lane] = asyncio.Queue()
        for _ in range(concurrency):
            self._lanes.put_nowait(self.backend.lane())
        self._jobs: dict[str, Job] = {}
        self._reported: dict[str, asyncio.Future[None]] = {}
        self._outbox: collections.deque[tuple[str, JobEvent]] = collections.deque()
        self._outbox_lock = threading.Lock()
        self._wake = asyncio.Event()
        self._count_lock = threading.Lock()
        self.busy = 0  # pipelines running now
        self.peak = 0  # the most pipelines that ever ran at once here
        self._processes: set[asyncio.Task[Any]] = set()
        self._init_batching(batch_size, batch_wait)
        self.keeper = Keeper(store_for(checkpoint_dir))  # held jobs' checkpoints
        await self._register()
        self._loops = [asyncio.ensure_future(self._poll_loop()), asyncio.ensure_future(self._report_loop())]

    @property
    def _checked(self) -> bool:
        """Whether the ingress checks this backend's jobs (it has a validator to hand over)."""
        return callable(getattr(self.backend, "validator", None))

    async def _register(self) -> None:
        blob = pickle.dumps(self.backend.validator()) if self._checked else None  # type: ignore[attr-defined]
        await call(self.registry, "register", self.kind, self.name, self.concurrency, blob, retry_for=None)

    # -- the request -------------------------------------------------------------------------------
    async def run(self, job_id: str, owner: str, spec: JobSpec, held: dict[str, Any] | None = None) -> str:
        """Run one job (``held``: from its stored checkpoint): ``"ran"`` once its end (or hold) was
        reported, ``"refused"`` if it may not start."""
        if held is None and self._batches(spec):
            task = detached(lambda: self._batched(job_id, owner, spec), self._processes)
        else:
            task = detached(lambda: self._process(job_id, owner, spec, held), self._processes)
        result: str = await asyncio.shield(task)
        return result

    async def _process(self, job_id: str, owner: str, spec: JobSpec, held: dict[str, Any] | None) -> str:
        lane = await self._lanes.get()  # the lease: a lane of this replica's device
        handed = False
        job = Job(spec, owner, id=job_id)
        self._jobs[job_id] = job  # before the claim: a stop routed here right after it finds the job
        try:
            seq = await call(self.registry, "claim", job_id, self.name, retry_for=None)
            if seq is None:
                return "refused"
            with job.lock:
                job.events.extend([None] * seq)  # the registry's events come first
                job.state = "stopping" if job.signal.stopped else "running"
                job.started = time.time()
            job.listener = functools.partial(self._post, job_id)
            reported = self._reported[job_id] = self._loop.create_future()
            self.keeper.expect(job_id, held)
            worker = threading.Thread(
                target=self._work, args=(job, lane), name=f"stopcock-ray-worker-{job_id[:8]}", daemon=True
            )
            worker.start()
            handed = True  # the worker gives the lane back once the run has returned
            await reported
            return "ran"
        finally:
            if not handed:
                self._lanes.put_nowait(lane)
            self._reported.pop(job_id, None)
            self._jobs.pop(job_id, None)

    def _work(self, job: Job, lane: Lane) -> None:
        with self._count_lock:
            self.busy += 1
            self.peak = max(self.peak, self.busy)
        ended = None
        try:
            lane_here = lane if self._checked else _Checked(lane, self.backend)
            ended = self.keeper.resumed(job) or run_lane(job, lane_here, self.step_delay, self.stop_grace)
        finally:  # the pipeline has returned: the job's end (or hold) is told, then its lane is free
            with self._count_lock:
                self.busy -= 1
            try:
                self.keeper.settle(job, ended or INTERRUPTED)
            finally:
                self._give_back(lane)

    def _give_back(self, lane: Lane) -> None:
        try:
            self._loop.call_soon_threadsafe(self._lanes.put_nowait, lane)
        except RuntimeError:  # the replica's loop has closed: it is shutting down
            pass

    # -- stops -------------------------------------------------------------------------------------
    async def _poll_loop(self) -> None:
        applied: list[str] = []
        while True:
            stops, known, asks = await call(
                self.registry,
                "poll",
                self.name,
                applied,
                list(self._jobs),
                self.peak,
                self.busy,
                POLL_S,
                retry_for=None,
            )
            applied = []
            for job_id, reason in stops.items():
                job = self._jobs.get(job_id)
                if job is not None:
                    job.request_stop(reason)  # the step reached now is the job's stop_step
                applied.append(job_id)
            for job_id, action, reason in asks:
                job = self._jobs.get(job_id)
                if job is not None:
                    _act(job, action, reason)
            if not known:
                await self._register()

    # -- reports -----------------------------------------------------------------------------------
    def _post(self, job_id: str, event: JobEvent) -> None:
        """A job's new event (from its worker thread): queue it and wake the report loop."""
        with self._outbox_lock:
            self._outbox.append((job_id, event))
        try:
            self._loop.call_soon_threadsafe(self._wake.set)
        except RuntimeError:
            pass

    async def _report_loop(self) -> None:
        """Send the news in batches, one batch in flight: the slower the registry, the larger the batch."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            with self._outbox_lock:
                items, self._outbox = list(self._outbox), collections.deque()
            if not items:
                continue
            events, views = _news(items, self._jobs)
            ended = [job_id for job_id, e in events if e.type == "done" or e.type in HELD_STATES]
            results = {j: self.keeper.news_of(j, self._jobs[j]) for j in ended if j in self._jobs}
            counts = self.batching.counts()  # after the rows whose done events these are have ended
            await call(self.registry, "report", self.name, events, views, results, counts, retry_for=None)
            for job_id in ended:
                future = self._reported.get(job_id)
                if future is not None and not future.done():
                    future.set_result(None)

    async def check_health(self) -> None:
        """Serve's health check: the replica is unhealthy if its poll or report loop has died."""
        for loop in self._loops:
            if loop.done():
                raise RuntimeError(f"a background loop of the model replica has ended: {loop!r}")

    async def stats(self) -> dict[str, int]:
        return dict(busy=self.busy, peak=self.peak, concurrency=self.concurrency) | self.batching.counts()


def _act(job: Job, action: str, reason: str) -> None:
    """Apply an ask of the registry to the job: skip its item, stop after it, or hold it (a pause or
    a preemption: the run is checkpointed at its next step, then held)."""
    if action == "hold":
        job.interrupt.stop(reason)
    elif action == "skip":
        job.signal.skip()
    else:
        job.signal.stop_after_item(reason)


def _news(
    items: list[tuple[str, JobEvent]], jobs: dict[str, Job]
) -> tuple[list[tuple[str, JobEvent]], dict[str, Any]]:
    """The events to report (a job's older previews dropped: the newest supersedes them) and the
    current views of the jobs they are of."""
    last = {job_id: i for i, (job_id, e) in enumerate(items) if e.type == "preview"}
    events = [(job_id, e) for i, (job_id, e) in enumerate(items) if e.type != "preview" or last[job_id] == i]
    views = {j: job.view().to_json() for j in {j for j, _ in items} if (job := jobs.get(j)) is not None}
    return events, views
