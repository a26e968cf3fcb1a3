"""The OpenAI-compatible endpoints, driven by the official ``openai`` package against a real server."""

from __future__ import annotations

import base64
import io

import httpx
import openai
import pytest
from PIL import Image

from stopcock.server.openai_api import StopTrimmer, finish_reason
from stopcock.server.testing import serving, sse_data

KEY = "test-key"


@pytest.fixture(scope="module")
def server(server_backends, one_torch_thread):
    options = {"concurrency": 1, "queue_size": 8, "step_delay": 0.01}
    with serving(server_backends, api_keys=[KEY], **options) as (url, engine):
        yield url, engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key=KEY, max_retries=0)


def test_models_are_listed(client):
    assert {m.id for m in client.models.list()} == {"tiny-text", "tiny-sd"}


def test_completion_with_stop_sequence(client):
    full = client.completions.create(
        model="tiny-text", prompt="Once upon a time", max_tokens=24, temperature=0
    )
    choice = full.choices[0]
    assert choice.finish_reason == "length" and full.usage.completion_tokens == 24 and choice.text
    stop = choice.text[len(choice.text) // 2 :][:2]  # a piece of the greedy text: it must stop there
    cut = client.completions.create(
        model="tiny-text", prompt="Once upon a time", max_tokens=24, temperature=0, stop=[stop]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == choice.text[: choice.text.index(stop)]  # the stop sequence is not returned
    assert cut.stopcock["reason"] == "stop_string" and cut.stopcock["steps"] < 24  # type: ignore[attr-defined]


def test_streamed_completion_equals_the_whole(client):
    whole = client.completions.create(model="tiny-text", prompt="Hello", max_tokens=16, temperature=0)
    chunks = list(
        client.completions.create(
            model="tiny-text", prompt="Hello", max_tokens=16, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_chat_completion_streamed_and_not(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    reply = client.chat.completions.create(model="tiny-text", messages=messages, max_tokens=10, temperature=0)
    assert reply.choices[0].message.role == "assistant" and reply.choices[0].finish_reason == "length"
    stream = client.chat.completions.create(
        model="tiny-text",
        messages=messages,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reply.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 10


def test_image_generation(client):
    response = client.images.generate(
        prompt="a red square", model="tiny-sd", response_format="b64_json", extra_body={"steps": 3, "seed": 1}
    )
    image = Image.open(io.BytesIO(base64.b64decode(response.data[0].b64_json)))
    assert image.size[0] > 0 and response.stopcock["steps"] == 3  # type: ignore[attr-defined]


def test_bad_requests_are_4xx_errors_the_client_understands(client):
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.UnprocessableEntityError, match="echo"):
        client.completions.create(model="tiny-text", prompt="x", echo=True)
    with pytest.raises(openai.UnprocessableEntityError, match="n"):
        client.completions.create(model="tiny-text", prompt="x", n=2)
    with pytest.raises(openai.UnprocessableEntityError, match="b64_json"):
        client.images.generate(prompt="x", response_format="url")
    with pytest.raises(openai.UnprocessableEntityError, match="size"):
        client.images.generate(prompt="x", size="1000x1000")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=str(client.base_url), api_key="wrong", max_retries=0).models.list()


def test_a_streaming_client_that_disconnects_stops_its_generation(server):
    url, engine = server
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "tiny-text", "prompt": "Once", "max_tokens": 1000, "stream": True, "temperature": 0}
    with httpx.Client(base_url=url, headers=headers, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            first = next(sse_data(lines))
            for _ in range(3):
                next(sse_data(lines))
        job = first["id"].removeprefix("cmpl-")
        # the job's own event stream ends with its final state
        with http.stream("GET", f"/v1/jobs/{job}/events") as events:
            done = next(e for e in sse_data(events.iter_lines()) if e["type"] == "done")
    assert (done["state"], done["reason"]) == ("stopped", "disconnected")
    assert 4 <= done["stop_step"] <= done["step"] <= done["stop_step"] + 1
    assert engine.stats()["running"] == 0


def test_the_job_api_stops_an_openai_request(server, client):
    url, _ = server
    stream = client.completions.create(
        model="tiny-text", prompt="Once", max_tokens=1000, stream=True, temperature=0
    )
    first = next(iter(stream))
    job = first.id.removeprefix("cmpl-")
    stopped = httpx.post(f"{url}/v1/jobs/{job}/stop", headers={"Authorization": f"Bearer {KEY}"}).json()
    chunks = list(stream)
    assert stopped["state"] == "stopped" and chunks[-1].choices[0].finish_reason == "stop"
    outcome = chunks[-1].stopcock  # type: ignore[attr-defined]
    assert (outcome["reason"], outcome["steps"]) == ("user", stopped["step"])
    assert stopped["stop_step"] <= stopped["step"] <= stopped["stop_step"] + 1


@pytest.mark.parametrize(
    ("chunks", "stops", "expected", "hit"),
    [
        (["Hel", "lo wor", "ld"], ["wor"], "Hello ", True),
        (["ab", "c"], ["bd"], "abc", False),
        (["a", "b", "c", "d"], ["cd", "bc"], "a", True),
        (["x\n", "\ny"], ["\n\n"], "x", True),
        (["plain"], None, "plain", False),
    ],
)
def test_stop_trimmer_cuts_at_the_first_stop_across_chunks(chunks, stops, expected, hit):
    trimmer = StopTrimmer(stops)
    assert "".join(trimmer.feed(c) for c in chunks) + trimmer.flush() == expected
    assert trimmer.hit is hit


def test_finish_reasons():
    assert [
        finish_reason(r, False) for r in ("eos", "stop_string", "user", "length", "timeout", "max_steps")
    ] == ["stop", "stop", "stop", "length", "length", "length"]
    assert finish_reason("length", True) == "stop"


def test_a_non_streaming_client_that_gives_up_stops_its_generation(server):
    url, _ = server
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {
        "model": "tiny-text",
        "prompt": "Once",
        "max_tokens": 1000,
        "temperature": 0,
    }  # greedy: no early eos
    with httpx.Client(base_url=url, headers=headers, timeout=60) as http:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up long before the job could finish
            http.post("/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.5))
        job = http.get("/v1/jobs", params={"limit": 1}).json()["data"][0]["id"]
        with http.stream("GET", f"/v1/jobs/{job}/events") as events:
            done = next(e for e in sse_data(events.iter_lines()) if e["type"] == "done")
    assert (done["state"], done["reason"]) == ("stopped", "disconnected")
    assert done["stop_step"] <= done["step"] <= done["stop_step"] + 1
