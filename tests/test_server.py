"""The generation service: job API, per-job stop, queue, keys and limits, on a real uvicorn server.

Jobs run the tiny real models. To catch a job mid-run without racing it, jobs ask for many steps
and the engine's test-only ``step_delay`` throttle keeps them running; tests wait for progress
events (never sleep) before stopping, and a stop cuts the throttle short.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from stopcock.server.backends import ImageBackend, TextBackend
from stopcock.server.engine import LocalEngine
from stopcock.server.testing import serving, sse_data

LONG = 1000  # tokens: more than any test lets a job run
DELAY = 0.01  # the test-only per-step throttle

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@contextlib.contextmanager
def serve(backends, *, keys=(), **engine_options: Any) -> Iterator[tuple[httpx.Client, LocalEngine]]:
    with (
        serving(backends, api_keys=keys, **{"step_delay": DELAY, **engine_options}) as (url, engine),
        httpx.Client(base_url=url, timeout=60) as client,
    ):
        yield client, engine


@pytest.fixture(scope="module")
def server(server_backends):
    with serve(server_backends, concurrency=1, queue_size=4) as (client, _):
        yield client


def events(
    client: httpx.Client, job_id: str, headers: dict[str, str] | None = None
) -> Iterator[dict[str, Any]]:
    """The job's events as they come (the stream closes when the iterator is dropped)."""
    with client.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        yield from sse_data(response.iter_lines())


def wait_for_step(client: httpx.Client, job_id: str, step: int, **kw: Any) -> dict[str, Any]:
    for event in events(client, job_id, **kw):
        if event["type"] == "progress" and event["step"] >= step:
            return event
        assert event["type"] != "done", f"the job ended before step {step}: {event}"
    raise AssertionError("the event stream ended without a done event")


def submit(client: httpx.Client, body: dict[str, Any], **kw: Any) -> dict[str, Any]:
    response = client.post("/v1/jobs", json=body, **kw)
    assert response.status_code == 201, response.text
    return response.json()


def text_job(max_tokens: int = LONG, **stop: Any) -> dict[str, Any]:
    return {
        "kind": "text",
        "prompt": "Once upon a time",
        "parameters": {"max_tokens": max_tokens},
        "stop": stop,
    }


def test_text_job_runs_and_streams_its_text(server):
    job = submit(server, text_job(12))
    assert job["state"] == "queued" and len(job["id"]) >= 22
    seen = list(events(server, job["id"]))
    types = [e["type"] for e in seen]
    assert types[:2] == ["queued", "started"] and types[-1] == "done"
    assert [e["seq"] for e in seen] == list(range(1, len(seen) + 1))
    assert [e["step"] for e in seen if e["type"] == "progress"] == list(range(1, 13))
    done = seen[-1]
    assert (done["state"], done["reason"], done["step"], done["total"]) == ("completed", "length", 12, 12)
    found = server.get(f"/v1/jobs/{job['id']}/result").json()
    assert found["result"]["text"] == "".join(e["text"] for e in seen if e["type"] == "text") != ""
    assert found["job"]["outcome"]["steps"] == 12
    assert (
        list(events(server, job["id"], headers={"Last-Event-ID": str(len(seen))})) == []
    )  # nothing after done
    # replay from a cursor: only the later events
    assert [e["seq"] for e in events(server, job["id"], headers={"Last-Event-ID": str(len(seen) - 2)})] == [
        len(seen) - 1,
        len(seen),
    ]


def test_stop_mid_run_answers_once_it_took_effect(server):
    job = submit(server, text_job())
    seen = wait_for_step(server, job["id"], 3)
    stopped = server.post(f"/v1/jobs/{job['id']}/stop").json()
    assert (stopped["state"], stopped["reason"]) == ("stopped", "user")
    assert seen["step"] <= stopped["stop_step"] <= stopped["step"] <= stopped["stop_step"] + 1
    assert stopped["outcome"]["stopped"] is True and stopped["outcome"]["steps"] == stopped["step"]
    assert server.get(f"/v1/jobs/{job['id']}").json() == stopped
    assert server.post(f"/v1/jobs/{job['id']}/stop").json() == stopped  # idempotent
    result = server.get(f"/v1/jobs/{job['id']}/result").json()["result"]
    assert result["completion_tokens"] == stopped["step"] and result["text"]


def test_stop_after_the_end_reports_the_end(server):
    job = submit(server, text_job(3))
    done = list(events(server, job["id"]))[-1]
    again = server.post(f"/v1/jobs/{job['id']}/stop").json()
    assert (
        (again["state"], again["reason"], again["step"])
        == ("completed", "length", 3)
        == (
            done["state"],
            done["reason"],
            done["step"],
        )
    )


