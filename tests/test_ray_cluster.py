"""The Ray engine on a real multi-node cluster on this machine (``ray.cluster_utils.Cluster``): a head
node with the Serve controller, its HTTP proxy, the job registry and the ingress (pinned there with
``node:__internal_head__``), and two worker nodes with one text model replica each (a custom
resource per node that one replica takes, so the placement is known). What fails, and what is kept:

- a model replica killed mid-job (``ray.kill``): its jobs end ``failed`` with the reason (a stop
  accepted just before the kill ends its job ``stopped`` or ``failed``, never lost, never left
  ``stopping``); the other node's jobs run on;
- a whole node removed mid-job: the same (a stop accepted just before ends its job ``stopped`` or
  ``failed``), and Serve places the replacement on a spare node;
- the registry killed (Serve restarts it): states, stops, results, holds and the events of running jobs
  are read back from its journal;
- stops before a job's claim (tombstones) and ids chosen by the registry's caller across nodes;
- with ``on_replica_loss="rerun"`` (the last tests redeploy the application so), a replica killed
  and a node removed mid-job: their jobs run again on another replica, with the text of an
  uninterrupted run (a stop accepted just before the kill ends its job ``stopped``, not run again).

Every test ends with no job left unfinished. Slow (a cluster of three nodes, replicas replaced):
marked ``cluster``, deselected by default and run by ``make test-cluster`` (and ``make test``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
import types
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import RAY_KEYS, free_port

from stopcock.server.testing import sse_data

pytest.importorskip("ray.serve")

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]

ALICE = {"Authorization": f"Bearer {RAY_KEYS[0]}"}
OWNER = hashlib.sha256(RAY_KEYS[0].encode()).hexdigest()
BOB = hashlib.sha256(RAY_KEYS[1].encode()).hexdigest()
APP = "stopcock"
SLOT = "stopcock_text_slot"  # one per worker node: each takes one text model replica
HEAD = "node:__internal_head__"
LONG = 1000  # tokens (the most a job may ask for): a job that runs until it is stopped
FINAL = ("stopped", "completed", "failed")
WAIT_S = 240  # the bound of every wait for the cluster (a job's end, a registry restarted)
RERUN_TOKENS = 200  # a greedy job long enough to remove its node mid-run
HEAL_S = 480  # the bound of the wait for Serve's replacement of a replica (a new process loads the model)


@pytest.fixture(scope="module")
def on_cluster(text_model_dir, tmp_path_factory, request) -> Iterator[types.SimpleNamespace]:
    """The stopcock application (text only: 2 model replicas of 2 pipelines each, 1 ingress replica)
    on a cluster of a head node and two worker nodes, started here and shut down at the end."""
    os.environ["RAY_AUTH_MODE"] = "disabled"  # a private cluster: no token file
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from stopcock.server.ray_deploy import REGISTRY, RayOptions, build
    from stopcock.server.ray_engine.wire import ModelSpec

    if ray.is_initialized():
        pytest.fail("the cluster tests need a pytest process of their own: run them with make test-cluster")
    # Ray's folder of its own, so that the cluster's address file is not where a plain ray.init()
    # elsewhere on this machine (another test run, a stopcock serve) looks for a cluster to join
    folder = os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="stopcock-cluster-", dir="/tmp")
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "include_dashboard": False, "object_store_memory": 100 * 2**20},
    )
    connected = False
    try:
        workers = [cluster.add_node(num_cpus=1, resources={SLOT: 1}) for _ in range(2)]
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        connected = True
        port = free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        options = RayOptions(
            models=[ModelSpec("text", str(text_model_dir), "tiny-text", "")],
            api_keys=list(RAY_KEYS),
            replicas=2,
            concurrency=2,
            model_actor_options={"num_cpus": 0, "resources": {SLOT: 1}},
            registry_actor_options={"resources": {HEAD: 0.001}},
            ingress_actor_options={"resources": {HEAD: 0.001}},
            queue_size=16,
            step_delay=0.05,
            torch_threads=1,
            journal_dir=str(tmp_path_factory.mktemp("cluster-journal")),
            checkpoint_dir=str(tmp_path_factory.mktemp("cluster-checkpoints")),  # every node's: one machine
        )
        serve.run(build(options), name=APP, route_prefix="/")
        yield types.SimpleNamespace(
            cluster=cluster,
            workers=workers,
            url=f"http://127.0.0.1:{port}",
            registry=serve.get_deployment_handle(REGISTRY, APP),
            logs=folder,
            options=options,
        )
    finally:
        if connected:
            serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
        os.environ.pop("RAY_TMPDIR")
        if not request.session.testsfailed:  # else its logs are kept there (the failures name it)
            shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def client(on_cluster) -> Iterator[httpx.Client]:
    """An HTTP client of the Serve proxy; after the test, no job of its owner is left unfinished."""
    with httpx.Client(base_url=on_cluster.url, headers=ALICE, timeout=WAIT_S) as http:
        yield http
        unfinished = [j for j in http.get("/v1/jobs", params={"limit": 1000}).json()["data"]
                      if j["state"] not in FINAL]
        for job in unfinished:
            http.post(f"/v1/jobs/{job['id']}/stop")
        assert not unfinished, f"jobs left unfinished: {unfinished}"
        stats = call(on_cluster, "stats")
        assert (stats["running"], stats["queued"]) == (0, 0)


# -- helpers -----------------------------------------------------------------------------------------
def call(on_cluster: Any, method: str, *args: Any) -> Any:
    return getattr(on_cluster.registry, method).remote(*args).result(timeout_s=WAIT_S)


def actor_info(actor: str) -> dict[str, Any]:
    """Ray's record of the live actor named ``actor`` (in Serve's namespace): its node, its process."""
    import ray
    from ray._private import state

    handle = ray.get_actor(actor, namespace="serve")
    info: dict[str, Any] = state.actors(actor_id=handle._actor_id.hex())
    return info


def node_of(actor: str) -> str:
    """The id of the node where the actor named ``actor`` runs."""
    return str(actor_info(actor)["Address"]["NodeID"])


def text_job(max_tokens: int = LONG) -> dict[str, Any]:
    return {"kind": "text", "prompt": "Once upon a time", "parameters": {"max_tokens": max_tokens}}


def submit(client: httpx.Client, body: dict[str, Any] | None = None) -> str:
    response = client.post("/v1/jobs", json=body or text_job())
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def events(client: httpx.Client, job_id: str, after: int = 0) -> Iterator[dict[str, Any]]:
    with client.stream("GET", f"/v1/jobs/{job_id}/events", params={"after": after}) as response:
        assert response.status_code == 200, response.read()
        yield from sse_data(response.iter_lines())


def wait_for_step(client: httpx.Client, job_id: str, step: int) -> list[dict[str, Any]]:
    """The job's events up to its first progress at ``step`` or beyond (it must not end before)."""
    seen = []
    for event in events(client, job_id):
        seen.append(event)
        assert event["type"] != "done", f"the job ended before step {step}: {event}"
        if event["type"] == "progress" and event["step"] >= step:
            return seen
    raise AssertionError("the event stream ended without a done event")


