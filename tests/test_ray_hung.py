"""A model replica that hangs (its process frozen with ``SIGSTOP``, as a node cut off from the
cluster looks) does not stall the Ray job registry: while it is frozen, the registry still answers
its counts (directly, and ``/v1/health`` through the ingress) and a stop of a job on the other
replica; once the replica thaws, the stop asked for its own job while it was frozen reaches it. The
same for the ingress replica, whose long poll of the registry (the feed of its event streams) the
registry answers while it is frozen: a stream it serves gets every event once it thaws.

The application here is a second one (``hung``, two text replicas) on the test session's local
cluster (``ray_serve`` in conftest), so that freezing a replica leaves the shared application alone.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import signal
import threading
import time
import types
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import RAY_KEYS

pytest.importorskip("ray.serve")

APP = "hung"
ALICE = {"Authorization": f"Bearer {RAY_KEYS[0]}"}
OWNER = hashlib.sha256(RAY_KEYS[0].encode()).hexdigest()
#: Seconds the registry has to answer while a replica is frozen: a bound on a hang, not a timing
#: (an answer takes milliseconds; a stalled registry never answers while the replica stays frozen).
BOUND = 20.0


@pytest.fixture(scope="module")
def hung_app(ray_serve: Any, text_model_dir: Any) -> Iterator[Any]:
    from ray import serve

    from stopcock.server.ray_deploy import REGISTRY, RayOptions, build
    from stopcock.server.ray_engine.wire import ModelSpec

    options = RayOptions(
        models=[ModelSpec("text", str(text_model_dir), "tiny-text", "")],
        api_keys=list(RAY_KEYS),
        replicas=2,
        model_actor_options={"num_cpus": 0},
        step_delay=0.01,
        torch_threads=1,
        journal_dir=None,
    )
    serve.run(build(options), name=APP, route_prefix=f"/{APP}")
    try:
        registry = serve.get_deployment_handle(REGISTRY, APP)
        assert len(call(registry, "replicas", "text", 2, 120.0)) == 2
        yield types.SimpleNamespace(registry=registry, url=f"{ray_serve.url}/{APP}")
    finally:
        serve.delete(APP)


def call(registry: Any, method: str, *args: Any, timeout: float = 120.0) -> Any:
    return getattr(registry, method).remote(*args).result(timeout_s=timeout)


def submit(registry: Any, max_tokens: int = 1000) -> str:
    from stopcock.server.contract import JobSpec

    job_id = uuid.uuid4().hex
    spec = JobSpec("text", "Once upon a time", {"max_tokens": max_tokens, "temperature": 0.0, "top_p": 1.0})
    view = call(registry, "submit", job_id, spec, OWNER, time.time())
    assert getattr(view, "id", None) == job_id, view
    return job_id


def wait_for_step(registry: Any, job_id: str, step: int) -> None:
    after = 0
    while True:
        answer = call(registry, "events", job_id, OWNER, after, 30.0)
        assert isinstance(answer, tuple), answer  # a Refused: a registry restarted without its journal
        events, after, ended = answer
        assert not ended, f"the job ended before step {step}: {events}"
        if any(e.type == "progress" and e.data.get("step", 0) >= step for e in events):
            return


def replica_pid(name: str) -> int:
    import ray

    actor = ray.get_actor(name, namespace="serve")
    pid: int = ray.get(actor.__ray_call__.remote(lambda _: os.getpid()), timeout=60)
    return pid


@pytest.mark.timeout(600)
def test_a_frozen_replica_does_not_stall_the_registry(hung_app: Any) -> None:
    registry = hung_app.registry
    frozen_job, other_job = submit(registry), submit(registry)
    for job_id in (frozen_job, other_job):
        wait_for_step(registry, job_id, 2)
    frozen, other = (call(registry, "placement", j) for j in (frozen_job, other_job))
    assert frozen is not None and other is not None and frozen != other  # one job on each replica
    pid = replica_pid(frozen)
    os.kill(pid, signal.SIGSTOP)
    try:
        # the registry answers the frozen replica's waiting poll with this stop at once
        asked = call(registry, "stop", frozen_job, OWNER, "user", False, timeout=BOUND)
        assert asked.state == "stopping"
        started = time.monotonic()
        counts = call(registry, "stats", timeout=BOUND)
        assert counts["kinds"]["text"]["ready"] == 2 and counts["running"] == 2
        health = httpx.get(f"{hung_app.url}/v1/health", headers=ALICE, timeout=BOUND)
        assert health.status_code == 200 and health.json()["running"] == 2, health.text
        stopped = call(registry, "stop", other_job, OWNER, "user", True, timeout=BOUND)
        assert (stopped.state, stopped.reason) == ("stopped", "user")
        assert stopped.stop_step <= stopped.step <= stopped.stop_step + 1
        print(f"answered in {time.monotonic() - started:.2f} s with a replica frozen")
    finally:
        os.kill(pid, signal.SIGCONT)
    # the stop asked while the replica was frozen is applied once it thaws: it was not lost
    ended = call(registry, "wait", frozen_job, OWNER, 120.0)
    assert (ended.state, ended.reason) == ("stopped", "user")


def ingress_pid() -> int:
    """The process of the application's one ingress replica."""
    import ray

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    ingress = [n for n in names if n.startswith(f"SERVE_REPLICA::{APP}#Ingress#")]
    assert len(ingress) == 1, names
    return replica_pid(ingress[0])


