"""The Ray engine's parts wired in one event loop, without a cluster: the job registry, a model
replica (its lease of lanes, its stop poll and reports) and the ingress engine, each talking to the
others through an in-process stand-in for a Serve handle. What a cluster cannot show
deterministically is checked here: the lease when Serve cancels a request, claims against stops,
and the journal a restarted registry reads back. ``tests/test_ray_engine.py`` runs it on Ray."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("ray")

from ray_doubles import (  # tests/ is on sys.path under pytest
    LocalHandle,
    construct,
    engine_over,
    fleet_of,
    report_hold,
)

from stopcock.server.backends import ImageBackend
from stopcock.server.contract import JobEvent, JobSpec, JobStateConflict
from stopcock.server.jobs import Job
from stopcock.server.ray_engine.ingress import RayEngine
from stopcock.server.ray_engine.registry import JobRegistry
from stopcock.server.ray_engine.replica import ModelReplica
from stopcock.server.ray_engine.wire import ModelSpec
from stopcock.server.schemas import ImageParameters

OWNER = "me"
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def text(max_tokens: int) -> JobSpec:
    return JobSpec("text", "Once upon a time", {"max_tokens": max_tokens, "temperature": 0.0, "top_p": 1.0})


async def wired(
    backend: Any, stop_grace: float | None = 5.0, **registry_options: Any
) -> tuple[RayEngine, JobRegistry, ModelReplica]:
    """A registry, one model replica of ``backend`` (one lane) and an engine over them."""
    registry = await construct(JobRegistry, {}, alive=lambda name: True, **registry_options)
    spec = ModelSpec(backend.kind, name=backend.name, factory=lambda: backend)
    replica = await construct(
        ModelReplica,
        spec,
        concurrency=1,
        step_delay=0.01,
        stop_grace=stop_grace,
        torch_threads=None,
        registry=LocalHandle(registry),
        name="replica-0",
    )
    registry.models[backend.kind] = LocalHandle(replica)
    engine = RayEngine(LocalHandle(registry), {backend.kind: {"id": backend.name, "description": ""}})
    return engine, registry, replica


async def reach(engine: RayEngine, job_id: str, step: int) -> None:
    async for event in engine.events(job_id, OWNER):
        assert event.type != "done", f"the job ended before step {step}"
        if event.type == "progress" and event.data["step"] >= step:
            return


def test_a_cancelled_request_frees_no_lane_before_its_pipeline_returned(server_backends):
    """Serve frees a request's slot when it cancels the request, the pipeline's thread runs on: the
    replica's lane comes back only when the run has returned, so the next job waits for it."""

    async def main() -> None:
        engine, registry, replica = await wired(server_backends["text"])
        first = await engine.submit(text(1000), OWNER)
        await reach(engine, first.id, 2)
        registry._dispatches[first.id].cancel()  # what Serve does to the request; the job is not told
        second = await engine.submit(text(4), OWNER)
        await reach(engine, first.id, 6)  # the first pipeline runs on...
        assert (await engine.get(second.id, OWNER)).state == "queued"  # ...and holds the only lane
        assert replica.busy == 1
        stopped = await engine.stop(first.id, OWNER)
        assert (stopped.state, stopped.reason) == ("stopped", "user")
        done = await engine.wait(second.id, OWNER)
        assert (done.state, done.step) == ("completed", 4)
        assert done.started is not None and stopped.finished is not None
        assert done.started >= stopped.finished  # the runs never overlapped
        assert replica.peak == 1

    asyncio.run(main())


