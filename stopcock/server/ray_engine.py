"""The Ray Serve engine: the server's :class:`~stopcock.server.contract.Engine` over replicas and machines.

Three kinds of Serve deployments (:mod:`stopcock.server.ray_deploy` puts them together):

- **Ingress** replicas serve the FastAPI app of :func:`~stopcock.server.app.create_app` over a
  :class:`RayEngine`: they hold no job state, so any of them answers for any job.
- **One job registry** (:class:`JobRegistry`, one replica) is the one place where a job's start and
  its stop are ordered. It keeps every job's record (state, events, result), bounds the queue, sends
  each job to a model deployment, and routes a stop to the model replica that claimed the job, or
  keeps it as a tombstone when no replica has: a replica may start a job only after the registry
  granted it the claim, and it grants none for a stopped job. Stops and job ends are written to a
  journal before they are acknowledged, so a restarted registry loses none of them.
- **Model** replicas (:class:`ModelReplica`, one deployment per kind) each hold the model and
  ``concurrency`` lanes, the replica's device lease: a lane is taken before a job's claim and given
  back by the worker thread only once ``stopcock.run`` has returned, whatever Serve thinks of the
  request, so a replica never runs more pipelines at once than it has lanes. A replica long-polls
  the registry for stops of its jobs (applied with the same exact stop-step bookkeeping as
  :class:`~stopcock.server.engine.LocalEngine`, :mod:`stopcock.server.jobs`) and reports each job's
  events in batches.

The job's ``stop_step`` is the step its run had reached when the stop reached the replica that
runs it; the run ends at ``stop_step`` or ``stop_step + 1``. Ray is imported only by the functions
that need it: importing this module does not start or need a cluster.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import functools
import json
import logging
import os
import pickle
import secrets
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .contract import (
    FINAL_STATES,
    Backend,
    Event,
    InvalidJob,
    JobNotFound,
    JobSpec,
    JobView,
    KindNotServed,
    Lane,
    QueueFull,
)
from .jobs import Job, checked_grace, finish, new_id, run_lane, since, summary_of_end, wait_final

__all__ = [
    "JobRegistry",
    "Journal",
    "LocalHandle",
    "ModelReplica",
    "ModelSpec",
    "RayEngine",
    "Refused",
    "construct",
]

log = logging.getLogger("stopcock.server.ray")

#: Seconds a long poll waits before it answers empty (and is asked again): the replicas' heartbeat.
POLL_S = 5.0
#: Seconds a replica may stay silent before the registry asks Ray whether it is still alive.
SILENT_S = 3 * POLL_S


# -- what travels between the deployments ------------------------------------------------------------
@dataclass(frozen=True)
class Refused:
    """An answer of the registry that the engine raises as the contract's error ``code``."""

    code: str  # not_found | queue_full | kind | invalid
    message: str

    def error(self) -> Exception:
        kinds: dict[str, type[Exception]] = {
            "not_found": JobNotFound,
            "queue_full": QueueFull,
            "kind": KindNotServed,
            "invalid": InvalidJob,
        }
        return kinds[self.code](self.message)


@dataclass(frozen=True)
class ModelSpec:
    """One kind of model to serve: ``model`` is a folder or hub id (None: the built-in demo model),
    or ``factory`` builds the backend (any :class:`~stopcock.server.contract.Backend`; pickled to
    the replicas). ``name`` and ``description`` are what ``/v1/models`` shows. ``device``: where a
    built-in backend's model is moved once loaded (``auto``: ``cuda`` when the replica sees a GPU,
    as with ``ray_actor_options={"num_gpus": 1}``, else ``cpu``); a factory places its own."""

    kind: str
    model: str | None = None
    name: str | None = None
    description: str | None = None
    factory: Callable[[], Backend] | None = None
    device: str = "auto"  # where a built-in backend's model runs: auto (a GPU if Ray gave one), cpu, cuda...

    @property
    def served_name(self) -> str:
        if self.name:
            return self.name
        if self.factory is not None:
            raise ValueError(f"a {self.kind} model built by a factory needs a name")
        return f"stopcock-demo-{self.kind}" if self.model is None else self.model

    @property
    def served_description(self) -> str:
        if self.description is not None:
            return self.description
        if self.model is None and self.factory is None:
            from ..tiny.demo import DESCRIPTIONS

            return DESCRIPTIONS[self.kind]
        return ""

    def load(self) -> Backend:
        if self.factory is not None:
            return self.factory()
        from ..loading import resolve_model
        from .backends import ImageBackend, TextBackend

        classes: dict[str, Any] = {"text": TextBackend, "image": ImageBackend}
        if self.kind not in classes:
            raise ValueError(f"no built-in {self.kind!r} backend: give a factory")
        backend: Any = classes[self.kind].load(
            resolve_model(self.model, self.kind), self.served_name, self.served_description
        )
        device = self.device
        if device == "auto":
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device != "cpu":  # the lanes share the moved weights
            (backend.pipe.model if self.kind == "text" else backend.pipe).to(device)
        placed: Backend = backend
        return placed


def spec_to_json(spec: JobSpec) -> dict[str, Any]:
    return {
        "kind": spec.kind,
        "prompt": spec.prompt,
        "params": dict(spec.params),
        "stop": dict(spec.stop),
        "messages": None if spec.messages is None else [dict(m) for m in spec.messages],
        "prompts": None if spec.prompts is None else list(spec.prompts),
    }


