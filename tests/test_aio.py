"""stopcock.arun and stopcock.astream: cancelling the task stops the run, for both libraries; a real
uvicorn server streams tokens with FastAPI, and a client that disconnects stops the run."""

from __future__ import annotations

import asyncio
import socket
import threading
from contextlib import contextmanager

import anyio
import httpx
import pytest
import torch
import uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from test_stream_text import Pause  # tests/ is on sys.path under pytest

import stopcock
from stopcock.stream import Done, Step, TextChunk

BOUND = 60  # seconds: a hang guard for waits, never a timing assertion
pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture
def text_call(text_model, tokenizer):
    inputs = tokenizer(["Hello"], return_tensors="pt")
    return (text_model,), {**inputs, "tokenizer": tokenizer, "max_new_tokens": 200, "do_sample": False}


@pytest.fixture
def image_call(image_pipe):
    return (image_pipe, "a cat"), {"num_inference_steps": 50, "generator": torch.Generator().manual_seed(0)}


@pytest.fixture(params=["text", "image"])
def call(request):
    return request.getfixturevalue(f"{request.param}_call")


def _clean(target) -> bool:
    """No hooks left on any model of the target, and diffusers' interrupt flag reset."""
    models = (
        [target]
        if isinstance(target, torch.nn.Module)
        else [c for c in target.components.values() if isinstance(c, torch.nn.Module)]
    )
    hooks = any(m._forward_pre_hooks or m._forward_hooks for model in models for m in model.modules())
    return not hooks and not getattr(target, "_interrupt", False)


def test_arun_under_plain_asyncio(text_model, tokenizer):
    inputs = tokenizer(["Hello"], return_tensors="pt")
    kwargs = {**inputs, "tokenizer": tokenizer, "max_new_tokens": 8, "do_sample": False}
    outcome = asyncio.run(stopcock.arun(text_model, **kwargs))
    assert outcome.reason == "length" and outcome.steps == 8
    assert torch.equal(outcome.output, stopcock.run(text_model, **kwargs).output)


async def test_cancelling_arun_stops_the_run_and_waits_for_it(call):
    (target, *args), kwargs = call
    pause = Pause(at=3)
    task = asyncio.create_task(stopcock.arun(target, *args, on_step=pause, **kwargs))
    await pause.reached.wait_async()
    task.cancel()
    # One pass of the loop: the cancelled task runs before this one resumes (FIFO), and it stops
    # the run synchronously when the CancelledError reaches arun.
    await asyncio.sleep(0)
    pause.release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    steps_when_cancelled = list(pause.steps)
    assert pause.worker_ended()
    # the stop came while step 3's on_step held the worker: it ends step 3 (on_step runs before the check)
    assert pause.steps == steps_when_cancelled == [1, 2, 3]
    assert _clean(target)


async def test_arun_raises_the_runs_exception(text_call):
    (target,), kwargs = text_call

    def on_step(state):
        if state.step == 2:
            raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        await stopcock.arun(target, on_step=on_step, **kwargs)
    assert _clean(target)


async def test_stop_from_the_event_loop_and_wait_async(text_call):
    (target,), kwargs = text_call
    signal, pause = stopcock.StopSignal(), Pause(at=2)
    signal.on_stop(pause.release.set)
    task = asyncio.create_task(stopcock.arun(target, stop=signal, on_step=pause, **kwargs))
    await pause.reached.wait_async()
    assert signal.stop("user")  # on the loop's thread
    assert await signal.wait_async() == "user"
    outcome = await task
    assert outcome.stopped and outcome.reason == "user" and outcome.steps == 2  # seen at the paused step


async def test_astream_text_and_image(text_call, image_call, tokenizer):
    (target,), kwargs = text_call
    events = [e async for e in stopcock.astream(target, **{**kwargs, "max_new_tokens": 16})]
    outcome = events[-1].outcome
    new = outcome.output[0, kwargs["input_ids"].shape[1] :]
    assert "".join(e.text for e in events if isinstance(e, TextChunk)) == tokenizer.decode(
        new, skip_special_tokens=True
    )
    (pipe, prompt), kwargs = image_call
    async with stopcock.astream(pipe, prompt, **{**kwargs, "num_inference_steps": 4}) as stream:
        events = [e async for e in stream]
    assert [e.step for e in events if isinstance(e, Step)] == [1, 2, 3, 4]
    assert isinstance(events[-1], Done) and events[-1].outcome.reason == "completed"