def test_conditions_stop_a_job(server):
    job = submit(server, text_job(max_steps=5))
    done = list(events(server, job["id"]))[-1]
    assert (done["state"], done["reason"], done["step"]) == ("stopped", "max_steps", 5)


def test_unknown_job_is_a_404_everywhere(server):
    for method, path in [("GET", ""), ("POST", "/stop"), ("GET", "/events"), ("GET", "/result")]:
        response = server.request(method, f"/v1/jobs/not-a-job{path}")
        assert response.status_code == 404
        assert "no job" in response.json()["error"]["message"]


def test_queue_bound_queued_stop_and_slot_release(server_backends):
    with serve(server_backends, concurrency=1, queue_size=1) as (client, engine):
        running_job = submit(client, text_job())
        wait_for_step(client, running_job["id"], 1)
        queued = submit(client, text_job())
        full = client.post("/v1/jobs", json=text_job())
        assert full.status_code == 429 and "queue is full" in full.json()["error"]["message"]
        assert full.headers["retry-after"]

        # stopping a queued job removes it without running it
        dropped = client.post(f"/v1/jobs/{queued['id']}/stop").json()
        assert (dropped["state"], dropped["reason"], dropped["step"], dropped["started"]) == (
            "stopped",
            "user",
            0,
            None,
        )
        assert "never ran" in dropped["outcome"]["detail"]
        assert [e["type"] for e in events(client, queued["id"])] == ["queued", "done"]

        # the running job stops; its slot is freed only once it has, and the next job then runs
        nxt = submit(client, text_job(4))
        first = client.post(f"/v1/jobs/{running_job['id']}/stop").json()
        assert first["state"] == "stopped"
        done = list(events(client, nxt["id"]))[-1]
        assert (done["state"], done["step"]) == ("completed", 4)
        assert done["started"] >= first["finished"]  # the runs never overlapped
        assert engine.stats()["running"] == 0 and engine.stats()["queued"] == 0


def test_a_stop_at_any_moment_takes_effect(server_backends):
    """Submit and stop at once, many times, unthrottled: queued, just taken by the worker, or running,
    every job ends stopped by the user; one that never started never ran a step."""
    with serve(server_backends, concurrency=1, queue_size=2, step_delay=0) as (client, _):
        for _ in range(20):
            job = submit(client, text_job(LONG))
            stopped = client.post(f"/v1/jobs/{job['id']}/stop").json()
            assert (stopped["state"], stopped["reason"]) == ("stopped", "user"), stopped
            # the step reached when the stop arrived, or the one then in flight; never a later one
            assert stopped["stop_step"] <= stopped["step"] <= stopped["stop_step"] + 1
            if stopped["started"] is None:
                assert stopped["step"] == 0


def test_image_job_previews_and_a_partial_image(server):
    body = {"kind": "image", "prompt": "a red square", "parameters": {"steps": 200, "seed": 1}}
    job = submit(server, body)
    previews = []
    for event in events(server, job["id"]):
        previews += [event] if event["type"] == "preview" else []
        if event["type"] == "progress" and event["step"] >= 2:
            break
    assert previews and previews[0]["image"].startswith("iVBOR")  # PNG, base64
    stopped = server.post(f"/v1/jobs/{job['id']}/stop").json()
    assert (stopped["state"], stopped["reason"], stopped["total"]) == ("stopped", "user", 200)
    assert 2 <= stopped["stop_step"] <= stopped["step"] <= stopped["stop_step"] + 1
    assert stopped["outcome"]["partial"] == "denoised"
    result = server.get(f"/v1/jobs/{job['id']}/result").json()["result"]
    assert result["image"].startswith("iVBOR")


def test_concurrency_limit_then_shutdown_stops_every_job_and_joins_the_workers(server_backends):
    before = set(threading.enumerate())
    with serve(server_backends, concurrency=2, queue_size=2) as (client, engine):
        jobs = [submit(client, text_job()) for _ in range(3)]
        for job in jobs[:2]:
            wait_for_step(client, job["id"], 1)
        # two workers: the third job waits while the first two run
        assert client.get(f"/v1/jobs/{jobs[2]['id']}").json()["state"] == "queued"
        batching = {"batch_size": 1, "batch_wait_ms": 0, "batch_rows_running": 0, "batches_run": 0,
                    "batched_jobs": 0}  # batch_size 1: no batches
        assert engine.stats() == {"queued": 1, "running": 2, "jobs": 3, "workers_alive": 2, **batching}
        engine.close()
        views = [client.get(f"/v1/jobs/{j['id']}").json() for j in jobs]
        assert {v["state"] for v in views} == {"stopped"} and {v["reason"] for v in views} == {"shutdown"}
        assert views[2]["started"] is None and views[2]["step"] == 0  # the queued one never ran
        assert engine.stats()["workers_alive"] == 0
        refused = client.post("/v1/jobs", json=text_job(2))
        assert refused.status_code == 429
    # the engine's workers and the server's thread are gone (a thread pool's idle threads may linger)
    assert [t for t in threading.enumerate() if t.name.startswith("stopcock-") and t not in before] == []


