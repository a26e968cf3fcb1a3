"""OpenAI-compatible endpoints over the same jobs: completions, chat completions, images.

Each request is a job; the response id is the job id behind a ``cmpl-``/``chatcmpl-`` prefix, and
the job API takes it as it is (``POST /v1/jobs/{response id}/stop`` stops it). When the client goes
away, streaming or not, the job is stopped with reason ``"disconnected"``: no orphan compute.
``stop`` sequences are cut from the returned text, as OpenAI does. ``finish_reason`` is ``"stop"``
for a stop sequence, end of text or a stop request, ``"length"`` for ``max_tokens``, a timeout or a
step limit. Each response also carries a ``stopcock`` object: the run's Outcome summary (reason,
steps, latency).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request

from .contract import JobSpec, JobView
from .deps import ApiError, EventStream, Owner, engine_of, until_done_or_gone
from .schemas import MIN_SAMPLING_TEMPERATURE, ChatRequest, CompletionRequest, ImageRequest

__all__ = ["StopTrimmer", "finish_reason", "openai"]

openai = APIRouter(prefix="/v1", tags=["openai"])

_LENGTH_REASONS = frozenset({"length", "max_steps", "timeout", "deadline"})


def finish_reason(reason: str | None, hit_stop: bool) -> str:
    return "length" if not hit_stop and reason in _LENGTH_REASONS else "stop"


class StopTrimmer:
    """Cuts streamed text at the first stop sequence, holding back a tail that may begin one."""

    def __init__(self, stops: list[str] | None) -> None:
        self.stops = stops or []
        self.pending = ""
        self.hit = False

    def feed(self, chunk: str) -> str:
        if self.hit:
            return ""
        self.pending += chunk
        cut = min((i for i in (self.pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.hit = True
            out, self.pending = self.pending[:cut], ""
            return out
        keep = max(
            (n for s in self.stops for n in range(1, len(s)) if self.pending.endswith(s[:n])), default=0
        )
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(out) :]
        return out

    def flush(self) -> str:
        out, self.pending = ("" if self.hit else self.pending), ""
        return out


def _model(request: Request, kind: str, asked: str | None) -> str:
    served = engine_of(request).models.get(kind)
    if served is None:
        raise ApiError(404, f"this server has no {kind} model", code="model_not_found")
    if asked is not None and asked != served["id"]:
        raise ApiError(
            404,
            f"model {asked!r} is not served here; use {served['id']!r} (see GET /v1/models)",
            code="model_not_found",
        )
    return served["id"]


def _repeatable(spec: JobSpec) -> bool:
    """Whether a run of the text job again gives the same text (it is greedy, or seeded)."""
    return spec.params["temperature"] < MIN_SAMPLING_TEMPERATURE or spec.params.get("seed") is not None


async def _final(request: Request, spec: JobSpec, who: str) -> tuple[JobView, dict[str, Any]]:
    engine = engine_of(request)
    view = await engine.submit(spec, who)
    view = await until_done_or_gone(request, engine, view.id, who)
    if view.state == "failed":
        raise ApiError(500, f"generation failed: {view.error}", "server_error", "generation_failed")
    return view, (await engine.result(view.id, who))["result"] or {}


def _usage(result: dict[str, Any]) -> dict[str, int]:
    prompt, completion = result.get("prompt_tokens", 0), result.get("completion_tokens", 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _text(request: Request, body: CompletionRequest | ChatRequest, who: str, chat: bool) -> Any:
    model = _model(request, "text", body.model)
    spec = body.spec()
    stops = spec.stop.get("stop_strings")
    object_ = "chat.completion" if chat else "text_completion"
    prefix = "chatcmpl-" if chat else "cmpl-"

    def choice(text: str | None, finish: str | None, delta: bool) -> dict[str, Any]:
        if not chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        if delta:
            return {"index": 0, "delta": {} if text is None else {"content": text}, "finish_reason": finish}
        return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}

    if not body.stream:
        view, result = await _final(request, spec, who)
        trimmer = StopTrimmer(stops)
        text = trimmer.feed(result.get("text", "")) + trimmer.flush()
        return {
            "id": prefix + view.id,
            "object": object_,
            "created": int(view.created),
            "model": model,
            "choices": [choice(text, finish_reason(view.reason, trimmer.hit), delta=False)],
            "usage": _usage(result),
            "stopcock": view.outcome,
        }

    engine = engine_of(request)
    view = await engine.submit(spec, who)
    chunk_object = "chat.completion.chunk" if chat else "text_completion"
    include_usage = bool((body.stream_options or {}).get("include_usage"))

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
        data = {
            "id": prefix + view.id,
            "object": chunk_object,
            "created": int(view.created),
            "model": model,
            "choices": choices,
            **extra,
        }
        return f"data: {json.dumps(data)}\n\n"

    done = False

    async def events() -> AsyncIterator[str]:
        nonlocal done
        trimmer = StopTrimmer(stops)
        streamed = sent = 0  # characters of the job's text: streamed here; sent by its current run
        if chat:
            yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
        async for event in engine.events(view.id, who):
            if event.type == "text":
                piece = event.data["text"]
                sent += len(piece)
                if sent > streamed:  # the part not streamed yet (a re-run sends its text again)
                    text = trimmer.feed(piece[len(piece) - (sent - streamed) :])
                    streamed = sent
                    if text:
                        yield chunk([choice(text, None, delta=True)])
            elif event.type == "requeued":
                # its model replica was lost (Ray engine): the job runs again and sends its text again
                # from text_kept; a stream cannot take text back, so it goes on only when the re-run's
                # text is the same (greedy, or seeded)
                sent = event.data["text_kept"]
                if streamed > sent and not _repeatable(spec):
                    message = (
                        f"the model replica running this job was lost ({event.data['why']}) and the job runs"
                        " again, with other text than was streamed (it samples without a seed): pass a seed"
                        " to have a stream go on through such a loss"
                    )
                    yield f"data: {json.dumps({'error': {'message': message, 'type': 'server_error'}})}\n\n"
                    return
            elif event.type == "done":
                done = True
                if event.data["state"] == "failed":
                    error = {"message": f"generation failed: {event.data['error']}", "type": "server_error"}
                    yield f"data: {json.dumps({'error': error})}\n\n"
                    return
                rest = trimmer.flush()
                if rest:
                    yield chunk([choice(rest, None, delta=True)])
                final = choice(None, finish_reason(event.data["reason"], trimmer.hit), delta=True)
                yield chunk([final], stopcock=event.data["outcome"])
                if include_usage:
                    result = (await engine.result(view.id, who))["result"] or {}
                    yield chunk([], usage=_usage(result))
                yield "data: [DONE]\n\n"

    async def stop_if_unfinished() -> None:
        if not done:  # the client went away: stop the generation, without waiting for it
            await engine.stop(view.id, who, "disconnected", wait=False)

    return EventStream(events(), stop_if_unfinished)


@openai.post("/completions")
async def completions(request: Request, who: Owner, body: CompletionRequest) -> Any:
    """OpenAI ``completions``: ``prompt``, ``max_tokens``, ``stop``, ``stream``, ``temperature``..."""
    return await _text(request, body, who, chat=False)


@openai.post("/chat/completions")
async def chat_completions(request: Request, who: Owner, body: ChatRequest) -> Any:
    """OpenAI ``chat.completions``, with the model's chat template (or a plain transcript)."""
    return await _text(request, body, who, chat=True)


@openai.post("/images/generations")
async def images(request: Request, who: Owner, body: ImageRequest) -> dict[str, Any]:
    """OpenAI ``images.generate`` with ``response_format="b64_json"``; extensions: steps, seed."""
    _model(request, "image", body.model)
    view, result = await _final(request, body.spec(), who)
    data = [{"b64_json": result["image"], "revised_prompt": None}] if result.get("image") else []
    return {"created": int(view.created), "data": data, "stopcock": view.outcome}
