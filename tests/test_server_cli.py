"""``stopcock serve`` as a user runs it: a subprocess on loopback, stopped with Ctrl+C (SIGINT)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import httpx
import pytest

from stopcock.server.serve import STEP_DELAY_ENV
from stopcock.server.testing import sse_data


def test_serve_runs_and_shuts_down_cleanly_on_ctrl_c(text_model_dir, tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text("# one key per line\nsecret-1\n\nsecret-2\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", STEP_DELAY_ENV: "0.05", "XDG_CACHE_HOME": str(tmp_path)}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "stopcock.cli",
            "serve",
            "--text-model",
            str(text_model_dir),
            "--port",
            "0",
            "--api-keys-file",
            str(keys),
        ],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert process.stderr is not None
        for line in process.stderr:  # uvicorn says where it listens once it is ready
            found = re.search(r"running on (http://127\.0\.0\.1:\d+)", line, re.IGNORECASE)
            if found:
                break
        else:
            pytest.fail("the server never said it was running")
        url, headers = found.group(1), {"Authorization": "Bearer secret-2"}
        with httpx.Client(base_url=url, headers=headers, timeout=60) as client:
            assert client.get("/v1/models").json()["data"][0]["stopcock_kind"] == "text"
            assert client.get("/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
            job = client.post(
                "/v1/jobs", json={"kind": "text", "prompt": "Hi", "parameters": {"max_tokens": 1000}}
            )
            with client.stream("GET", f"/v1/jobs/{job.json()['id']}/events") as events:
                for event in sse_data(events.iter_lines()):
                    if event["type"] == "progress" and event["step"] >= 2:
                        process.send_signal(signal.SIGINT)  # Ctrl+C: the running job ends, its stream too
                    if event["type"] == "done":
                        break
        assert (event["state"], event["reason"]) == ("stopped", "shutdown") and event["step"] < 1000
        assert process.wait(timeout=60) == 130  # the CLI's exit code for Ctrl+C, after a clean shutdown
    finally:
        process.kill()
        process.wait()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--port", "70000"], "a port is 0..65535"),
        (["--concurrency", "0"], "must be >= 1"),
        (["--api-key", "a", "--api-keys-file", "f"], "not allowed with argument"),
    ],
)
def test_bad_serve_arguments_exit_2(args, message):
    done = subprocess.run(
        [sys.executable, "-m", "stopcock.cli", "serve", *args], capture_output=True, text=True
    )
    assert done.returncode == 2 and message in done.stderr


def test_an_empty_keys_file_is_an_error(tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text("# nothing here\n")
    done = subprocess.run(
        [sys.executable, "-m", "stopcock.cli", "serve", "--api-keys-file", str(keys)],
        capture_output=True,
        text=True,
        env={**os.environ, "XDG_CACHE_HOME": str(tmp_path)},
    )
    assert done.returncode == 1 and "holds no keys" in done.stderr and "Traceback" not in done.stderr


def test_a_missing_model_is_a_one_line_error(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "stopcock.cli", "serve", "--text-model", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1 and "model folder not found" in done.stderr and "Traceback" not in done.stderr


def test_no_model_arguments_serve_both_demo_models():
    from stopcock.server.backends import load_backends
    from stopcock.server.testing import serving

    with serving(load_backends(None, None)) as (url, _), httpx.Client(base_url=url, timeout=60) as client:
        models = {m["stopcock_kind"]: m for m in client.get("/v1/models").json()["data"]}
        assert {kind: m["id"] for kind, m in models.items()} == {
            "text": "stopcock-demo-text",
            "image": "stopcock-demo-image",
        }
        assert all(m["description"] for m in models.values())
        job = client.post("/v1/jobs", json={"kind": "text", "prompt": "Hi", "parameters": {"max_tokens": 3}})
        with client.stream("GET", f"/v1/jobs/{job.json()['id']}/events") as events:
            done = list(sse_data(events.iter_lines()))[-1]
    assert (done["state"], done["step"]) == ("completed", 3)


def test_a_blank_key_is_refused(capsys):
    from stopcock.server.deps import Keys
    from stopcock.server.serve import main

    assert main(["--api-key", "good", "--api-key", " "]) == 1  # before any model is loaded
    assert "cannot be empty or blank" in capsys.readouterr().err
    with pytest.raises(ValueError, match="non-empty"):
        Keys(["good", ""])  # create_app(engine, api_keys=...) refuses it too


@pytest.mark.parametrize(
    "extra, named",
    [
        (["--replicas", "2"], "--replicas"),
        (["--checkpoint-dir", "/tmp", "--wait-for-resources"], "--wait-for-resources, --checkpoint-dir"),
        (["--max-reruns", "2", "--on-replica-loss", "rerun"], "--on-replica-loss, --max-reruns"),
    ],
)
def test_ray_options_on_the_local_engine_are_an_error_naming_the_fix(capsys, extra, named):
    from stopcock.server.serve import main

    assert main(["--port", "0", *extra]) == 1  # before any model is loaded
    err = capsys.readouterr().err
    assert f"{named}: Ray Serve options; add --engine ray, or drop them" in err


def test_max_reruns_without_rerun_is_an_error_naming_the_fix(capsys):
    from stopcock.server.serve import main

    assert main(["--port", "0", "--engine", "ray", "--max-reruns", "2"]) == 1  # before any cluster starts
    err = capsys.readouterr().err
    assert "--max-reruns bounds the re-runs of --on-replica-loss rerun: add that, or drop it" in err
