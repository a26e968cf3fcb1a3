"""The Ray Serve engine on a local cluster (``ray_serve`` in conftest: 2 text replicas, 1 image
replica, 2 ingress replicas): what only a cluster shows. A stop reaches the replica that runs the
job through any ingress replica; a stop before any replica claimed the job is kept and the job never
starts; 100 jobs stopped at random moments by 12 concurrent clients, none running more than one step
past its stop and no replica above its concurrency; a replica killed mid-job; a registry restarted
between a stop and its effect; a paused job resumed after the replica that held it died (last: it
leaves Serve replacing that replica). The behaviours both engines share are in ``test_engine_contract.py``.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import RAY_KEYS

from stopcock.server.testing import sse_data

pytest.importorskip("ray.serve")

ALICE = {"Authorization": f"Bearer {RAY_KEYS[0]}"}
OWNER = hashlib.sha256(RAY_KEYS[0].encode()).hexdigest()
LONG = 1000
TAG = "x-stopcock-replica"


@pytest.fixture
def client(ray_serve) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=ray_serve.url, headers=ALICE, timeout=120) as http:
        yield http
        for job in http.get("/v1/jobs", params={"limit": 1000}).json()["data"]:
            if job["state"] not in ("stopped", "completed", "failed"):
                http.post(f"/v1/jobs/{job['id']}/stop")


def registry_call(ray_serve: Any, method: str, *args: Any) -> Any:
    return getattr(ray_serve.registry, method).remote(*args).result(timeout_s=180)


def replaced(ray_serve: Any, dead: str, kind: str = "text", count: int = 2, timeout: float = 150) -> set[str]:
    """The names of ``kind``'s replicas once Serve has replaced the ``dead`` one and the registry no
    longer counts it (the tests after this one then start from a true count of lanes)."""
    deadline = time.monotonic() + timeout
    while True:  # each call waits up to 2 s for a change: not a sleep
        names = {r["name"] for r in registry_call(ray_serve, "replicas", kind, count + 1, 2.0)}
        if dead not in names and len(names) == count:
            return names
        assert time.monotonic() < deadline, f"{dead} is still counted, or was not replaced: {names}"


def events(client: httpx.Client, job_id: str) -> Iterator[dict[str, Any]]:
    with client.stream("GET", f"/v1/jobs/{job_id}/events") as response:
        assert response.status_code == 200, response.read()
        yield from sse_data(response.iter_lines())


def wait_for_step(client: httpx.Client, job_id: str, step: int) -> dict[str, Any]:
    for event in events(client, job_id):
        assert event["type"] != "done", f"the job ended before step {step}: {event}"
        if event["type"] == "progress" and event["step"] >= step:
            return event
    raise AssertionError("the event stream ended without a done event")


def text_job(max_tokens: int = LONG) -> dict[str, Any]:
    return {"kind": "text", "prompt": "Once upon a time", "parameters": {"max_tokens": max_tokens}}


def submit(client: httpx.Client, body: dict[str, Any]) -> httpx.Response:
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 201, response.text
    return response


def within_one_step(view: dict[str, Any]) -> bool:
    return view["stop_step"] <= view["step"] <= view["stop_step"] + 1


def test_a_stop_reaches_the_replica_that_runs_the_job_through_any_ingress(ray_serve, client):
    a, b = (submit(client, text_job()).json() for _ in range(2))
    for job in (a, b):
        wait_for_step(client, job["id"], 2)
    where = {registry_call(ray_serve, "placement", job["id"]) for job in (a, b)}
    assert len(where) == 2 and all("TextModel" in name for name in where)  # one job on each replica
    stopped = client.post(f"/v1/jobs/{b['id']}/stop").json()
    assert (stopped["state"], stopped["reason"]) == ("stopped", "user") and within_one_step(stopped)
    reached = client.get(f"/v1/jobs/{a['id']}").json()["step"]
    assert wait_for_step(client, a["id"], reached + 3)["step"] > reached  # the other job runs on
    assert client.post(f"/v1/jobs/{a['id']}/stop").json()["state"] == "stopped"

    # the proxy spreads requests over the 2 ingress replicas: a job submitted through one of them
    # is stopped, exactly, through the other (they share nothing but the registry)
    for _ in range(40):
        submitted = submit(client, text_job())
        job = submitted.json()
        wait_for_step(client, job["id"], 1)
        answer = client.post(f"/v1/jobs/{job['id']}/stop")
        stopped = answer.json()
        assert (stopped["state"], stopped["reason"]) == ("stopped", "user") and within_one_step(stopped)
        if answer.headers[TAG] != submitted.headers[TAG]:
            break
    else:
        pytest.fail("40 stops all went through the ingress replica of their submit")


def test_a_stop_before_any_replica_claimed_the_job_is_kept_and_it_never_starts(ray_serve, client):
    busy = [submit(client, text_job()).json() for _ in range(2)]
    for job in busy:
        wait_for_step(client, job["id"], 1)
    waiting = submit(client, text_job()).json()  # both replicas are busy: its request waits in Serve
    stopped = client.post(f"/v1/jobs/{waiting['id']}/stop").json()
    assert (stopped["state"], stopped["started"], stopped["step"]) == ("stopped", None, 0)
    refused = registry_call(ray_serve, "stats")["refused_claims"]
    for job in busy:
        client.post(f"/v1/jobs/{job['id']}/stop")
    # a freed replica gets the request, asks the registry for the claim, and is refused
    assert registry_call(ray_serve, "settled", waiting["id"], 120) == "refused"
    assert registry_call(ray_serve, "stats")["refused_claims"] == refused + 1
    assert [e["type"] for e in events(client, waiting["id"])] == ["queued", "done"]
    assert client.get(f"/v1/jobs/{waiting['id']}").json() == stopped
    assert registry_call(ray_serve, "placement", waiting["id"]) is None


def test_100_jobs_stopped_at_random_moments_none_runs_past_its_stop(ray_serve):
    """12 concurrent clients, 100 jobs (a fifth of them images), each stopped at a random moment:
    right after its submit, or after a random number of its progress events. Every one ends
    stopped, within one step of its stop_step (none before it started ran a step), and no replica
    ever ran more pipelines than its one lane."""
    rng = random.Random(0)
    plans = [(rng.random() < 0.2, rng.choice([0, 0, *range(1, 20)])) for _ in range(100)]
    views: list[tuple[bool, int, dict[str, Any]]] = []

    async def one(client: httpx.AsyncClient, image: bool, after: int) -> None:
        body = (
            {"kind": "image", "prompt": "a red square", "parameters": {"steps": 200, "previews": False}}
            if image
            else text_job()
        )
        response = await client.post("/v1/jobs", json=body)
        assert response.status_code == 201, response.text
        job = response.json()["id"]
        if after:
            async with client.stream("GET", f"/v1/jobs/{job}/events") as stream:
                async for line in stream.aiter_lines():
                    event = next(sse_data((line,)), None)
                    if (
                        event is not None
                        and event["type"] == "progress"
                        and event["step"] >= min(after, 4 if image else after)
                    ):
                        break
        views.append((image, after, (await client.post(f"/v1/jobs/{job}/stop")).json()))

    async def main() -> None:
        pending = list(plans)

        async def worker() -> None:
            async with httpx.AsyncClient(base_url=ray_serve.url, headers=ALICE, timeout=120) as client:
                while pending:
                    await one(client, *pending.pop())

        await asyncio.gather(*(worker() for _ in range(12)))

    asyncio.run(main())
    assert len(views) == 100
    for image, after, view in views:
        assert (view["state"], view["reason"]) == ("stopped", "user"), view
        assert within_one_step(view), view  # 0 jobs ran on past their stop
        if view["started"] is None:
            assert view["step"] == 0
        if after:
            assert view["stop_step"] >= min(after, 4 if image else after)  # stopped after what the client saw
    stats = registry_call(ray_serve, "stats")
    assert stats["pipelines_peak"] <= stats["concurrency"] == 1  # no replica above its concurrency
    assert (stats["running"], stats["queued"]) == (0, 0)
    for kind in ("text", "image"):
        assert all(r["peak"] <= r["concurrency"] for r in registry_call(ray_serve, "replicas", kind))


def test_a_replica_killed_mid_job_fails_the_job_which_is_not_run_again(ray_serve, client):
    import ray

    body = {"model": "tiny-text", "prompt": "Once", "max_tokens": LONG, "stream": True, "temperature": 0}
    with client.stream("POST", "/v1/completions", json=body) as response:
        chunks = sse_data(response.iter_lines())
        job = next(chunks)["id"].removeprefix("cmpl-")
        next(chunks)
        replica = registry_call(ray_serve, "placement", job)
        ray.kill(ray.get_actor(replica, namespace="serve"), no_restart=True)
        rest = list(chunks)  # the client's stream ends, with the job's end
    assert "error" in rest[-1] and "generation failed" in rest[-1]["error"]["message"]
    assert "died" in rest[-1]["error"]["message"]
    view = client.get(f"/v1/jobs/{job}").json()
    assert (view["state"], view["reason"]) == ("failed", "error")
    assert replica in view["error"] and "not run again" in view["error"]
    assert client.post(f"/v1/jobs/{job}/stop").json() == view  # a stop answers with that state
    seen = list(events(client, job))
    assert seen[-1]["state"] == "failed" and [e["type"] for e in seen].count("started") == 1
    # Serve replaces the replica; the job stays failed, not run again
    healed = registry_call(ray_serve, "replicas", "text", 2, 150)
    assert len(healed) == 2 and replica not in {r["name"] for r in healed}
    assert client.get(f"/v1/jobs/{job}").json() == view
    assert registry_call(ray_serve, "settled", job, 10) == "failed"
    again = submit(client, text_job(3)).json()  # the deployment serves on
    assert list(events(client, again["id"]))[-1]["state"] == "completed"


def test_a_registry_restart_loses_no_acknowledged_stop(ray_serve, client):
    import ray

    from stopcock.server.ray_engine.ingress import RayEngine

    running = [submit(client, text_job()).json() for _ in range(2)]
    for job in running:
        wait_for_step(client, job["id"], 1)
    queued = submit(client, text_job()).json()
    tombstone = submit(client, text_job()).json()
    assert client.post(f"/v1/jobs/{tombstone['id']}/stop").json()["started"] is None
    registry = registry_call(ray_serve, "whoami")

    async def stop_then_kill() -> dict[str, Any]:
        engine = RayEngine(ray_serve.registry, {"text": {"id": "tiny-text", "description": ""}})
        view = await engine.stop(running[0]["id"], OWNER, "user", wait=False)  # acknowledged now...
        ray.kill(ray.get_actor(registry, namespace="serve"), no_restart=True)  # ...then the registry dies
        return view.to_json()

    acknowledged = asyncio.run(stop_then_kill())
    assert acknowledged["state"] in ("stopping", "stopped")
    # every call below waits for Serve to restart the registry, which reads its journal back
    done = list(events(client, running[0]["id"]))[-1]
    assert (done["state"], done["reason"]) == ("stopped", "user") and within_one_step(done)
    assert registry_call(ray_serve, "whoami") != registry
    kept = client.get(f"/v1/jobs/{tombstone['id']}").json()
    assert (kept["state"], kept["started"], kept["step"]) == ("stopped", None, 0)
    other = client.post(f"/v1/jobs/{running[1]['id']}/stop").json()  # still running, still stoppable
    assert (other["state"], other["reason"]) == ("stopped", "user") and within_one_step(other)
    wait_for_step(client, queued["id"], 1)  # the queued job was sent again, and runs
    stopped = client.post(f"/v1/jobs/{queued['id']}/stop").json()
    assert (stopped["state"], stopped["reason"]) == ("stopped", "user") and within_one_step(stopped)
    assert client.get(f"/v1/jobs/{tombstone['id']}").json() == kept  # never started
    stats = registry_call(ray_serve, "stats")
    assert (stats["running"], stats["queued"]) == (0, 0)
    assert len(registry_call(ray_serve, "replicas", "text", 2, 60)) == 2  # the replicas found it again


def test_a_paused_job_resumes_after_the_replica_that_held_it_died(ray_serve, client):
    """A paused job's checkpoint is in the object store, owned by the registry: it outlives the
    replica that made it, and another replica resumes the job with the text of an uninterrupted run."""
    import ray

    sampled = {"max_tokens": 40, "temperature": 1.0, "top_p": 0.9, "seed": 5}
    body = {"kind": "text", "prompt": "Once upon a time", "parameters": sampled}
    alone = submit(client, body).json()
    assert list(events(client, alone["id"]))[-1]["state"] == "completed"
    job = submit(client, body).json()
    wait_for_step(client, job["id"], 3)
    replica = registry_call(ray_serve, "placement", job["id"])
    paused = client.post(f"/v1/jobs/{job['id']}/pause").json()
    assert paused["state"] == "paused" and paused["checkpoint_step"] == paused["step"] >= 3
    ray.kill(ray.get_actor(replica, namespace="serve"), no_restart=True)
    assert client.post(f"/v1/jobs/{job['id']}/resume").json()["state"] == "queued"
    done = list(events(client, job["id"]))[-1]
    assert (done["state"], done["saved_steps"]) == ("completed", paused["step"]), done
    assert registry_call(ray_serve, "placement", job["id"]) not in (None, replica)
    texts = [client.get(f"/v1/jobs/{j['id']}/result").json()["result"]["text"] for j in (alone, job)]
    assert texts[0] == texts[1] != ""
    assert replica not in replaced(ray_serve, replica)  # Serve replaces it; the registry lets it go
