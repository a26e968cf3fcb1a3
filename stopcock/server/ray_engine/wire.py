"""What travels between the Ray engine's deployments: model specs, refusals, job specs as JSON, and
the call that asks a deployment again while it is down."""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..contract import (
    Backend,
    InvalidJob,
    JobNotFound,
    JobSpec,
    JobStateConflict,
    KindNotServed,
    QueueFull,
    Unavailable,
)

__all__ = [
    "POLL_S", "SILENT_S", "ModelSpec", "Refused", "by_grpc", "call", "detached",
    "spec_from_json", "spec_to_json",
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

    code: str  # not_found | queue_full | kind | invalid | unavailable | conflict
    message: str

    def error(self) -> Exception:
        kinds: dict[str, type[Exception]] = {
            "not_found": JobNotFound,
            "queue_full": QueueFull,
            "kind": KindNotServed,
            "invalid": InvalidJob,
            "unavailable": Unavailable,
            "conflict": JobStateConflict,
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
            from ...tiny.demo import DESCRIPTIONS

            return DESCRIPTIONS[self.kind]
        return ""

    def load(self) -> Backend:
        if self.factory is not None:
            return self.factory()
        from ...loading import resolve_model
        from ..backends import ImageBackend, TextBackend

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
        "priority": spec.priority,
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
        int(data.get("priority", 0)),
    )


def _ray_errors() -> tuple[type[Exception], ...]:
    """The errors of a call whose callee died or could not be reached (worth asking again)."""
    import ray.serve.exceptions as serve_errors
    from ray.exceptions import RayActorError

    names = ("DeploymentUnavailableError", "ReplicaUnavailableError")  # not in every Ray 2.x
    return (RayActorError, *(getattr(serve_errors, n) for n in names if hasattr(serve_errors, n)))


def by_grpc(handle: Any) -> Any:
    """``handle`` (a Serve handle, or a stand-in without options) with its calls sent over Serve's
    gRPC transport between deployments (``_by_reference=False``) rather than as Ray actor tasks.

    An actor task's answer is a streaming reply, and the callee's event loop waits until the
    caller has acknowledged its last item before it takes the next call (Ray's
    ``WaitAllObjectsReported``, ray-project/ray#44079): a caller that hangs (its process frozen, its
    node cut off) would stall the callee. A gRPC answer is written without waiting for the caller,
    so the registry answers a hung model replica's waiting stop poll and goes on serving the others.
    A Serve without that transport (an older Ray) gets the handle as it is."""
    options = getattr(handle, "options", None)
    if options is None or not _has_grpc_transport(type(handle)):
        return handle
    return options(_by_reference=False)


_GRPC_TRANSPORT: dict[type, bool] = {}


def _has_grpc_transport(handle_type: type) -> bool:
    """Whether the Serve handles of ``handle_type`` can send their calls over gRPC."""
    known = _GRPC_TRANSPORT.get(handle_type)
    if known is None:
        options: Any = handle_type.options  # type: ignore[attr-defined]
        known = _GRPC_TRANSPORT[handle_type] = "_by_reference" in inspect.signature(options).parameters
    return known


async def call(handle: Any, method: str, *args: Any, retry_for: float | None = 60.0) -> Any:
    """``await handle.method.remote(*args)`` over gRPC (see :func:`by_grpc`), asked again (with a
    growing pause) while the callee is down or restarting, for up to ``retry_for`` seconds (None: as
    long as it takes). Every method called this way is idempotent."""
    errors = _ray_errors()
    give_up = None if retry_for is None else time.monotonic() + retry_for
    pause = 0.05
    target = by_grpc(getattr(handle, method))
    while True:
        try:
            return await target.remote(*args)
        except errors:
            if give_up is not None and time.monotonic() > give_up:
                raise
            log.warning("%s: the callee is unavailable; asking again in %.2f s", method, pause)
            await asyncio.sleep(pause)  # a back-off between retries, not a synchronisation
            pause = min(pause * 2, 1.0)


def detached(awaitable: Callable[[], Awaitable[Any]], keep: set[asyncio.Task[Any]]) -> asyncio.Task[Any]:
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
