"""A text model served as a group of ranks (``stopcock serve --tp N``): rank 0 in the server process,
rank 1 a worker process, a tiny Llama sharded with transformers' tensor parallelism (gloo, CPU).

A real uvicorn server over the local engine. A stop from a server request (by id, a timeout, a client
that goes away) must end the job on every rank at the same step: the worker's own report of its
run (written to the group's store by the worker) is read next to the job's outcome. The job's text
must be the unsharded model's, the server must stay usable after a stop, and closing the model must
end the worker process. Every wait is bounded.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch.distributed as dist
from test_ranks_cli import llama_dir  # noqa: F401 - the tiny Llama fixture (tests/ is on sys.path)
from test_server import events, submit, wait_for_step

import stopcock
from stopcock.errors import UserError
from stopcock.server import ranked
from stopcock.server.ranked import RankedTextBackend
from stopcock.server.testing import serving, sse_data

PROMPT = "Once upon a time"
DELAY = 0.05  # the test-only throttle after each step, cut short by a stop: a stop lands mid-run


@pytest.fixture(scope="module")
def served(llama_dir: Path, one_torch_thread) -> Iterator[tuple[httpx.Client, RankedTextBackend]]:  # noqa: F811
    """A server whose text model is sharded over 2 local ranks; the worker must have ended after."""
    assert not dist.is_initialized()
    backend = RankedTextBackend.load(str(llama_dir), 2)
    workers = list(backend.group.procs)
    try:
        with (
            serving({"text": backend}, step_delay=DELAY, stop_grace=5.0) as (url, _),
            httpx.Client(base_url=url, timeout=120) as client,
        ):
            yield client, backend
    finally:
        backend.close()
    assert [w.returncode for w in workers] == [0]  # told to leave, and left
    assert not dist.is_initialized()


@pytest.fixture(scope="module")
def unsharded(llama_dir: Path):  # noqa: F811
    """The same model in one process: what each job's text must be."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    model = AutoModelForCausalLM.from_pretrained(llama_dir).eval()
    pipe = pipeline("text-generation", model=model, tokenizer=AutoTokenizer.from_pretrained(llama_dir))

    def text(tokens: int) -> str:
        outcome = stopcock.run(pipe, PROMPT, max_new_tokens=tokens, do_sample=False, return_full_text=False)
        return str(outcome.output[0]["generated_text"])

    return text


def _job(max_tokens: int, **stop: Any) -> dict[str, Any]:
    return {"kind": "text", "prompt": PROMPT, "parameters": {"max_tokens": max_tokens, "temperature": 0},
            "stop": stop}


def _worker_end(backend: RankedTextBackend) -> dict[str, Any]:
    """How rank 1 reported the end of the group's last run (its steps, reason and text)."""
    (report,) = backend.group.reports[-1]
    return report


def _result(client: httpx.Client, job_id: str) -> dict[str, Any]:
    return client.get(f"/v1/jobs/{job_id}/result", params={"wait": "true"}).json()


@pytest.mark.timeout(600)
def test_a_stop_by_id_ends_every_rank_at_the_same_step(served, unsharded):
    client, backend = served
    job = submit(client, _job(200))
    wait_for_step(client, job["id"], 3)
    stopped = client.post(f"/v1/jobs/{job['id']}/stop").json()
    assert (stopped["state"], stopped["reason"]) == ("stopped", "user")
    steps = stopped["outcome"]["steps"]
    worker = _worker_end(backend)
    assert (worker["stopped"], worker["reason"], worker["steps"]) == (True, "user", steps)
    assert 3 <= steps < 200
    result = _result(client, job["id"])["result"]
    assert result["text"] == worker["tokens"][0]["generated_text"] == unsharded(steps)

    # the server goes on: the next job runs on both ranks to its end, with the unsharded text
    done = _result(client, submit(client, _job(12))["id"])
    assert (done["job"]["state"], done["job"]["outcome"]["steps"]) == ("completed", 12)
    assert done["result"]["text"] == unsharded(12)
    assert _worker_end(backend)["steps"] == 12


@pytest.mark.timeout(600)
def test_a_timeout_and_a_client_gone_end_every_rank_at_the_same_step(served):
    client, backend = served
    timed = _result(client, submit(client, _job(200, timeout=0.3))["id"])["job"]  # rank 0's clock
    assert (timed["state"], timed["reason"]) == ("stopped", "timeout")
    assert _worker_end(backend)["steps"] == timed["outcome"]["steps"] < 200

    job = submit(client, _job(200))
    stream = client.stream("GET", f"/v1/jobs/{job['id']}/events", params={"stop_on_disconnect": "true"})
    with stream as response:
        for event in sse_data(response.iter_lines()):
            if event["type"] == "progress" and event["step"] >= 3:
                break  # the client goes away at step 3
    gone = _result(client, job["id"])["job"]
    assert (gone["state"], gone["reason"]) == ("stopped", "disconnected")
    worker = _worker_end(backend)
    assert (worker["reason"], worker["steps"]) == ("disconnected", gone["outcome"]["steps"])
    assert [e["type"] for e in events(client, job["id"])][-1] == "done"


