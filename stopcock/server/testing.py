"""Run an app on loopback in a background thread: for tests, benchmarks and notebooks."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .engine import LocalEngine

__all__ = ["running", "serving", "sse_data"]


@contextlib.contextmanager
def running(app: Any, *, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Serve ``app`` with uvicorn on ``host`` (a free port by default); yields the base URL.

    On exit the server shuts down (open streams get 3 seconds) and its thread is joined.
    """
    import uvicorn

    class Server(uvicorn.Server):
        ready = threading.Event()

        async def startup(self, sockets: Any = None) -> None:
            try:
                await super().startup(sockets)
            finally:
                self.ready.set()

    server = Server(
        uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=3)
    )
    thread = threading.Thread(target=server.run, name="stopcock-uvicorn", daemon=True)
    thread.start()
    server.ready.wait()
    if not server.started:
        thread.join()
        raise RuntimeError(f"uvicorn could not start on {host}:{port}")
    bound = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{bound}"
    finally:
        server.should_exit = True
        thread.join()


@contextlib.contextmanager
def serving(
    backends: Mapping[str, Any], *, api_keys: Iterable[str] = (), **engine_options: Any
) -> Iterator[tuple[str, LocalEngine]]:
    """A :class:`LocalEngine` over ``backends`` served on loopback; yields (base URL, engine)."""
    from .app import create_app
    from .engine import LocalEngine

    engine = LocalEngine(backends, **engine_options)
    try:
        with running(create_app(engine, api_keys=api_keys)) as url:
            try:
                yield url, engine
            finally:
                engine.close()  # first: open streams end with their jobs' outcome
    finally:
        engine.close()


def sse_data(lines: Iterable[str]) -> Iterator[Any]:
    """The JSON ``data:`` payloads of a server-sent event stream, given its lines."""
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])
