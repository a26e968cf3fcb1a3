"""Pause, resume and priority preemption in the server (real uvicorn, tiny real models): a job paused
and resumed, or preempted by a higher-priority job, ends with the result of a run never held; the
views and events say so; only the owner can pause; a held job can still be stopped."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from stopcock.server.testing import serving, sse_data

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KEY, OTHER = {"Authorization": "Bearer owner-key"}, {"Authorization": "Bearer other-key"}


@contextlib.contextmanager
def serve(backends, **options: Any) -> Iterator[httpx.Client]:
    with (
        serving(backends, api_keys=["owner-key", "other-key"], step_delay=0.01, **options) as (url, _),
        httpx.Client(base_url=url, timeout=120, headers=KEY) as client,
    ):
        yield client


@pytest.fixture(scope="module")
def server(server_backends):
    with serve(server_backends, concurrency=1, queue_size=8) as client:
        yield client


def submit(client: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 201, response.text
    return response.json()


def until(client: httpx.Client, job_id: str, what) -> dict[str, Any]:
    """The first event of the job that ``what(event)`` accepts (the stream ends with ``done``)."""
    with client.stream("GET", f"/v1/jobs/{job_id}/events") as response:
        for event in sse_data(response.iter_lines()):
            if what(event):
                return event
            assert event["type"] != "done", f"the job ended first: {event}"
    raise AssertionError("the event stream ended without a done event")


def finished(client: httpx.Client, job_id: str) -> dict[str, Any]:
    done = until(client, job_id, lambda e: e["type"] == "done")
    return {**done, "result": client.get(f"/v1/jobs/{job_id}/result").json()["result"]}


def image_job(seed: int = 3, priority: int = 0, steps: int = 24) -> dict[str, Any]:
    return {
        "kind": "image",
        "prompt": "a lighthouse",
        "priority": priority,
        "parameters": {"steps": steps, "seed": seed, "previews": False},
    }


def text_job(priority: int = 0, **parameters: Any) -> dict[str, Any]:
    return {
        "kind": "text",
        "prompt": "Once upon a time",
        "priority": priority,
        "parameters": {"max_tokens": 40, **parameters},
    }


def progressed(step: int):
    return lambda e: e["type"] == "progress" and e["step"] >= step


@pytest.mark.parametrize("body", [image_job(), text_job(temperature=0.8, seed=5)], ids=["image", "text"])
def test_pause_and_resume_give_the_result_of_a_run_never_paused(server, body):
    reference = finished(server, submit(server, body)["id"])
    job = submit(server, body)
    until(server, job["id"], progressed(3))
    assert server.post(f"/v1/jobs/{job['id']}/pause", headers=OTHER).status_code == 404  # the owner's only
    paused = server.post(f"/v1/jobs/{job['id']}/pause").json()
    assert paused["state"] == "paused" and paused["checkpoint_step"] == paused["step"] >= 3
    assert server.post(f"/v1/jobs/{job['id']}/pause").json()["state"] == "paused"  # idempotent
    assert server.get("/v1/health").json()["running"] == 0  # its worker is free meanwhile
    assert server.post(f"/v1/jobs/{job['id']}/resume", headers=OTHER).status_code == 404
    assert server.post(f"/v1/jobs/{job['id']}/resume").json()["state"] in ("queued", "running", "completed")
    done = finished(server, job["id"])
    assert done["state"] == "completed" and done["step"] == reference["step"]
    assert done["saved_steps"] == paused["checkpoint_step"] and done["outcome"]["resumed"]["exact"] is True
    assert done["result"] == reference["result"]
    kinds = [e["type"] for e in sse_data(server.get(f"/v1/jobs/{job['id']}/events").iter_lines())]
    assert kinds.count("started") == 2 and "paused" in kinds and "resumed" in kinds and kinds[-1] == "done"


def test_a_higher_priority_job_preempts_and_the_preempted_one_resumes_identically(server):
    reference = finished(server, submit(server, image_job(seed=4))["id"])
    low = submit(server, image_job(seed=4, priority=0))
    until(server, low["id"], progressed(3))
    high = submit(server, text_job(priority=5))
    preempted = until(server, low["id"], lambda e: e["type"] == "preempted")
    assert preempted["checkpoint_step"] >= 3
    high_done, low_done = finished(server, high["id"]), finished(server, low["id"])
    assert high_done["state"] == low_done["state"] == "completed"
    assert high_done["finished"] < low_done["finished"]  # the preempted job resumed afterwards
    assert low_done["preemptions"] == 1 and low_done["saved_steps"] == preempted["checkpoint_step"]
    assert low_done["result"] == reference["result"]


def test_preemption_order_takes_the_lowest_priority_first(server_backends):
    with serve(server_backends, concurrency=2, queue_size=8) as client:
        jobs = {p: submit(client, text_job(priority=p, max_tokens=400)) for p in (1, 0)}
        for job in jobs.values():
            until(client, job["id"], progressed(2))
        urgent = submit(client, text_job(priority=9, max_tokens=5))
        until(client, jobs[0]["id"], lambda e: e["type"] == "preempted")
        assert finished(client, urgent["id"])["state"] == "completed"
        assert client.get(f"/v1/jobs/{jobs[1]['id']}").json()["preemptions"] == 0
        same = submit(client, text_job(priority=1, max_tokens=5))  # equal priority: waits, preempts no one
        assert finished(client, same["id"])["state"] == "completed"
        assert client.get(f"/v1/jobs/{jobs[1]['id']}").json()["preemptions"] == 0
        for job in jobs.values():
            client.post(f"/v1/jobs/{job['id']}/stop")


def test_a_held_job_can_be_stopped_and_an_ended_one_cannot_pause(server):
    job = submit(server, text_job(max_tokens=400))
    until(server, job["id"], progressed(2))
    paused = server.post(f"/v1/jobs/{job['id']}/pause").json()
    stopped = server.post(f"/v1/jobs/{job['id']}/stop").json()
    assert (stopped["state"], stopped["reason"], stopped["step"]) == ("stopped", "user", paused["step"])
    assert "stopped while paused" in stopped["outcome"]["detail"]
    result = server.get(f"/v1/jobs/{job['id']}/result").json()["result"]
    assert result["completion_tokens"] == paused["step"] and result["text"]
    for action in ("pause", "resume"):
        refused = server.post(f"/v1/jobs/{job['id']}/{action}")
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "job_state_conflict"
    assert server.post("/v1/jobs/nope/pause").status_code == 404


def test_a_queued_job_paused_never_runs_until_resumed(server):
    running = submit(server, text_job(max_tokens=400))
    until(server, running["id"], progressed(1))
    queued = submit(server, text_job(max_tokens=3))
    paused = server.post(f"/v1/jobs/{queued['id']}/pause").json()
    assert paused["state"] == "paused" and paused["started"] is None and paused["checkpoint_step"] is None
    server.post(f"/v1/jobs/{running['id']}/stop")
    assert server.get(f"/v1/jobs/{queued['id']}").json()["state"] == "paused"
    server.post(f"/v1/jobs/{queued['id']}/resume")
    assert finished(server, queued["id"])["state"] == "completed"


def test_a_paused_job_resumes_from_its_checkpoint_saved_to_a_file(server_backends, tmp_path):
    """What an engine that moves checkpoints between processes relies on: the lanes resume from a
    checkpoint that went through a file (the text lane's own sampler made again at its saved state)."""
    from stopcock.checkpoint import Checkpoint

    with (
        serving(server_backends, api_keys=["owner-key"], step_delay=0.01, concurrency=1) as (url, engine),
        httpx.Client(base_url=url, timeout=120, headers=KEY) as client,
    ):
        for body in (text_job(temperature=0.9, seed=11), image_job(seed=6)):
            reference = finished(client, submit(client, body)["id"])
            job = submit(client, body)
            until(client, job["id"], progressed(3))
            client.post(f"/v1/jobs/{job['id']}/pause")
            held = engine._jobs[job["id"]]
            held.checkpoint = Checkpoint.load(held.checkpoint.save(tmp_path / f"{body['kind']}.safetensors"))
            assert held.checkpoint.live == (["logits_processor"] if body["kind"] == "text" else [])
            client.post(f"/v1/jobs/{job['id']}/resume")
            done = finished(client, job["id"])
            assert done["state"] == "completed" and done["result"] == reference["result"], body["kind"]


def test_a_job_of_several_prompts_pauses_at_its_prompt_and_resumes_identically(server):
    body = {"kind": "text", "prompts": ["Once upon a time", "Hello world", "The quick brown fox"],
            "parameters": {"max_tokens": 30, "temperature": 0.7, "seed": 2}}
    reference = finished(server, submit(server, body)["id"])
    job = submit(server, body)
    until(server, job["id"], lambda e: e["type"] == "item" and e["index"] == 1 and e["state"] == "started")
    until(server, job["id"], progressed(3))
    paused = server.post(f"/v1/jobs/{job['id']}/pause").json()
    assert paused["state"] == "paused" and paused["checkpoint_step"] is not None
    server.post(f"/v1/jobs/{job['id']}/resume")
    done = finished(server, job["id"])
    assert done["state"] == "completed" and done["outcome"]["item_reasons"] == ["completed"] * 3
    assert done["result"] == reference["result"]
