"""Batched text jobs on the Ray engine, on a real local Ray cluster: one text model replica (one
pipeline, batches of up to ``ROWS`` rows) serving the demo text model, reached through the job
registry's Serve handle by a :class:`~stopcock.server.ray_engine.RayEngine` in this process.

Concurrent greedy text jobs run as the rows of one ``generate`` (the registry's counts, gathered
from the replica, show one batch of all of them), each with the text, step, state and reason it has
alone (run one at a time on ``LocalEngine`` here); a job that samples runs alone beside them. A stop
by id sent while the batch runs ends that job's row within one token with its partial text, through
the registry, the replica's stop poll and the row's stop check, while the other rows go on
untouched. The batch waits (``batch_wait``) until all its jobs have arrived, so its makeup does not
depend on timing.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("ray.serve")

from conftest import free_port  # tests/ is on sys.path under pytest

from stopcock.server.contract import JobSpec
from stopcock.server.ray_engine.ingress import RayEngine

APP = "raybatch"
OWNER = "me"
ROWS = 7
TOKENS = 24
PROMPTS = ["Beautiful is", "Explicit is", "Simple is", "Flat is", "Errors should", "In the face", "There"]
STOPS: list[dict[str, Any]] = [
    {}, {}, {}, {}, {"stop_strings": ["\n"]}, {"max_steps": 5},
    {"deadline": time.time() - 1},  # already past: the row ends before its first token
]
MODELS = {"text": {"id": "demo-text", "description": ""}}
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def greedy(prompt: str, stop: dict[str, Any] | None = None) -> JobSpec:
    params = {"max_tokens": TOKENS, "temperature": 0.0, "top_p": 1.0, "seed": None}
    return JobSpec("text", prompt, params, dict(stop or {}))


@pytest.fixture(scope="module")
def alone() -> list[dict[str, Any]]:
    """Each job's view and result run alone, one after another, on ``LocalEngine`` in this process."""
    from stopcock.server.backends import load_backends
    from stopcock.server.engine import LocalEngine

    engine = LocalEngine({"text": load_backends(None, None)["text"]}, batch_size=1)

    async def each() -> list[dict[str, Any]]:
        found = []
        for prompt, stop in zip(PROMPTS, STOPS, strict=True):
            view = await engine.submit(greedy(prompt, stop), OWNER)
            await engine.wait(view.id, OWNER, 120)
            found.append(await engine.result(view.id, OWNER))
        return found

    try:
        return asyncio.run(each())
    finally:
        engine.close(timeout=60)


@pytest.fixture(scope="module")
def registry(tmp_path_factory) -> Iterator[Any]:
    """The job registry's handle of a stopcock application of its own (``raybatch``): one demo text
    model replica, batches of ``ROWS`` waiting up to 120 s to fill, the test-only throttle of
    0.02 s a token (so a batch still runs when a stop is sent). On the session's cluster if a test
    before started one, else on one started (and shut down) here."""
    os.environ["RAY_AUTH_MODE"] = "disabled"
    import ray
    from ray import serve

    from stopcock.server.ray_deploy import REGISTRY, RayOptions, build
    from stopcock.server.ray_engine.wire import ModelSpec

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=100 * 2**20,
                 log_to_driver=False, configure_logging=False)
    try:
        if started:
            serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
        options = RayOptions(
            models=[ModelSpec("text", None, MODELS["text"]["id"], "")],
            model_actor_options={"num_cpus": 0},
            queue_size=2 * ROWS,
            step_delay=0.02,
            torch_threads=1,
            journal_dir=None,
            batch_size=ROWS,
            batch_wait=120.0,
        )
        serve.run(build(options), name=APP, route_prefix=f"/{APP}")
        try:
            yield serve.get_deployment_handle(REGISTRY, APP)
        finally:
            serve.delete(APP)
    finally:
        if started:
            serve.shutdown()
            ray.shutdown()


async def counts(engine: RayEngine) -> dict[str, Any]:
    return await engine.stats()  # type: ignore[no-any-return]