def test_a_job_stopped_before_its_claim_never_starts(server_backends):
    async def main() -> None:
        engine, registry, replica = await wired(server_backends["text"])
        running = await engine.submit(text(1000), OWNER)
        await reach(engine, running.id, 1)
        waiting = await engine.submit(text(1000), OWNER)  # its request waits for the lane, unclaimed
        stopped = await engine.stop(waiting.id, OWNER)
        assert (stopped.state, stopped.reason, stopped.started, stopped.step) == ("stopped", "user", None, 0)
        assert "never ran" in stopped.outcome["detail"]
        await engine.stop(running.id, OWNER)
        # the replica gets the lane and the request, asks for the claim, and is refused
        assert await registry.settled(waiting.id, 60) == "refused"
        assert [e.type async for e in engine.events(waiting.id, OWNER)] == ["queued", "done"]
        assert await engine.get(waiting.id, OWNER) == stopped
        assert registry.refused_claims == 1 and replica.peak == 1

    asyncio.run(main())


def test_claims_are_ordered_with_stops():
    async def main() -> None:
        registry = await construct(JobRegistry, {"text": _Never()}, alive=lambda name: True)
        a = await registry.submit("job-a", text(3), OWNER, 0.0)
        assert await registry.claim("job-a", "r1") == 1  # one event (queued) before the replica's
        assert await registry.claim("job-a", "r1") == 1  # the same replica asking again: still yes
        assert await registry.claim("job-a", "r2") is None  # another replica: no
        await registry.submit("job-b", text(3), OWNER, 0.0)
        await registry.stop("job-b", OWNER, "user", wait=False)
        assert await registry.claim("job-b", "r1") is None  # stopped before any claim: never starts
        assert (await registry.get("job-a", OWNER)).state == "running" != a.state
        # the stop of a claimed job waits for its replica's poll
        view = await registry.stop("job-a", OWNER, "user", wait=False)
        assert view.state == "stopping"
        stops, known, _ = await registry.poll("r1", [], ["job-a"], 0, 0, 0.0)
        assert stops == {"job-a": "user"} and known is False  # r1 never registered here
        stops, _, _ = await registry.poll("r1", ["job-a"], ["job-a"], 0, 0, 0.0)
        assert stops == {}  # applied

    asyncio.run(main())


def test_a_restarted_registry_reads_back_every_acknowledged_stop(tmp_path):
    journal = str(tmp_path / "registry.jsonl")

    async def before() -> None:
        registry = await construct(
            JobRegistry, {"text": _Never()}, journal=journal, retain=2, alive=lambda name: True
        )
        for name in ("queued", "tombstone", "claimed", "ended", "old-1", "old-2"):
            await registry.submit(name, text(50), OWNER, 1.0)
        await registry.claim("claimed", "r1")
        await registry.stop("claimed", OWNER, "disconnected", wait=False)  # acknowledged, not yet applied
        for name in ("old-1", "old-2", "tombstone", "ended"):  # the two first are forgotten (retain=2)
            if name == "tombstone":
                await registry.stop("tombstone", OWNER, "user", wait=False)  # acknowledged: never runs
                continue
            await registry.claim(name, "r1")
            job = Job(text(50), OWNER, id=name, seq=1)
            job.emit("started")
            job.state, job.step, job.outcome = "completed", 50, {"steps": 50}
            job.emit("done", **job.view().to_json())
            await registry.report(
                "r1",
                [(name, e) for e in job.events if e is not None],
                {name: job.view().to_json()},
                {name: {"text": f"{name}!"}},
            )

    asyncio.run(before())
    sent = _Never()

    async def after() -> None:
        registry = await construct(
            JobRegistry, {"text": sent}, journal=journal, retain=2, alive=lambda name: True
        )
        assert registry.restored == 4
        tombstone = await registry.get("tombstone", OWNER)
        assert (tombstone.state, tombstone.reason, tombstone.started) == ("stopped", "user", None)
        assert await registry.claim("tombstone", "r2") is None  # it still never starts
        claimed = await registry.get("claimed", OWNER)
        assert claimed.state == "stopping"
        stops, _, _ = await registry.poll("r1", [], ["claimed"], 0, 0, 0.0)
        assert stops == {"claimed": "disconnected"}  # sent again to the replica that runs it
        found = await registry.result("ended", OWNER)
        assert found["job"]["state"] == "completed" and found["result"] == {"text": "ended!"}
        ended_events, _, ended = await registry.events("ended", OWNER, 0, 0.0)
        assert ended and [e.type for e in ended_events] == ["queued", "done"] and ended_events[-1].seq == 3
        assert (await registry.get("old-1", OWNER)).__class__.__name__ == "Refused"  # forgotten
        assert (await registry.get("queued", OWNER)).state == "queued"
        await asyncio.wait_for(sent.called.wait(), 10)
        assert sent.jobs == ["queued"]  # the queued job is sent again (it never started); no other

    asyncio.run(after())


