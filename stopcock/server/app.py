"""The FastAPI app: the job API, the OpenAI-compatible API and the web page.

The app holds no module-level state: :func:`create_app` puts the engine and the keys on
``app.state`` and every handler reaches them through ``request.app.state``, so the same app can be
served over another :class:`~stopcock.server.contract.Engine` (e.g. a distributed one) unchanged.
"""

from __future__ import annotations

import html
from collections.abc import Iterable
from importlib import resources
from importlib.util import find_spec
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .. import __version__
from .contract import Engine, InvalidJob, JobNotFound, JobStateConflict, KindNotServed, QueueFull
from .deps import MAX_BODY_BYTES, ApiError, Keys, error_response
from .jobs_api import jobs
from .openai_api import openai

__all__ = ["create_app"]


class _BodyLimit:
    """Refuse request bodies above ``MAX_BODY_BYTES`` with a 413, declared or chunked.

    The body is read here, before the app, and replayed to it: FastAPI turns an error raised while
    it reads a body into a 400, so the limit cannot be enforced from inside its reads.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"0").lstrip(b"0") or b"0"
        # Digits first: int() of thousands of digits raises (Python's limit on int conversion).
        too_large = not declared.isdigit() or len(declared) > 9 or int(declared) > MAX_BODY_BYTES
        body, more = bytearray(), True
        while more and not too_large:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away before sending its whole request: no one to answer
            body += message.get("body", b"")
            more = message.get("more_body", False)
            too_large = len(body) > MAX_BODY_BYTES
        if too_large:
            response = error_response(
                413,
                f"the request body must be at most {MAX_BODY_BYTES} bytes",
                "invalid_request_error",
                "body_too_large",
            )
            return await response(scope, receive, send)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # e.g. http.disconnect, which the OpenAI routes watch for
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)


def _validation_message(errors: list[Any]) -> str:
    parts = []
    for error in errors[:5]:
        where = ".".join(str(p) for p in error.get("loc", ()) if p != "body")
        parts.append(f"{where}: {error.get('msg')}" if where else str(error.get("msg")))
    return "; ".join(parts)


def _install_errors(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.type, exc.code)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [{k: v for k, v in e.items() if k in ("loc", "msg", "type")} for e in exc.errors()]
        return error_response(
            422,
            _validation_message(errors),
            "invalid_request_error",
            "invalid_request",
            detail=jsonable_encoder(errors),
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), "invalid_request_error")

    statuses: dict[type[Exception], tuple[int, str]] = {
        JobNotFound: (404, "not_found"),
        QueueFull: (429, "queue_full"),
        KindNotServed: (400, "model_not_served"),
        InvalidJob: (400, "invalid_job"),
        JobStateConflict: (409, "job_state_conflict"),
    }
    for cls, (status, code) in statuses.items():

        async def handler(
            request: Request, exc: Exception, status: int = status, code: str = code
        ) -> JSONResponse:
            return error_response(status, str(exc), "invalid_request_error", code)

        app.add_exception_handler(cls, handler)


DOCS_ASSETS = "/docs/assets"  # where the API docs' scripts, styles and icon are served from


def _operations_page(schema: dict[str, Any], openapi_url: str) -> str:
    """A page listing the API's operations, with no script or style from elsewhere: the API docs
    where the bundled Swagger UI assets are not installed."""
    rows = []
    for path, methods in schema.get("paths", {}).items():
        for method, operation in methods.items():
            summary = operation.get("summary") or operation.get("description", "").split("\n", 1)[0]
            rows.append(f"<tr><td><code>{html.escape(method.upper())}</code></td>"
                        f"<td><code>{html.escape(path)}</code></td><td>{html.escape(summary)}</td></tr>")
    return (
        f"<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>stopcock API</title></head>"
        f"<body><h1>stopcock {html.escape(str(schema.get('info', {}).get('version', '')))} API</h1>"
        f"<p>The whole schema: <a href=\"{html.escape(openapi_url)}\">{html.escape(openapi_url)}</a>."
        " For the interactive docs, install the server extra: <code>pip install 'stopcock[server]'</code>"
        " (fastapi-offline ships Swagger UI's files).</p>"
        f"<table><tr><th>method</th><th>path</th><th>what it does</th></tr>{''.join(rows)}</table>"
        "</body></html>"
    )


def _install_docs(app: FastAPI) -> None:
    """The API docs at ``/docs`` (Swagger UI) and ``/redoc``, served with no CDN: the scripts, styles
    and icon that FastAPI's own pages load from a CDN come from the files fastapi-offline ships. Without
    that package, ``/docs`` is a plain list of the operations."""
    bundled = find_spec("fastapi_offline") is not None
    if bundled:
        assets = resources.files("fastapi_offline").joinpath("static")
        app.mount(DOCS_ASSETS, StaticFiles(directory=str(assets)), name="docs-assets")

    def urls(request: Request) -> tuple[str, str]:
        root = str(request.scope.get("root_path", "")).rstrip("/")
        return root + DOCS_ASSETS, root + str(app.openapi_url)

    @app.get("/docs", response_class=HTMLResponse, include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        at, openapi_url = urls(request)
        if not bundled:
            return HTMLResponse(_operations_page(app.openapi(), openapi_url))
        return get_swagger_ui_html(
            openapi_url=openapi_url, title=f"{app.title} API", swagger_js_url=f"{at}/swagger-ui-bundle.js",
            swagger_css_url=f"{at}/swagger-ui.css", swagger_favicon_url=f"{at}/favicon.png",
        )

    @app.get("/redoc", response_class=HTMLResponse, include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        at, openapi_url = urls(request)
        if not bundled:
            return HTMLResponse(_operations_page(app.openapi(), openapi_url))
        return get_redoc_html(openapi_url=openapi_url, title=f"{app.title} API",
                              redoc_js_url=f"{at}/redoc.standalone.js", redoc_favicon_url=f"{at}/favicon.png",
                              with_google_fonts=False)


def create_app(engine: Engine, *, api_keys: Iterable[str] = ()) -> FastAPI:
    """The app over ``engine``; with ``api_keys``, every API call needs one of them. The API docs
    (``/docs``, ``/redoc``) load nothing from another host, so they work offline."""
    app = FastAPI(
        title="stopcock",
        version=__version__,
        description="Start generations, stop your own, and watch them: a job API, an OpenAI-compatible API"
        " and a web page.",
        docs_url=None,  # served by _install_docs, from bundled assets
        redoc_url=None,
    )
    _install_docs(app)
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
