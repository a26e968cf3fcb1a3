"""The generation service: a job API with per-job stop, an OpenAI-compatible API and a web page.

``stopcock serve`` runs it (see :mod:`stopcock.server.serve`); in code, build an engine over
backends and an app over the engine::

    from stopcock.server import LocalEngine, TextBackend, create_app
    engine = LocalEngine({"text": TextBackend.load("path/to/model")}, concurrency=1, queue_size=16)
    app = create_app(engine, api_keys=["secret"])   # serve with uvicorn; engine.close() at the end

Names are imported on first use, so that the CLI can register ``serve`` without importing FastAPI.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "create_app": "stopcock.server.app",
    "Engine": "stopcock.server.engine",
    "JobSpec": "stopcock.server.engine",
    "LocalEngine": "stopcock.server.engine",
    "TextBackend": "stopcock.server.backends",
    "ImageBackend": "stopcock.server.backends",
    "add_parser": "stopcock.server.serve",
    "main": "stopcock.server.serve",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'stopcock.server' has no attribute {name!r}")


__all__ = list(_LAZY)