def test_a_replica_that_dies_fails_its_job_which_is_not_sent_again():
    from ray.exceptions import ActorDiedError

    class Dies:
        def __init__(self) -> None:
            self.calls = 0

        async def run(self, job_id: str, owner: str, spec: JobSpec) -> str:
            self.calls += 1
            assert await registry.claim(job_id, "r1") is not None
            raise ActorDiedError()

    async def main() -> None:
        nonlocal registry
        dies = Dies()
        registry = await construct(JobRegistry, {"text": LocalHandle(dies)}, alive=lambda name: False)
        await registry.register("text", "r1", 1, None)
        await registry.submit("job", text(5), OWNER, 0.0)
        assert await registry.settled("job", 10) == "failed"
        view = await registry.get("job", OWNER)
        assert (view.state, view.reason) == ("failed", "error") and "died" in view.error
        assert "not run again" in view.error and dies.calls == 1
        assert (await registry.stop("job", OWNER)) == view  # a stop answers with that state
        assert (await registry.stats())["replicas"] == 0

    registry: Any = None
    asyncio.run(main())


class _Never:
    """A model deployment stand-in whose replicas never answer (every job stays unclaimed)."""

    def __init__(self) -> None:
        self.jobs: list[str] = []
        self.called = asyncio.Event()

    def __getattr__(self, method: str) -> Any:
        assert method == "run"
        outer = self

        class _Run:
            @staticmethod
            def remote(job_id: str, owner: str, spec: JobSpec) -> Any:
                outer.jobs.append(job_id)
                outer.called.set()
                return asyncio.get_running_loop().create_future()  # never resolved

        return _Run


def test_events_numbered_elsewhere_keep_their_numbers():
    job = Job(text(3), OWNER, seq=1)
    job.emit("started")
    assert [e.seq for e in job.events if e is not None] == [2]
    copy = Job(text(3), OWNER)
    copy.emit("queued", position=1)
    copy.put(JobEvent(5, "progress", {"step": 3, "total": 3}))
    copy.put(JobEvent(2, "started", {}))  # older than what it holds: already past
    assert [e.seq if e else None for e in copy.events] == [1, None, None, None, 5]


def test_a_stop_held_by_a_slow_step_escalates_after_the_replicas_grace():
    """As ``LocalEngine(stop_grace=...)``: a model replica's ``stop_grace`` aborts a step that holds a
    stop, and the job keeps the last finished step's image (test_escalation's slow layer)."""
    from test_escalation import GRACE, HELD, STEPS, slow_sd  # tests/ is on sys.path under pytest

    pipe, slow = slow_sd()
    params = ImageParameters(steps=STEPS, seed=3, previews=False).model_dump()

    async def main() -> None:
        engine, _, _ = await wired(ImageBackend(pipe, "slow-sd"), stop_grace=GRACE)
        job = await engine.submit(JobSpec("image", "a cat", params), OWNER)
        assert await asyncio.to_thread(slow.entered.wait, 60)
        stopped = await engine.stop(job.id, OWNER)
        assert (stopped.state, stopped.reason, stopped.step) == ("stopped", "user", HELD)
        assert stopped.outcome["mode"] == "abort" and "escalated" in stopped.outcome["detail"]
        assert (await engine.result(job.id, OWNER))["result"]["image"].startswith("iVBOR")

    try:
        asyncio.run(main())
    finally:
        slow.release.set()


