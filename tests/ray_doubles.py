"""Stand-ins for Ray Serve in one process: the registry, model replicas and engine of the Ray engine
run in one event loop without a cluster (``tests/test_ray_local.py``)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

from stopcock.server.contract import JobEvent, JobSpec
from stopcock.server.jobs import Job
from stopcock.server.ray_engine.ingress import RayEngine
from stopcock.server.ray_engine.registry import JobRegistry
from stopcock.server.ray_engine.replica import ModelReplica
from stopcock.server.ray_engine.wire import ModelSpec

__all__ = ["LocalHandle", "construct", "engine_over", "fleet_of", "report_hold"]


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


async def fleet_of(
    backend: Any,
    count: int,
    checkpoint_dir: str,
    registry_options: dict[str, Any] | None = None,
    **replica_options: Any,
) -> tuple[JobRegistry, list[ModelReplica]]:
    """A registry (with ``registry_options``) and ``count`` model replicas of ``backend``, one lane each,
    named ``replica-0``... (with ``replica_options``), held jobs' checkpoints in ``checkpoint_dir``.
    Every replica counts as alive (the test installs its own answer): never Ray's, which a test run
    may have started for something else, and which knows none of these replicas."""
    options = {"alive": lambda name: True, **(registry_options or {})}
    registry = await construct(JobRegistry, {}, checkpoint_dir=checkpoint_dir, **options)
    spec = ModelSpec(backend.kind, name=backend.name, factory=lambda: backend)
    replicas = [
        await construct(
            ModelReplica,
            spec,
            step_delay=0.01,
            torch_threads=None,
            registry=LocalHandle(registry),
            name=f"replica-{i}",
            checkpoint_dir=checkpoint_dir,
            **replica_options,
        )
        for i in range(count)
    ]
    return registry, replicas


def engine_over(registry: JobRegistry, backend: Any, handle: Any) -> RayEngine:
    """The engine over ``registry``, whose model deployment of ``backend``'s kind is ``handle``."""
    registry.models[backend.kind] = handle
    return RayEngine(LocalHandle(registry), {backend.kind: {"id": backend.name, "description": ""}})


async def report_hold(
    registry: JobRegistry,
    replica: str,
    job_id: str,
    spec: JobSpec,
    step: int,
    folder: Path,
    owner: str,
    total: int | None = None,
) -> Path:
    """What a model replica reports when it has paused ``job_id`` at ``step`` (of ``total``): the
    ``paused`` event, the job's view and its checkpoint's parcel (a file in ``folder``, returned)."""
    job = Job(spec, owner, id=job_id, seq=1)
    job.state, job.step, job.total, job.started = "paused", step, total, 1.0
    parcel = folder / f"{job_id}.safetensors"
    parcel.write_bytes(b"a checkpoint")
    news = {"parcel": str(parcel), "steps": step, "saved_steps": 0}
    event = JobEvent(2, "paused", {"step": step, "checkpoint_step": step})
    await registry.report(replica, [(job_id, event)], {job_id: job.view().to_json()}, {job_id: news})
    return parcel
