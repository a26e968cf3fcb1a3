"""What every route shares: API errors, keys and owners, the engine on ``app.state``, SSE framing,
and what a client's going away does to its job."""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Annotated, Any

import anyio
from fastapi import Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.types import Receive, Scope, Send

from .contract import Engine, JobEvent, JobView

__all__ = [
    "MAX_BODY_BYTES", "ApiError", "EventStream", "Keys", "Owner", "engine_of", "error_response", "owner",
    "sse", "until_done_or_gone",
]

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
        keys = list(keys)
        if not all(isinstance(k, str) and k.strip() for k in keys):
            raise ValueError("an API key must be a non-empty string (a blank key would let anyone in)")
        self._owners = {self._digest(k.strip()) for k in keys}

    @staticmethod
    def _digest(key: str) -> str:
        return hashlib.sha256(key.encode()).hexdigest()

    @property
    def required(self) -> bool:
        return bool(self._owners)

    def owner(self, key: str | None) -> str:
        """The owner of a request that sent ``key`` (None: no bearer key); 401 if it is not one."""
        if not self._owners:
            return "local"
        digest = self._digest((key or "").strip())
        if key is None or digest not in self._owners:
            raise ApiError(
                401,
                "a valid API key is required: send 'Authorization: Bearer KEY'",
                "authentication_error",
                "invalid_api_key",
            )
        return digest


#: Declares the bearer key in the OpenAPI schema (so ``/docs`` can send one); the check is :class:`Keys`'.
_bearer = HTTPBearer(auto_error=False, description="an API key, when the server is started with keys")


async def owner(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> str:
    """The owner of the request (a FastAPI dependency); 401 without a valid key.

    ``async``, so that FastAPI runs it on the event loop rather than in a worker thread."""
    keys: Keys = request.app.state.keys
    return keys.owner(None if credentials is None else credentials.credentials)


def engine_of(request: Request) -> Engine:
    engine: Engine = request.app.state.engine
    return engine


Owner = Annotated[str, Depends(owner)]


def sse(event: JobEvent) -> str:
    return f"id: {event.seq}\nevent: {event.type}\ndata: {json.dumps(event.to_json())}\n\n"


async def until_done_or_gone(request: Request, engine: Engine, job_id: str, who: str) -> JobView:
    """Wait for the job to end; if the client disconnects first, stop the job.

    The server may tell of the disconnect (an ``http.disconnect`` message: uvicorn) or cancel the
    handler (Ray Serve, at its next ``await``): either way the job is stopped."""
    ended = False
    try:
        async with anyio.create_task_group() as group:

            async def watch() -> None:
                while (await request.receive())["type"] != "http.disconnect":
                    pass
                await engine.stop(job_id, who, "disconnected", wait=False)

            group.start_soon(watch)
            view = await engine.wait(job_id, who)
            ended = True
            group.cancel_scope.cancel()
    finally:
        if not ended:  # cancelled (or failed) before the job ended: nobody is left to read it
            with anyio.CancelScope(shield=True):
                await engine.stop(job_id, who, "disconnected", wait=False)
    return view


class EventStream(StreamingResponse):
    """Streams a job's events; when the response ends, however it ends (the client went away,
    even before the first byte), ``on_end()`` runs, shielded from cancellation."""

    def __init__(self, body: AsyncIterator[str], on_end: Callable[[], Awaitable[None]]) -> None:
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_end = on_end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._on_end()


def error_response(
    status: int, message: str, type_: str, code: str | None = None, **extra: Any
) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "code": code}, **extra}
    retry = {429: "1", 503: "5"}.get(status)  # busy: ask again soon; no replica ready: it may be starting
    return JSONResponse(body, status_code=status, headers={"Retry-After": retry} if retry else None)