# -- pause, resume and priority preemption ---------------------------------------------------------
SAMPLED = {"max_tokens": 24, "temperature": 1.0, "top_p": 0.9, "seed": 7}


class _RoundRobin:
    """A stand-in for a model deployment's handle over several replicas: each call goes to the next
    replica in turn (Serve's router picks one with a free slot; here the order is fixed, so a job
    sent again lands on another replica than the one that held it)."""

    def __init__(self, replicas: list[ModelReplica]) -> None:
        self.handles = [LocalHandle(r) for r in replicas]
        self.calls = 0

    def __getattr__(self, method: str) -> Any:
        handle = self.handles[self.calls % len(self.handles)]
        self.calls += 1
        return getattr(handle, method)


async def replicas_over(
    backend: Any, count: int, checkpoint_dir: str
) -> tuple[RayEngine, JobRegistry, list[ModelReplica]]:
    """A registry and ``count`` model replicas of ``backend`` (one lane each), held jobs' checkpoints
    in ``checkpoint_dir``, and an engine over them."""
    registry, replicas = await fleet_of(backend, count, checkpoint_dir)
    return engine_over(registry, backend, _RoundRobin(replicas)), registry, replicas


async def alone(engine: RayEngine) -> str:
    """The text of a sampled job run alone, from its start to its end (what a stopped and resumed
    or re-run one must give)."""
    job = await engine.submit(JobSpec("text", "Once upon a time", SAMPLED), OWNER)
    _, text_ = await text_of(engine, job.id)
    return text_


async def text_of(engine: RayEngine, job_id: str) -> tuple[Any, str]:
    done = await engine.wait(job_id, OWNER)
    return done, (await engine.result(job_id, OWNER))["result"]["text"]


def test_a_job_paused_on_one_replica_resumes_on_another_with_the_text_of_an_uninterrupted_run(
    server_backends, tmp_path
):
    async def main() -> None:
        engine, registry, _ = await replicas_over(server_backends["text"], 2, str(tmp_path))
        uninterrupted = await alone(engine)  # replica-0
        job = await engine.submit(JobSpec("text", "Once upon a time", SAMPLED), OWNER)  # replica-1
        await reach(engine, job.id, 5)
        assert await registry.placement(job.id) == "replica-1"
        paused = await engine.pause(job.id, OWNER)
        assert paused.state == "paused" and paused.checkpoint_step == paused.step >= 5
        assert await registry.placement(job.id) is None  # the claim is released: the lane is free
        assert len(list(tmp_path.iterdir())) == 1  # the checkpoint, where any replica reads it
        assert (await engine.pause(job.id, OWNER)) == paused  # idempotent
        resumed = await engine.resume(job.id, OWNER)
        assert resumed.state == "queued" and resumed.checkpoint_step == paused.step
        done, text = await text_of(engine, job.id)
        assert await registry.placement(job.id) == "replica-0"  # another replica resumed it
        assert (done.state, done.step, done.saved_steps) == ("completed", 24, paused.step)
        assert text == uninterrupted != ""
        types = [e.type async for e in engine.events(job.id, OWNER)]
        assert types.count("started") == 2 and "paused" in types and "resumed" in types
        assert list(tmp_path.iterdir()) == []  # dropped once the job ended
        with pytest.raises(JobStateConflict):
            await engine.pause(job.id, OWNER)

    asyncio.run(main())