# -- keys ----------------------------------------------------------------------------------------------
PUBLIC = {"/", "/openapi.json", "/docs", "/redoc"}  # static, the same for everyone: see the README


def test_keys_guard_every_endpoint_and_scope_jobs_to_their_key(server_backends):
    alice, bob = {"Authorization": "Bearer alice-key"}, {"Authorization": "Bearer bob-key"}
    with serve(server_backends, keys=["alice-key", "bob-key"], concurrency=1, queue_size=2) as (client, _):
        job = submit(client, text_job(), headers=alice)
        schema = client.get("/openapi.json")
        assert schema.status_code == 200
        assert schema.json()["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"  # for /docs
        # every operation the app has (so a new one cannot be left open), with no key, a wrong key,
        # and a key without the Bearer scheme
        operations = [
            (method.upper(), path.replace("{job_id}", job["id"]))
            for path, item in schema.json()["paths"].items()
            for method in item
        ]
        assert len(operations) >= 11 and ("POST", f"/v1/jobs/{job['id']}/stop") in operations
        for method, path in operations:
            for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": "alice-key"}):
                response = client.request(method, path, headers=headers)
                assert response.status_code == 401, (method, path, headers)
                assert response.json()["error"]["code"] == "invalid_api_key"
        # the public pages say nothing about the jobs, the models or the keys
        for path in PUBLIC:
            page = client.get(path)
            assert page.status_code == 200, path
            assert not [s for s in (job["id"], "tiny-text", "tiny-sd", "alice-key") if s in page.text]
        # bob can neither read nor stop alice's job; it is not even found
        assert client.get(f"/v1/jobs/{job['id']}", headers=bob).status_code == 404
        assert client.post(f"/v1/jobs/{job['id']}/stop", headers=bob).status_code == 404
        assert client.get("/v1/jobs", headers=bob).json()["data"] == []
        assert client.get(f"/v1/jobs/{job['id']}", headers=alice).json()["state"] in ("queued", "running")
        stopped = client.post(f"/v1/jobs/{job['id']}/stop", headers=alice).json()
        assert (stopped["state"], stopped["reason"]) == ("stopped", "user")


# -- limits --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"kind": "text", "prompt": "x" * 4001}, 422, "prompt"),
        ({"kind": "text", "prompt": ""}, 422, "prompt"),
        ({"kind": "text", "prompt": "x", "parameters": {"max_tokens": 5000}}, 422, "max_tokens"),
        ({"kind": "text", "prompt": "x", "parameters": {"max_tokens": 0}}, 422, "max_tokens"),
        ({"kind": "text", "prompt": "x", "parameters": {"beams": 2}}, 422, "beams"),
        ({"kind": "text", "prompt": "x", "stop": {"timeout": -1}}, 422, "timeout"),
        ({"kind": "text", "prompt": "x", "stop": {"stop_strings": ["a"] * 5}}, 422, "stop_strings"),
        ({"kind": "image", "prompt": "x", "parameters": {"steps": 201}}, 422, "steps"),
        ({"kind": "image", "prompt": "x", "parameters": {"width": 100}}, 422, "width"),
        ({"kind": "image", "prompt": "x", "parameters": {"height": 4096}}, 422, "height"),
        ({"kind": "image", "prompt": "x", "stop": {"stop_strings": ["a"]}}, 422, "text jobs only"),
        ({"kind": "video", "prompt": "x"}, 422, "kind"),
        ({"kind": "text", "prompt": "word " * 100, "parameters": {"max_tokens": 1024}}, 400, "context"),
    ],
)
def test_limits_answer_4xx_with_a_json_error(server, body, status, words):
    response = server.post("/v1/jobs", json=body)
    assert response.status_code == status
    assert words in response.json()["error"]["message"]


