"""``examples/fastapi_app.py`` in a real uvicorn server, with httpx: a client that leaves the stream
stops its run; the blocking endpoint answers with the partial image at its own time limit.

The stream's run is held at a step (:mod:`tiny.slow`) until the server has received the client's
disconnect, so the run cannot end on its own first; the image model is made slow (every step takes
at least 50 ms), so a 1,000-step run cannot finish within its 0.3 s limit.
"""

from __future__ import annotations

import base64
import importlib.util
import io
import json
import queue
import threading
from pathlib import Path

import httpx
import pytest

from stopcock.server.testing import running
from tiny.slow import SlowLayer, slow_down

ROOT = Path(__file__).resolve().parent.parent
WAIT = 120
HOLD = 5  # the 0-based model call held in the stream's run


def _example():
    spec = importlib.util.spec_from_file_location("fastapi_app", ROOT / "examples" / "fastapi_app.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class DisconnectSpy:
    """ASGI middleware: ``seen`` is set once the app has received a client's ``http.disconnect``."""

    def __init__(self, app) -> None:
        self.app = app
        self.seen = threading.Event()

    async def __call__(self, scope, receive, send) -> None:
        async def spied():
            message = await receive()
            if message["type"] == "http.disconnect":
                self.seen.set()
            return message

        await self.app(scope, spied, send)


@pytest.fixture(scope="module")
def served(one_torch_thread):
    example = _example()
    image_pipe, text_pipe = example.demo_models()
    hold = slow_down(text_pipe.model, "transformer.h.0.mlp", SlowLayer(hold_at=HOLD))
    slow_down(image_pipe.unet, "conv_in", SlowLayer(seconds=0.05))
    outcomes: queue.Queue = queue.Queue()
    spy = DisconnectSpy(example.create_app(image_pipe, text_pipe, on_outcome=outcomes.put))
    try:
        with running(spy) as url:
            yield url, spy, hold, outcomes
    finally:
        hold.release.set()


@pytest.mark.timeout(WAIT * 2)
def test_a_client_that_leaves_the_stream_stops_its_run(served):
    url, spy, hold, outcomes = served
    with httpx.Client(base_url=url, timeout=WAIT) as client:
        params = {"prompt": "Beautiful is", "max_new_tokens": 500}
        with client.stream("GET", "/stream", params=params) as answer:
            assert answer.status_code == 200
            assert answer.headers["content-type"].startswith("text/event-stream")
            lines = answer.iter_lines()
            assert next(line for line in lines if line.startswith("event: ")) == "event: text"
            assert json.loads(next(lines).removeprefix("data: "))["text"]
            assert hold.entered.wait(WAIT)  # the run is held in a step: it cannot end on its own
        # leaving the block closed the connection, with the run still going
        assert spy.seen.wait(WAIT)
        hold.release.set()
        outcome = outcomes.get(timeout=WAIT)
        assert outcome.stopped and outcome.reason == "cancelled"
        assert HOLD < outcome.steps < 500
        assert client.get("/runs").json()[-1] == {"kind": "text", **outcome.summary()}


@pytest.mark.timeout(WAIT * 2)
def test_the_blocking_endpoint_returns_the_partial_image_at_its_time_limit(served):
    from PIL import Image

    url, _, _, outcomes = served
    answer = httpx.post(f"{url}/image", json={"prompt": "7", "steps": 1000, "timeout": 0.3}, timeout=WAIT)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    summary = body["outcome"]
    assert summary["stopped"] and summary["reason"] == "timeout" and summary["partial"] == "denoised"
    assert summary["steps"] < 1000 and summary["total_steps"] == 1000
    png = base64.b64decode(body["image"].removeprefix("data:image/png;base64,"))
    assert Image.open(io.BytesIO(png)).size == (16, 16)
    assert outcomes.get(timeout=WAIT).summary() == summary


def test_bad_requests_get_a_clear_error(served):
    url = served[0]
    answer = httpx.post(f"{url}/image", json={"steps": 0, "timeout": -1}, timeout=WAIT)
    assert answer.status_code == 422
    wrong = {tuple(e["loc"]) for e in answer.json()["detail"]}
    assert wrong == {("body", "steps"), ("body", "timeout")}