def test_a_job_of_higher_priority_preempts_a_running_one_which_resumes_after_it(server_backends, tmp_path):
    async def main() -> None:
        engine, _, replicas = await replicas_over(server_backends["text"], 1, str(tmp_path))
        uninterrupted = await alone(engine)
        low = await engine.submit(JobSpec("text", "Once upon a time", SAMPLED), OWNER)
        await reach(engine, low.id, 3)
        high = await engine.submit(JobSpec("text", "Hello", text(4).params, priority=5), OWNER)
        assert high.priority == 5
        high_done, _ = await text_of(engine, high.id)
        low_done, low_text = await text_of(engine, low.id)
        assert (high_done.state, low_done.state) == ("completed", "completed")
        assert low_done.preemptions == 1 and low_done.saved_steps >= 3
        assert low_text == uninterrupted  # as if it had never been preempted
        types = [e.type async for e in engine.events(low.id, OWNER)]
        assert types.count("preempted") == 1 and types.count("started") == 2
        assert high_done.started is not None and low_done.finished is not None
        assert high_done.finished is not None and high_done.finished <= low_done.finished
        assert replicas[0].peak == 1  # one lane: they never ran at once

    asyncio.run(main())


def test_a_paused_job_stopped_ends_with_its_last_run_and_a_queued_one_pauses_at_once(
    server_backends, tmp_path
):
    async def main() -> None:
        engine, _, _ = await replicas_over(server_backends["text"], 1, str(tmp_path))
        running = await engine.submit(text(1000), OWNER)
        await reach(engine, running.id, 2)
        queued = await engine.submit(text(5), OWNER)
        held = await engine.pause(queued.id, OWNER)  # no replica runs it: held at once, no checkpoint
        assert (held.state, held.checkpoint_step, held.started) == ("paused", None, None)
        paused = await engine.pause(running.id, OWNER)
        assert paused.state == "paused"
        stopped = await engine.stop(running.id, OWNER)
        assert (stopped.state, stopped.reason, stopped.step) == ("stopped", "user", paused.step)
        assert f"at step {paused.step}" in stopped.outcome["detail"]
        assert list(tmp_path.iterdir()) == []  # its checkpoint is dropped
        await engine.resume(queued.id, OWNER)
        done = await engine.wait(queued.id, OWNER)
        assert (done.state, done.step, done.saved_steps) == ("completed", 5, 0)

    asyncio.run(main())


def test_a_stop_that_crosses_a_hold_ends_the_job_which_is_not_queued_again(tmp_path):
    """The replica held the job (asked to) just as a stop was asked: the hold's report reaches the
    registry after the stop, and the job ends stopped at the step it was held at, never sent again."""

    async def main() -> None:
        sent = _Never()
        registry = await construct(
            JobRegistry, {"text": sent}, alive=lambda name: True, checkpoint_dir=str(tmp_path)
        )
        await registry.register("text", "r1", 1, None)
        await registry.submit("job", text(50), OWNER, 0.0)
        assert await registry.claim("job", "r1") == 1
        pausing = asyncio.ensure_future(registry.pause("job", OWNER))
        _, _, asks = await registry.poll("r1", [], ["job"], 0, 0, 30.0)  # answered once the pause asks
        assert asks == [("job", "hold", "paused")]
        assert (await registry.stop("job", OWNER, "user", wait=False)).state == "stopping"
        parcel = await report_hold(registry, "r1", "job", text(50), 2, tmp_path, OWNER)
        view = await asyncio.wait_for(pausing, 30)
        assert (view.state, view.reason, view.step, view.stop_step) == ("stopped", "user", 2, 2)
        assert "held" in view.outcome["detail"] and not parcel.exists()  # its checkpoint dropped
        assert await registry.claim("job", "r1") is None and sent.jobs == ["job"]  # not sent again

    asyncio.run(main())


