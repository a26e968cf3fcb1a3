"""The server under hostile input and concurrency (issue 11, items 5 to 7): never a 5xx, every refusal
a 4xx with the JSON error shape; a seed gives the same image whatever else runs; the OpenAI
response ids work with the job API as they are. On a real uvicorn server with the tiny models.

Bounded here; ``make soak`` (``STOPCOCK_SOAK=1``) runs more and prints the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

from stopcock.errors import UserError
from stopcock.server.app import create_app
from stopcock.server.contract import JobSpec, job_id_of
from stopcock.server.engine import LocalEngine
from stopcock.server.jobs import new_id
from stopcock.server.schemas import ImageParameters
from stopcock.server.serve import read_keys
from stopcock.server.testing import serving

BOUND = 60  # seconds: a hang guard, never a timing assertion

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def client(server_backends) -> Iterator[httpx.Client]:
    with (
        serving(server_backends, concurrency=1, queue_size=8) as (url, _),
        httpx.Client(base_url=url, timeout=BOUND) as http,
    ):
        yield http


def _error_shaped(response: httpx.Response) -> bool:
    body = response.json()
    return isinstance(body.get("error"), dict) and {"message", "type", "code"} <= set(body["error"])


def _finished_job(client: httpx.Client) -> str:
    job = client.post("/v1/jobs", json={"kind": "text", "prompt": "Hi", "parameters": {"max_tokens": 2}})
    assert job.status_code == 201, job.text
    client.get(f"/v1/jobs/{job.json()['id']}/events").raise_for_status()  # the stream ends with the job
    return str(job.json()["id"])


# -- headers ------------------------------------------------------------------------------------------
HOSTILE_EVENT_IDS = [
    "9" * 5000, "\xb2", "\xb9", "1\xb2", "\u0663".encode().decode("latin-1"), "-1", "+1", "1 x", "1.5",
    "0x10", "9" * 19, "1e3", "\u0661\u0662".encode().decode("latin-1"), "NaN", "1_000",
]  # 5,000 digits, Unicode digits (superscripts, Arabic-Indic as their UTF-8 bytes), signs, ...


def _random_event_ids(rng: random.Random, n: int) -> list[str]:
    alphabet = "0123456789" * 4 + "\xb2\xb3\xb9\xbc-+ ._xe\u00e9"
    sizes = [1, 2, 18, 19, 40, 4301, 5000]
    values = ("".join(rng.choice(alphabet) for _ in range(rng.choice(sizes))).strip() for _ in range(n))
    return [v or "x" for v in values]  # a header value has no white space at its ends


def test_hostile_last_event_ids_are_4xx_with_the_json_error(client, figures):
    job = _finished_job(client)
    values = HOSTILE_EVENT_IDS + _random_event_ids(random.Random(0), figures.trials(ci=60, soak=2000))
    statuses: dict[int, int] = {}
    for value in values:
        response = client.get(f"/v1/jobs/{job}/events", headers=[(b"last-event-id", value.encode("latin-1"))])
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        if value.isascii() and value.isdigit() and len(value) <= 18:
            assert response.status_code == 200  # a valid id: resumed after it (nothing left here)
        else:
            assert response.status_code == 422 and _error_shaped(response), (value[:40], response.text)
    five = sum(n for status, n in statuses.items() if status >= 500)
    figures.record("hostile Last-Event-ID headers", len(values), "requests", failures={"server_errors": five})
    assert five == 0
    resumed = client.get(f"/v1/jobs/{job}/events", headers={"Last-Event-ID": "1"})
    assert "id: 1\n" not in resumed.text and "event: done" in resumed.text  # resumed after event 1
    assert client.get(f"/v1/jobs/{job}/events", params={"after": "9" * 5000}).status_code == 422


def test_a_content_length_of_thousands_of_digits_is_a_413(server_backends):
    """Through ASGI as any server may deliver it (uvicorn's own parser refuses it first, with a 400)."""
    engine = LocalEngine(server_backends, concurrency=1, queue_size=1)
    app = create_app(engine)
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": "/v1/jobs", "raw_path": b"/v1/jobs", "query_string": b"", "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"9" * 5000)],
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
    }
    try:
        asyncio.run(app(scope, receive, send))  # type: ignore[arg-type]
    finally:
        engine.close()
    assert sent[0]["status"] == 413
    assert json.loads(sent[1]["body"])["error"]["code"] == "body_too_large"


