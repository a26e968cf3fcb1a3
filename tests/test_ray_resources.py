"""Resources on Ray: what each model replica asks for (flags, else fitted to the cluster), the
start-up refusal of replicas the cluster cannot place, ``/v1/health``'s ready replicas of each kind,
and a submission for a kind with no ready replica answered at once with a 503 and ``Retry-After``."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from typing import Any

import httpx
import pytest

pytest.importorskip("ray")

from conftest import free_port  # tests/ is on sys.path under pytest
from ray_doubles import LocalHandle, construct

from stopcock.server.app import create_app
from stopcock.server.contract import JobSpec, Unavailable
from stopcock.server.ray_engine.ingress import RayEngine
from stopcock.server.ray_engine.registry import JobRegistry
from stopcock.server.ray_engine.resources import Demand, describe, replica_needs, unplaceable

OWNER = "me"


def test_replicas_ask_for_what_is_given_else_what_fits_the_cluster():
    two_cpus = [{"CPU": 2.0, "GPU": 0.0}]
    assert replica_needs(4, None, None, two_cpus) == {"CPU": 0.5, "GPU": 0.0}  # an equal share
    assert replica_needs(1, None, None, two_cpus) == {"CPU": 1.0, "GPU": 0.0}  # at most one each
    assert replica_needs(3, None, None, two_cpus) == {"CPU": 0.66, "GPU": 0.0}
    with_gpus = [{"CPU": 8.0, "GPU": 2.0}]
    assert replica_needs(2, None, None, with_gpus) == {"CPU": 1.0, "GPU": 1.0}  # a GPU each
    assert replica_needs(4, 2.0, 0.5, two_cpus) == {"CPU": 2.0, "GPU": 0.5}  # as given
    with pytest.raises(ValueError, match=">= 0"):
        replica_needs(1, -1.0, None, two_cpus)
    assert describe({"CPU": 0.5, "GPU": 1.0}) == "0.5 CPU, 1 GPU"


def test_unplaceable_names_the_deployment_what_it_needs_and_what_the_cluster_has():
    each = {"CPU": 1.0, "GPU": 0.0}
    demands = [Demand("TextModel", 2, each), Demand("ImageModel", 2, each)]
    problem = unplaceable(demands, [{"CPU": 2.0, "GPU": 0.0}])
    assert problem is not None
    assert "ImageModel asks for 2 replica(s) of 1 CPU each; only 0 fit" in problem
    assert "TextModel" not in problem  # the first two fit
    assert "the cluster has node 0: 2 CPU" in problem
    assert unplaceable(demands, [{"CPU": 2.0}, {"CPU": 2.0}]) is None  # two nodes: it fits
    # a replica does not straddle nodes: two nodes of 1 CPU cannot hold a replica of 2 CPUs
    assert "only 0 fit" in str(
        unplaceable([Demand("TextModel", 1, {"CPU": 2.0})], [{"CPU": 1.0}, {"CPU": 1.0}])
    )
    gpu = unplaceable([Demand("ImageModel", 1, {"CPU": 0.0, "GPU": 1.0})], [{"CPU": 16.0, "GPU": 0.0}])
    assert gpu is not None and "1 GPU each; only 0 fit" in gpu


class _Never:
    """A model deployment stand-in that never answers (its jobs stay queued)."""

    def __getattr__(self, method: str) -> Any:
        class _Run:
            @staticmethod
            def remote(*args: Any) -> Any:
                return asyncio.get_running_loop().create_future()

        return _Run


@pytest.mark.timeout(120)
def test_no_ready_replica_is_a_503_at_once_and_health_counts_ready_replicas():
    """A real uvicorn server over the Ray engine's ingress and registry (in this process, through
    stand-ins for Serve handles): the text kind has its one replica, the image kind none."""
    import uvicorn

    async def main() -> None:
        kinds = {
            "text": {"deployment": "TextModel", "asked": 1, "needs": "1 CPU"},
            "image": {"deployment": "ImageModel", "asked": 2, "needs": "0.5 CPU"},
        }
        models = {"text": _Never(), "image": _Never()}
        registry = await construct(JobRegistry, models, alive=lambda name: True, kinds=kinds)
        await registry.register("text", "text-0", 1, None)
        served = {kind: {"id": f"tiny-{kind}", "description": ""} for kind in models}
        engine = RayEngine(LocalHandle(registry), served)

        with pytest.raises(
            Unavailable, match=r"no ImageModel replica is ready \(0 of 2 asked for; each needs 0.5"
        ):
            await engine.submit(JobSpec("image", "a cat", {}), OWNER)

        port = free_port()
        server = uvicorn.Server(
            uvicorn.Config(create_app(engine), host="127.0.0.1", port=port, log_level="warning")
        )
        serving = asyncio.ensure_future(server.serve())
        try:
            while not server.started:  # uvicorn has no started event to await
                assert not serving.done(), "the server did not start"
                await asyncio.sleep(0.01)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
                health = (await client.get("/v1/health")).json()
                assert health["kinds"] == {
                    "text": {"ready": 1, "asked": 1},
                    "image": {"ready": 0, "asked": 2},
                }
                answer = await client.post("/v1/jobs", json={"kind": "image", "prompt": "a cat"})
                assert answer.status_code == 503 and answer.headers["retry-after"] == "5"
                error = answer.json()["error"]
                assert error["code"] == "unavailable" and "ImageModel" in error["message"]
                queued = await client.post("/v1/jobs", json={"kind": "text", "prompt": "Hi"})
                assert queued.status_code == 201 and queued.json()["state"] == "queued"
        finally:
            server.should_exit = True
            await serving

    asyncio.run(main())


@pytest.mark.timeout(300)
def test_serve_refuses_replicas_the_cluster_cannot_place():
    """``stopcock serve --engine ray`` checks the replicas asked for against the cluster it started
    before it deploys anything, and exits 1 naming the deployment, its needs and the cluster's."""
    too_many = str(os.cpu_count() or 1)  # each replica asks for every CPU: two cannot both fit
    command = [sys.executable, "-m", "stopcock.cli", "serve", "--engine", "ray", "--port", str(free_port())]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_AUTH_MODE": "disabled"}
    done = subprocess.run(
        [*command, "--replicas", "2", "--replica-cpus", too_many],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert done.returncode == 1, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert "the cluster cannot place the model replicas" in done.stderr
    assert f"TextModel asks for 2 replica(s) of {too_many} CPU each" in done.stderr
    assert "the cluster has node 0:" in done.stderr and "--wait-for-resources" in done.stderr


@pytest.mark.timeout(300)
def test_serve_waits_for_resources_when_asked_and_answers_503_meanwhile():
    """With ``--wait-for-resources`` the server runs although no model replica fits: ``/v1/health``
    shows none ready and a submission is a 503 naming the deployment, answered at once."""
    import signal

    too_many = str(2 * (os.cpu_count() or 1))  # no replica fits on this machine
    port = free_port()
    command = [sys.executable, "-m", "stopcock.cli", "serve", "--engine", "ray", "--port", str(port)]
    command += ["--replica-cpus", too_many, "--wait-for-resources"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_AUTH_MODE": "disabled"}
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        assert process.stderr is not None
        said = []
        for line in process.stderr:
            said.append(line)
            if "running on" in line:
                break
        else:
            pytest.fail("the server never said it was running: " + "".join(said[-20:]))
        assert any("waiting for resources: TextModel asks for 1 replica(s)" in line for line in said)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            kinds = client.get("/v1/health").json()["kinds"]
            assert kinds == {"text": {"ready": 0, "asked": 1}, "image": {"ready": 0, "asked": 1}}
            answer = client.post("/v1/jobs", json={"kind": "text", "prompt": "Hi"})
            assert answer.status_code == 503 and answer.headers["retry-after"] == "5"
            assert "no TextModel replica is ready" in answer.json()["error"]["message"]
        os.killpg(process.pid, signal.SIGINT)
        assert process.wait(timeout=120) == 130
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
