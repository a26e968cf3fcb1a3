"""Holds survive a registry restart: a paused job comes back paused (never run unasked) and resumes
from its checkpoint in the shared folder with the text of an uninterrupted run; a preempted job comes
back queued with its checkpoint and is sent again; a checkpoint that did not survive (the object
store's) is said to be lost and the job runs from its start; a compacted journal keeps the holds.

No cluster: the registry and its model replicas run in one event loop (``ray_doubles``); a restart is
a new registry built from the same journal, with a new model replica, as Serve restarts them.
``tests/test_ray_cluster.py`` restarts the registry on a multi-node cluster."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray")

from ray_doubles import LocalHandle, construct, report_hold  # tests/ is on sys.path under pytest

from stopcock.server.contract import JobEvent, JobSpec, JobView
from stopcock.server.engine import LocalEngine
from stopcock.server.jobs import Job
from stopcock.server.ray_engine.ingress import RayEngine
from stopcock.server.ray_engine.registry import JobRegistry
from stopcock.server.ray_engine.replica import ModelReplica
from stopcock.server.ray_engine.wire import ModelSpec, spec_to_json

OWNER = "me"
SAMPLED = {"max_tokens": 24, "temperature": 1.0, "top_p": 0.9, "seed": 7}
pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(180)]


def sampled() -> JobSpec:
    return JobSpec("text", "Once upon a time", SAMPLED)


class Parked:
    """A model deployment's handle whose requests wait for a replica that never frees (they stay in
    Serve's queue): the job stays unclaimed. ``sent`` holds each request's arguments."""

    def __init__(self) -> None:
        self.sent: list[tuple[Any, ...]] = []
        self._more: asyncio.Event | None = None

    async def wait_sent(self, count: int) -> None:
        """Until ``count`` requests were sent."""
        while len(self.sent) < count:
            self._more = asyncio.Event()
            await self._more.wait()

    def __getattr__(self, method: str) -> Any:
        outer = self

        class _Run:
            @staticmethod
            def remote(*args: Any) -> Any:
                outer.sent.append(args)
                if outer._more is not None:
                    outer._more.set()
                return asyncio.get_running_loop().create_future()  # never resolved

        return _Run


class Deferred:
    """A model deployment's handle whose requests wait until its replicas are up (as Serve queues
    them), then go to ``handle`` (set by :meth:`up`)."""

    def __init__(self) -> None:
        self.ready: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    def up(self, handle: Any) -> None:
        self.ready.set_result(handle)

    def __getattr__(self, method: str) -> Any:
        ready = self.ready

        class _Call:
            @staticmethod
            def remote(*args: Any) -> Any:
                async def call() -> Any:
                    return await getattr(await ready, method).remote(*args)

                return asyncio.ensure_future(call())

        return _Call


class Routed:
    """A model deployment's handle that sends its first requests to ``first`` (in turn), the later
    ones to ``then`` (Serve's router decides; here the order is fixed)."""

    def __init__(self, first: list[Any], then: Any) -> None:
        self.first, self.then = list(first), then

    def __getattr__(self, method: str) -> Any:
        return getattr(self.first.pop(0) if self.first else self.then, method)


async def world(
    backend: Any, journal: Path, checkpoint_dir: str | None, name: str, route: Any = LocalHandle
) -> tuple[RayEngine, JobRegistry, ModelReplica]:
    """A registry on ``journal`` (restored from it, if it has entries, and sending the jobs it
    restored once the replica is up), one model replica ``name`` of ``backend`` registered with it,
    reached through ``route(replica)``, and an engine over them."""
    deployment = Deferred()
    registry = await construct(
        JobRegistry,
        {backend.kind: deployment},
        alive=lambda name: True,
        journal=str(journal),
        checkpoint_dir=checkpoint_dir,
    )
    spec = ModelSpec(backend.kind, name=backend.name, factory=lambda: backend)
    replica = await construct(
        ModelReplica,
        spec,
        step_delay=0.01,
        torch_threads=None,
        registry=LocalHandle(registry),
        name=name,
        checkpoint_dir=checkpoint_dir,
    )
    deployment.up(route(replica))
    engine = RayEngine(LocalHandle(registry), {backend.kind: {"id": backend.name, "description": ""}})
    return engine, registry, replica


async def uninterrupted(backend: Any) -> str:
    """The text of ``sampled()`` on the local engine, run once without a hold."""
    engine = LocalEngine({backend.kind: backend})
    try:
        view = await engine.submit(sampled(), OWNER)
        assert (await engine.wait(view.id, OWNER, 120)).state == "completed"
        text: str = (await engine.result(view.id, OWNER))["result"]["text"]
        return text
    finally:
        await engine.aclose()


async def reach(engine: RayEngine, job_id: str, step: int) -> None:
    async for event in engine.events(job_id, OWNER):
        assert event.type != "done", f"the job ended before step {step}"
        if event.type == "progress" and event.data["step"] >= step:
            return


async def until(engine: RayEngine, job_id: str, type_: str) -> JobEvent:
    async for event in engine.events(job_id, OWNER):
        if event.type == type_:
            return event
    raise AssertionError(f"the job's events ended without {type_!r}")


async def finished(engine: RayEngine, job_id: str) -> tuple[JobView, str]:
    done = await engine.wait(job_id, OWNER)
    return done, (await engine.result(job_id, OWNER))["result"]["text"]


async def so_far(registry: JobRegistry, job_id: str) -> list[JobEvent]:
    """The job's events known now (without waiting for more)."""
    found = await registry.events(job_id, OWNER, 0, 0.0)
    assert isinstance(found, tuple)
    return found[0]


async def viewed(registry: JobRegistry, job_id: str) -> JobView:
    found = await registry.get(job_id, OWNER)
    assert isinstance(found, JobView), found
    return found


def restarted(registry: JobRegistry) -> None:
    """The registry dies: nothing more reaches its journal."""
    assert registry.journal is not None
    registry.journal.close()


def test_a_paused_job_survives_a_registry_restart_and_resumes_bit_identically(server_backends, tmp_path):
    backend, folder = server_backends["text"], tmp_path / "checkpoints"

    async def main() -> None:
        expected = await uninterrupted(backend)
        engine, registry, _ = await world(backend, tmp_path / "j.jsonl", str(folder), "replica-0")
        job = await engine.submit(sampled(), OWNER)
        await reach(engine, job.id, 5)
        paused = await engine.pause(job.id, OWNER)
        assert paused.state == "paused" and paused.checkpoint_step == paused.step >= 5
        [checkpoint] = list(folder.iterdir())
        restarted(registry)

        engine, registry, replica = await world(backend, tmp_path / "j.jsonl", str(folder), "replica-1")
        assert registry.restored == 1
        back = await engine.get(job.id, OWNER)
        assert (back.state, back.step) == ("paused", paused.step)
        assert back.checkpoint_step == paused.checkpoint_step
        assert back.started == paused.started and back.total == paused.total
        assert job.id not in registry._dispatches and replica.peak == 0  # never run unasked
        assert [checkpoint] == list(folder.iterdir())
        events = await so_far(registry, job.id)
        assert [e.type for e in events].count("paused") == 1
        assert all("checkpoint_lost" not in e.data for e in events)

        resumed = await engine.resume(job.id, OWNER)
        assert (resumed.state, resumed.checkpoint_step) == ("queued", paused.checkpoint_step)
        done, text = await finished(engine, job.id)
        assert (done.state, done.step, done.saved_steps) == ("completed", 24, paused.step)
        assert text == expected != ""  # bit-identical to the uninterrupted run
        started = [e async for e in engine.events(job.id, OWNER) if e.type == "started"]
        assert [e.data.get("resumed_from") for e in started] == [None, paused.checkpoint_step]
        assert list(folder.iterdir()) == []  # dropped once the job ended

    asyncio.run(main())


def test_a_preempted_job_survives_a_registry_restart_and_finishes_with_the_same_text(
    server_backends, tmp_path
):
    backend, folder = server_backends["text"], tmp_path / "checkpoints"
    parked = Parked()

    def first_two_then_parked(replica: ModelReplica) -> Routed:
        """The low job, then the high one, go to the replica; the low one sent again waits."""
        return Routed([LocalHandle(replica), LocalHandle(replica)], parked)

    async def main() -> None:
        expected = await uninterrupted(backend)
        journal = tmp_path / "j.jsonl"
        engine, registry, _ = await world(backend, journal, str(folder), "replica-0", first_two_then_parked)
        low = await engine.submit(sampled(), OWNER)
        await reach(engine, low.id, 3)
        greedy = {"max_tokens": 4, "temperature": 0.0, "top_p": 1.0}
        high = await engine.submit(JobSpec("text", "Hello", greedy, priority=5), OWNER)
        held = (await until(engine, low.id, "preempted")).data
        assert (await engine.wait(high.id, OWNER)).state == "completed"
        before = await engine.get(low.id, OWNER)
        assert (before.state, before.preemptions) == ("preempted", 1)
        assert before.checkpoint_step == held["checkpoint_step"]
        assert [args[0] for args in parked.sent] == [low.id]  # sent again, waiting for a replica
        restarted(registry)

        engine, registry, replica = await world(backend, journal, str(folder), "replica-1")
        back = registry._jobs[low.id].job.view()  # before the restored job is sent on
        assert (back.state, back.preemptions) == ("preempted", 1)
        assert back.checkpoint_step == held["checkpoint_step"]
        assert low.id in registry._dispatches  # sent again, with its checkpoint
        done, text = await finished(engine, low.id)
        assert (done.state, done.step, done.preemptions) == ("completed", 24, 1)
        assert done.saved_steps == held["checkpoint_step"] >= 3
        assert text == expected  # as if it had never been preempted, nor the registry restarted
        started = [e async for e in engine.events(low.id, OWNER) if e.type == "started"]
        assert [e.data.get("resumed_from") for e in started] == [None, held["checkpoint_step"]]
        assert replica.peak == 1 and list(folder.iterdir()) == []
        restarted(registry)

        _, registry, _ = await world(backend, journal, str(folder), "replica-2")  # its end keeps its counts
        ended = await viewed(registry, low.id)
        assert (ended.state, ended.preemptions, ended.saved_steps) == ("completed", 1, done.saved_steps)

    asyncio.run(main())


@pytest.fixture
def object_store(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Ray in this process (an object store for the registry's checkpoints): the session's cluster if
    a test before started one, else a local one started (and shut down) here."""
    import ray

    if ray.is_initialized():
        yield
        return
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # a private cluster: no token file
    ray.init(
        address="local", num_cpus=1, include_dashboard=False, object_store_memory=100 * 2**20,
        log_to_driver=False, configure_logging=False,
    )
    try:
        yield
    finally:
        ray.shutdown()


def test_a_held_job_whose_checkpoint_was_in_the_object_store_says_so_and_runs_from_its_start(
    server_backends, tmp_path, object_store
):
    backend, journal = server_backends["text"], tmp_path / "j.jsonl"

    async def main() -> None:
        expected = await uninterrupted(backend)
        engine, registry, _ = await world(backend, journal, None, "replica-0")
        job = await engine.submit(sampled(), OWNER)
        await reach(engine, job.id, 5)
        paused = await engine.pause(job.id, OWNER)
        assert paused.state == "paused" and paused.checkpoint_step == paused.step >= 5
        restarted(registry)

        engine, registry, replica = await world(backend, journal, None, "replica-1")
        back = await engine.get(job.id, OWNER)
        assert (back.state, back.step, back.checkpoint_step) == ("paused", paused.step, None)
        assert job.id not in registry._dispatches and replica.peak == 0  # never run unasked
        lost = (await so_far(registry, job.id))[-1]
        assert (lost.type, lost.data["checkpoint_step"]) == ("paused", None)
        told = lost.data["checkpoint_lost"]
        assert f"checkpoint at step {paused.checkpoint_step} was lost" in told
        assert "object store" in told and "checkpoint_dir" in told  # why, and the fix
        restarted(registry)

        engine, registry, _ = await world(backend, journal, None, "replica-2")  # told once
        events = await so_far(registry, job.id)
        assert [e.seq for e in events if "checkpoint_lost" in e.data] == [lost.seq]
        assert (await engine.get(job.id, OWNER)).state == "paused"
        await engine.resume(job.id, OWNER)
        done, text = await finished(engine, job.id)
        assert (done.state, done.step, done.saved_steps) == ("completed", 24, 0)  # from its start
        assert text == expected
        started = [e async for e in engine.events(job.id, OWNER) if e.type == "started"]
        assert [e.data.get("resumed_from") for e in started] == [None, None]

    asyncio.run(main())


def view_of(state: str, step: int, checkpoint_step: int | None, **counts: int) -> dict[str, Any]:
    job = Job(JobSpec("text", "Once upon a time", SAMPLED), OWNER, id="x", created=1.0)
    job.state, job.step, job.total, job.started = state, step, 24, 2.0  # type: ignore[assignment]
    return {**job.view().to_json(), "checkpoint_step": checkpoint_step, **counts}


def test_a_journal_restores_holds_whose_checkpoint_is_gone_and_old_journals_as_before(tmp_path):
    """Journals written by hand: a preempted job whose checkpoint file is gone comes back preempted,
    says so and is sent again without a checkpoint; a job held by a registry that journaled no holds
    (only its claim released) is queued again, as it always was."""
    journal = tmp_path / "j.jsonl"
    gone = tmp_path / "gone.safetensors"
    spec = spec_to_json(sampled())
    entries = [
        {"op": "submit", "id": "pre", "owner": OWNER, "spec": spec, "created": 1.0, "position": 1},
        {"op": "claim", "id": "pre", "replica": "r1"},
        {"op": "hold", "id": "pre", "view": view_of("preempted", 4, 3, preemptions=1), "handle": str(gone)},
        {"op": "claim", "id": "pre", "replica": None},
        {"op": "submit", "id": "old", "owner": OWNER, "spec": spec, "created": 1.0, "position": 2},
        {"op": "claim", "id": "old", "replica": "r1"},
        {"op": "claim", "id": "old", "replica": None},
    ]
    journal.write_text("".join(json.dumps(e) + "\n" for e in entries), "utf-8")
    parked = Parked()

    async def main() -> None:
        registry = await construct(
            JobRegistry, {"text": parked}, journal=str(journal), alive=lambda name: True,
            checkpoint_dir=str(tmp_path / "checkpoints"),
        )
        pre = await viewed(registry, "pre")
        assert (pre.state, pre.step, pre.checkpoint_step, pre.preemptions) == ("preempted", 4, None, 1)
        told = (await so_far(registry, "pre"))[-1]
        assert told.type == "preempted" and f"its file {gone} is gone" in told.data["checkpoint_lost"]
        old = await viewed(registry, "old")
        assert (old.state, old.step, old.checkpoint_step) == ("queued", 0, None)
        await asyncio.wait_for(parked.wait_sent(2), 10)
        assert sorted(args[0] for args in parked.sent) == ["old", "pre"]
        assert all(len(args) == 3 for args in parked.sent)  # (id, owner, spec): no checkpoint to resume

    asyncio.run(main())


def test_a_compacted_journal_keeps_the_holds(tmp_path):
    """A job held on a replica (its hold reported by hand) and one paused while it waited, then many
    jobs ended: the journal is compacted, and still restores both paused (the first with its
    checkpoint, sent with it once resumed; the other sent to run from its start)."""
    journal, folder = tmp_path / "j.jsonl", tmp_path / "checkpoints"
    parked = Parked()  # the deployment after the restart

    async def registry_now(deployment: Any) -> JobRegistry:
        registry: JobRegistry = await construct(
            JobRegistry, {"text": deployment}, journal=str(journal), retain=1, alive=lambda name: True,
            checkpoint_dir=str(folder),
        )
        return registry

    async def before() -> str:
        registry = await registry_now(Parked())
        await registry.register("text", "r1", 1, None)
        await registry.submit("held", sampled(), OWNER, 0.0)
        assert await registry.claim("held", "r1") == 1
        pausing = asyncio.ensure_future(registry.pause("held", OWNER))
        _, _, asks = await registry.poll("r1", [], ["held"], 0, 0, 30.0)  # answered once the pause asks
        assert asks == [("held", "hold", "paused")]
        parcel = await report_hold(registry, "r1", "held", sampled(), 6, folder, OWNER, total=24)
        paused = await asyncio.wait_for(pausing, 30)
        assert isinstance(paused, JobView) and paused.state == "paused"
        await registry.submit("waiting", sampled(), OWNER, 0.5)  # never claimed: paused at once
        assert (await registry.pause("waiting", OWNER)).state == "paused"  # type: ignore[union-attr]
        for n in range(12):  # jobs that run and end: the journal grows, then is compacted
            name = f"done-{n}"
            await registry.submit(name, sampled(), OWNER, 1.0)
            await registry.claim(name, "r1")
            done = Job(sampled(), OWNER, id=name, seq=1)
            done.state, done.step, done.outcome = "completed", 24, {"steps": 24}
            done.emit("done", **done.view().to_json())
            await registry.report("r1", [(name, done.events[-1])], {}, {name: {"text": "!"}})  # type: ignore[list-item]
        assert registry.journal is not None
        registry.journal.close()
        return str(parcel)

    async def after(parcel: str) -> None:
        lines = [json.loads(line) for line in journal.read_text("utf-8").splitlines()]
        assert sum(e["op"] == "submit" for e in lines) < 13  # compacted: the forgotten jobs are gone
        # its claim and its release are gone too, the hold is kept
        assert [e["op"] for e in lines if e["id"] == "held" and e["op"] != "event"] == ["submit", "hold"]
        registry = await registry_now(parked)
        back = await viewed(registry, "held")
        assert (back.state, back.step, back.checkpoint_step, back.total) == ("paused", 6, 6, 24)
        waiting = await viewed(registry, "waiting")
        assert (waiting.state, waiting.step, waiting.checkpoint_step) == ("paused", 0, None)
        assert parked.sent == []  # paused: never sent unasked
        await registry.resume("held", OWNER)
        await asyncio.wait_for(parked.wait_sent(1), 10)
        [(job_id, _, _, held)] = parked.sent
        assert (job_id, held["handle"], held["saved_steps"]) == ("held", parcel, 0)
        await registry.resume("waiting", OWNER)
        await asyncio.wait_for(parked.wait_sent(2), 10)
        assert parked.sent[1][0] == "waiting" and len(parked.sent[1]) == 3  # no checkpoint: from its start

    asyncio.run(after(asyncio.run(before())))