def spec_from_json(data: Mapping[str, Any]) -> JobSpec:
    messages, prompts = data.get("messages"), data.get("prompts")
    return JobSpec(
        data["kind"],
        data["prompt"],
        dict(data["params"]),
        dict(data["stop"]),
        None if messages is None else tuple(dict(m) for m in messages),
        None if prompts is None else tuple(prompts),
    )


def _view_from_json(data: Mapping[str, Any]) -> JobView:
    return JobView(**{name: data[name] for name in JobView.__dataclass_fields__})


def _ray_errors() -> tuple[type[Exception], ...]:
    """The errors of a call whose callee died or could not be reached (worth asking again)."""
    import ray.serve.exceptions as serve_errors
    from ray.exceptions import RayActorError

    names = ("DeploymentUnavailableError", "ReplicaUnavailableError")  # not in every Ray 2.x
    return (RayActorError, *(getattr(serve_errors, n) for n in names if hasattr(serve_errors, n)))


async def _call(handle: Any, method: str, *args: Any, retry_for: float | None = 60.0) -> Any:
    """``await handle.method.remote(*args)``, asked again (with a growing pause) while the callee is
    down or restarting, for up to ``retry_for`` seconds (None: as long as it takes). Every method
    called this way is idempotent."""
    errors = _ray_errors()
    give_up = None if retry_for is None else time.monotonic() + retry_for
    pause = 0.05
    while True:
        try:
            return await getattr(handle, method).remote(*args)
        except errors:
            if give_up is not None and time.monotonic() > give_up:
                raise
            log.warning("%s: the callee is unavailable; asking again in %.2f s", method, pause)
            await asyncio.sleep(pause)  # a back-off between retries, not a synchronisation
            pause = min(pause * 2, 1.0)


def _detached(awaitable: Callable[[], Awaitable[Any]], keep: set[asyncio.Task[Any]]) -> asyncio.Task[Any]:
    """Run ``awaitable()`` in a task outside the current request's context: when a request is
    cancelled (its client went away), Serve cancels the calls to other deployments made in its
    context, and a stop, a job's dispatch or its run must not be cancelled with it. ``keep`` holds
    the task until it is done."""

    async def run() -> Any:
        return await awaitable()

    task: asyncio.Task[Any] = contextvars.Context().run(asyncio.ensure_future, run())
    keep.add(task)
    task.add_done_callback(keep.discard)
    return task


# -- the ingress side ----------------------------------------------------------------------------------
class RayEngine:
    """The :class:`~stopcock.server.contract.Engine` of an ingress replica: every call goes to the
    job registry (a Serve handle), so every ingress replica sees every job.

    ``models`` maps each served kind to ``{"id", "description"}``. Jobs are checked before they are
    queued with the model's validator (e.g. the prompt's length in tokens), which the model replicas
    hand to the registry when they start; it is fetched once per kind and run in a thread.
    """

    def __init__(self, registry: Any, models: Mapping[str, Mapping[str, str]], *, retry_for: float = 60.0):
        self.registry = registry
        self.models: Mapping[str, Mapping[str, str]] = {kind: dict(m) for kind, m in models.items()}
        self.retry_for = retry_for
        self._validators: dict[str, Any] = {}
        self._validating = threading.Lock()
        self._detached: set[asyncio.Task[Any]] = set()

    async def _ask(self, method: str, *args: Any) -> Any:
        answer = await _call(self.registry, method, *args, retry_for=self.retry_for)
        if isinstance(answer, Refused):
            raise answer.error()
        return answer

    async def _validator(self, kind: str) -> Any:
        if kind not in self._validators:
            blob = await self._ask("validator", kind, POLL_S * 6)
            if blob is False:
                raise QueueFull(f"the {kind} model is not ready yet (no replica has started); try later")
            # pickled by our own model replicas (a tokenizer can take a while to unpickle: not on the loop)
            self._validators[kind] = None if blob is None else await asyncio.to_thread(pickle.loads, blob)
        return self._validators[kind]

    def _validate(self, validator: Any, spec: JobSpec) -> None:
        with self._validating:  # one check at a time: a tokenizer is not meant for several threads
            validator.validate(spec)

    async def submit(self, spec: JobSpec, owner: str) -> JobView:
        if spec.kind not in self.models:
            served = ", ".join(self.models)
            raise KindNotServed(f"this server has no {spec.kind} model; it serves: {served}")
        if spec.priority != 0:  # the registry queues in submission order and cannot preempt (no checkpoints)
            raise InvalidJob(
                "the Ray engine runs jobs in submission order: leave out priority (or serve with the local"
                " engine, which preempts by priority)"
            )
        validator = await self._validator(spec.kind)
        if validator is not None:
            await asyncio.to_thread(self._validate, validator, spec)
        view: JobView = await self._ask("submit", new_id(), spec, owner, time.time())
        return view

    async def get(self, job_id: str, owner: str) -> JobView:
        view: JobView = await self._ask("get", job_id, owner)
        return view

    async def list(self, owner: str, limit: int = 100) -> list[JobView]:
        views: list[JobView] = await self._ask("jobs_of", owner, limit)
        return views

    async def stop(
        self, job_id: str, owner: str, reason: str = "user", wait: bool = True, at: str = "now"
    ) -> JobView:
        """Stop a job (see :meth:`JobRegistry.stop`; ``at="item"``: :meth:`JobRegistry.ask`). The call
        to the registry runs on its own, so a client that goes away before the answer does not take
        the stop with it."""
        if at == "item":
            call = lambda: self._ask("ask", job_id, owner, "after_item", reason)  # noqa: E731
        else:
            call = lambda: self._ask("stop", job_id, owner, reason, wait)  # noqa: E731
        view: JobView = await asyncio.shield(_detached(call, self._detached))
        return view

    async def skip(self, job_id: str, owner: str) -> JobView:
        """Skip the running job's current item (see :meth:`JobRegistry.ask`)."""
        view: JobView = await self._ask("ask", job_id, owner, "skip", "skipped")
        return view

    async def wait(self, job_id: str, owner: str, timeout: float | None = None) -> JobView:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = POLL_S if deadline is None else min(POLL_S, max(0.0, deadline - time.monotonic()))
            view: JobView = await self._ask("wait", job_id, owner, left)
            if view.state in FINAL_STATES or (deadline is not None and time.monotonic() >= deadline):
                return view

    async def events(self, job_id: str, owner: str, after: int = 0) -> AsyncIterator[Event]:
        while True:
            new, after, ended = await self._ask("events", job_id, owner, after, POLL_S)
            for event in new:
                yield event
            if ended:
                return

    async def result(self, job_id: str, owner: str) -> dict[str, Any]:
        found: dict[str, Any] = await self._ask("result", job_id, owner)
        return found

    async def stats(self) -> dict[str, int]:  # type: ignore[override]
        """Counts across the cluster (an awaitable, unlike ``LocalEngine``'s: they live in the registry)."""
        counts: dict[str, int] = await self._ask("stats")
        return counts

    async def aclose(self) -> None:
        """Nothing to close: an ingress replica holds no job (stop them with :meth:`JobRegistry.stop_all`)."""


