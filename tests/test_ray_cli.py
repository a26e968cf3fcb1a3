"""``stopcock serve --engine ray`` as a user runs it: a subprocess that starts its own local Ray
cluster, serves on loopback, and on Ctrl+C stops every job (reason ``"shutdown"``), removes the
application, shuts the cluster down and exits 130."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import httpx
import pytest
from conftest import free_port

from stopcock.server.serve import STEP_DELAY_ENV
from stopcock.server.testing import sse_data

pytest.importorskip("ray.serve")


def test_serve_on_ray_runs_and_shuts_down_cleanly_on_ctrl_c(text_model_dir, tmp_path):
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", STEP_DELAY_ENV: "0.05", "RAY_AUTH_MODE": "disabled"}
    command = [
        sys.executable,
        "-m",
        "stopcock.cli",
        "serve",
        "--engine",
        "ray",
        "--text-model",
        str(text_model_dir),
        "--port",
        str(port),
        "--api-key",
        "secret",
        "--replicas",
        "1",
    ]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        assert process.stderr is not None
        for line in process.stderr:
            found = re.search(r"running on (http://127\.0\.0\.1:\d+) \(Ray Serve", line)
            if found:
                break
        else:
            pytest.fail("the server never said it was running")
        url = found.group(1)
        assert url.endswith(f":{port}")
        with httpx.Client(base_url=url, headers={"Authorization": "Bearer secret"}, timeout=120) as client:
            assert client.get("/v1/models").json()["data"][0]["stopcock_kind"] == "text"
            assert client.get("/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
            job = client.post(
                "/v1/jobs", json={"kind": "text", "prompt": "Hi", "parameters": {"max_tokens": 1000}}
            )
            with client.stream("GET", f"/v1/jobs/{job.json()['id']}/events") as events:
                for event in sse_data(events.iter_lines()):
                    if event["type"] == "progress" and event["step"] >= 2:
                        os.killpg(process.pid, signal.SIGINT)  # Ctrl+C in its terminal: the whole group
                    if event["type"] == "done":
                        break
        assert (event["state"], event["reason"]) == ("stopped", "shutdown") and event["step"] < 1000
        assert process.wait(timeout=120) == 130
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def test_a_missing_model_is_a_one_line_error_before_any_cluster(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "stopcock.cli",
            "serve",
            "--engine",
            "ray",
            "--text-model",
            str(tmp_path / "no"),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1 and "model folder not found" in done.stderr and "Traceback" not in done.stderr