# -- bodies: strict numbers, tiny temperatures ----------------------------------------------------------
@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/completions", {"model": "tiny-text", "prompt": "Hi", "max_tokens": True}, "max_tokens"),
        ("/v1/completions", {"model": "tiny-text", "prompt": "Hi", "temperature": True}, "temperature"),
        ("/v1/completions", {"model": "tiny-text", "prompt": "Hi", "max_tokens": 2.0}, "max_tokens"),
        ("/v1/chat/completions", {"model": "tiny-text", "messages": [{"role": "user", "content": "Hi"}],
                                  "max_completion_tokens": False}, "max_completion_tokens"),
        ("/v1/jobs", {"kind": "text", "prompt": "Hi", "parameters": {"max_tokens": True}}, "max_tokens"),
        ("/v1/jobs", {"kind": "text", "prompt": "Hi", "parameters": {"seed": "5"}}, "seed"),
        ("/v1/jobs", {"kind": "image", "prompt": "Hi", "parameters": {"steps": 2.0}}, "steps"),
        ("/v1/jobs", {"kind": "text", "prompt": "Hi", "stop": {"max_steps": True}}, "max_steps"),
        ("/v1/images/generations", {"prompt": "Hi", "steps": True}, "steps"),
    ],
)
def test_numeric_fields_take_numbers_of_their_type_only(client, path, body, field):
    response = client.post(path, json=body)
    assert response.status_code == 422 and _error_shaped(response), response.text
    assert field in response.json()["error"]["message"]


def test_integers_are_still_numbers_for_float_fields(client):
    body = {"kind": "text", "prompt": "Hi", "parameters": {"max_tokens": 2, "temperature": 1, "top_p": 1}}
    assert client.post("/v1/jobs", json=body).status_code == 201


@pytest.mark.parametrize("temperature", [1e-320, 5e-324, 1e-40, 1e-6])
def test_tiny_temperatures_decode_greedily(client, temperature):
    def completion(t: float) -> httpx.Response:
        body = {"model": "tiny-text", "prompt": "Once upon a time", "max_tokens": 8, "temperature": t}
        return client.post("/v1/completions", json={**body, "seed": 1})

    tiny, greedy = completion(temperature), completion(0)
    assert tiny.status_code == 200, tiny.text
    assert tiny.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
    job = client.post("/v1/jobs", json={"kind": "text", "prompt": "Hi",
                                        "parameters": {"max_tokens": 4, "temperature": temperature}})
    events = client.get(f"/v1/jobs/{job.json()['id']}/events").text
    done = json.loads(events.rsplit("event: done\ndata: ", 1)[1])
    assert done["state"] == "completed", done