def final(client: httpx.Client, job_id: str) -> dict[str, Any]:
    """The job's done event (its final view), once it has ended."""
    done = list(events(client, job_id))[-1]
    assert done["type"] == "done", done
    return done


def within_one_step(view: dict[str, Any]) -> bool:
    return view["stop_step"] <= view["step"] <= view["stop_step"] + 1


def running_on_all(client: httpx.Client, on_cluster: Any, count: int = 4) -> dict[str, list[str]]:
    """``count`` long jobs submitted and running (past step 1): ``{replica: [job, ...]}``."""
    jobs = [submit(client) for _ in range(count)]
    for job in jobs:
        wait_for_step(client, job, 1)
    where: dict[str, list[str]] = {}
    for job in jobs:
        where.setdefault(call(on_cluster, "placement", job), []).append(job)
    return where


def replicas(on_cluster: Any, count: int = 2) -> list[str]:
    """The live text model replicas, once there are ``count`` (Serve replaces a dead one)."""
    live = on_cluster.registry.replicas.remote("text", count, HEAL_S).result(timeout_s=HEAL_S + WAIT_S)
    found = [r["name"] for r in live]
    assert len(found) == count, f"{count} asked for, {len(found)} live: {found}; {cluster_state(on_cluster)}"
    return found


def cluster_state(on_cluster: Any) -> str:
    """What Serve says of the model deployment, the alive nodes' resources, and where the logs are."""
    import ray
    from ray import serve

    deployment = serve.status().applications[APP].deployments["TextModel"]
    nodes = [n["Resources"] for n in ray.nodes() if n["Alive"]]
    serving = f"TextModel {getattr(deployment.status, 'value', deployment.status)}: {deployment.message!r}"
    return f"{serving}; nodes: {nodes}; Ray's logs: {on_cluster.logs}"


def stop_all(client: httpx.Client, jobs: list[str]) -> None:
    for job in jobs:
        view = client.post(f"/v1/jobs/{job}/stop").json()
        assert (view["state"], view["reason"]) == ("stopped", "user") and within_one_step(view), view