# -- the journal -------------------------------------------------------------------------------------
class Journal:
    """The registry's append-only log (JSON lines): jobs submitted, claimed, stopped, ended, forgotten.

    Each entry is written and flushed to the operating system before the registry acknowledges what
    it records, so a registry process that dies (and is restarted by Serve) reads back every stop it
    acknowledged. ``fsync=True`` also survives the machine's crash, at a disk sync per entry. On
    opening, the log is read back and rewritten with only what is still needed (compaction).
    """

    def __init__(self, path: str | os.PathLike[str], *, fsync: bool = False) -> None:
        self.path = Path(path)
        self.fsync = fsync
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.entries = self._read()
        self._file = self.path.open("a", encoding="utf-8")
        self.written = 0

    def _read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        entries = []
        for line in self.path.read_text("utf-8").splitlines():
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut short by a crash mid-write: it was never acknowledged
                log.warning("journal %s: skipping a cut line", self.path)
        return entries

    def write(self, op: str, **fields: Any) -> None:
        self._file.write(json.dumps({"op": op, **fields}, separators=(",", ":")) + "\n")
        self._file.flush()
        if self.fsync:
            os.fsync(self._file.fileno())
        self.written += 1

    def rewrite(self, entries: list[dict[str, Any]]) -> None:
        """Replace the log with ``entries`` (atomically: a crash leaves the old one or the new one)."""
        fresh = self.path.with_suffix(".tmp")
        with fresh.open("w", encoding="utf-8") as out:
            out.writelines(json.dumps(e, separators=(",", ":")) + "\n" for e in entries)
            out.flush()
            os.fsync(out.fileno())
        self._file.close()
        os.replace(fresh, self.path)
        self._file = self.path.open("a", encoding="utf-8")
        self.written = 0

    def close(self) -> None:
        self._file.close()


# -- the registry ------------------------------------------------------------------------------------
class _Record:
    """The registry's record of a job: a :class:`~stopcock.server.jobs.Job` fed by its replica's
    reports, who claimed it, and the stop asked for it."""

    def __init__(self, job: Job, position: int) -> None:
        self.job = job
        self.position = position
        self.claimed_by: str | None = None
        self.stop: str | None = None  # the reason, once a stop was asked
        self.stop_applied = False  # the replica said it applied the stop
        self.asks: list[tuple[str, str]] = []  # (action, reason) for its replica: "skip", "after_item"
        self.journaled_end = False

    @property
    def final(self) -> bool:
        return self.job.state in FINAL_STATES


@dataclass
class _Replica:
    name: str
    kind: str
    concurrency: int
    seen: float
    peak: int = 0
    busy: int = 0