async def test_aclose_stops_the_run(call):
    (target, *args), kwargs = call
    pause = Pause(at=2)
    stream = stopcock.astream(target, *args, on_step=pause, **kwargs)
    stream.signal.on_stop(pause.release.set)
    assert isinstance(await stream.__anext__(), (TextChunk, Step))
    await pause.reached.wait_async()
    await stream.aclose()
    assert stream.outcome is not None and stream.outcome.reason == "cancelled"
    assert stream.outcome.steps == 2 and pause.steps == [1, 2]  # seen at the paused step
    assert pause.worker_ended() and _clean(target)
    assert [e async for e in stream] == []


async def test_cancelling_the_consuming_task_stops_the_stream(call):
    (target, *args), kwargs = call
    pause = Pause(at=3)
    stream = stopcock.astream(target, *args, on_step=pause, **kwargs)
    stream.signal.on_stop(pause.release.set)
    received = []
    consuming = asyncio.Event()  # a task cancelled before it ever ran could not close its stream

    async def consume():
        async for event in stream:
            received.append(event)
            consuming.set()

    task = asyncio.create_task(consume())
    await consuming.wait()
    await pause.reached.wait_async()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert pause.worker_ended()
    assert stream.outcome is not None and stream.outcome.reason == "cancelled" and stream.outcome.steps == 3
    assert pause.steps == [1, 2, 3] and _clean(target)  # seen at the paused step


async def test_anyio_cancel_scope_stops_the_stream(call):
    (target, *args), kwargs = call
    pause = Pause(at=2)
    stream = stopcock.astream(target, *args, on_step=pause, **kwargs)
    stream.signal.on_stop(pause.release.set)

    consuming = anyio.Event()  # a task cancelled before it ever ran could not close its stream

    async def consume():
        async for _event in stream:
            consuming.set()

    async with anyio.create_task_group() as group:
        group.start_soon(consume)
        await consuming.wait()
        await pause.reached.wait_async()
        group.cancel_scope.cancel()
    assert stream.outcome is not None and stream.outcome.reason == "cancelled" and stream.outcome.steps == 2
    assert pause.worker_ended() and _clean(target)


async def test_anyio_cancel_scope_around_arun(text_call):
    (target,), kwargs = text_call
    pause = Pause(at=2)
    finished = False
    with anyio.CancelScope() as scope:

        async def cancel_when_reached():
            await pause.reached.wait_async()
            scope.cancel()  # wakes the task awaiting arun first (FIFO), then the worker goes on
            asyncio.get_running_loop().call_soon(pause.release.set)

        async with anyio.create_task_group() as group:
            group.start_soon(cancel_when_reached)
            await stopcock.arun(target, on_step=pause, **kwargs)
            finished = True
    assert scope.cancelled_caught and not finished
    assert pause.worker_ended() and pause.steps == [1, 2]  # seen at the paused step


async def test_a_second_cancellation_does_not_cut_the_wait_short(text_call):
    (target,), kwargs = text_call
    pause = Pause(at=2)
    task = asyncio.create_task(stopcock.arun(target, on_step=pause, **kwargs))
    await pause.reached.wait_async()
    for _ in range(2):
        task.cancel()
        await asyncio.sleep(0)  # one pass of the loop: the task handles its cancellation
    assert not task.done()  # still waiting for the held worker
    pause.release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert pause.steps == [1, 2] and pause.worker_ended()  # seen at the paused step


async def test_a_stream_never_iterated_runs_nothing(text_call):
    (target,), kwargs = text_call
    steps: list[int] = []
    stream = stopcock.astream(target, on_step=lambda state: steps.append(state.step), **kwargs)

    async def consume():
        async for _event in stream:
            pass

    task = asyncio.create_task(consume())
    task.cancel()  # before the task ever ran: its stream is never iterated
    with pytest.raises(asyncio.CancelledError):
        await task
    await stream.aclose()  # nothing to stop: returns at once
    assert stream.outcome is None and stream.signal.reason == "cancelled"
    assert [e async for e in stream] == []  # closed: it can no longer start
    assert steps == [] and stream._thread.ident is None  # the worker thread was never started
    # a stream that is iterated starts its run then, and a stop asked before that is honoured
    early = stopcock.astream(target, **kwargs)
    early.stop("early")
    events = [e async for e in early]
    assert [type(e) for e in events] == [Done] and events[0].outcome.reason == "early"
    assert events[0].outcome.steps == 0


# -- a real server ------------------------------------------------------------------------------


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
        assert outcome.steps == 5 and pause.steps == [1, 2, 3, 4, 5]
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
        assert streams[0].outcome.reason == "cancelled" and streams[0].outcome.steps == step