def test_what_a_group_cannot_agree_on_is_refused(served):
    client, _ = served
    for stop in ({"stop_strings": ["x"]}, {"repetition": True}, {"timeout": 5, "grace": "line"}):
        refused = client.post("/v1/jobs", json=_job(10, **stop))
        assert refused.status_code == 400 and "not agreed across the ranks" in refused.text, stop
    with pytest.raises(UserError, match="give --text-model"):
        ranked.load_ranked_backends(None, None, 2, threads=None, concurrency=1)
    with pytest.raises(UserError, match="drop --concurrency"):
        ranked.load_ranked_backends("x", None, 2, threads=None, concurrency=2)


def test_the_serve_command_refuses_a_model_that_cannot_be_sharded(text_model_dir, capsys):
    from stopcock.server.serve import main

    assert main(["--text-model", str(text_model_dir), "--tp", "2", "--port", "0"]) == 1
    assert "GPT2LMHeadModel has no tensor-parallel plan" in capsys.readouterr().err
    assert main(["--text-model", str(text_model_dir), "--tp", "2", "--engine", "ray", "--port", "0"]) == 1
    assert "drop --engine ray" in capsys.readouterr().err


@pytest.mark.timeout(600)
def test_the_serve_command_serves_a_sharded_model_and_its_end_ends_the_worker(llama_dir: Path):  # noqa: F811
    import os
    import re
    import signal
    import subprocess
    import sys

    from test_ranks_cli import _children, _exits_within

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "stopcock", "serve", "--text-model", str(llama_dir), "--tp", "2",
               "--port", "0"]
    server = subprocess.Popen(command, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert server.stderr is not None
        url = None
        for line in server.stderr:
            found = re.search(r"running on (http://\S+)", line)
            if found:
                url = found.group(1)
                break
        assert url is not None, "the server ended before serving"
        (worker,) = _children(server.pid)
        with httpx.Client(base_url=url, timeout=120) as client:
            done = _result(client, submit(client, _job(6))["id"])
        assert (done["job"]["state"], done["job"]["outcome"]["steps"]) == ("completed", 6)
        server.send_signal(signal.SIGINT)  # Ctrl+C: the server shuts down, and ends the other rank
        server.wait(120)
        assert _exits_within(worker, 0)  # gone by the time the server has exited
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


@pytest.mark.timeout(600)
def test_a_second_group_agrees_too_and_a_killed_worker_fails_its_job(llama_dir: Path, served):  # noqa: F811
    """After a group has ended, a new one (new workers) in this process: rank 0 counts its runs from the
    start again, as the new workers do, so a stop is still agreed (else the announcement would wait for
    acknowledgements under another key). Then its worker is killed mid-job. Last of the tests on
    ``served``: it ends that group first."""
    client, first = served
    job = submit(client, _job(200))
    wait_for_step(client, job["id"], 2)
    assert client.post(f"/v1/jobs/{job['id']}/stop").json()["reason"] == "user"  # runs on the first group
    client.close()
    first.close()  # as the end of the served fixture does; closing again there changes nothing
    second = RankedTextBackend.load(str(llama_dir), 2)
    try:
        with serving({"text": second}, step_delay=DELAY) as (url, _), httpx.Client(base_url=url) as c:
            job = submit(c, _job(200))
            wait_for_step(c, job["id"], 3)
            stopped = c.post(f"/v1/jobs/{job['id']}/stop").json()
            assert (stopped["state"], stopped["reason"]) == ("stopped", "user")
            assert _worker_end(second)["steps"] == stopped["outcome"]["steps"]

            # a worker killed mid-job: rank 0's next collective fails, the job fails saying so, and the
            # model refuses new jobs (503) instead of leaving them to wait for a rank that is gone
            job = submit(c, _job(200))
            wait_for_step(c, job["id"], 3)
            (worker,) = second.group.procs
            worker.kill()
            worker.wait()
            failed = _result(c, job["id"])["job"]
            assert failed["state"] == "failed" and "RankLost" in failed["error"], failed
            assert "has died" in failed["error"] and "restarted" in failed["error"]
            refused = c.post("/v1/jobs", json=_job(5))
            assert refused.status_code == 503 and "restart the server" in refused.text
    finally:
        second.close()