def a_job_completes(client: httpx.Client) -> None:
    job = submit(client, text_job(3))
    done = final(client, job)
    assert (done["state"], done["step"]) == ("completed", 3)


def failed_with(view: dict[str, Any], replica: str) -> bool:
    return (
        (view["state"], view["reason"]) == ("failed", "error")
        and replica in view["error"]
        and "not run again" in view["error"]
    )


# -- the tests -----------------------------------------------------------------------------------------
def test_the_model_replicas_are_spread_over_the_worker_nodes(on_cluster, client):
    names = replicas(on_cluster)
    assert cluster_state(on_cluster).startswith("TextModel HEALTHY")  # what Serve says, too
    workers = {node.node_id for node in on_cluster.workers}
    assert {node_of(name) for name in names} == workers  # one on each worker node
    head = on_cluster.cluster.head_node.node_id
    assert node_of(call(on_cluster, "whoami")) == head
    where = running_on_all(client, on_cluster)
    assert sorted(len(jobs) for jobs in where.values()) == [2, 2] and set(where) == set(names)
    stop_all(client, [job for jobs in where.values() for job in jobs])


def test_a_replica_killed_mid_job_fails_its_jobs_and_loses_no_accepted_stop(on_cluster, client):
    import ray

    where = running_on_all(client, on_cluster)
    killed, other = sorted(where)
    asked, plain = where[killed]
    # a stop accepted (journaled, answered) right before the kill: its replica may have applied it
    # and reported the end (stopped), or not (failed); either way it is not lost
    accepted = call(on_cluster, "stop", asked, OWNER, "user", False)
    assert accepted.state in ("stopping", "stopped")
    ray.kill(ray.get_actor(killed, namespace="serve"), no_restart=True)
    failed = final(client, plain)
    stopped = final(client, asked)
    assert failed_with(failed, killed), failed
    assert stopped["reason"] == "user" or failed_with(stopped, killed), stopped  # never lost, never running
    for job in (plain, asked):
        assert [e["type"] for e in events(client, job)].count("started") == 1  # not run again
        assert client.post(f"/v1/jobs/{job}/stop").json()["state"] in ("stopped", "failed")

    # the other node's jobs run on, and stop as always
    for job in where[other]:
        reached = client.get(f"/v1/jobs/{job}").json()["step"]
        assert wait_for_step(client, job, reached + 2)[-1]["step"] > reached
    stop_all(client, where[other])

    healed = replicas(on_cluster)  # Serve replaced the replica (on the node it died on)
    assert killed not in healed and {node_of(n) for n in healed} == {n.node_id for n in on_cluster.workers}
    view = {k: v for k, v in failed.items() if k not in ("seq", "type")}  # the done event's view
    assert client.get(f"/v1/jobs/{plain}").json() == view
    a_job_completes(client)


def test_a_node_removed_mid_job_fails_its_jobs_and_loses_no_accepted_stop(on_cluster, client):
    where = running_on_all(client, on_cluster)
    lost_replica = next(r for r in where if node_of(r) == on_cluster.workers[0].node_id)
    other = next(r for r in where if r != lost_replica)
    asked, plain = where[lost_replica]
    # a spare node, with a free slot for the replacement (as a cluster with room to spare has): Serve
    # places it there once the replica is gone
    spare = on_cluster.cluster.add_node(num_cpus=1, resources={SLOT: 1})
    accepted = call(on_cluster, "stop", asked, OWNER, "user", False)
    assert accepted.state in ("stopping", "stopped")

    lost = on_cluster.workers.pop(0)
    on_cluster.cluster.remove_node(lost)  # the raylet and every process of the node: the replica with it
    on_cluster.workers.append(spare)

    failed = final(client, plain)
    assert failed_with(failed, lost_replica), failed
    stopped = final(client, asked)
    assert stopped["reason"] == "user" or failed_with(stopped, lost_replica), stopped
    for job in where[other]:
        reached = client.get(f"/v1/jobs/{job}").json()["step"]
        assert wait_for_step(client, job, reached + 2)[-1]["step"] > reached
    stop_all(client, where[other])

    healed = replicas(on_cluster)
    assert lost_replica not in healed
    assert {node_of(n) for n in healed} == {n.node_id for n in on_cluster.workers}
    for job in (plain, asked):
        assert [e["type"] for e in events(client, job)].count("started") == 1  # not run again
    a_job_completes(client)