def test_malformed_and_oversized_bodies(server):
    json_type = {"Content-Type": "application/json"}
    response = server.post("/v1/jobs", content=b"{not json", headers=json_type)
    assert response.status_code == 422 and response.json()["error"]["message"]
    response = server.post("/v1/jobs", content=b"x" * ((1 << 20) + 1), headers=json_type)
    assert response.status_code == 413 and "at most" in response.json()["error"]["message"]
    assert server.get("/no/such/route").json()["error"]["message"]


def test_chunked_bodies_are_limited_too(server):
    """A body sent in chunks, with no Content-Length, is counted as it comes: 413 past the limit."""

    def chunks(body: bytes, size: int = 1 << 16) -> Iterator[bytes]:
        yield from (body[i : i + size] for i in range(0, len(body), size))

    json_type = {"Content-Type": "application/json"}
    over = server.post("/v1/jobs", content=chunks(b" " * (1 << 20) + b"{}"), headers=json_type)
    assert "content-length" not in over.request.headers  # sent chunked
    assert over.status_code == 413 and over.json()["error"]["code"] == "body_too_large"
    job = submit(server, {}, content=chunks(json.dumps(text_job(2)).encode()), headers=json_type)
    assert list(events(server, job["id"]))[-1]["state"] == "completed"  # the body reached the app whole


def test_a_seed_gives_the_same_text_whatever_else_runs(server_backends):
    """Sampling draws from the job's own generator: a seeded job gives the same text alone and while
    another sampling job runs on the other worker (with torch's global generator, it would not)."""
    sampled = {"temperature": 1.0, "top_p": 0.9}

    def seeded(client: httpx.Client, seed: int) -> str:
        body = {"kind": "text", "prompt": "Once upon a time", "parameters": {"max_tokens": 24, **sampled}}
        body["parameters"]["seed"] = seed
        job = submit(client, body)
        assert list(events(client, job["id"]))[-1]["state"] == "completed"
        return str(client.get(f"/v1/jobs/{job['id']}/result").json()["result"]["text"])

    with serve(server_backends, concurrency=2, queue_size=2) as (client, _):
        alone = seeded(client, 7)
        noise = submit(client, {**text_job(), "parameters": {"max_tokens": LONG, **sampled, "seed": 1}})
        wait_for_step(client, noise["id"], 1)
        beside = seeded(client, 7)
        other = seeded(client, 8)
        stopped = client.post(f"/v1/jobs/{noise['id']}/stop").json()
    assert (stopped["state"], stopped["reason"]) == ("stopped", "user")  # it ran all along
    assert beside == alone != other


def test_image_job_on_a_text_only_server_is_refused(text_pipe):
    with serve({"text": TextBackend(text_pipe, "tiny-text")}) as (client, _):
        response = client.post("/v1/jobs", json={"kind": "image", "prompt": "x"})
        assert response.status_code == 400 and "no image model" in response.json()["error"]["message"]


def test_image_backends_check_what_the_pipeline_takes():
    from stopcock.server.contract import InvalidJob, JobSpec
    from stopcock.server.schemas import ImageParameters
    from tiny.image import ddpm_pipeline, lcm_pipeline

    with pytest.raises(ValueError, match="takes no prompt"):
        ImageBackend(ddpm_pipeline(), "ddpm")  # takes no prompt
    lcm = ImageBackend(lcm_pipeline(), "lcm")
    lcm.validate(JobSpec("image", "x", ImageParameters().model_dump()))  # defaults are fine
    with pytest.raises(InvalidJob, match="takes no negative_prompt"):
        lcm.validate(JobSpec("image", "x", ImageParameters(negative_prompt="blur").model_dump()))


def test_two_apps_in_one_process_share_nothing(text_pipe):
    """The app keeps its engine and keys on ``app.state``: two apps over two engines stay apart."""
    from fastapi.testclient import TestClient

    from stopcock.server.app import create_app

    engines = [LocalEngine({"text": TextBackend(text_pipe, name)}) for name in ("model-a", "model-b")]
    key = {"Authorization": "Bearer key-a"}
    try:
        with (
            TestClient(create_app(engines[0], api_keys=["key-a"])) as a,
            TestClient(create_app(engines[1])) as b,
        ):
            assert a.get("/v1/models").status_code == 401 and b.get("/v1/models").status_code == 200
            assert a.get("/v1/models", headers=key).json()["data"][0]["id"] == "model-a"
            assert b.get("/v1/models").json()["data"][0]["id"] == "model-b"
            job = b.post("/v1/jobs", json=text_job(2)).json()
            assert a.get(f"/v1/jobs/{job['id']}", headers=key).status_code == 404
            assert b.get(f"/v1/jobs/{job['id']}").status_code == 200
    finally:
        for engine in engines:
            engine.close()
