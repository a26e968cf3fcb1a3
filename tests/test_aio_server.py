"""A real uvicorn server streams tokens with FastAPI; a client that disconnects stops the run."""

from __future__ import annotations

import socket
import threading
from contextlib import contextmanager

import httpx
import pytest
import torch
import uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

import stopcock
from stopcock.stream import TextChunk

BOUND = 60  # seconds: a hang guard for waits, never a timing assertion


class Pause:
    """An on_step that records steps and holds the worker at step ``at`` until ``release``."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.steps: list[int] = []
        self.workers: list[threading.Thread] = []
        self.reached = threading.Event()
        self.release = threading.Event()

    def __call__(self, state) -> None:
        self.steps.append(state.step)
        self.workers.append(threading.current_thread())
        if state.step == self.at:
            self.reached.set()
            assert self.release.wait(BOUND)


def make_app(model, tokenizer, pause: Pause, streams: list) -> FastAPI:
    app = FastAPI()

    @app.get("/generate")
    async def generate(prompt: str, max_new_tokens: int = 200) -> StreamingResponse:
        inputs = tokenizer([prompt], return_tensors="pt")
        events = stopcock.astream(
            model,
            **inputs,
            tokenizer=tokenizer,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            on_step=pause,
        )
        events.signal.on_stop(pause.release.set)  # the held worker goes on once the stop is requested
        streams.append(events)

        async def body():
            async with events:
                async for event in events:
                    if isinstance(event, TextChunk):
                        yield event.text

        return StreamingResponse(body(), media_type="text/plain")

    return app


@contextmanager
def serving(app: FastAPI):
    """uvicorn on a socket bound to 127.0.0.1 beforehand: clients can connect at once."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn-test")
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(BOUND)
        sock.close()
        assert not thread.is_alive()


def test_client_disconnect_stops_the_run_within_one_step(text_model, tokenizer):
    torch.set_num_threads(1)
    pause, streams = Pause(at=5), []
    with (
        serving(make_app(text_model, tokenizer, pause, streams)) as url,
        httpx.Client(timeout=BOUND) as client,
    ):
        with client.stream("GET", f"{url}/generate", params={"prompt": "Hello"}) as response:
            assert response.status_code == 200
            chunks = response.iter_raw()  # kept: dropping this generator would close the response
            assert next(chunks)  # tokens are flowing
            assert pause.reached.wait(BOUND)  # the run is at step 5, mid-stream
        # leaving the block closed the connection before the end of the response
        worker = pause.workers[0]
        worker.join(BOUND)
        assert not worker.is_alive()
        outcome = streams[0].outcome
        assert outcome is not None and outcome.stopped and outcome.reason == "cancelled"
        # the step under way when the client left is the last one: 200 were asked for
        assert outcome.steps == 6 and pause.steps == [1, 2, 3, 4, 5, 6]
        assert not any(m._forward_pre_hooks for m in text_model.modules())
        # the server still serves: a full run completes
        pause.at = -1
        text = client.get(f"{url}/generate", params={"prompt": "Hello", "max_new_tokens": 5}).text
        assert streams[1].outcome.reason == "length" and streams[1].outcome.steps == 5
        new = streams[1].outcome.output[0, len(tokenizer("Hello")["input_ids"]) :]
        assert text == tokenizer.decode(new, skip_special_tokens=True)


@pytest.mark.parametrize("step", [1, 3])
def test_disconnect_at_other_steps(text_model, tokenizer, step):
    pause, streams = Pause(at=step), []
    with (
        serving(make_app(text_model, tokenizer, pause, streams)) as url,
        httpx.Client(timeout=BOUND) as client,
    ):
        with client.stream("GET", f"{url}/generate", params={"prompt": "Hello"}) as response:
            assert response.status_code == 200
            assert pause.reached.wait(BOUND)
        pause.workers[0].join(BOUND)
        assert not pause.workers[0].is_alive()
        assert streams[0].outcome.reason == "cancelled" and streams[0].outcome.steps == step + 1