def test_a_registry_restart_keeps_states_stops_results_and_the_events_of_running_jobs(on_cluster, client):
    import ray

    completed = submit(client, text_job(4))
    kept_result = client.get(f"/v1/jobs/{completed}/result", params={"wait": "true"}).json()
    assert kept_result["job"]["state"] == "completed"
    where = running_on_all(client, on_cluster)
    followed, stopped_before, paused, *others = [job for jobs in where.values() for job in jobs]
    seen = wait_for_step(client, followed, 6)  # what a client saw of a running job before the restart
    accepted = call(on_cluster, "stop", stopped_before, OWNER, "user", False)
    assert accepted.state in ("stopping", "stopped")
    held = client.post(f"/v1/jobs/{paused}/pause").json()  # its checkpoint a file in checkpoint_dir
    assert held["state"] == "paused" and held["checkpoint_step"] == held["step"] >= 1, held
    registry = call(on_cluster, "whoami")
    ray.kill(ray.get_actor(registry, namespace="serve"), no_restart=True)

    # every call below waits for Serve to restart the registry (on the head node), which reads its
    # journal back: the events seen before, with the same numbers, then the later ones
    after = wait_for_step(client, followed, seen[-1]["step"] + 3)
    assert call(on_cluster, "whoami") != registry
    assert node_of(call(on_cluster, "whoami")) == on_cluster.cluster.head_node.node_id
    assert after[: len(seen)] == seen
    assert [e["seq"] for e in after] == list(range(1, len(after) + 1))  # none missing (no previews here)
    done = final(client, stopped_before)  # the stop accepted before the restart took effect
    assert (done["state"], done["reason"]) == ("stopped", "user") and within_one_step(done)
    assert client.get(f"/v1/jobs/{completed}/result").json() == kept_result
    back = client.get(f"/v1/jobs/{paused}").json()  # still paused, with its checkpoint: never run unasked
    assert (back["state"], back["step"], back["checkpoint_step"]) == ("paused", held["step"], held["step"])
    assert client.post(f"/v1/jobs/{paused}/resume").json()["checkpoint_step"] == held["step"]
    resumed = wait_for_step(client, paused, held["step"] + 1)
    assert [e.get("resumed_from") for e in resumed if e["type"] == "started"] == [None, held["step"]]
    stop_all(client, [followed, paused, *others])
    assert [e["type"] for e in events(client, followed)].count("started") == 1
    assert len(replicas(on_cluster)) == 2  # the replicas found the new registry


def test_tombstones_and_caller_chosen_ids_work_across_nodes(on_cluster, client):
    """A job stopped before any replica claimed it never starts, wherever its request goes; the
    registry takes the job id from its caller (an ingress replica), so a submit asked again (as an
    ingress does after a registry restart) is the same job, and another owner's id is not found."""
    from stopcock.server.contract import JobSpec

    where = running_on_all(client, on_cluster)  # every lane of both nodes busy: new jobs wait in Serve
    waiting = submit(client)
    spec = JobSpec("text", "Once upon a time", {"max_tokens": 3, "temperature": 0.0, "top_p": 1.0})
    first = call(on_cluster, "submit", "chosen-by-the-caller", spec, OWNER, time.time(), True)
    again = call(on_cluster, "submit", "chosen-by-the-caller", spec, OWNER, time.time(), True)
    assert again == first and first.state == "queued"
    theirs = call(on_cluster, "submit", "chosen-by-the-caller", spec, BOB, time.time(), True)
    assert theirs.code == "not_found"
    assert call(on_cluster, "get", "chosen-by-the-caller", BOB).code == "not_found"
    runs = call(on_cluster, "submit", "runs-after-them", spec, OWNER, time.time(), True)
    assert runs.state == "queued"

    refused = call(on_cluster, "stats")["refused_claims"]
    for job in (waiting, "chosen-by-the-caller"):  # stopped before any replica claimed them
        view = client.post(f"/v1/jobs/{job}/stop").json()
        assert (view["state"], view["started"], view["step"]) == ("stopped", None, 0)
    stop_all(client, [job for jobs in where.values() for job in jobs])

    # the freed replicas get the waiting requests, ask for their claims, and are refused
    for job in (waiting, "chosen-by-the-caller"):
        assert call(on_cluster, "settled", job, WAIT_S) == "refused"
        assert [e["type"] for e in events(client, job)] == ["queued", "done"]
        assert call(on_cluster, "placement", job) is None
    assert call(on_cluster, "stats")["refused_claims"] == refused + 2
    done = final(client, "runs-after-them")  # the caller's id, followed through the ingress
    assert (done["state"], done["step"]) == ("completed", 3)
    ran_on = node_of(call(on_cluster, "placement", "runs-after-them"))
    assert ran_on in {n.node_id for n in on_cluster.workers}
    assert call(on_cluster, "settled", "runs-after-them", WAIT_S) == "ran"