class JobRegistry:
    """The job registry (one Serve replica): records, queue bound, dispatch, claims, stops, journal.

    ``models`` maps each kind to the handle of its model deployment. Everything here runs on one
    event loop, so each method is atomic up to its first ``await``: a claim and a stop of the same
    job are ordered, and a job stopped before any replica claimed it never starts. At most
    ``queue_size`` jobs wait for a replica; ``retain`` finished jobs are kept; a stop with ``wait``
    answers once the run returned, or after ``stop_wait`` seconds with the job still ``stopping``.
    ``journal`` is the path of the journal, or ``journal_dir`` the folder of one named after the
    Serve application (None: none, and a restart forgets everything).
    """

    async def __init__(  # type: ignore[misc]
        self,
        models: Mapping[str, Any],
        *,
        queue_size: int = 16,
        retain: int = 256,
        stop_wait: float = 30.0,
        journal: str | None = None,
        journal_dir: str | None = None,
        fsync: bool = False,
        alive: Callable[[str], bool] | None = None,
    ) -> None:
        if queue_size < 0 or retain < 1:
            raise ValueError("queue_size must be >= 0 and retain >= 1")
        self.models = dict(models)
        self.queue_size = queue_size
        self.retain = retain
        self.stop_wait = stop_wait
        self._alive = alive or _actor_alive
        self._jobs: dict[str, _Record] = {}
        self._queued: set[str] = set()
        self._finished: collections.deque[str] = collections.deque()
        self._claims: dict[str, set[str]] = collections.defaultdict(set)  # replica -> its unfinished jobs
        self._pollers: dict[str, asyncio.Event] = {}
        self._replicas: dict[str, _Replica] = {}
        self._validators: dict[str, bytes | None] = {}
        self._kind_ready: dict[str, asyncio.Event] = collections.defaultdict(asyncio.Event)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._dispatches: dict[str, asyncio.Task[Any]] = {}  # job -> its dispatch, while it runs
        self._settled: dict[str, str] = {}  # job -> what its dispatch came to
        self._replicas_changed = asyncio.Event()
        self._closing = False
        self.refused_claims = 0
        self._started = time.monotonic()
        if journal is None and journal_dir is not None:  # one journal per application, named after it
            from ray import serve

            journal = str(Path(journal_dir) / f"{serve.get_replica_context().app_name}.jsonl")
        self.journal = None if journal is None else Journal(journal, fsync=fsync)
        self.restored = self._restore() if self.journal is not None else 0
        self._spawn(self._watch())

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        return _detached(lambda: coro, self._tasks)

    def _write(self, op: str, **fields: Any) -> None:
        if self.journal is not None:
            self.journal.write(op, **fields)

    # -- the engine's calls (owner-scoped) --------------------------------------------------------
    async def submit(self, job_id: str, spec: JobSpec, owner: str, created: float) -> JobView | Refused:
        """Queue a job (idempotent by ``job_id``: the ingress may ask again after a registry restart)."""
        known = self._jobs.get(job_id)
        if known is not None:
            return known.job.view() if secrets.compare_digest(known.job.owner, owner) else _not_found(job_id)
        if self._closing:
            return Refused("queue_full", "the server is shutting down")
        if spec.kind not in self.models:
            served = ", ".join(self.models)
            return Refused("kind", f"this server has no {spec.kind} model; it serves: {served}")
        if len(self._queued) >= self.queue_size:
            message = f"the queue is full ({self.queue_size} jobs waiting); try again later"
            return Refused("queue_full", message)
        record = _Record(Job(spec, owner, id=job_id, created=created), len(self._queued) + 1)
        self._write(
            "submit",
            id=job_id,
            owner=owner,
            spec=spec_to_json(spec),
            created=created,
            position=record.position,
        )
        self._add(record)
        self._dispatches[job_id] = self._spawn(self._dispatch(record))
        return record.job.view()

    async def get(self, job_id: str, owner: str) -> JobView | Refused:
        record = self._find(job_id, owner)
        return record if isinstance(record, Refused) else record.job.view()

    async def jobs_of(self, owner: str, limit: int = 100) -> list[JobView]:
        """The owner's jobs, newest first (at most ``limit``)."""
        mine = [r.job for r in self._jobs.values() if secrets.compare_digest(r.job.owner, owner)]
        return [job.view() for job in reversed(mine[-limit:])]

    async def stop(
        self, job_id: str, owner: str, reason: str = "user", wait: bool = True
    ) -> JobView | Refused:
        """Stop a job: a job no replica has claimed ends ``stopped`` now and never starts (a tombstone);
        a claimed one is stopped by its replica at its next step. Written to the journal before the
        answer. With ``wait``, answers once the run returned (or after ``stop_wait`` seconds)."""
        record = self._find(job_id, owner)
        if isinstance(record, Refused):
            return record
        if not record.final:
            if record.stop is None:
                record.stop = reason
                self._write("stop", id=job_id, reason=reason)
            if record.claimed_by is None:
                record.job.request_stop(record.stop)  # its stop_step: the step it reached, none
                self._end_here(record, "stopped", record.stop, "stopped while queued: it never ran")
            else:
                with record.job.lock:
                    if record.job.state == "running":
                        record.job.state = "stopping"
                record.job.changes.bump()
                self._wake(record.claimed_by)
                if wait:
                    await wait_final(record.job, self.stop_wait)
        return record.job.view()

    async def ask(self, job_id: str, owner: str, action: str, reason: str) -> JobView | Refused:
        """Skip the current item (``action="skip"``) or stop after it (``"after_item"``), answered at
        once. A job no replica has claimed has no current item: a skip leaves it as it is, a stop
        after the item stops it now. Delivered to the replica with its next poll (not journaled)."""
        record = self._find(job_id, owner)
        if isinstance(record, Refused):
            return record
        if record.final:
            return record.job.view()
        if record.claimed_by is None:
            return record.job.view() if action == "skip" else await self.stop(job_id, owner, reason, False)
        record.asks.append((action, reason))
        self._wake(record.claimed_by)
        return record.job.view()

    async def wait(self, job_id: str, owner: str, timeout: float | None) -> JobView | Refused:
        record = self._find(job_id, owner)
        if isinstance(record, Refused):
            return record
        await wait_final(record.job, timeout)
        return record.job.view()

    async def events(
        self, job_id: str, owner: str, after: int, timeout: float
    ) -> tuple[list[Event], int, bool] | Refused:
        """The job's events after ``after`` (waiting up to ``timeout`` for one), the new cursor, and
        whether ``done`` is among them."""
        record = self._find(job_id, owner)
        if isinstance(record, Refused):
            return record
        version = record.job.changes.version
        new, cursor, ended = since(record.job, after)
        if not new and not ended:
            await record.job.changes.wait_past(version, timeout)
            new, cursor, ended = since(record.job, after)
        return new, cursor, ended

    async def result(self, job_id: str, owner: str) -> dict[str, Any] | Refused:
        record = self._find(job_id, owner)
        if isinstance(record, Refused):
            return record
        view = record.job.view()
        with record.job.lock:
            result = record.job.result if view.state in FINAL_STATES else None
        return {"job": view.to_json(), "result": result}

    async def stats(self) -> dict[str, int]:
        replicas = list(self._replicas.values())
        return {
            "queued": len(self._queued),
            "running": sum(len(jobs) for jobs in self._claims.values()),
            "jobs": len(self._jobs),
            "workers_alive": sum(r.concurrency for r in replicas),
            "replicas": len(replicas),
            "pipelines_peak": max((r.peak for r in replicas), default=0),
            "concurrency": min((r.concurrency for r in replicas), default=0),
            "refused_claims": self.refused_claims,
        }

    async def validator(self, kind: str, timeout: float) -> bytes | bool | None:
        """The pickled validator of ``kind`` (None: the backend has none), once a replica registered
        one; False if none did within ``timeout`` seconds."""
        if kind not in self._validators:
            try:
                await asyncio.wait_for(self._kind_ready[kind].wait(), timeout)
            except asyncio.TimeoutError:
                return False
        return self._validators[kind]

    async def stop_all(self, reason: str = "shutdown", timeout: float = 60.0) -> int:
        """Refuse new jobs, stop every job, wait (up to ``timeout`` s) for them to end; returns how many.

        (Not ``shutdown``: a Serve handle's own ``shutdown`` would hide it.)"""
        self._closing = True
        open_ = [r for r in self._jobs.values() if not r.final]
        for record in open_:
            await self.stop(record.job.id, record.job.owner, reason, wait=False)
        for record in open_:
            await wait_final(record.job, timeout)
        return len(open_)

    # -- the model replicas' calls -------------------------------------------------------------------
    async def register(self, kind: str, replica: str, concurrency: int, validator: bytes | None) -> None:
        """A model replica of ``kind`` has started (or finds a restarted registry)."""
        self._replicas[replica] = _Replica(replica, kind, concurrency, time.monotonic())
        self._replicas_changed.set()
        if kind not in self._validators:
            self._validators[kind] = validator
            self._kind_ready[kind].set()

    async def claim(self, job_id: str, replica: str) -> int | None:
        """May ``replica`` start the job? The number of events before its first if so (it numbers
        its events from there), None if not: stopped, ended, forgotten, or claimed by another."""
        record = self._jobs.get(job_id)
        if record is None or record.final or record.claimed_by not in (None, replica):
            self.refused_claims += 1
            return None
        self._seen(replica)
        if record.claimed_by is None:
            self._write("claim", id=job_id, replica=replica)
            record.claimed_by = replica
            self._queued.discard(job_id)
            self._claims[replica].add(job_id)
            with record.job.lock:
                record.job.state = "running"
            record.job.changes.bump()
        return len(record.job.events)

    async def report(
        self,
        replica: str,
        events: list[tuple[str, Event]],
        views: Mapping[str, Mapping[str, Any]],
        results: Mapping[str, Any],
    ) -> None:
        """A batch of a replica's news: events (in order), the current views of its jobs, and the
        results of those that ended (whose ``done`` event is in ``events``)."""
        self._seen(replica)
        for job_id, view in views.items():
            record = self._jobs.get(job_id)
            if record is not None and record.claimed_by == replica and not record.final:
                if view["state"] not in FINAL_STATES:  # the end comes with the done event
                    state = view["state"]
                    if record.stop is not None and state == "running":
                        state = "stopping"  # asked here, not yet applied there
                    record.job.apply({**view, "state": state})
        for job_id, event in events:
            record = self._jobs.get(job_id)
            if record is None or record.claimed_by != replica or record.job.ended:
                continue
            if event.type == "done":
                with record.job.lock:
                    record.job.result = results.get(job_id)
                record.job.apply(event.data)
            record.job.put(event)
            if event.type == "done":
                self._ended(record)

    async def poll(
        self, replica: str, applied: list[str], running: list[str], peak: int, busy: int, timeout: float
    ) -> tuple[dict[str, str], bool, list[tuple[str, str, str]]]:
        """A replica's long poll: the stops asked for its jobs that it has not applied yet, as
        ``{job_id: reason}`` (waiting up to ``timeout`` for one), whether this registry knows the
        replica (False after a registry restart: it then registers again), and the other asks for
        its jobs as ``(job_id, action, reason)`` (see :meth:`ask`)."""
        self._seen(replica, peak, busy)
        for job_id in applied:
            record = self._jobs.get(job_id)
            if record is not None and record.claimed_by == replica:
                record.stop_applied = True
        for job_id in running:  # after a restart: the replica still runs them
            record = self._jobs.get(job_id)
            if record is not None and record.claimed_by == replica and not record.final:
                self._claims[replica].add(job_id)
        pending = self._pending(replica)
        if not pending and not self._asks(replica, take=False):
            event = self._pollers[replica] = asyncio.Event()
            try:
                await asyncio.wait_for(event.wait(), timeout)
            except asyncio.TimeoutError:
                pass
            pending = self._pending(replica)
        return pending, replica in self._replicas, self._asks(replica, take=True)

    # -- operations and tests ----------------------------------------------------------------------
    async def placement(self, job_id: str) -> str | None:
        """The replica (its Ray actor name) that claimed the job, if any."""
        record = self._jobs.get(job_id)
        return None if record is None else record.claimed_by

    async def whoami(self) -> str:
        """This registry replica's Ray actor name."""
        import ray

        return str(ray.get_runtime_context().get_actor_name())

    async def replicas(self, kind: str, at_least: int = 0, timeout: float = 0.0) -> list[dict[str, Any]]:
        """The live model replicas of ``kind`` (name, concurrency, peak and current pipelines), once
        there are ``at_least`` of them (or after ``timeout`` seconds)."""
        deadline = time.monotonic() + timeout

        def live() -> list[dict[str, Any]]:
            return [dict(r.__dict__) for r in self._replicas.values() if r.kind == kind]

        while len(live()) < at_least and time.monotonic() < deadline:
            self._replicas_changed.clear()
            try:
                await asyncio.wait_for(self._replicas_changed.wait(), deadline - time.monotonic())
            except asyncio.TimeoutError:
                break
        return live()

    async def settled(self, job_id: str, timeout: float) -> str | None:
        """Once the job's dispatch is over (or after ``timeout`` s): what became of it (``ran``,
        ``refused``: a replica got it and could not start it, ``failed``), or None if it is not known
        (no dispatch of it in this registry, or still going)."""
        task = self._dispatches.get(job_id)
        if task is None:
            return self._settled.get(job_id)
        done, _ = await asyncio.wait({task}, timeout=timeout)
        return task.result() if done else None

    # -- internals ---------------------------------------------------------------------------------
    def _find(self, job_id: str, owner: str) -> _Record | Refused:
        record = self._jobs.get(job_id)
        if record is None or not secrets.compare_digest(record.job.owner, owner):
            return _not_found(job_id)
        return record

    def _add(self, record: _Record) -> None:
        self._jobs[record.job.id] = record
        if not record.final and record.claimed_by is None:
            self._queued.add(record.job.id)
        record.job.emit("queued", position=record.position)

    def _seen(self, replica: str, peak: int | None = None, busy: int | None = None) -> None:
        known = self._replicas.get(replica)
        if known is not None:
            known.seen = time.monotonic()
            if peak is not None and busy is not None:
                known.peak, known.busy = max(known.peak, peak), busy

    def _wake(self, replica: str) -> None:
        poller = self._pollers.get(replica)
        if poller is not None:
            poller.set()

    def _asks(self, replica: str, *, take: bool) -> list[tuple[str, str, str]]:
        """The asks waiting for ``replica``'s jobs; ``take`` hands them over (cleared here)."""
        found = []
        for job_id in self._claims.get(replica, ()):
            record = self._jobs[job_id]
            found += [(job_id, action, reason) for action, reason in record.asks]
            if take:
                record.asks = []
        return found

    def _pending(self, replica: str) -> dict[str, str]:
        pending = {}
        for job_id in self._claims.get(replica, ()):
            record = self._jobs[job_id]
            if record.stop is not None and not record.stop_applied and not record.final:
                pending[job_id] = record.stop
        return pending

    def _end_here(
        self, record: _Record, state: str, reason: str, detail: str, error: str | None = None
    ) -> None:
        """End a job from the registry: it never started (a tombstone), or its replica is gone."""
        job = record.job
        finish(
            job,
            state,
            reason,
            outcome=summary_of_end(state, reason, job.step, job.total, job.started, detail),
            error=error,
        )
        self._ended(record)

    def _ended(self, record: _Record) -> None:
        job_id = record.job.id
        self._queued.discard(job_id)
        if record.claimed_by is not None:
            self._claims[record.claimed_by].discard(job_id)
        if not record.journaled_end:
            record.journaled_end = True
            with record.job.lock:
                done = len(record.job.events)
                result = record.job.result
            self._write("end", id=job_id, view=record.job.view().to_json(), result=result, done=done)
            self._finished.append(job_id)
            while len(self._finished) > self.retain:
                old = self._finished.popleft()
                self._jobs.pop(old, None)
                self._write("forget", id=old)
            self._compact_if_long()

    def _lost(self, replica: str, why: str) -> None:
        """``replica`` is gone: its unfinished jobs fail (they are not run again)."""
        self._replicas.pop(replica, None)
        self._replicas_changed.set()
        for job_id in list(self._claims.pop(replica, ())):
            record = self._jobs[job_id]
            if not record.final:
                message = f"the model replica running this job ({replica}) {why}; the job was not run again"
                self._end_here(record, "failed", "error", message, error=message)

    async def _dispatch(self, record: _Record) -> str:
        """Send the job to its model deployment, and learn there if the replica that runs it dies;
        returns what became of it: ``ran``, ``refused`` (the replica may not start it), ``failed``."""
        outcome = "failed"
        try:
            outcome = await self._send(record)
            return outcome
        finally:
            self._dispatches.pop(record.job.id, None)
            self._settled[record.job.id] = outcome
            while len(self._settled) > 4 * self.retain:
                self._settled.pop(next(iter(self._settled)))

    async def _send(self, record: _Record) -> str:
        from ray.exceptions import ActorDiedError, RayActorError, RayError
        from ray.serve.exceptions import RayServeException

        job = record.job
        for attempt in range(3):
            if record.final:
                return "refused"
            try:
                # "ran": the replica reported the job's end before answering; "refused": not claimed there
                answer: str = await self.models[job.spec.kind].run.remote(job.id, job.owner, job.spec)
                return answer
            except RayActorError as exc:
                if record.claimed_by is None and attempt < 2:
                    continue  # the replica it went to died before claiming it: it never started, send again
                if record.claimed_by is not None:
                    replica = record.claimed_by
                    if isinstance(exc, ActorDiedError) or not await asyncio.to_thread(self._alive, replica):
                        self._lost(replica, f"died ({type(exc).__name__})")
                    # else: unreachable for now, not dead; the watch decides if it stays silent
                else:
                    self._end_here(
                        record,
                        "failed",
                        "error",
                        "no model replica could take it",
                        error=f"{type(exc).__name__}: {exc}",
                    )
                return "failed"
            except (RayError, RayServeException) as exc:  # the call itself failed, not the pipeline
                if not record.final:
                    message = f"the model deployment could not run it: {type(exc).__name__}: {exc}"
                    self._end_here(record, "failed", "error", message, error=message)
                return "failed"
        return "failed"

    async def _watch(self) -> None:
        """Every few seconds: a replica that has been silent for a while, and that Ray says is gone,
        takes its unfinished jobs with it (this catches the replicas whose jobs no dispatch call
        watches, after a registry restart, and the replicas that were scaled away)."""
        while True:
            await asyncio.sleep(POLL_S)  # a period, not a synchronisation
            now = time.monotonic()
            for replica in [r for r in self._replicas.values() if now - r.seen > SILENT_S]:
                if not await asyncio.to_thread(self._alive, replica.name):
                    self._lost(replica.name, "is gone")
            # claimed by a replica this registry never heard of (restored from the journal)
            for name in [n for n, jobs in self._claims.items() if jobs and n not in self._replicas]:
                if now - self._started > SILENT_S and not await asyncio.to_thread(self._alive, name):
                    self._lost(name, "is gone")

    def _restore(self) -> int:
        """Rebuild the records from the journal; queued jobs are sent again (they never started)."""
        assert self.journal is not None
        entries: dict[str, dict[str, Any]] = {}
        for entry in self.journal.entries:
            op, job_id = entry["op"], entry["id"]
            if op == "submit":
                entries[job_id] = {"submit": entry}
            elif op == "forget":
                entries.pop(job_id, None)
            elif job_id in entries:
                entries[job_id][op] = entry
        for job_id, parts in entries.items():
            sub = parts["submit"]
            job = Job(spec_from_json(sub["spec"]), sub["owner"], id=job_id, created=sub["created"])
            record = _Record(job, sub["position"])
            record.claimed_by = parts.get("claim", {}).get("replica")
            record.stop = parts.get("stop", {}).get("reason")
            if record.claimed_by is not None:
                record.job.state = "stopping" if record.stop else "running"
            self._add(record)
            end = parts.get("end")
            if end is not None:
                record.journaled_end = True
                record.job.result = end["result"]
                record.job.apply(end["view"])
                record.job.put(Event(end["done"], "done", end["view"]))
                self._queued.discard(job_id)
                self._finished.append(job_id)
            elif record.claimed_by is not None:
                self._claims[record.claimed_by].add(job_id)
            elif record.stop is not None:  # stopped unclaimed, and the registry died before writing the end
                record.job.request_stop(record.stop)
                self._end_here(record, "stopped", record.stop, "stopped while queued: it never ran")
            else:
                self._dispatches[job_id] = self._spawn(self._dispatch(record))
        self.journal.rewrite([e for p in entries.values() for e in p.values()])
        return len(entries)

    def _compact_if_long(self) -> None:
        if self.journal is not None and self.journal.written > 8 * (self.retain + len(self._jobs)):
            keep = set(self._jobs)
            self.journal.rewrite(self._entries_of(keep))

    def _entries_of(self, keep: set[str]) -> list[dict[str, Any]]:
        entries = []
        for job_id in keep:
            record = self._jobs[job_id]
            job = record.job
            entries.append(
                {
                    "op": "submit",
                    "id": job_id,
                    "owner": job.owner,
                    "spec": spec_to_json(job.spec),
                    "created": job.created,
                    "position": record.position,
                }
            )
            if record.claimed_by is not None:
                entries.append({"op": "claim", "id": job_id, "replica": record.claimed_by})
            if record.stop is not None:
                entries.append({"op": "stop", "id": job_id, "reason": record.stop})
            if record.journaled_end:
                with job.lock:
                    done, result = len(job.events), job.result
                entries.append(
                    {"op": "end", "id": job_id, "view": job.view().to_json(), "result": result, "done": done}
                )
        return entries


