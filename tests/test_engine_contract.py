"""What the README promises of the server, checked on both engines: ``LocalEngine`` (one process)
and the Ray Serve engine (2 text replicas, 1 image replica, 2 ingress replicas on a local cluster).

Every test talks HTTP to the same app (the job API, the OpenAI-compatible API with the official
``openai`` client, the web page), so a behaviour that passes here is the same on both. Both servers
run 2 text jobs at once (LocalEngine: 2 workers; Ray: 2 replicas of one pipeline each), queue 16,
take the keys ``alice-key`` and ``bob-key``, and throttle each step by 0.01 s (the test-only knob) so
that a test can catch a job mid-run: tests wait for progress events, never sleep. After each test
every job still going is stopped, so tests do not see each other's jobs.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import io
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from browser import chromium  # tests/ is on sys.path under pytest
from conftest import RAY_KEYS

from stopcock.server.contract import FINAL_STATES, Engine
from stopcock.server.testing import serving, sse_data

ALICE = {"Authorization": f"Bearer {RAY_KEYS[0]}"}
BOB = {"Authorization": f"Bearer {RAY_KEYS[1]}"}
ALICE_OWNER = __import__("hashlib").sha256(RAY_KEYS[0].encode()).hexdigest()
LONG = 1000  # tokens: more than any test lets a job run
CONCURRENCY, QUEUE = 2, 16

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@dataclass
class Server:
    name: str
    url: str
    stats: Callable[[], dict[str, int]]
    engine: Callable[[], Engine]  # an engine over the same jobs, for this test's event loop


@pytest.fixture(scope="module", params=["local", "ray"])
def server(request, server_backends) -> Iterator[Server]:
    if request.param == "local":
        options = {"concurrency": CONCURRENCY, "queue_size": QUEUE, "step_delay": 0.01}
        with serving(server_backends, api_keys=RAY_KEYS, **options) as (url, engine):
            yield Server("local", url, engine.stats, lambda: engine)
        return
    from stopcock.server.ray_engine.ingress import RayEngine

    ray = request.getfixturevalue("ray_serve")
    models = {"text": {"id": "tiny-text", "description": ""}, "image": {"id": "tiny-sd", "description": ""}}
    yield Server(
        "ray", ray.url, lambda: ray.registry.stats.remote().result(), lambda: RayEngine(ray.registry, models)
    )


@pytest.fixture
def client(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=ALICE, timeout=60) as http:
        yield http
        for headers in (ALICE, BOB):  # stop what the test left going
            for job in http.get("/v1/jobs", headers=headers).json()["data"]:
                if job["state"] not in FINAL_STATES:
                    http.post(f"/v1/jobs/{job['id']}/stop", headers=headers)


def events(client: httpx.Client, job_id: str, **kw: Any) -> Iterator[dict[str, Any]]:
    with client.stream("GET", f"/v1/jobs/{job_id}/events", **kw) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        yield from sse_data(response.iter_lines())


def wait_for_step(client: httpx.Client, job_id: str, step: int, **kw: Any) -> dict[str, Any]:
    for event in events(client, job_id, **kw):
        if event["type"] == "progress" and event["step"] >= step:
            return event
        assert event["type"] != "done", f"the job ended before step {step}: {event}"
    raise AssertionError("the event stream ended without a done event")


def done_of(client: httpx.Client, job_id: str, **kw: Any) -> dict[str, Any]:
    return list(events(client, job_id, **kw))[-1]


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


def first_to_run(client: httpx.Client, jobs: list[dict[str, Any]]) -> dict[str, Any]:
    """The first of ``jobs`` to report a step (each followed on a thread of its own; the others'
    streams end with their jobs)."""
    pool = concurrent.futures.ThreadPoolExecutor(len(jobs))
    try:
        runs = {pool.submit(wait_for_step, client, job["id"], 1): job for job in jobs}
        done, _ = concurrent.futures.wait(runs, return_when=concurrent.futures.FIRST_COMPLETED)
        first = done.pop()
        first.result()  # raises if that job ended before its first step
        return runs[first]
    finally:
        pool.shutdown(wait=False)


def within_one_step(view: dict[str, Any]) -> bool:
    return view["stop_step"] <= view["step"] <= view["stop_step"] + 1


# -- the job API ---------------------------------------------------------------------------------------
def test_models_and_health(client):
    models = {m["stopcock_kind"]: m["id"] for m in client.get("/v1/models").json()["data"]}
    assert models == {"text": "tiny-text", "image": "tiny-sd"}
    health = client.get("/v1/health").json()
    assert health["status"] == "ok" and health["workers_alive"] >= CONCURRENCY
    assert {"queued", "running", "jobs", "workers_alive"} <= set(health)


def test_text_job_runs_and_streams_its_text(client):
    job = submit(client, text_job(12))
    assert job["state"] == "queued" and len(job["id"]) >= 22
    seen = list(events(client, job["id"]))
    types = [e["type"] for e in seen]
    assert types[:2] == ["queued", "started"] and types[-1] == "done"
    assert [e["seq"] for e in seen] == list(range(1, len(seen) + 1))
    assert [e["step"] for e in seen if e["type"] == "progress"] == list(range(1, 13))
    done = seen[-1]
    assert (done["state"], done["reason"], done["step"], done["total"]) == ("completed", "length", 12, 12)
    found = client.get(f"/v1/jobs/{job['id']}/result").json()
    assert found["result"]["text"] == "".join(e["text"] for e in seen if e["type"] == "text") != ""
    assert found["job"]["outcome"]["steps"] == 12
    assert list(events(client, job["id"], headers={**ALICE, "Last-Event-ID": str(len(seen))})) == []
    replay = events(client, job["id"], headers={**ALICE, "Last-Event-ID": str(len(seen) - 2)})
    assert [e["seq"] for e in replay] == [len(seen) - 1, len(seen)]
    assert [e["seq"] for e in events(client, job["id"], params={"after": len(seen) - 1})] == [len(seen)]


def test_stop_mid_run_answers_once_it_took_effect(client):
    job = submit(client, text_job())
    seen = wait_for_step(client, job["id"], 3)
    stopped = client.post(f"/v1/jobs/{job['id']}/stop").json()
    assert (stopped["state"], stopped["reason"]) == ("stopped", "user")
    assert seen["step"] <= stopped["stop_step"] and within_one_step(stopped)
    assert stopped["outcome"]["stopped"] is True and stopped["outcome"]["steps"] == stopped["step"]
    assert client.get(f"/v1/jobs/{job['id']}").json() == stopped
    assert client.post(f"/v1/jobs/{job['id']}/stop").json() == stopped  # idempotent
    result = client.get(f"/v1/jobs/{job['id']}/result").json()["result"]
    assert result["completion_tokens"] == stopped["step"] and result["text"]
    assert done_of(client, job["id"])["state"] == "stopped"


def test_pause_holds_a_job_and_resume_finishes_it(client):
    job = submit(client, text_job(40))
    wait_for_step(client, job["id"], 2)
    paused = client.post(f"/v1/jobs/{job['id']}/pause").json()
    assert paused["state"] == "paused" and paused["checkpoint_step"] == paused["step"] >= 2
    assert client.post(f"/v1/jobs/{job['id']}/resume").json()["state"] in ("queued", "running", "completed")
    done = done_of(client, job["id"])
    assert (done["state"], done["step"], done["saved_steps"]) == ("completed", 40, paused["step"])


def test_priority_is_honoured(client):
    answer = client.post("/v1/jobs", json={**text_job(3), "priority": 5})
    assert answer.status_code == 201 and answer.json()["priority"] == 5
    assert done_of(client, answer.json()["id"])["state"] == "completed"


def test_a_job_paused_and_resumed_has_the_text_of_an_uninterrupted_run(client):
    """On Ray the checkpoint goes through the object store, and any text replica may resume it."""
    sampled = {"max_tokens": 48, "temperature": 1.0, "top_p": 0.9, "seed": 11}
    body = {"kind": "text", "prompt": "Once upon a time", "parameters": sampled}
    alone = submit(client, body)
    assert done_of(client, alone["id"])["state"] == "completed"
    job = submit(client, body)
    wait_for_step(client, job["id"], 3)
    paused = client.post(f"/v1/jobs/{job['id']}/pause").json()
    assert paused["state"] == "paused" and paused["checkpoint_step"] == paused["step"] >= 3
    assert client.post(f"/v1/jobs/{job['id']}/resume").status_code == 200
    done = done_of(client, job["id"])
    assert (done["state"], done["saved_steps"]) == ("completed", paused["step"])
    texts = [client.get(f"/v1/jobs/{j['id']}/result").json()["result"]["text"] for j in (alone, job)]
    assert texts[0] == texts[1] != ""


def test_a_job_of_higher_priority_preempts_the_lowest_running_one(client):
    """Every text slot busy (LocalEngine: its workers; Ray: each replica's lane): a job of higher
    priority preempts the running job of the lowest priority, which resumes once a slot is free."""
    lowest = submit(client, {**text_job(200), "priority": 0})  # long enough to be running still
    other = submit(client, {**text_job(), "priority": 1})
    for job in (lowest, other):
        wait_for_step(client, job["id"], 1)
    high = submit(client, {**text_job(3), "priority": 5})
    assert done_of(client, high["id"])["state"] == "completed"
    seen = list(events(client, lowest["id"]))
    assert [e["type"] for e in seen].count("preempted") == 1
    done = seen[-1]
    assert (done["state"], done["step"], done["preemptions"]) == ("completed", 200, 1)
    assert done["saved_steps"] >= 1
    assert client.get(f"/v1/jobs/{other['id']}").json()["preemptions"] == 0


def test_a_resumed_job_runs_before_the_jobs_of_its_priority_queued_after_it(client):
    """Every text slot busy (two): a job paused and resumed goes back ahead of a job queued after it.
    On Ray, Serve's router would hand the freed lane to the older request; the registry refuses its
    claim and the lane goes to the resumed job."""
    first, second = (submit(client, text_job()) for _ in range(2))
    for job in (first, second):
        wait_for_step(client, job["id"], 1)
    waiting = [submit(client, text_job()) for _ in range(2)]
    paused = client.post(f"/v1/jobs/{first['id']}/pause").json()
    assert paused["state"] == "paused"
    took = first_to_run(client, waiting)  # the one the freed slot took
    behind = next(j for j in waiting if j is not took)
    assert client.get(f"/v1/jobs/{behind['id']}").json()["state"] == "queued"
    assert client.post(f"/v1/jobs/{first['id']}/resume").json()["state"] != "paused"
    stopped = client.post(f"/v1/jobs/{took['id']}/stop").json()  # frees a slot: the resumed job's
    assert stopped["state"] == "stopped"
    wait_for_step(client, first["id"], paused["step"] + 1)
    assert client.get(f"/v1/jobs/{behind['id']}").json()["state"] == "queued"
    assert client.get(f"/v1/jobs/{second['id']}").json()["state"] == "running"


def test_stop_after_the_end_reports_the_end(client):
    job = submit(client, text_job(3))
    done = done_of(client, job["id"])
    again = client.post(f"/v1/jobs/{job['id']}/stop").json()
    assert (again["state"], again["reason"], again["step"]) == ("completed", "length", 3)
    assert (done["state"], done["reason"], done["step"]) == ("completed", "length", 3)


def test_conditions_stop_a_job(client):
    done = done_of(client, submit(client, text_job(max_steps=5))["id"])
    assert (done["state"], done["reason"], done["step"]) == ("stopped", "max_steps", 5)


def test_unknown_job_is_a_404_everywhere(client):
    for method, path in [("GET", ""), ("POST", "/stop"), ("GET", "/events"), ("GET", "/result")]:
        response = client.request(method, f"/v1/jobs/not-a-job{path}")
        assert response.status_code == 404 and "no job" in response.json()["error"]["message"]


def test_result_is_a_409_while_the_job_runs(client):
    job = submit(client, text_job())
    wait_for_step(client, job["id"], 1)
    response = client.get(f"/v1/jobs/{job['id']}/result")
    assert response.status_code == 409 and response.json()["error"]["code"] == "job_not_finished"


def test_a_full_queue_is_a_429_and_a_queued_job_stopped_never_runs(client, server):
    running = [submit(client, text_job()) for _ in range(CONCURRENCY)]
    for job in running:
        wait_for_step(client, job["id"], 1)
    queued = [submit(client, text_job()) for _ in range(QUEUE)]
    assert {client.get(f"/v1/jobs/{j['id']}").json()["state"] for j in queued} == {"queued"}
    assert server.stats()["queued"] == QUEUE
    full = client.post("/v1/jobs", json=text_job())
    assert full.status_code == 429 and "queue is full" in full.json()["error"]["message"]
    assert full.headers["retry-after"]
    dropped = client.post(f"/v1/jobs/{queued[0]['id']}/stop").json()
    assert (dropped["state"], dropped["reason"], dropped["step"], dropped["started"]) == (
        "stopped",
        "user",
        0,
        None,
    )
    assert "never ran" in dropped["outcome"]["detail"]
    assert [e["type"] for e in events(client, queued[0]["id"])] == ["queued", "done"]
    small = submit(client, text_job(2))  # a place is free again
    for job in running + queued[1:]:  # stopped queued, or after a freed slot took it: either way stopped
        stopped = client.post(f"/v1/jobs/{job['id']}/stop").json()
        assert stopped["state"] == "stopped" and within_one_step(stopped), stopped
    done = done_of(client, small["id"])  # the stopped jobs' slots serve what is left
    assert (done["state"], done["step"]) == ("completed", 2)
    assert server.stats()["queued"] == 0


def test_a_stop_at_any_moment_takes_effect(client):
    """Submit and stop at once: queued, being handed to a worker or replica, or running, every job
    ends stopped by the user; one that never started never ran a step."""
    for _ in range(20):
        job = submit(client, text_job())
        stopped = client.post(f"/v1/jobs/{job['id']}/stop").json()
        assert (stopped["state"], stopped["reason"]) == ("stopped", "user"), stopped
        assert within_one_step(stopped)
        if stopped["started"] is None:
            assert stopped["step"] == 0


def test_image_job_previews_and_a_partial_image(client):
    job = submit(client, {"kind": "image", "prompt": "a red square", "parameters": {"steps": 200, "seed": 1}})
    previews = []
    for event in events(client, job["id"]):
        previews += [event] if event["type"] == "preview" else []
        if event["type"] == "progress" and event["step"] >= 2 and previews:
            break
    assert previews and previews[0]["image"].startswith("iVBOR")
    stopped = client.post(f"/v1/jobs/{job['id']}/stop").json()
    assert (stopped["state"], stopped["reason"], stopped["total"]) == ("stopped", "user", 200)
    assert 2 <= stopped["stop_step"] and within_one_step(stopped)
    assert stopped["outcome"]["partial"] == "denoised"
    assert client.get(f"/v1/jobs/{job['id']}/result").json()["result"]["image"].startswith("iVBOR")


def test_a_seed_gives_the_same_text_whatever_else_runs(client):
    sampled = {"temperature": 1.0, "top_p": 0.9}

    def seeded(seed: int) -> str:
        body = {"kind": "text", "prompt": "Once upon a time", "parameters": {"max_tokens": 24, **sampled}}
        body["parameters"]["seed"] = seed
        job = submit(client, body)
        assert done_of(client, job["id"])["state"] == "completed"
        return str(client.get(f"/v1/jobs/{job['id']}/result").json()["result"]["text"])

    alone = seeded(7)
    noise = submit(client, {**text_job(), "parameters": {"max_tokens": LONG, **sampled, "seed": 1}})
    wait_for_step(client, noise["id"], 1)
    beside, other = seeded(7), seeded(8)
    assert client.post(f"/v1/jobs/{noise['id']}/stop").json()["state"] == "stopped"
    assert beside == alone != other


# -- items: several prompts, skip, stop after the current one -------------------------------------
PROMPTS = ["Once upon a time", "Hello world", "The quick brown fox"]


def act_on_item(client: httpx.Client, job_id: str, item: int, step: int, path: str) -> list[dict[str, Any]]:
    """Follow the job; once item ``item`` reached ``step``, POST ``path``; every event up to done."""
    seen, current, acted = [], None, False
    for event in events(client, job_id):
        seen.append(event)
        if event["type"] == "item" and event["state"] == "started":
            current = event["index"]
        if not acted and current == item and event["type"] == "progress" and event["step"] >= step:
            response = client.post(f"/v1/jobs/{job_id}/{path}")
            assert response.status_code == 200, response.text
            assert response.json()["state"] == "running"  # answered at once, the job still running
            acted = True
    assert acted
    return seen


def test_skip_ends_the_current_item_and_the_job_goes_on(client):
    job = submit(client, {"kind": "text", "prompts": PROMPTS, "parameters": {"max_tokens": 30}})
    done = act_on_item(client, job["id"], 0, 2, "skip")[-1]
    assert done["state"] == "completed"
    assert done["outcome"]["item_reasons"] == ["skipped", "completed", "completed"]


def test_a_stop_after_the_item_lets_it_finish_and_starts_no_other(client):
    job = submit(client, {"kind": "text", "prompts": PROMPTS, "parameters": {"max_tokens": 8}})
    seen = act_on_item(client, job["id"], 0, 2, "stop?at=item")
    done = seen[-1]
    assert done["state"] == "stopped"
    assert [e["index"] for e in seen if e["type"] == "item" and e["state"] == "started"] == [0]
    assert done["outcome"]["item_reasons"][0] == "completed" and done["step"] == 8


# -- keys --------------------------------------------------------------------------------------------
PUBLIC = {"/", "/openapi.json", "/docs", "/redoc"}


def test_keys_guard_every_endpoint_and_scope_jobs_to_their_key(client):
    job = submit(client, text_job())
    schema = client.get("/openapi.json", headers={})
    assert schema.status_code == 200
    operations = [
        (method.upper(), path.replace("{job_id}", job["id"]))
        for path, item in schema.json()["paths"].items()
        for method in item
    ]
    assert len(operations) >= 11 and ("POST", f"/v1/jobs/{job['id']}/stop") in operations
    with httpx.Client(base_url=client.base_url, timeout=60) as anonymous:
        for method, path in operations:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": RAY_KEYS[0]}):
                response = anonymous.request(method, path, headers=headers)
                assert response.status_code == 401, (method, path, headers)
                assert response.json()["error"]["code"] == "invalid_api_key"
        for path in PUBLIC:
            page = anonymous.get(path)
            assert page.status_code == 200, path
            assert not [s for s in (job["id"], "tiny-text", "tiny-sd", RAY_KEYS[0]) if s in page.text]
    assert client.get(f"/v1/jobs/{job['id']}", headers=BOB).status_code == 404
    assert client.post(f"/v1/jobs/{job['id']}/stop", headers=BOB).status_code == 404
    assert client.get(f"/v1/jobs/{job['id']}/events", headers=BOB).status_code == 404
    assert client.get(f"/v1/jobs/{job['id']}/result", headers=BOB).status_code == 404
    assert job["id"] not in {j["id"] for j in client.get("/v1/jobs", headers=BOB).json()["data"]}
    assert job["id"] in {j["id"] for j in client.get("/v1/jobs").json()["data"]}
    stopped = client.post(f"/v1/jobs/{job['id']}/stop").json()
    assert (stopped["state"], stopped["reason"]) == ("stopped", "user")


# -- limits --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"kind": "text", "prompt": "x" * 4001}, 422, "prompt"),
        ({"kind": "text", "prompt": "x", "parameters": {"max_tokens": 5000}}, 422, "max_tokens"),
        ({"kind": "text", "prompt": "x", "parameters": {"beams": 2}}, 422, "beams"),
        ({"kind": "image", "prompt": "x", "parameters": {"width": 100}}, 422, "width"),
        ({"kind": "image", "prompt": "x", "stop": {"stop_strings": ["a"]}}, 422, "text jobs only"),
        ({"kind": "video", "prompt": "x"}, 422, "kind"),
        ({"kind": "text", "prompt": "word " * 100, "parameters": {"max_tokens": 1024}}, 400, "context"),
    ],
)
def test_limits_answer_4xx_with_a_json_error(client, body, status, words):
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == status
    assert words in response.json()["error"]["message"]


def test_malformed_and_oversized_bodies(client):
    json_type = {**ALICE, "Content-Type": "application/json"}
    response = client.post("/v1/jobs", content=b"{not json", headers=json_type)
    assert response.status_code == 422 and response.json()["error"]["message"]
    response = client.post("/v1/jobs", content=b"x" * ((1 << 20) + 1), headers=json_type)
    assert response.status_code == 413 and "at most" in response.json()["error"]["message"]


# -- disconnects ---------------------------------------------------------------------------------------
def test_closing_the_event_stream_does_not_stop_the_job(client):
    job = submit(client, text_job())
    first = wait_for_step(client, job["id"], 2)  # the stream is closed when this returns
    later = wait_for_step(client, job["id"], first["step"] + 3)
    assert later["step"] > first["step"] and client.get(f"/v1/jobs/{job['id']}").json()["state"] == "running"
    assert client.post(f"/v1/jobs/{job['id']}/stop").json()["reason"] == "user"


def test_a_follower_that_asks_for_it_stops_the_job_when_it_goes_away(client):
    job = submit(client, text_job())
    first = wait_for_step(client, job["id"], 2, params={"stop_on_disconnect": "true"})  # closed on return
    done = done_of(client, job["id"])  # a plain follower: it reads to the end without stopping anything
    assert (done["state"], done["reason"]) == ("stopped", "disconnected")
    assert first["step"] <= done["stop_step"] and within_one_step(done)


def test_a_blocking_result_waits_for_the_end_and_stops_the_job_if_its_client_gives_up(client):
    short = submit(client, text_job(max_tokens=3))
    found = client.get(f"/v1/jobs/{short['id']}/result", params={"wait": "true"})
    assert found.status_code == 200 and found.json()["job"]["state"] == "completed"
    assert found.json()["result"]["text"]
    job = submit(client, text_job())
    wait_for_step(client, job["id"], 1)
    with pytest.raises(httpx.ReadTimeout):  # the client gives up long before the job could finish
        client.get(f"/v1/jobs/{job['id']}/result", params={"wait": "true"},
                   timeout=httpx.Timeout(60, read=0.5))
    done = done_of(client, job["id"])
    assert (done["state"], done["reason"]) == ("stopped", "disconnected") and within_one_step(done)
    assert client.get("/v1/jobs/not-a-job/result", params={"wait": "true"}).status_code == 404


def test_a_stop_whose_caller_goes_away_still_takes_effect(client, server):
    job = submit(client, text_job())
    wait_for_step(client, job["id"], 1)

    async def stop_and_leave() -> None:
        engine = server.engine()
        stop = asyncio.ensure_future(engine.stop(job["id"], ALICE_OWNER, "user"))
        await asyncio.sleep(0)  # let it begin, then cancel it as a server does when its client leaves
        stop.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stop
        await engine.wait(job["id"], ALICE_OWNER)  # the server's loop lives on (here: until the end)

    asyncio.run(stop_and_leave())
    done = done_of(client, job["id"])
    assert (done["state"], done["reason"]) == ("stopped", "user") and within_one_step(done)


@pytest.fixture
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=RAY_KEYS[0], max_retries=0)


def test_a_streaming_client_that_disconnects_stops_its_generation(client, server):
    body = {"model": "tiny-text", "prompt": "Once", "max_tokens": LONG, "stream": True, "temperature": 0}
    with client.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        first = next(sse_data(lines))
        for _ in range(3):
            next(sse_data(lines))
    done = done_of(client, first["id"].removeprefix("cmpl-"))
    assert (done["state"], done["reason"]) == ("stopped", "disconnected")
    assert 4 <= done["stop_step"] and within_one_step(done)


def test_a_non_streaming_client_that_gives_up_stops_its_generation(client):
    body = {"model": "tiny-text", "prompt": "Once", "max_tokens": LONG, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up long before the job could finish
        client.post("/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.5))
    job = client.get("/v1/jobs", params={"limit": 1}).json()["data"][0]["id"]
    done = done_of(client, job)
    assert (done["state"], done["reason"]) == ("stopped", "disconnected") and within_one_step(done)


def test_a_chat_client_that_disconnects_stops_its_generation(client):
    body = {
        "model": "tiny-text",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": LONG,
        "stream": True,
        "temperature": 0,
    }
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        lines = response.iter_lines()
        first = next(sse_data(lines))
        next(sse_data(lines))
    done = done_of(client, first["id"].removeprefix("chatcmpl-"))
    assert (done["state"], done["reason"]) == ("stopped", "disconnected") and within_one_step(done)


# -- the OpenAI-compatible API, with the official client ------------------------------------------------
def test_openai_models_and_a_completion_cut_at_a_stop_sequence(oai):
    assert {m.id for m in oai.models.list()} == {"tiny-text", "tiny-sd"}
    full = oai.completions.create(model="tiny-text", prompt="Once upon a time", max_tokens=24, temperature=0)
    choice = full.choices[0]
    assert choice.finish_reason == "length" and full.usage.completion_tokens == 24 and choice.text
    stop = choice.text[len(choice.text) // 2 :][:2]
    cut = oai.completions.create(
        model="tiny-text", prompt="Once upon a time", max_tokens=24, temperature=0, stop=[stop]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == choice.text[: choice.text.index(stop)]
    assert cut.stopcock["reason"] == "stop_string" and cut.stopcock["steps"] < 24  # type: ignore[attr-defined]


def test_openai_streamed_completion_and_chat_equal_the_whole(oai):
    whole = oai.completions.create(model="tiny-text", prompt="Hello", max_tokens=16, temperature=0)
    chunks = list(
        oai.completions.create(model="tiny-text", prompt="Hello", max_tokens=16, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    reply = oai.chat.completions.create(model="tiny-text", messages=messages, max_tokens=10, temperature=0)
    assert reply.choices[0].message.role == "assistant" and reply.choices[0].finish_reason == "length"
    stream = list(
        oai.chat.completions.create(
            model="tiny-text",
            messages=messages,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert stream[0].choices[0].delta.role == "assistant"
    assert (
        "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        == reply.choices[0].message.content
    )
    assert stream[-1].usage.completion_tokens == 10


def test_openai_image_generation(oai):
    from PIL import Image

    response = oai.images.generate(
        prompt="a red square", model="tiny-sd", response_format="b64_json", extra_body={"steps": 3, "seed": 1}
    )
    image = Image.open(io.BytesIO(base64.b64decode(response.data[0].b64_json)))
    assert image.size[0] > 0 and response.stopcock["steps"] == 3  # type: ignore[attr-defined]


def test_openai_bad_requests_are_4xx_errors_the_client_understands(oai):
    with pytest.raises(openai.NotFoundError, match="not served here"):
        oai.completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.UnprocessableEntityError, match="echo"):
        oai.completions.create(model="tiny-text", prompt="x", echo=True)
    with pytest.raises(openai.UnprocessableEntityError, match="b64_json"):
        oai.images.generate(prompt="x", response_format="url")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=str(oai.base_url), api_key="wrong", max_retries=0).models.list()


def test_the_job_api_stops_an_openai_request(oai, client):
    stream = oai.completions.create(
        model="tiny-text", prompt="Once", max_tokens=LONG, stream=True, temperature=0
    )
    first = next(iter(stream))
    stopped = client.post(f"/v1/jobs/{first.id.removeprefix('cmpl-')}/stop").json()
    chunks = list(stream)
    assert stopped["state"] == "stopped" and chunks[-1].choices[0].finish_reason == "stop"
    outcome = chunks[-1].stopcock  # type: ignore[attr-defined]
    assert (outcome["reason"], outcome["steps"]) == ("user", stopped["step"]) and within_one_step(stopped)


# -- the web page ------------------------------------------------------------------------------------


def test_the_page_generates_and_stops(server, client):
    with chromium() as browser:
        page = browser.new_page()
        page.set_default_timeout(60_000)
        page.goto(server.url)
        page.fill("#key", RAY_KEYS[0])
        page.dispatch_event("#key", "change")
        page.check("input[name=kind][value=text]")
        page.fill("#prompt", "Once upon a time")
        page.fill("#max-tokens", str(LONG))
        page.click("#generate")
        page.wait_for_function("Number(document.getElementById('progress').value) >= 3")
        page.click("#stop")
        status = page.locator("#status[data-state=stopped]")
        status.wait_for()
        job, step = status.get_attribute("data-job"), status.get_attribute("data-step")
    view = client.get(f"/v1/jobs/{job}").json()
    assert (view["state"], view["reason"], view["step"]) == ("stopped", "user", int(str(step)))
    assert within_one_step(view)


def test_the_local_engine_path_never_imports_ray():
    """Ray stays optional: the package, LocalEngine, the app and ``stopcock serve`` import no ray
    (the Ray engine's modules import it only when they deploy or call it)."""
    import subprocess
    import sys

    code = (
        "import sys, stopcock.server, stopcock.server.engine, stopcock.server.app, stopcock.server.serve,"
        " stopcock.server.ray_engine, stopcock.server.ray_deploy, stopcock.cli;"
        " stopcock.server.serve.configure(__import__('argparse').ArgumentParser());"
        " assert not [m for m in sys.modules if m == 'ray' or m.startswith('ray.')], 'ray was imported'"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