# -- ids ---------------------------------------------------------------------------------------------
def test_openai_response_ids_work_with_the_job_api_as_they_are(client):
    text = client.post("/v1/completions", json={"model": "tiny-text", "prompt": "Hi", "max_tokens": 3})
    chat = client.post("/v1/chat/completions", json={
        "model": "tiny-text", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
    for response, prefix in ((text, "cmpl-"), (chat, "chatcmpl-")):
        response_id = response.json()["id"]
        assert response_id.startswith(prefix)
        job = client.get(f"/v1/jobs/{response_id}")
        assert job.status_code == 200 and job.json()["id"] == response_id.removeprefix(prefix)
        stopped = client.post(f"/v1/jobs/{response_id}/stop")
        assert stopped.status_code == 200 and stopped.json()["state"] == "completed"  # it had ended
        assert client.get(f"/v1/jobs/{response_id}/result").json()["job"]["id"] == job.json()["id"]
        assert "event: done" in client.get(f"/v1/jobs/{response_id}/events").text
    assert client.get("/v1/jobs/cmpl-nope").status_code == 404


def test_job_ids_never_start_with_a_dash_nor_with_a_response_prefix(client):
    ids = [new_id() for _ in range(20_000)] + [_finished_job(client)]
    assert not [i for i in ids if not i[0].isalnum() or job_id_of(i) != i]
    assert len(set(ids)) == len(ids) and min(map(len, ids)) == 24  # 144 random bits, URL-safe


# -- keys file -------------------------------------------------------------------------------------------
def test_a_keys_file_allows_trailing_comments_and_refuses_keys_with_spaces(tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text("# the team\nalice-key  # Alice\nbob#key\n\tcarol-key\t# Carol, tab-separated\n\n")
    assert read_keys(argparse.Namespace(api_keys_file=str(keys), api_key=None)) == [
        "alice-key", "bob#key", "carol-key"]
    keys.write_text("alice-key\nbob key # a key with a space\n")
    with pytest.raises(UserError, match="line 2: a key cannot hold spaces"):
        read_keys(argparse.Namespace(api_keys_file=str(keys), api_key=None))


# -- concurrent lanes (item 6) ---------------------------------------------------------------------------
def test_lanes_share_the_models_and_nothing_else(server_backends):
    image = [server_backends["image"].lane().pipe.components for _ in range(2)]
    text = [{"model": p.model, "tokenizer": p.tokenizer} for p in (server_backends["text"].lane().pipe
                                                                     for _ in range(2))]
    for one, two in (image, text):
        for name, part in one.items():
            if isinstance(part, torch.nn.Module):
                assert two[name] is part, name  # the weights are shared
            elif part is not None:
                assert two[name] is not part, name  # a scheduler, a tokenizer: each lane its own


def test_two_lanes_tokenize_at_once_as_each_does_alone(server_backends):
    """The mechanism behind item 6: each tokenizer call sets its tokenizer's padding; two lanes at
    once must not see each other's settings (a shared tokenizer got 0.7% of the calls wrong)."""
    backend = server_backends["image"]
    one, two = backend.lane().pipe.tokenizer, backend.lane().pipe.tokenizer
    padded = len(one("a cat", padding="max_length", max_length=one.model_max_length)["input_ids"])
    wrong: list[int] = []
    done = threading.Event()

    def pad() -> None:
        for _ in range(3000):
            n = len(one("a cat", padding="max_length", max_length=one.model_max_length, truncation=True)
                    ["input_ids"])
            if n != padded:
                wrong.append(n)
        done.set()

    def longest() -> None:
        while not done.is_set():
            two("a cat", padding="longest")

    threads = [threading.Thread(target=pad), threading.Thread(target=longest)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(BOUND)
    assert wrong == []


def _image(steps: int, seed: int, prompt: str = "a cat") -> JobSpec:
    return JobSpec("image", prompt, ImageParameters(steps=steps, seed=seed, previews=False).model_dump())


def test_a_seed_gives_the_same_image_whatever_else_runs(server_backends, figures):
    """``--concurrency 2``: same-seed jobs side by side, and beside other jobs, give the image of the
    job run alone, PNG byte for byte."""
    engine = LocalEngine({"image": server_backends["image"]}, concurrency=2, queue_size=64)

    async def png(*specs: JobSpec) -> list[str]:
        views = [await engine.submit(spec, "me") for spec in specs]
        results = []
        for view in views:
            await engine.wait(view.id, "me", timeout=BOUND)
            results.append((await engine.result(view.id, "me"))["result"]["image"])
        return results

    async def races(n: int) -> tuple[int, int]:
        (alone,) = await png(_image(2, 7))
        rng, differ = random.Random(0), 0
        for i in range(n):
            other = _image(rng.randint(1, 3), rng.randint(0, 9), rng.choice(["a dog", "", "a cat " * 9]))
            pair = [_image(2, 7), _image(2, 7)] if i % 2 else [_image(2, 7), other]
            differ += sum(image != alone for image in (await png(*pair))[: 2 if i % 2 else 1])
        return differ, n + n // 2

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # threads switch often: more interleavings per run
    try:
        with contextlib.closing(engine):
            differ, images = asyncio.run(races(figures.trials(ci=10, soak=400)))
    finally:
        sys.setswitchinterval(interval)
    figures.record("same-seed images under --concurrency 2", images, "images",
                   failures={"differ_from_alone": differ})
    assert differ == 0
