"""repetition and grace in the server's stop fields, the OpenAI API's extension, and the CLI's flags."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from stopcock.conditions import Repetition, SoftTimeout, Timeout, from_options
from stopcock.server.backends import TextBackend
from stopcock.server.testing import serving

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def server(text_pipe):
    with (
        serving({"text": TextBackend(text_pipe, "tiny-text")}, concurrency=1, queue_size=4) as (url, _),
        httpx.Client(base_url=url, timeout=60) as client,
    ):
        yield client


def test_options():
    options = {"repetition": {"ngram": 2}, "timeout": 5, "grace": "line", "grace_max": 1}
    soft, rep = from_options(options)
    assert isinstance(rep, Repetition) and (rep.ngram, rep.repeats, rep.window) == (2, 3, 64)
    assert isinstance(soft, SoftTimeout) and (soft.seconds, soft.grace, soft.grace_max) == (5, "line", 1)
    assert [type(c) for c in from_options({"timeout": 5, "repetition": False})] == [Timeout]
    with pytest.raises(ValueError, match="give one of them too"):
        from_options({"grace": "line"})
    with pytest.raises(ValueError, match="give grace too"):
        from_options({"timeout": 1, "grace_max": 3})
    with pytest.raises(ValueError, match="known"):
        from_options({"repetition": {"n": 2}})


@pytest.mark.timeout(120)
def test_text_job_ends_where_it_loops(server):
    body = {"kind": "text", "prompt": "Once upon a time", "parameters": {"max_tokens": 200},
            "stop": {"repetition": {"ngram": 2, "repeats": 3}}}
    job = server.post("/v1/jobs", json=body)
    assert job.status_code == 201, job.text
    result = server.get(f"/v1/jobs/{job.json()['id']}/result", params={"wait": "true"}).json()
    outcome = result["job"]["outcome"]
    assert outcome["reason"] == "repetition" and outcome["steps"] < 200


@pytest.mark.timeout(120)
def test_openai_extension_field(server):
    body = {"model": "tiny-text", "prompt": "Once upon a time", "max_tokens": 200, "temperature": 0,
            "repetition": True}
    answer = server.post("/v1/completions", json=body).json()
    assert answer["stopcock"]["reason"] == "repetition" and answer["stopcock"]["steps"] < 200
    assert answer["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"kind": "image", "prompt": "x", "stop": {"repetition": True}}, "text jobs only"),
        ({"kind": "text", "prompt": "x", "stop": {"grace": "line"}}, "timeout"),
        ({"kind": "text", "prompt": "x", "stop": {"timeout": 5, "grace": "word"}}, "grace"),
        ({"kind": "text", "prompt": "x", "stop": {"repetition": {"ngram": 8, "repeats": 4, "window": 16}}},
         "window"),
    ],
)
def test_bad_stop_fields_answer_422(server, body, words):
    response = server.post("/v1/jobs", json=body)
    assert response.status_code == 422
    assert words in response.json()["error"]["message"]


@pytest.mark.timeout(120)
def test_cli_flags():
    run = [sys.executable, "-m", "stopcock", "text", "--prompt", "Beautiful is", "--progress", "none"]
    run.append("--json")
    done = subprocess.run([*run, "--timeout", "0", "--grace", "sentence"], capture_output=True, text=True,
                          timeout=100)
    report = json.loads(done.stdout)
    assert (report["reason"], report["text"], report["exit_code"]) == ("timeout", " better than ugly.", 3)
    bad = subprocess.run([*run, "--grace", "line"], capture_output=True, text=True, timeout=100)
    assert bad.returncode == 2 and "--grace applies to a timeout" in bad.stderr


@pytest.mark.timeout(300)
def test_batched_rows_end_as_a_run_alone_does(one_torch_thread):
    """Repetition and grace in a batch: each row ends where the job run alone ends."""
    from concurrent.futures import ThreadPoolExecutor

    from stopcock.server.backends import load_backends

    backend = load_backends(None, None)["text"]  # the demo text model: it loops from "Beautiful is"
    bodies = [
        {"kind": "text", "prompt": "Beautiful is", "parameters": {"max_tokens": 300, "temperature": 0},
         "stop": {"repetition": True}},
        {"kind": "text", "prompt": "Errors should", "parameters": {"max_tokens": 300, "temperature": 0},
         "stop": {"timeout": 0.001, "grace": "line", "grace_max": 600}},
    ]

    def results(**options):
        with serving({"text": backend}, **options) as (url, _), httpx.Client(base_url=url, timeout=120) as c:
            with ThreadPoolExecutor(2) as pool:
                ids = list(pool.map(lambda body: c.post("/v1/jobs", json=body).json()["id"], bodies))
            found = [c.get(f"/v1/jobs/{i}/result", params={"wait": "true"}).json() for i in ids]
            health = c.get("/v1/health").json()
        return [(r["result"]["text"], r["job"]["outcome"]["reason"]) for r in found], health

    alone, _ = results(batch_size=1)
    batched, health = results(batch_size=2, batch_wait=30.0)
    assert [reason for _, reason in alone] == ["repetition", "timeout"]
    assert alone[1][0].endswith("\n") and "\n" not in alone[1][0][:-1]
    assert batched == alone
    assert (health["batches_run"], health["batched_jobs"]) == (1, 2)  # the two ran as one batch


@pytest.mark.timeout(240)
def test_the_page_sends_repetition_and_grace():
    from browser import chromium  # tests/ is on sys.path under pytest

    from stopcock.server.backends import load_backends

    with (
        serving(load_backends(None, None), concurrency=1, queue_size=2) as (url, _),
        chromium() as browser,
    ):
        page = browser.new_page()
        page.set_default_timeout(60_000)
        page.goto(url)
        page.locator("#models[data-state=known]").wait_for()
        page.fill("#prompt", "Beautiful is")
        page.fill("#max-tokens", "300")
        page.check("#repetition")
        page.click("#generate")
        page.locator("#status[data-state=stopped]").wait_for()
        assert page.get_attribute("#status", "data-reason") == "repetition"
        assert page.inner_text("#output").endswith("In the facticality.\nIn the factical")
        page.uncheck("#repetition")
        page.fill("#time-limit", "0.001")
        page.select_option("#grace", "line")
        before = page.get_attribute("#status", "data-job")
        page.click("#generate")
        page.wait_for_function("""(before) => {
            const status = document.getElementById('status');
            return status.dataset.job !== before && status.dataset.state === 'stopped';
        }""", arg=before)
        assert page.get_attribute("#status", "data-reason") == "timeout"
        assert page.inner_text("#output") == " better than ugly.\n"  # the first line, whole
