"""The FastAPI app: the job API, the OpenAI-compatible API and the web page.

The app holds no module-level state: :func:`create_app` puts the engine and the keys on
``app.state`` and every handler reaches them through ``request.app.state``, so the same app can be
served over another :class:`~stopcock.server.engine.Engine` (e.g. a distributed one) unchanged.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator, Iterable
from importlib import resources
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, FastAPI, Query, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from .. import __version__
from .engine import FINAL_STATES, Engine, Event, InvalidJob, JobNotFound, KindNotServed, QueueFull
from .schemas import JobRequest

__all__ = ["ApiError", "Keys", "create_app", "engine_of", "owner", "sse"]

MAX_BODY_BYTES = 1 << 20


class ApiError(Exception):
    """An error answered as ``{"error": {"message", "type", "code"}}`` (OpenAI's shape)."""

    def __init__(
        self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.code = status, message, type_, code


class Keys:
    """The configured API keys; no keys means an open server (bind it to loopback only).

    A job belongs to the key that created it: the owner is a digest of the key, never the key.
    """

    def __init__(self, keys: Iterable[str] = ()) -> None:
        self._owners = {self._digest(k) for k in keys}

    @staticmethod
    def _digest(key: str) -> str:
        return hashlib.sha256(key.encode()).hexdigest()

    @property
    def required(self) -> bool:
        return bool(self._owners)

    def owner(self, authorization: str | None) -> str:
        if not self._owners:
            return "local"
        scheme, _, key = (authorization or "").partition(" ")
        digest = self._digest(key.strip())
        if scheme.lower() != "bearer" or digest not in self._owners:
            raise ApiError(
                401,
                "a valid API key is required: send 'Authorization: Bearer KEY'",
                "authentication_error",
                "invalid_api_key",
            )
        return digest


def owner(request: Request) -> str:
    """The owner of the request (a FastAPI dependency); 401 without a valid key."""
    keys: Keys = request.app.state.keys
    return keys.owner(request.headers.get("authorization"))


def engine_of(request: Request) -> Engine:
    engine: Engine = request.app.state.engine
    return engine


Owner = Annotated[str, Depends(owner)]


def sse(event: Event) -> str:
    return f"id: {event.seq}\nevent: {event.type}\ndata: {json.dumps(event.to_json())}\n\n"


def _error(status: int, message: str, type_: str, code: str | None = None, **extra: Any) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "code": code}, **extra}
    return JSONResponse(body, status_code=status, headers={"Retry-After": "1"} if status == 429 else None)


jobs = APIRouter(prefix="/v1", tags=["jobs"])


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
async def get_job(request: Request, who: Owner, job_id: str) -> dict[str, Any]:
    """The job's state, step, total and reason."""
    return (await engine_of(request).get(job_id, who)).to_json()


@jobs.post("/jobs/{job_id}/stop")
async def stop_job(request: Request, who: Owner, job_id: str) -> dict[str, Any]:
    """Stop this job (only this one) and answer with its state once the stop took effect.

    Idempotent; a queued job is removed without running; a finished job answers as it ended.
    """
    return (await engine_of(request).stop(job_id, who, "user")).to_json()


@jobs.get("/jobs/{job_id}/result")
async def job_result(request: Request, who: Owner, job_id: str) -> dict[str, Any]:
    """The final state and the generated text or image (PNG, base64); 409 while it runs."""
    found = await engine_of(request).result(job_id, who)
    if found["job"]["state"] not in FINAL_STATES:
        raise ApiError(
            409,
            f"job {job_id} is still {found['job']['state']}: wait for its 'done' event",
            code="job_not_finished",
        )
    return found


@jobs.get("/jobs/{job_id}/events")
async def job_events(
    request: Request, who: Owner, job_id: str, after: Annotated[int, Query(ge=0)] = 0
) -> StreamingResponse:
    """Server-sent events: queued, started, progress, text, preview, done.

    Resume with ``?after=SEQ`` or the ``Last-Event-ID`` header. Closing this stream does not stop
    the job (use ``/stop``).
    """
    engine = engine_of(request)
    await engine.get(job_id, who)  # 404 now, not inside the stream
    last = request.headers.get("last-event-id", "")
    start = max(after, int(last) if last.isdigit() else 0)

    async def body() -> AsyncIterator[str]:
        async for event in engine.events(job_id, who, start):
            yield sse(event)

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


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
    return {"status": "ok", **engine_of(request).stats()}


class _BodyLimit:
    """Refuse request bodies above ``MAX_BODY_BYTES`` (413), declared or streamed."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > MAX_BODY_BYTES:
            response = _error(
                413,
                f"the request body must be at most {MAX_BODY_BYTES} bytes",
                "invalid_request_error",
                "body_too_large",
            )
            return await response(scope, receive, send)
        seen = 0

        async def limited() -> Any:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > MAX_BODY_BYTES:
                raise ApiError(
                    413, f"the request body must be at most {MAX_BODY_BYTES} bytes", code="body_too_large"
                )
            return message

        await self.app(scope, limited, send)


def _validation_message(errors: list[Any]) -> str:
    parts = []
    for error in errors[:5]:
        where = ".".join(str(p) for p in error.get("loc", ()) if p != "body")
        parts.append(f"{where}: {error.get('msg')}" if where else str(error.get("msg")))
    return "; ".join(parts)


def _install_errors(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.type, exc.code)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [{k: v for k, v in e.items() if k in ("loc", "msg", "type")} for e in exc.errors()]
        return _error(
            422,
            _validation_message(errors),
            "invalid_request_error",
            "invalid_request",
            detail=jsonable_encoder(errors),
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail), "invalid_request_error")

    statuses: dict[type[Exception], tuple[int, str]] = {
        JobNotFound: (404, "not_found"),
        QueueFull: (429, "queue_full"),
        KindNotServed: (400, "model_not_served"),
        InvalidJob: (400, "invalid_job"),
    }
    for cls, (status, code) in statuses.items():

        async def handler(
            request: Request, exc: Exception, status: int = status, code: str = code
        ) -> JSONResponse:
            return _error(status, str(exc), "invalid_request_error", code)

        app.add_exception_handler(cls, handler)


def create_app(engine: Engine, *, api_keys: Iterable[str] = ()) -> FastAPI:
    """The app over ``engine``; with ``api_keys``, every API call needs one of them."""
    from .openai_api import openai

    app = FastAPI(
        title="stopcock",
        version=__version__,
        description="Start generations, stop your own, and watch them: a job API, an OpenAI-compatible API"
        " and a web page.",
    )
    app.state.engine = engine
    app.state.keys = Keys(api_keys)
    app.include_router(jobs)
    app.include_router(openai)
    _install_errors(app)
    app.add_middleware(_BodyLimit)

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def page() -> HTMLResponse:
        return HTMLResponse(resources.files(__package__).joinpath("static/index.html").read_text("utf-8"))

    return app