# -- on_replica_loss="rerun" (last in the file: the application is redeployed so) --------------------
def rerun_deployed(on_cluster: Any) -> None:
    """Redeploy the application with ``on_replica_loss="rerun"``, once (Serve replaces the registry,
    which reads its journal back, and the model replicas, which register with it)."""
    from dataclasses import replace

    from ray import serve

    from stopcock.server.ray_deploy import build

    if getattr(on_cluster, "rerun", False):
        return
    serve.run(build(replace(on_cluster.options, on_replica_loss="rerun")), name=APP, route_prefix="/")
    on_cluster.rerun = True
    # a replica Serve shut down may have registered with the new registry first (its watch drops it
    # once silent): only the live ones get requests
    on_cluster.registry.replicas.remote("text", 2, HEAL_S).result(timeout_s=HEAL_S + WAIT_S)


def uninterrupted(client: httpx.Client) -> dict[str, Any]:
    """The result of a greedy job of ``RERUN_TOKENS`` tokens run alone."""
    reference = submit(client, text_job(RERUN_TOKENS))
    found: dict[str, Any] = client.get(f"/v1/jobs/{reference}/result", params={"wait": "true"}).json()
    assert found["job"]["state"] == "completed"
    return found


def test_with_rerun_a_killed_replicas_job_runs_again_and_a_stopped_one_does_not(on_cluster, client):
    import ray

    rerun_deployed(on_cluster)
    reference = uninterrupted(client)
    jobs = [submit(client, text_job(RERUN_TOKENS)) for _ in range(4)]  # every lane of both replicas
    for job in jobs:
        wait_for_step(client, job, 1)
    where: dict[str, list[str]] = {}
    for job in jobs:
        where.setdefault(call(on_cluster, "placement", job), []).append(job)
    killed = sorted(where)[0]
    asked, plain = where[killed]
    accepted = call(on_cluster, "stop", asked, OWNER, "user", False)
    assert accepted.state in ("stopping", "stopped")
    ray.kill(ray.get_actor(killed, namespace="serve"), no_restart=True)

    stopped = final(client, asked)  # applied before the kill, or ended by the registry: never run again
    assert (stopped["state"], stopped["reason"]) == ("stopped", "user"), stopped
    assert "requeued" not in [e["type"] for e in events(client, asked)]
    done = final(client, plain)
    assert (done["state"], done["step"]) == ("completed", RERUN_TOKENS), done
    assert client.get(f"/v1/jobs/{plain}/result").json()["result"]["text"] == reference["result"]["text"]
    seen = list(events(client, plain))
    assert [e["type"] for e in seen].count("requeued") == 1
    assert next(e for e in seen if e["type"] == "requeued")["replica"] == killed
    assert call(on_cluster, "placement", plain) != killed
    for job in [j for r, js in where.items() if r != killed for j in js]:  # the other replica's ran on
        assert final(client, job)["state"] == "completed"
    replicas(on_cluster)  # Serve replaced the killed replica


def test_with_rerun_a_node_removed_mid_job_runs_its_job_again_on_another_node(on_cluster, client):
    rerun_deployed(on_cluster)
    reference = uninterrupted(client)
    job = submit(client, text_job(RERUN_TOKENS))
    wait_for_step(client, job, 3)
    lost_replica = call(on_cluster, "placement", job)
    lost = next(n for n in on_cluster.workers if n.node_id == node_of(lost_replica))
    spare = on_cluster.cluster.add_node(num_cpus=1, resources={SLOT: 1})  # room for the replacement
    on_cluster.workers.remove(lost)
    on_cluster.cluster.remove_node(lost)  # the raylet and every process of the node: the replica with it
    on_cluster.workers.append(spare)

    done = final(client, job)
    assert (done["state"], done["step"]) == ("completed", RERUN_TOKENS), done
    found = client.get(f"/v1/jobs/{job}/result").json()
    assert found["result"]["text"] == reference["result"]["text"] != ""
    seen = list(events(client, job))
    types = [e["type"] for e in seen]
    assert types.count("requeued") == 1 and types.count("started") == 2
    requeued = next(e for e in seen if e["type"] == "requeued")
    assert (requeued["replica"], requeued["from_step"], requeued["text_kept"]) == (lost_replica, 0, 0)
    ran_on = call(on_cluster, "placement", job)
    assert ran_on != lost_replica and node_of(ran_on) != lost.node_id
    assert lost_replica not in [r["name"] for r in call(on_cluster, "replicas", "text")]
    a_job_completes(client)