async def step_reached(engine: RayEngine, job_id: str, step: int) -> None:
    async for event in engine.events(job_id, OWNER):
        assert event.type != "done", f"the job ended before step {step}"
        if event.type == "progress" and event.data["step"] >= step:
            return
    raise AssertionError("the events ended without a done event")


@pytest.mark.timeout(900)
def test_concurrent_greedy_jobs_run_as_one_batch_with_the_texts_they_have_alone(registry, alone):
    async def main() -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any], dict[str, Any]]:
        engine = RayEngine(registry, MODELS)
        before = await counts(engine)
        sampled = await engine.submit(
            JobSpec("text", "Now is", {"max_tokens": 4, "temperature": 0.8, "top_p": 1.0, "seed": 3}), OWNER
        )
        # it runs first: a greedy job reaching the replica first would take the lane and wait for
        # a batch of ROWS while the sampled job held one of the replica's ROWS request slots
        await step_reached(engine, sampled.id, 1)
        specs = [greedy(p, s) for p, s in zip(PROMPTS, STOPS, strict=True)]
        views = await asyncio.gather(*(engine.submit(spec, OWNER) for spec in specs))
        for view in views:
            await engine.wait(view.id, OWNER, 300)
        await engine.wait(sampled.id, OWNER, 300)
        results = [await engine.result(view.id, OWNER) for view in views]
        return results, await engine.result(sampled.id, OWNER), before, await counts(engine)

    results, sampled, before, after = asyncio.run(main())
    assert after["batches_run"] - before["batches_run"] == 1  # one batch...
    assert after["batched_jobs"] - before["batched_jobs"] == ROWS  # ...of every greedy job
    assert (after["batch_size"], after["batch_rows_running"]) == (ROWS, 0)
    for one, row in zip(alone, results, strict=True):
        assert row["result"] == one["result"]
        for field in ("state", "reason", "step"):
            assert row["job"][field] == one["job"][field]
        assert row["job"]["outcome"]["detail"] == "ran as one row of a batch"
    reasons = [row["job"]["reason"] for row in results]
    assert reasons == ["length"] * 4 + ["stop_string", "max_steps", "deadline"]
    assert (results[-1]["job"]["step"], results[-1]["result"]["text"]) == (0, "")
    assert sampled["job"]["state"] == "completed"  # a job that samples runs alone
    assert sampled["job"]["outcome"]["detail"] != "ran as one row of a batch"


@pytest.mark.timeout(600)
def test_a_stop_by_id_ends_its_row_within_one_token_and_the_others_go_on(registry, alone):
    target = 2

    async def main() -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any], dict[str, Any]]:
        engine = RayEngine(registry, MODELS)
        before = await counts(engine)
        views = await asyncio.gather(*(engine.submit(greedy(p), OWNER) for p in PROMPTS))
        await step_reached(engine, views[target].id, 6)
        stopped = (await engine.stop(views[target].id, OWNER)).to_json()
        for view in views:
            await engine.wait(view.id, OWNER, 300)
        results = [await engine.result(view.id, OWNER) for view in views]
        return results, stopped, before, await counts(engine)

    results, stopped, before, after = asyncio.run(main())
    assert (after["batches_run"] - before["batches_run"], after["batched_jobs"] - before["batched_jobs"]) == (
        1,
        ROWS,
    )
    job = results[target]["job"]
    assert (job["state"], job["reason"]) == ("stopped", "user")
    assert stopped == job  # the stop answered once the row had ended
    assert 6 <= job["stop_step"] <= job["step"] <= job["stop_step"] + 1  # within one token of its stop
    assert job["step"] < TOKENS
    text = results[target]["result"]["text"]
    assert text and alone[target]["result"]["text"].startswith(text)  # the partial text of the same run
    assert text != alone[target]["result"]["text"]
    for i, row in enumerate(results):
        if i != target:
            assert (row["job"]["state"], row["job"]["step"]) == ("completed", TOKENS)
        if i != target and not STOPS[i]:  # the jobs run alone without stop conditions
            assert row["result"]["text"] == alone[i]["result"]["text"]