def _not_found(job_id: str) -> Refused:
    return Refused("not_found", f"no job {job_id!r} (unknown, expired, or created with another key)")


def _actor_alive(name: str) -> bool:
    """Whether the Serve replica actor ``name`` is alive (Ray frees a dead actor's name)."""
    import ray

    try:
        ray.get_actor(name, namespace="serve")
    except ValueError:
        return False
    return True


# -- the model replicas --------------------------------------------------------------------------------
class _Checked:
    """A lane that checks the job first: for a backend without a validator, whose jobs the ingress
    could not check (an invalid job then fails, instead of being refused with a 400)."""

    def __init__(self, lane: Lane, backend: Backend) -> None:
        self.lane, self.backend = lane, backend

    def execute(self, spec: JobSpec, ctx: Any) -> Any:
        self.backend.validate(spec)
        return self.lane.execute(spec, ctx)


_INTERRUPTED = ("failed", "error", None, "the worker was interrupted")


class ModelReplica:
    """A model replica: the backend, ``concurrency`` lanes (the device lease), the stop poll and the
    report loop. ``registry`` is the registry's handle (looked up in the replica's Serve application
    when None); ``name`` identifies the replica (its Ray actor name when None).

    :meth:`run` is the deployment's only request: the registry sends each job there and Serve routes
    it to a replica with a free request slot (``max_ongoing_requests`` = ``concurrency``). The job's
    whole life runs in a task of its own, so a cancelled request (Serve frees its slot) neither
    stops the job nor frees its lane: the lane comes back only when the pipeline has returned.
    """

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
        self._outbox: collections.deque[tuple[str, Event]] = collections.deque()
        self._outbox_lock = threading.Lock()
        self._wake = asyncio.Event()
        self._count_lock = threading.Lock()
        self.busy = 0  # pipelines running now
        self.peak = 0  # the most pipelines that ever ran at once here
        self._processes: set[asyncio.Task[Any]] = set()
        await self._register()
        self._loops = [asyncio.ensure_future(self._poll_loop()), asyncio.ensure_future(self._report_loop())]

    @property
    def _checked(self) -> bool:
        """Whether the ingress checks this backend's jobs (it has a validator to hand over)."""
        return callable(getattr(self.backend, "validator", None))

    async def _register(self) -> None:
        blob = pickle.dumps(self.backend.validator()) if self._checked else None  # type: ignore[attr-defined]
        await _call(self.registry, "register", self.kind, self.name, self.concurrency, blob, retry_for=None)

    # -- the request -------------------------------------------------------------------------------
    async def run(self, job_id: str, owner: str, spec: JobSpec) -> str:
        """Run one job: ``"ran"`` once its end was reported, ``"refused"`` if it may not start."""
        task = _detached(lambda: self._process(job_id, owner, spec), self._processes)
        result: str = await asyncio.shield(task)
        return result

    async def _process(self, job_id: str, owner: str, spec: JobSpec) -> str:
        lane = await self._lanes.get()  # the lease: a lane of this replica's device
        handed = False
        job = Job(spec, owner, id=job_id)
        self._jobs[job_id] = job  # before the claim: a stop routed here right after it finds the job
        try:
            seq = await _call(self.registry, "claim", job_id, self.name, retry_for=None)
            if seq is None:
                return "refused"
            with job.lock:
                job.events.extend([None] * seq)  # the registry's events come first
                job.state = "stopping" if job.signal.stopped else "running"
                job.started = time.time()
            job.listener = functools.partial(self._post, job_id)
            reported = self._reported[job_id] = self._loop.create_future()
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
            ended = run_lane(job, lane_here, self.step_delay, self.stop_grace)
        finally:  # the pipeline has returned: the job's end is told, then its lane is free for the next
            with self._count_lock:
                self.busy -= 1
            try:
                state, reason, summary, error = ended or _INTERRUPTED
                finish(job, state, reason, outcome=summary, error=error)
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
            stops, known, asks = await _call(
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
                    job.signal.skip() if action == "skip" else job.signal.stop_after_item(reason)
            if not known:
                await self._register()

    # -- reports -----------------------------------------------------------------------------------
    def _post(self, job_id: str, event: Event) -> None:
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
            last_preview = {job_id: i for i, (job_id, e) in enumerate(items) if e.type == "preview"}
            events = [
                (job_id, e)
                for i, (job_id, e) in enumerate(items)
                if e.type != "preview" or last_preview[job_id] == i  # older previews are dropped anyway
            ]
            views = {
                job_id: job.view().to_json()
                for job_id in {j for j, _ in items}
                if (job := self._jobs.get(job_id)) is not None
            }
            ended = [job_id for job_id, e in events if e.type == "done"]
            results = {job_id: self._jobs[job_id].result for job_id in ended if job_id in self._jobs}
            await _call(self.registry, "report", self.name, events, views, results, retry_for=None)
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
        return {"busy": self.busy, "peak": self.peak, "concurrency": self.concurrency}


# -- in one process ----------------------------------------------------------------------------------
async def construct(cls: type[Any], *args: Any, **kwargs: Any) -> Any:
    """An instance of a deployment class with an ``async __init__`` (as Serve makes one), in this process."""
    instance: Any = object.__new__(cls)
    await instance.__init__(*args, **kwargs)
    return instance


class LocalHandle:
    """A stand-in for a Serve handle to ``target`` in this process: ``await handle.method.remote(*args)``
    calls ``target.method(*args)``. With it the registry, model replicas and engine run in one event
    loop without a cluster (the engine's own tests use it)."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def __getattr__(self, method: str) -> Any:
        call = getattr(self.target, method)

        class _Method:
            @staticmethod
            def remote(*args: Any) -> Awaitable[Any]:
                return asyncio.ensure_future(call(*args))

        return _Method
