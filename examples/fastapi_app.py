"""A FastAPI app: a streaming endpoint whose client going away stops the run, and a blocking one that
returns the partial result when its own time limit is up.

    pip install "stopcock[all]"           # transformers, diffusers, and the server: FastAPI, uvicorn
    python examples/fastapi_app.py        # serves on http://127.0.0.1:8000
    curl -N "http://127.0.0.1:8000/stream?prompt=Beautiful%20is"       # Ctrl+C: the run stops
    curl -X POST http://127.0.0.1:8000/image -H "Content-Type: application/json" \\
         -d '{"prompt": "7", "steps": 1000, "timeout": 0.5}'           # the image as it was at 0.5 s
    curl http://127.0.0.1:8000/runs                                     # how the last runs ended

``GET /stream`` sends the text as server-sent events (``event: text``, then ``event: done`` with the
Outcome). :func:`stopcock.astream` runs the model in a worker thread; when the client disconnects,
Starlette cancels the response, and the cancellation stops the run at its next step (reason
``"cancelled"``) and waits for it: no compute outlives its request. ``POST /image`` awaits
:func:`stopcock.arun` with ``stop=stopcock.timeout(...)``: at the time limit the run ends at its next
step and the answer carries the image denoised so far, with the Outcome saying so.

It runs offline on the demo models that ship with stopcock; pass your own to :func:`create_app`.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

import torch
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field

import stopcock
from stopcock.loading import load_image_pipeline, load_text_model, resolve_model


class ImageRequest(BaseModel):
    prompt: str = Field("7", description="for the demo model, a digit '0' to '9'")
    steps: int = Field(50, ge=1, le=1000, description="denoising steps")
    timeout: float = Field(10.0, gt=0, le=600, description="seconds; then the partial image is returned")
    seed: int = 0


def demo_models() -> tuple[Any, Any]:
    """The shipped demo models: a diffusers pipeline (prompts "0" to "9") and a text-generation pipeline."""
    from transformers import pipeline

    torch.set_num_threads(1)  # tiny models: more threads only add synchronisation
    model, tokenizer = load_text_model(resolve_model(None, "text"), quiet=True)
    return load_image_pipeline(resolve_model(None, "image"), quiet=True), pipeline(
        "text-generation", model=model, tokenizer=tokenizer
    )


def create_app(
    image_pipe: Any = None,
    text_pipe: Any = None,
    on_outcome: Callable[[stopcock.Outcome], object] | None = None,
) -> FastAPI:
    """The app over a diffusers pipeline and a text-generation pipeline (default: the demo models).
    ``on_outcome(outcome)`` is called as each run ends (for logs or metrics)."""
    if image_pipe is None or text_pipe is None:
        image_pipe, text_pipe = demo_models()
    app = FastAPI(title="stopcock with FastAPI")
    runs: deque[dict[str, Any]] = deque(maxlen=20)
    # one run per model at a time: a pipeline is not safe to call from two threads at once
    image_lock, text_lock = asyncio.Lock(), asyncio.Lock()

    def ended(kind: str, outcome: stopcock.Outcome) -> None:
        runs.append({"kind": kind, **outcome.summary()})
        if on_outcome is not None:
            on_outcome(outcome)

    @app.get("/stream")
    async def stream(prompt: str = "Beautiful is", max_new_tokens: int = 200) -> StreamingResponse:
        async def events() -> AsyncIterator[str]:
            async with text_lock:
                run = stopcock.astream(
                    text_pipe, prompt, max_new_tokens=max_new_tokens, return_full_text=False
                )
                try:
                    async with run:  # a cancelled response stops the run and waits for it
                        async for event in run:
                            if isinstance(event, stopcock.TextChunk):
                                yield _sse("text", {"text": event.text, "step": event.step})
                            elif isinstance(event, stopcock.Done):
                                yield _sse("done", event.outcome.summary())
                finally:
                    if run.outcome is not None:
                        ended("text", run.outcome)

        return StreamingResponse(
            events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    @app.post("/image")
    async def image(request: ImageRequest) -> dict[str, Any]:
        async with image_lock:
            outcome = await stopcock.arun(
                image_pipe, request.prompt, num_inference_steps=request.steps, partial="denoised",
                generator=torch.Generator().manual_seed(request.seed), stop=stopcock.timeout(request.timeout),
            )
        ended("image", outcome)
        png = io.BytesIO()
        outcome.output.images[0].save(png, format="PNG")
        data = base64.b64encode(png.getvalue()).decode()
        return {"outcome": outcome.summary(), "image": f"data:image/png;base64,{data}"}

    @app.get("/runs")
    async def recent() -> list[dict[str, Any]]:
        """How the last runs ended, newest last."""
        return list(runs)

    return app


def _sse(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"


if __name__ == "__main__":
    import uvicorn

    uvicorn.run(create_app(), host="127.0.0.1", port=8000)