@pytest.mark.timeout(300)
def test_a_job_stopped_while_it_waits_for_its_batch_never_starts():
    """In one event loop (the registry, a replica and the engine through stand-ins for Serve handles):
    a job waiting on the replica for its batch to fill has no claim yet, so a stop ends it at once and
    the batch, once full, runs the others without it (its claim refused)."""
    from ray_doubles import LocalHandle, construct

    from stopcock.server.backends import load_backends
    from stopcock.server.ray_engine.registry import JobRegistry
    from stopcock.server.ray_engine.replica import ModelReplica
    from stopcock.server.ray_engine.wire import ModelSpec

    backend = load_backends(None, None)["text"]

    async def main() -> None:
        registry = await construct(JobRegistry, {}, alive=lambda name: True)
        replica = await construct(
            ModelReplica, ModelSpec("text", name="demo-text", factory=lambda: backend), torch_threads=None,
            registry=LocalHandle(registry), name="replica-0", batch_size=3, batch_wait=600.0,
        )
        registry.models["text"] = LocalHandle(replica)
        engine = RayEngine(LocalHandle(registry), MODELS)
        first = await engine.submit(greedy(PROMPTS[0]), OWNER)
        while not replica._gathered:  # yield to the loop until the job waits on the replica (no timing)
            await asyncio.sleep(0)
        stopped = await engine.stop(first.id, OWNER)
        assert (stopped.state, stopped.reason, stopped.started, stopped.step) == ("stopped", "user", None, 0)
        others = [await engine.submit(greedy(p), OWNER) for p in PROMPTS[1:3]]  # the batch is full now
        ended = [await engine.wait(view.id, OWNER, 120) for view in others]
        assert [(v.state, v.step) for v in ended] == [("completed", TOKENS)] * 2
        assert await registry.settled(first.id, 60) == "refused"
        assert registry.refused_claims == 1
        assert (replica.batching.batches, replica.batching.batched) == (1, 2)  # the batch ran without it
        assert (await engine.get(first.id, OWNER)).to_json() == stopped.to_json()

    asyncio.run(main())


@pytest.mark.timeout(300)
def test_a_row_is_never_held_a_pause_is_a_409_and_no_preemption_hits_it():
    """In one event loop (stand-ins for Serve handles): a row of a batch keeps no checkpoint, so the
    registry answers its pause with a conflict that names the fix, and a waiting job of a higher
    priority (one that samples, so it runs alone) preempts no row: the rows end with the texts they
    have alone, then it runs."""
    from ray_doubles import LocalHandle, construct

    from stopcock.server.backends import load_backends
    from stopcock.server.contract import JobStateConflict
    from stopcock.server.ray_engine.registry import JobRegistry
    from stopcock.server.ray_engine.replica import ModelReplica
    from stopcock.server.ray_engine.wire import ModelSpec

    backend = load_backends(None, None)["text"]

    async def main() -> None:
        registry = await construct(JobRegistry, {}, alive=lambda name: True)
        replica = await construct(
            ModelReplica, ModelSpec("text", name="demo-text", factory=lambda: backend), torch_threads=None,
            registry=LocalHandle(registry), name="replica-0", batch_size=2, batch_wait=600.0,
            step_delay=0.02,
        )
        registry.models["text"] = LocalHandle(replica)
        engine = RayEngine(LocalHandle(registry), MODELS)
        rows = [await engine.submit(greedy(p), OWNER) for p in PROMPTS[:2]]  # the batch is full
        await step_reached(engine, rows[0].id, 2)
        with pytest.raises(JobStateConflict, match=r"row of a batch.*--batch-size 1"):
            await engine.pause(rows[0].id, OWNER)
        sampled = JobSpec("text", PROMPTS[2], {"max_tokens": 4, "temperature": 1.0, "top_p": 1.0, "seed": 1},
                          {}, priority=5)
        urgent = await engine.submit(sampled, OWNER)
        ended = [await engine.wait(view.id, OWNER, 120) for view in rows]
        assert [(v.state, v.step, v.preemptions) for v in ended] == [("completed", TOKENS, 0)] * 2
        assert (await engine.wait(urgent.id, OWNER, 120)).state == "completed"
        assert (replica.batching.batches, replica.batching.batched) == (1, 2)

    asyncio.run(main())
