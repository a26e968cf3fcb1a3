"""Jobs with several prompts on a real uvicorn server: items run one after the other, each announced
by ``item`` events; ``POST /v1/jobs/{id}/skip`` ends the current item, ``POST /v1/jobs/{id}/stop?at=item``
lets it finish and starts no other. The test-only throttle keeps items running until the test acts
on an event (never a sleep)."""

from __future__ import annotations

from typing import Any

import pytest
from test_server import LONG, events, serve, submit  # tests/ is on sys.path

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["Once upon a time", "Hello world", "The quick brown fox"]


@pytest.fixture(scope="module")
def server(server_backends):
    with serve(server_backends, concurrency=1, queue_size=4) as (client, _):
        yield client


def several(kind: str, size: int, **stop: Any) -> dict[str, Any]:
    parameters = {"max_tokens": size} if kind == "text" else {"steps": size, "previews": False}
    return {"kind": kind, "prompts": PROMPTS, "parameters": parameters, "stop": stop}


def act_at(client, job_id: str, item: int, step: int, action: str) -> list[dict[str, Any]]:
    """Follow the job; at ``step`` of item ``item``, POST ``action``; returns every event to done."""
    seen, current, acted = [], None, False
    for event in events(client, job_id):
        seen.append(event)
        if event["type"] == "item" and event["state"] == "started":
            current = event["index"]
        if not acted and current == item and event["type"] == "progress" and event["step"] >= step:
            response = client.post(f"/v1/jobs/{job_id}/{action}")
            assert response.status_code == 200, response.text
            assert response.json()["state"] == "running"  # answered at once, the job still running
            acted = True
    return seen


def test_several_prompts_complete_item_by_item(server):
    job = submit(server, several("text", 6))
    seen = list(events(server, job["id"]))
    items = [(e["index"], e["state"]) for e in seen if e["type"] == "item"]
    assert items == [(0, "started"), (0, "ended"), (1, "started"), (1, "ended"), (2, "started"), (2, "ended")]
    done = seen[-1]
    assert (done["state"], done["outcome"]["item_reasons"], done["step"]) == (
        "completed",
        ["completed"] * 3,
        18,
    )
    result = server.get(f"/v1/jobs/{job['id']}/result").json()["result"]
    assert [item["prompt"] for item in result["items"]] == PROMPTS
    assert all(item["text"] and item["completion_tokens"] == 6 for item in result["items"])


@pytest.mark.parametrize("kind", ["text", "image"])
def test_skip_ends_the_current_item_and_goes_on(server, kind):
    size = LONG if kind == "text" else 200
    job = submit(server, several(kind, size, max_steps=8))  # the items not skipped end at step 8
    seen = act_at(server, job["id"], item=1, step=3, action="skip")
    ended = [e for e in seen if e["type"] == "item" and e["state"] == "ended"]
    assert [e["reason"] for e in ended] == ["max_steps", "skipped", "max_steps"]
    assert 3 <= ended[1]["steps"] <= 4  # the step in flight when the skip came, at most
    done = seen[-1]  # every prompt ran: the job completed, each item ended as its reason says
    assert done["state"] == "completed"
    assert done["outcome"]["item_reasons"] == ["max_steps", "skipped", "max_steps"]
    result = server.get(f"/v1/jobs/{job['id']}/result").json()["result"]
    key = "text" if kind == "text" else "image"
    assert all(item[key] for item in result["items"])  # the skipped item keeps its partial result


def test_stop_at_item_lets_the_current_item_finish(server):
    job = submit(server, several("text", 12))
    seen = act_at(server, job["id"], item=0, step=3, action="stop?at=item")
    ended = [e for e in seen if e["type"] == "item" and e["state"] == "ended"]
    assert [(e["index"], e["reason"], e["steps"]) for e in ended] == [(0, "completed", 12)]
    done = seen[-1]
    assert (done["state"], done["reason"], done["outcome"]["item_reasons"]) == (
        "stopped",
        "user",
        ["completed"],
    )


def test_skip_and_stop_at_item_on_jobs_not_running(server):
    job = submit(server, several("text", 4))
    list(events(server, job["id"]))
    finished = server.post(f"/v1/jobs/{job['id']}/skip").json()
    assert finished["state"] == "completed"  # left as it ended
    assert server.post("/v1/jobs/unknown/skip").status_code == 404
    bad = server.post(f"/v1/jobs/{job['id']}/stop?at=later")
    assert bad.status_code == 422 and "error" in bad.json()


def test_a_job_takes_prompt_or_prompts(server):
    both = {**several("text", 4), "prompt": "x"}
    for body in (both, {"kind": "text", "parameters": {}}, {**several("text", 4), "prompts": []}):
        response = server.post("/v1/jobs", json=body)
        assert response.status_code == 422 and "error" in response.json(), body