class _Counting(LocalHandle):
    """A registry handle that counts the calls in flight by method (the most at once in ``peak``)."""

    def __init__(self, target: Any) -> None:
        super().__init__(target)
        self.now: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.calls: dict[str, int] = {}

    def __getattr__(self, method: str) -> Any:
        call = getattr(self.target, method)
        handle = self

        async def counted(*args: Any) -> Any:
            handle.now[method] = handle.now.get(method, 0) + 1
            handle.calls[method] = handle.calls.get(method, 0) + 1
            handle.peak[method] = max(handle.peak.get(method, 0), handle.now[method])
            try:
                return await call(*args)
            finally:
                handle.now[method] -= 1

        class _Method:
            @staticmethod
            def remote(*args: Any) -> Any:
                return asyncio.ensure_future(counted(*args))

        return _Method


def test_every_event_stream_of_an_ingress_is_fed_by_one_poll(server_backends):
    """Six streams of four jobs (two of one job, one resumed after its third event) each get their
    job's events in order, none missing or twice, while the registry has one poll in flight at most;
    a stream of an unknown job fails as the contract says."""
    from stopcock.server.contract import JobNotFound

    async def main() -> None:
        _, registry, _ = await wired(server_backends["text"])
        handle = _Counting(registry)
        engine = RayEngine(handle, {"text": {"id": "tiny", "description": ""}})
        jobs = [await engine.submit(text(12 + i), OWNER) for i in range(4)]

        async def follow(job_id: str, after: int = 0) -> list[JobEvent]:
            return [e async for e in engine.events(job_id, OWNER, after)]

        streams = [follow(job.id) for job in jobs] + [follow(jobs[0].id), follow(jobs[1].id, 3)]
        got = await asyncio.wait_for(asyncio.gather(*streams), 120)
        for job, events in zip([*jobs, jobs[0], jobs[1]], got, strict=True):
            known, _, ended = await registry.events(job.id, OWNER, 0, 0.0)
            assert ended
            start = 3 if events is got[5] else 0
            assert [e.seq for e in events] == [e.seq for e in known][start:]
            assert [e.seq for e in events] == list(range(start + 1, start + 1 + len(events)))
            assert events[-1].type == "done"
        assert handle.peak["feed"] == 1 and "events" not in handle.peak
        with pytest.raises(JobNotFound):
            await follow("no-such-job")

    asyncio.run(main())


def test_an_ingress_fetches_the_validators_as_it_starts(server_backends):
    """``warm()`` (called as an ingress replica starts) fetches each kind's validator in the
    background, so the first submission asks the registry for none."""

    async def main() -> None:
        _, registry, _ = await wired(server_backends["text"])
        handle = _Counting(registry)
        engine = RayEngine(handle, {"text": {"id": "tiny", "description": ""}})
        engine.warm()
        await asyncio.wait_for(asyncio.gather(*engine._detached), 60)
        assert handle.calls == {"validator": 1}
        job = await engine.submit(text(3), OWNER)
        assert handle.calls == {"validator": 1, "submit": 1}
        assert (await engine.wait(job.id, OWNER, 60)).state == "completed"

    asyncio.run(main())


def test_a_dead_replica_stops_counting_once_a_new_one_of_its_kind_registers(monkeypatch):
    """A replica that died holding no job is found by the registry only by asking Ray; when a
    replica of its kind registers (Serve's replacement, say), the registry asks about every replica
    of that kind at once, not only about those that have been silent for long (never, here)."""
    from stopcock.server.ray_engine import replicas

    monkeypatch.setattr(replicas, "SILENT_S", float("inf"))
    dead: set[str] = set()

    async def main() -> None:
        registry = await construct(JobRegistry, {}, alive=lambda name: name not in dead)
        fleet = registry.fleet
        for name in ("replica-a", "replica-b"):
            await registry.register("text", name, 1, None)
        dead.add("replica-b")

        async def settled() -> None:
            while "replica-b" in fleet.replicas:
                fleet.changed.clear()
                await fleet.changed.wait()

        await registry.register("text", "replica-c", 1, None)
        await asyncio.wait_for(settled(), 60)
        assert sorted(fleet.replicas) == ["replica-a", "replica-c"] and fleet.ready("text") == 2

    asyncio.run(main())
