"""Batched text jobs, checked from outside: a real uvicorn server, jobs submitted over HTTP at once.

Sixteen greedy jobs on the demo text model run as the rows of one ``generate`` (``batch_wait`` is
long enough for all sixteen to arrive, so they form exactly one batch, which ``/v1/health`` shows).
Each row's text equals the job's text run alone (one at a time, ``batch_size=1``); a stop by id
ends that row within one token while the others finish untouched; stop conditions and stop strings
end their rows with the reason a run alone gives.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from stopcock.server.backends import TextBackend
from stopcock.server.testing import serving

PROMPTS = [
    f"{w} is" for w in ("Beautiful", "Explicit", "Simple", "Complex", "Flat", "Sparse", "Readability",
                         "Special", "Errors", "x", "In the face", "There", "Now", "If the", "Namespaces",
                         "Although")
]
STOPS: list[dict[str, Any]] = [{}] * 13 + [
    {"stop_strings": ["\n"]}, {"max_steps": 5}, {"stop_strings": ["."]}
]
TOKENS = 64


def _body(prompt: str, stop: dict[str, Any]) -> dict[str, Any]:
    parameters = {"max_tokens": TOKENS, "temperature": 0}
    return {"kind": "text", "prompt": prompt, "parameters": parameters, "stop": stop}


def _submit(client: httpx.Client, body: dict[str, Any]) -> str:
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def _result(client: httpx.Client, job: str) -> dict[str, Any]:
    response = client.get(f"/v1/jobs/{job}/result", params={"wait": "true"}, timeout=120)
    assert response.status_code == 200, response.text
    return dict(response.json())


def _all_at_once(url: str, bodies: list[dict[str, Any]]) -> list[str]:
    with ThreadPoolExecutor(len(bodies)) as pool, httpx.Client(base_url=url, timeout=60) as client:
        return list(pool.map(lambda body: _submit(client, body), bodies))


@pytest.fixture(scope="module")
def text_backend(one_torch_thread):
    from stopcock.server.backends import load_backends

    return load_backends(None, None)["text"]


@pytest.fixture(scope="module")
def alone(text_backend: TextBackend) -> list[dict[str, Any]]:
    """Each job's result run alone, one after another."""
    with serving({"text": text_backend}, batch_size=1) as (url, _), httpx.Client(base_url=url) as client:
        return [_result(client, _submit(client, _body(p, s))) for p, s in zip(PROMPTS, STOPS, strict=True)]


@pytest.mark.timeout(300)
def test_sixteen_jobs_run_as_one_batch_with_the_texts_they_have_alone(text_backend, alone):
    with serving({"text": text_backend}, batch_size=16, batch_wait=30.0, queue_size=16) as (url, _):
        ids = _all_at_once(url, [_body(p, s) for p, s in zip(PROMPTS, STOPS, strict=True)])
        with httpx.Client(base_url=url) as client:
            batched = [_result(client, job) for job in ids]
            health = client.get("/v1/health").json()
    assert (health["batches_run"], health["batched_jobs"], health["batch_rows_running"]) == (1, 16, 0)
    for one, row in zip(alone, batched, strict=True):
        assert row["result"] == one["result"]
        for field in ("state", "reason", "step"):
            assert row["job"][field] == one["job"][field]
    reasons = [row["job"]["reason"] for row in batched]
    assert reasons[-3:] == ["stop_string", "max_steps", "stop_string"]
    assert reasons[:13] == ["length"] * 13


def _progress_at(client: httpx.Client, job: str, step: int, **params: str) -> None:
    """Follow the job's events until its progress reaches ``step`` (then close the stream)."""
    with client.stream("GET", f"/v1/jobs/{job}/events", params=params, timeout=60) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                assert event["type"] != "done", f"the job ended before step {step}"
                if event["type"] == "progress" and event["step"] >= step:
                    return
    raise AssertionError("the event stream ended early")


@pytest.mark.timeout(300)
def test_a_stop_by_id_ends_its_row_within_one_token_and_the_others_go_on(text_backend, alone):
    # the test-only throttle keeps the batch running until the stop has been sent
    options = {"batch_size": 16, "batch_wait": 30.0, "queue_size": 16, "step_delay": 0.02}
    with serving({"text": text_backend}, **options) as (url, _):
        ids = _all_at_once(url, [_body(p, {}) for p in PROMPTS])
        target = 5
        with httpx.Client(base_url=url, timeout=60) as client:
            _progress_at(client, ids[target], 8)
            stopped = client.post(f"/v1/jobs/{ids[target]}/stop").json()
            results = [_result(client, job) for job in ids]
    job = results[target]["job"]
    assert (job["state"], job["reason"]) == ("stopped", "user")
    assert stopped["state"] == "stopped"
    assert job["stop_step"] >= 8
    assert job["stop_step"] <= job["step"] <= job["stop_step"] + 1  # within one token of the stop
    text = results[target]["result"]["text"]
    assert text and text != alone[target]["result"]["text"]
    assert alone[target]["result"]["text"].startswith(text)  # the partial text of the same run
    others = [i for i in range(len(PROMPTS)) if i != target]
    for i in others:
        assert results[i]["job"]["state"] == "completed"
        assert results[i]["job"]["step"] == TOKENS
        if not STOPS[i]:
            assert results[i]["result"]["text"] == alone[i]["result"]["text"]