@pytest.mark.timeout(600)
def test_a_frozen_ingress_does_not_stall_the_registry_and_its_stream_loses_nothing(hung_app: Any) -> None:
    from stopcock.server.testing import sse_data

    registry = hung_app.registry
    job_id = submit(registry)
    wait_for_step(registry, job_id, 2)
    seen: list[dict[str, Any]] = []
    following = threading.Event()

    def follow() -> None:  # a client of the ingress: its stream is fed by the ingress's poll
        url = f"{hung_app.url}/v1/jobs/{job_id}/events"
        with httpx.stream("GET", url, headers=ALICE, timeout=300) as response:
            for event in sse_data(response.iter_lines()):
                seen.append(event)
                following.set()
                if event["type"] == "done":
                    return

    client = threading.Thread(target=follow, daemon=True)
    client.start()
    assert following.wait(120), "no event reached the stream"
    pid = ingress_pid()
    os.kill(pid, signal.SIGSTOP)
    try:  # the job's news keeps coming, and the registry answers the frozen ingress's poll with it
        wait_for_step(registry, job_id, max(e.get("step", 0) for e in seen) + 5)
        counts = call(registry, "stats", timeout=BOUND)
        assert counts["running"] == 1
        stopped = call(registry, "stop", job_id, OWNER, "user", True, timeout=BOUND)
        assert (stopped.state, stopped.reason) == ("stopped", "user")
    finally:
        os.kill(pid, signal.SIGCONT)
    client.join(120)
    assert not client.is_alive(), "the stream never ended"
    assert [e["seq"] for e in seen] == list(range(seen[0]["seq"], seen[0]["seq"] + len(seen)))  # none lost
    assert (seen[-1]["type"], seen[-1]["state"], seen[-1]["reason"]) == ("done", "stopped", "user")


def test_the_calls_ask_for_serves_grpc_transport_where_serve_has_one() -> None:
    from ray.serve.handle import DeploymentHandle
    from ray_doubles import LocalHandle

    from stopcock.server.ray_engine.wire import by_grpc

    class Old:  # a Serve handle without the gRPC transport
        def options(self, *, method_name: str = "") -> Any:
            raise AssertionError("asked for an option this Serve does not have")

    class New:
        def options(self, *, method_name: str = "", _by_reference: bool = True) -> Any:
            return ("over gRPC", not _by_reference)

    old, local = Old(), LocalHandle(object())
    assert by_grpc(old) is old and by_grpc(local) is local
    assert by_grpc(New()) == ("over gRPC", True)
    assert "_by_reference" in inspect.signature(DeploymentHandle.options).parameters  # this Ray has it
