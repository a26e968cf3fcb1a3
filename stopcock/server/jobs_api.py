"""The job API: submit, read, follow, stop and collect generation jobs (``/v1/jobs``).

A job is named by its id or by the id of the OpenAI-compatible response that started it
(``cmpl-<id>``, ``chatcmpl-<id>``): both work as they are.

A job runs on whether or not anyone follows it (it is collected later; an event stream can be
resumed), unless its client says otherwise: ``/events?stop_on_disconnect=true`` and
``/result?wait=true`` stop the job (reason ``"disconnected"``) when that client goes away first.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Depends, Header, Query, Request

from .contract import FINAL_STATES, Pausable, job_id_of
from .deps import ApiError, EventStream, Owner, engine_of, sse, until_done_or_gone
from .schemas import MAX_EVENT_ID, JobRequest

__all__ = ["jobs"]

jobs = APIRouter(prefix="/v1", tags=["jobs"])


async def _job_id(job_id: str) -> str:  # async: run on the event loop, not in a worker thread
    return job_id_of(job_id)


#: The ``{job_id}`` of a path: a job id, or the id of the OpenAI response that started the job.
JobId = Annotated[str, Depends(_job_id)]


@jobs.post("/jobs", status_code=201)
async def submit_job(request: Request, who: Owner, job: Annotated[JobRequest, Body()]) -> dict[str, Any]:
    """Queue a text or image job; answers with its id and state (429 when the queue is full)."""
    view = await engine_of(request).submit(job.spec(), who)
    return view.to_json()


@jobs.get("/jobs")
async def list_jobs(
    request: Request, who: Owner, limit: Annotated[int, Query(ge=1, le=1000)] = 100
) -> dict[str, Any]:
    """Your own jobs (those created with your key), newest first."""
    return {"object": "list", "data": [v.to_json() for v in await engine_of(request).list(who, limit)]}


@jobs.get("/jobs/{job_id}")
async def get_job(request: Request, who: Owner, job_id: JobId) -> dict[str, Any]:
    """The job's state, step, total and reason."""
    return (await engine_of(request).get(job_id, who)).to_json()


@jobs.post("/jobs/{job_id}/stop")
async def stop_job(
    request: Request, who: Owner, job_id: JobId, at: Annotated[Literal["now", "item"], Query()] = "now"
) -> dict[str, Any]:
    """Stop this job (only this one) and answer with its state once the stop took effect.

    ``?at=item``: let the current item (prompt) finish and start no other; answered at once, while
    the item runs. Idempotent; a queued job is removed without running; a finished job answers as
    it ended.
    """
    return (await engine_of(request).stop(job_id, who, "user", at=at)).to_json()


@jobs.post("/jobs/{job_id}/skip")
async def skip_job(request: Request, who: Owner, job_id: JobId) -> dict[str, Any]:
    """End the job's current item (prompt) and go on with the next; a job of one prompt ends
    (reason ``"skipped"``). Answered at once; a job not running is left as it is."""
    return (await engine_of(request).skip(job_id, who)).to_json()


def _pausable(request: Request) -> Pausable:
    engine = engine_of(request)
    if not isinstance(engine, Pausable):
        raise ApiError(400, f"this server's engine ({type(engine).__name__}) cannot pause jobs",
                       code="not_supported")
    return engine


@jobs.post("/jobs/{job_id}/pause")
async def pause_job(request: Request, who: Owner, job_id: JobId) -> dict[str, Any]:
    """Pause this job: a running one is checkpointed at its next step and its worker freed (the
    checkpoint stays on the server); answers once it is paused. 409 for a job that has ended; 400
    on an engine that cannot pause jobs."""
    return (await _pausable(request).pause(job_id, who)).to_json()


@jobs.post("/jobs/{job_id}/resume")
async def resume_job(request: Request, who: Owner, job_id: JobId) -> dict[str, Any]:
    """Resume a paused job: it is queued again and continues from its checkpoint, with the result
    of a run never paused. 409 for a job that has ended; 400 on an engine that cannot pause jobs."""
    return (await _pausable(request).resume(job_id, who)).to_json()


@jobs.get("/jobs/{job_id}/result")
async def job_result(
    request: Request, who: Owner, job_id: JobId, wait: Annotated[bool, Query()] = False
) -> dict[str, Any]:
    """The final state and the generated text or image (PNG, base64); 409 while it runs.

    ``wait=true`` answers once the job has ended instead, and stops it (reason ``"disconnected"``)
    if this client goes away first: a blocking call whose work ends with its caller."""
    engine = engine_of(request)
    if wait:
        await engine.get(job_id, who)  # 404 now
        await until_done_or_gone(request, engine, job_id, who)
    found = await engine.result(job_id, who)
    if found["job"]["state"] not in FINAL_STATES:
        raise ApiError(
            409,
            f"job {job_id} is still {found['job']['state']}: wait for its 'done' event",
            code="job_not_finished",
        )
    return found


@jobs.get("/jobs/{job_id}/events")
async def job_events(
    request: Request,
    who: Owner,
    job_id: JobId,
    after: Annotated[int, Query(ge=0, le=MAX_EVENT_ID)] = 0,
    last_event_id: Annotated[
        str | None,
        Header(alias="Last-Event-ID", pattern=r"^[0-9]{0,18}$", description="resume after this event's id"),
    ] = None,
    stop_on_disconnect: Annotated[bool, Query()] = False,
) -> EventStream:
    """Server-sent events: queued, started, progress, text, preview, paused, preempted, resumed, done.

    Resume with ``?after=SEQ`` or the ``Last-Event-ID`` header (an event's id: ASCII digits; an
    empty one means from the start). Closing this stream does not stop the job (use ``/stop``),
    unless ``stop_on_disconnect=true``: then a stream that ends before the ``done`` event, however
    it ends, stops the job (reason ``"disconnected"``).
    """
    engine = engine_of(request)
    await engine.get(job_id, who)  # 404 now, not inside the stream
    start = max(after, int(last_event_id or 0))
    done = False

    async def body() -> AsyncIterator[str]:
        nonlocal done
        async for event in engine.events(job_id, who, start):
            yield sse(event)
            done = event.type == "done"

    async def on_end() -> None:
        if stop_on_disconnect and not done:
            await engine.stop(job_id, who, "disconnected", wait=False)

    return EventStream(body(), on_end)


@jobs.get("/models")
async def list_models(request: Request, who: Owner) -> dict[str, Any]:
    """The served models, in OpenAI's list format (``stopcock_kind``: text or image)."""
    models = engine_of(request).models
    return {
        "object": "list",
        "data": [
            {
                "id": m["id"],
                "object": "model",
                "created": 0,
                "owned_by": "stopcock",
                "stopcock_kind": kind,
                "description": m["description"],
            }
            for kind, m in models.items()
        ],
    }


@jobs.get("/health")
async def health(request: Request, who: Owner) -> dict[str, Any]:
    """Queue and worker counts."""
    counts = engine_of(request).stats()
    if inspect.isawaitable(counts):  # an engine whose counts live elsewhere (the Ray engine's registry)
        counts = await counts
    return {"status": "ok", **counts}
