"""The generation service: a job API with per-job stop, an OpenAI-compatible API and a web page.

``stopcock serve`` runs it (see :mod:`stopcock.server.serve`); in code, build an engine over
backends and an app over the engine::

    from stopcock.server import LocalEngine, TextBackend, create_app
    engine = LocalEngine({"text": TextBackend.load("path/to/model")}, concurrency=1, queue_size=16)
    app = create_app(engine, api_keys=["secret"])   # serve with uvicorn; engine.close() at the end

Names are imported on first use, so that the CLI can register ``serve`` without importing FastAPI.
"""

from __future__ import annotations

from .._lazy import lazy_names

_LAZY = {
    "create_app": "stopcock.server.app",
    "Engine": "stopcock.server.contract",
    "JobSpec": "stopcock.server.contract",
    "LocalEngine": "stopcock.server.engine",
    "TextBackend": "stopcock.server.backends",
    "ImageBackend": "stopcock.server.backends",
    "add_parser": "stopcock.server.serve",
    "main": "stopcock.server.serve",
}

__getattr__ = lazy_names(__name__, _LAZY)


__all__ = list(_LAZY)