@pytest.mark.timeout(120)
def test_a_running_row_cannot_pause_and_says_how_to(text_backend):
    options = {"batch_size": 2, "batch_wait": 30.0, "step_delay": 0.02}
    with serving({"text": text_backend}, **options) as (url, _):
        ids = _all_at_once(url, [_body(p, {}) for p in PROMPTS[:2]])
        with httpx.Client(base_url=url, timeout=60) as client:
            _progress_at(client, ids[0], 2)
            refused = client.post(f"/v1/jobs/{ids[0]}/pause")
            for job in ids:
                client.post(f"/v1/jobs/{job}/stop")
    assert refused.status_code == 409
    assert "--batch-size 1" in refused.text


@pytest.mark.timeout(300)
def test_a_deadline_and_a_disconnect_end_only_their_rows(text_backend, alone):
    import time

    options = {"batch_size": 4, "batch_wait": 30.0, "step_delay": 0.02}
    bodies = [_body(PROMPTS[0], {"deadline": time.time() - 1}), *(_body(p, {}) for p in PROMPTS[1:4])]
    with serving({"text": text_backend}, **options) as (url, _):
        ids = _all_at_once(url, bodies)
        with httpx.Client(base_url=url, timeout=60) as client:
            # the client of job 1 follows it, and goes away at its 5th token
            _progress_at(client, ids[1], 5, stop_on_disconnect="true")
            results = [_result(client, job) for job in ids]
    expired, gone = results[0]["job"], results[1]["job"]
    # checked before the first token, as a run alone checks it: no token
    assert (expired["state"], expired["reason"], expired["step"]) == ("stopped", "deadline", 0)
    assert results[0]["result"]["text"] == ""
    assert (gone["state"], gone["reason"]) == ("stopped", "disconnected")
    assert gone["stop_step"] >= 5 and gone["stop_step"] <= gone["step"] <= gone["stop_step"] + 1
    assert alone[1]["result"]["text"].startswith(results[1]["result"]["text"])
    for i in (2, 3):
        assert results[i]["job"]["state"] == "completed"
        assert results[i]["result"] == alone[i]["result"]


@pytest.mark.timeout(120)
def test_closing_while_a_batch_waits_to_fill_stops_its_job_without_running_it(text_backend):
    import asyncio

    from stopcock.server.contract import JobSpec
    from stopcock.server.engine import LocalEngine

    engine = LocalEngine({"text": text_backend}, batch_size=4, batch_wait=60.0)
    params = {"max_tokens": TOKENS, "temperature": 0.0, "top_p": 1.0, "seed": None}
    try:
        view = asyncio.run(engine.submit(JobSpec("text", PROMPTS[0], params), "me"))
    finally:
        engine.close(timeout=60)  # wakes the worker waiting for the batch to fill
    ended = asyncio.run(engine.get(view.id, "me"))
    assert (ended.state, ended.reason, ended.started) == ("stopped", "shutdown", None)
    assert engine.stats()["workers_alive"] == 0 and engine.stats()["batches_run"] == 0


def test_a_batch_never_takes_a_job_past_a_higher_priority_one_that_runs_alone(text_backend):
    from stopcock.server.batching import Batching
    from stopcock.server.contract import JobSpec
    from stopcock.server.jobs import Job

    def job(priority: int, temperature: float = 0.0) -> Job:
        params = {"max_tokens": 8, "temperature": temperature, "top_p": 1.0, "seed": 1}
        return Job(JobSpec("text", "Beautiful is", params, priority=priority), "me")

    lanes = {"text": text_backend.lane()}
    greedy_high, sampled, greedy_same, greedy_low = job(5), job(1, 0.7), job(1), job(0)
    queue = [greedy_high, sampled, greedy_same, greedy_low]  # the engine's order: priority first
    assert Batching(16, 0.0)._ready(queue, lanes) == [greedy_high, greedy_same]
    assert Batching(1, 0.0)._ready(queue, lanes) == []  # batch size 1: nothing is batched
    greedy = [greedy_high, greedy_same, greedy_low]
    assert Batching(2, 0.0)._ready(greedy, lanes) == greedy[:2]  # at most the batch size


@pytest.mark.timeout(120)
def test_a_skip_ends_its_row_as_it_ends_a_job_of_one_prompt(text_backend, alone):
    options = {"batch_size": 2, "batch_wait": 30.0, "step_delay": 0.02}
    with serving({"text": text_backend}, **options) as (url, _):
        ids = _all_at_once(url, [_body(p, {}) for p in PROMPTS[:2]])
        with httpx.Client(base_url=url, timeout=60) as client:
            _progress_at(client, ids[0], 3)
            assert client.post(f"/v1/jobs/{ids[0]}/skip").status_code == 200
            skipped, other = (_result(client, job) for job in ids)
    assert (skipped["job"]["state"], skipped["job"]["reason"]) == ("stopped", "skipped")
    assert skipped["job"]["outcome"]["row_reasons"] == ["skipped"]
    assert alone[0]["result"]["text"].startswith(skipped["result"]["text"])
    assert other["job"]["state"] == "completed" and other["result"] == alone[1]["result"]
