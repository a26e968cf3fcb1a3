"""A lost model replica's jobs run again (``on_replica_loss="rerun"``), in one event loop without a
cluster: the registry, model replicas and engine of ``tests/test_ray_local.py``, over a stand-in for
a model deployment's handle whose replicas can be killed as ``ray.kill`` kills one (the calls waiting
on it, and those sent to it later, raise ``ActorDiedError``; its polls and reports end). A node
removed mid-job is in ``tests/test_ray_cluster.py``."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("ray")

from ray.exceptions import ActorDiedError
from ray_doubles import construct, engine_over, fleet_of  # tests/ is on sys.path under pytest
from test_ray_local import OWNER, SAMPLED, alone, reach, text, text_of

from stopcock.server.contract import JobSpec
from stopcock.server.ray_deploy import RayOptions
from stopcock.server.ray_engine.ingress import RayEngine
from stopcock.server.ray_engine.journal import Journal
from stopcock.server.ray_engine.registry import JobRegistry
from stopcock.server.ray_engine.replica import ModelReplica
from stopcock.server.ray_engine.wire import ModelSpec

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(300)]


class _Killable:
    """A model deployment's handle over ``replicas``: a call goes to the replica named next in
    ``route`` (scripted), else to the first live one. :meth:`kill` kills a replica as ``ray.kill``
    does; ``sent`` lists each call's ``(job_id, replica)``."""

    def __init__(self, replicas: list[ModelReplica]) -> None:
        self.replicas = {r.name: r for r in replicas}
        self.route: list[str] = []
        self.dead: set[str] = set()
        self.sent: list[tuple[str, str]] = []
        self._died = {name: asyncio.Event() for name in self.replicas}
        self._sending = asyncio.Event()  # set at each call

    def alive(self, name: str) -> bool:
        return name not in self.dead

    def __getattr__(self, method: str) -> Any:
        assert method == "run"
        name = self.route.pop(0) if self.route else next(n for n in self.replicas if n not in self.dead)
        outer = self

        class _Run:
            @staticmethod
            def remote(job_id: str, *args: Any) -> Any:
                outer.sent.append((job_id, name))
                outer._sending.set()
                return asyncio.ensure_future(outer._call(name, job_id, *args))

        return _Run

    async def _call(self, name: str, *args: Any) -> Any:
        if name in self.dead:
            raise ActorDiedError()
        answer = asyncio.ensure_future(self.replicas[name].run(*args))
        died = asyncio.ensure_future(self._died[name].wait())
        done, _ = await asyncio.wait({answer, died}, return_when=asyncio.FIRST_COMPLETED)
        if answer in done:
            died.cancel()
            return answer.result()
        raise ActorDiedError()

    def kill(self, name: str, *, tell: bool = True) -> None:
        """Kill the replica: its loops end, its runs stop (nothing of them is reported again) and,
        with ``tell``, the calls waiting on it raise (without: later, with :meth:`tell`)."""
        replica = self.replicas[name]
        self.dead.add(name)
        for loop in replica._loops:
            loop.cancel()
        for job in list(replica._jobs.values()):
            job.request_stop("killed")  # its thread ends; the report loop that would tell it is gone
        if tell:
            self.tell(name)

    def tell(self, name: str) -> None:
        self._died[name].set()

    async def sent_twice(self, job_id: str) -> None:
        """Once ``job_id`` has been sent a second time."""
        while [j for j, _ in self.sent].count(job_id) < 2:
            self._sending.clear()
            await self._sending.wait()


async def killable(
    backend: Any, count: int, checkpoint_dir: str, batch_size: int = 1, **registry_options: Any
) -> tuple[RayEngine, JobRegistry, _Killable]:
    """A registry (``on_replica_loss="rerun"`` unless told), ``count`` model replicas of ``backend``
    (one lane each) behind a :class:`_Killable` handle, and an engine over them."""
    options = {"on_replica_loss": "rerun", **registry_options}
    batching = dict(batch_size=batch_size, batch_wait=60.0)  # a batch starts once full: its rows are in
    registry, replicas = await fleet_of(backend, count, checkpoint_dir, options, **batching)
    fleet = _Killable(replicas)
    registry.fleet.alive = fleet.alive
    return engine_over(registry, backend, fleet), registry, fleet


async def streamed(engine: RayEngine, job_id: str) -> tuple[list[Any], str]:
    """The job's events, and its text as a client following them puts it together: a ``requeued``
    event keeps the first ``text_kept`` characters, the re-run sends the rest again."""
    events = [e async for e in engine.events(job_id, OWNER)]
    shown = ""
    for event in events:
        if event.type == "text":
            shown += event.data["text"]
        elif event.type == "requeued":
            shown = shown[: event.data["text_kept"]]
    return events, shown


def test_a_replica_killed_mid_job_runs_it_again_from_the_start_with_the_uninterrupted_text(
    server_backends, tmp_path
):
    async def main() -> None:
        engine, registry, fleet = await killable(server_backends["text"], 2, str(tmp_path))
        uninterrupted = await alone(engine)
        fleet.route = ["replica-1"]
        job = await engine.submit(JobSpec("text", "Once upon a time", SAMPLED), OWNER)
        await reach(engine, job.id, 5)
        assert await registry.placement(job.id) == "replica-1"
        fleet.kill("replica-1")
        done, result = await text_of(engine, job.id)
        assert (done.state, done.step) == ("completed", 24)
        assert result == uninterrupted != ""
        assert await registry.placement(job.id) == "replica-0"
        assert [j for j, _ in fleet.sent].count(job.id) == 2  # sent again exactly once
        events, shown = await streamed(engine, job.id)
        types = [e.type for e in events]
        assert types.count("requeued") == 1 and types.count("started") == 2
        assert [e.seq for e in events] == list(range(1, len(events) + 1))  # numbered after those sent
        requeued = next(e for e in events if e.type == "requeued")
        assert requeued.data["replica"] == "replica-1" and "died" in requeued.data["why"]
        assert (requeued.data["from_step"], requeued.data["checkpoint_step"]) == (0, None)
        assert (requeued.data["reruns"], requeued.data["max_reruns"], requeued.data["text_kept"]) == (1, 1, 0)
        assert types[types.index("requeued") + 1] == "started"
        assert shown == uninterrupted  # what a client following the stream shows
        assert (await registry.stats())["replicas"] == 1

    asyncio.run(main())


def test_an_image_job_run_again_makes_the_image_of_an_uninterrupted_run(server_backends, tmp_path):
    from stopcock.server.schemas import ImageParameters

    params = ImageParameters(steps=12, seed=3, previews=False).model_dump()

    async def main() -> None:
        engine, registry, fleet = await killable(server_backends["image"], 2, str(tmp_path))
        first = await engine.submit(JobSpec("image", "a cat", params), OWNER)
        await engine.wait(first.id, OWNER)
        uninterrupted = (await engine.result(first.id, OWNER))["result"]["image"]
        fleet.route = ["replica-1"]
        job = await engine.submit(JobSpec("image", "a cat", params), OWNER)
        await reach(engine, job.id, 4)
        fleet.kill("replica-1")
        done = await engine.wait(job.id, OWNER)
        assert (done.state, done.step) == ("completed", 12)
        assert (await engine.result(job.id, OWNER))["result"]["image"] == uninterrupted
        assert await registry.placement(job.id) == "replica-0"
        assert [e.type async for e in engine.events(job.id, OWNER)].count("requeued") == 1

    asyncio.run(main())


def test_a_job_resumed_before_runs_again_from_its_checkpoint(server_backends, tmp_path):
    async def main() -> None:
        engine, registry, fleet = await killable(server_backends["text"], 2, str(tmp_path))
        uninterrupted = await alone(engine)
        fleet.route = ["replica-1", "replica-0"]  # it runs on the first, resumes on the second
        job = await engine.submit(JobSpec("text", "Once upon a time", SAMPLED), OWNER)
        await reach(engine, job.id, 5)
        paused = await engine.pause(job.id, OWNER)
        assert paused.state == "paused" and paused.checkpoint_step is not None
        await engine.resume(job.id, OWNER)
        await reach(engine, job.id, paused.checkpoint_step + 3)
        assert await registry.placement(job.id) == "replica-0"
        fleet.kill("replica-0")
        done, result = await text_of(engine, job.id)
        assert await registry.placement(job.id) == "replica-1"
        assert (done.state, done.step) == ("completed", 24)
        assert result == uninterrupted
        assert done.saved_steps == paused.checkpoint_step  # the run that ended started from it
        events, shown = await streamed(engine, job.id)
        requeued = next(e for e in events if e.type == "requeued")
        assert requeued.data["from_step"] == requeued.data["checkpoint_step"] == paused.checkpoint_step
        assert 0 < requeued.data["text_kept"] < len(result)
        started = [e for e in events if e.type == "started"]
        assert [e.data.get("resumed_from") for e in started] == [
            None,
            paused.checkpoint_step,
            paused.checkpoint_step,
        ]
        assert shown == uninterrupted
        assert list(tmp_path.iterdir()) == []  # its checkpoint dropped once it ended

    asyncio.run(main())


def test_rows_of_a_batch_run_again_and_a_job_past_max_reruns_fails_saying_so(server_backends, tmp_path):
    async def main() -> None:
        engine, registry, fleet = await killable(server_backends["text"], 3, str(tmp_path), batch_size=2)
        fleet.route = ["replica-0", "replica-0"]
        greedy = [await engine.submit(text(200), OWNER) for _ in range(2)]
        for job in greedy:
            await reach(engine, job.id, 3)
        assert registry.holds.rows == {job.id for job in greedy}  # they run as the rows of one batch
        fleet.route = ["replica-1", "replica-1"]
        fleet.kill("replica-0")
        for job in greedy:
            await rerun_reaches(engine, job.id, 3)  # on replica-1
        assert {await registry.placement(job.id) for job in greedy} == {"replica-1"}
        fleet.route = ["replica-2", "replica-2"]
        fleet.kill("replica-1")  # each was run again once already: the most max_reruns=1 allows
        for job in greedy:
            done = await engine.wait(job.id, OWNER)
            assert (done.state, done.reason) == ("failed", "error")
            assert "replica-1" in done.error and "max_reruns=1" in done.error
            assert "run again 1 time already" in done.error and "not run again" in done.error
            types = [e.type async for e in engine.events(job.id, OWNER)]
            assert types.count("requeued") == 1 and types.count("started") == 2
            assert [j for j, _ in fleet.sent].count(job.id) == 2
        assert registry.holds.rows == set()
        after = await engine.submit(JobSpec("text", "Hello", {**SAMPLED, "max_tokens": 4}), OWNER)  # no batch
        done = await engine.wait(after.id, OWNER)
        assert (done.state, done.step) == ("completed", 4)

    asyncio.run(main())


def test_a_job_whose_stop_was_accepted_ends_stopped_and_is_not_run_again(server_backends, tmp_path):
    async def main() -> None:
        engine, registry, fleet = await killable(server_backends["text"], 2, str(tmp_path))
        job = await engine.submit(text(1000), OWNER)
        reached = await _step_of(engine, job.id, 4)
        fleet.kill("replica-0", tell=False)  # dead, and the registry does not know it yet
        stopping = await engine.stop(job.id, OWNER, wait=False)
        assert stopping.state == "stopping"  # accepted, never applied by the dead replica
        fleet.tell("replica-0")
        done = await engine.wait(job.id, OWNER)
        assert (done.state, done.reason) == ("stopped", "user")
        assert "replica-0" in done.outcome["detail"] and "before applying the stop" in done.outcome["detail"]
        assert done.stop_step is not None and done.stop_step >= reached
        types = [e.type async for e in engine.events(job.id, OWNER)]
        assert "requeued" not in types and types.count("started") == 1
        assert fleet.sent == [(job.id, "replica-0")]
        assert await registry.settled(job.id, 10) == "failed"

    asyncio.run(main())


def test_a_job_asked_to_pause_when_its_replica_died_is_held_and_resumes_later(server_backends, tmp_path):
    async def main() -> None:
        engine, registry, fleet = await killable(server_backends["text"], 2, str(tmp_path))
        uninterrupted = await alone(engine)
        fleet.route = ["replica-1"]
        job = await engine.submit(JobSpec("text", "Once upon a time", SAMPLED), OWNER)
        await reach(engine, job.id, 4)
        fleet.kill("replica-1", tell=False)  # dead before it holds the job
        pausing = asyncio.ensure_future(engine.pause(job.id, OWNER))
        await asked_to_hold(registry, job.id)
        fleet.tell("replica-1")
        paused = await asyncio.wait_for(pausing, 30)
        assert (paused.state, paused.step, paused.checkpoint_step) == ("paused", 0, None)
        held, _, _ = await registry.events(job.id, OWNER, 0, 0.0)  # so far: it has not ended
        assert [e.type for e in held][-2:] == ["requeued", "paused"]
        assert [j for j, _ in fleet.sent].count(job.id) == 1  # held: not sent until resumed
        await engine.resume(job.id, OWNER)
        done, result = await text_of(engine, job.id)
        assert (done.state, result) == ("completed", uninterrupted)
        assert fleet.sent[-1] == (job.id, "replica-0")

    asyncio.run(main())


def test_a_job_run_again_goes_ahead_of_a_job_queued_after_it(server_backends, tmp_path):
    """The lost job keeps its place: a job submitted after it, waiting for the same lane, is asked
    for first (as Serve's router would), refused, and runs after it."""

    async def main() -> None:
        engine, _, fleet = await killable(server_backends["text"], 2, str(tmp_path))
        fleet.route = ["replica-1", "replica-0", "replica-0"]
        lost = await engine.submit(text(50), OWNER)
        busy = await engine.submit(text(1000), OWNER)
        for job in (lost, busy):
            await reach(engine, job.id, 1)
        later = await engine.submit(text(5), OWNER)  # waits for replica-0's lane
        fleet.kill("replica-1")  # lost is sent again: to replica-0, behind later
        await asyncio.wait_for(fleet.sent_twice(lost.id), 30)
        assert (await engine.stop(busy.id, OWNER)).state == "stopped"  # the lane: later is asked first
        await rerun_reaches(engine, lost.id, 2)
        assert (await engine.get(later.id, OWNER)).state == "queued"
        assert (await engine.wait(lost.id, OWNER)).state == "completed"
        assert (await engine.wait(later.id, OWNER)).state == "completed"
        order = [j for j, _ in fleet.sent]
        assert order == [lost.id, busy.id, later.id, lost.id, later.id]  # later refused once, sent again

    asyncio.run(main())


async def asked_to_hold(registry: JobRegistry, job_id: str) -> None:
    """Once the registry has asked the job's replica to hold it (the pause's call has run)."""
    for _ in range(10_000):
        if job_id in registry.holds.asked:
            return
        await asyncio.sleep(0)  # a turn of the event loop, where the pause's call runs
    raise AssertionError(f"no hold was asked of {job_id}'s replica")


def test_with_fail_a_killed_replicas_job_fails_and_is_not_sent_again(server_backends, tmp_path):
    async def main() -> None:
        engine, registry, fleet = await killable(
            server_backends["text"], 2, str(tmp_path), on_replica_loss="fail"
        )
        job = await engine.submit(text(1000), OWNER)
        await reach(engine, job.id, 3)
        fleet.kill("replica-0")
        done = await engine.wait(job.id, OWNER)
        assert (done.state, done.reason) == ("failed", "error")
        assert "replica-0" in done.error and "not run again" in done.error
        assert fleet.sent == [(job.id, "replica-0")] and registry.reruns is None
        assert "requeued" not in [e.type async for e in engine.events(job.id, OWNER)]

    asyncio.run(main())


def test_a_released_job_is_journaled_unclaimed_and_sent_again_after_a_restart(tmp_path):
    """A replica found gone by the registry's watch, with no dispatch of its job waiting (after a
    registry restart): the job is sent again from here; the release is journaled, so a registry
    restarted after it sends the job again rather than wait for the lost replica."""
    from test_ray_local import _Never

    journal = str(tmp_path / "registry.jsonl")

    async def before() -> None:
        registry = await construct(JobRegistry, {"text": _Never()}, journal=journal, alive=lambda n: True)
        await registry.submit("job", text(50), OWNER, 1.0)
        assert await registry.claim("job", "r1") == 1

    async def restarted() -> None:
        sent = _Never()
        registry = await construct(
            JobRegistry, {"text": sent}, journal=journal, alive=lambda n: False, on_replica_loss="rerun"
        )
        assert (await registry.placement("job")) == "r1" and sent.jobs == []
        registry.fleet.lost("r1", "is gone")  # what the watch does once r1 has been silent a while
        view = await registry.get("job", OWNER)
        assert view.state == "queued" and (await registry.placement("job")) is None
        await asyncio.wait_for(sent.called.wait(), 10)
        assert sent.jobs == ["job"]
        events, _, _ = await registry.events("job", OWNER, 0, 0.0)
        assert [e.type for e in events] == ["queued", "requeued"] and events[-1].data["replica"] == "r1"

    async def again() -> None:
        sent = _Never()
        registry = await construct(
            JobRegistry, {"text": sent}, journal=journal, alive=lambda n: True, on_replica_loss="rerun"
        )
        assert (await registry.get("job", OWNER)).state == "queued"
        await asyncio.wait_for(sent.called.wait(), 10)
        assert sent.jobs == ["job"]  # sent again, not left to r1
        events, _, _ = await registry.events("job", OWNER, 0, 0.0)
        assert [e.type for e in events] == ["queued", "requeued"]  # the requeued event was journaled
        assert await registry.claim("job", "r2") == 2
        registry.fleet.lost("r2", "is gone")  # it ran again once before the restart: the most allowed
        view = await registry.get("job", OWNER)
        assert view.state == "failed" and "max_reruns=1" in view.error

    asyncio.run(before())
    asyncio.run(restarted())
    assert any('"replica":null' in line for line in Journal(journal).path.read_text().splitlines())
    asyncio.run(again())


def test_the_count_of_re_runs_outlives_the_events_a_journal_keeps(tmp_path):
    """With ``journal_events=0`` no ``requeued`` event survives a registry restart; the job's count of
    re-runs does (a ``rerun`` entry, kept by compaction too), so a job re-run once already is not run
    again after the restart when ``max_reruns=1``."""
    from test_ray_local import _Never

    journal = str(tmp_path / "registry.jsonl")
    options: dict[str, Any] = dict(journal=journal, journal_events=0, on_replica_loss="rerun", max_reruns=1)

    async def before() -> None:
        registry = await construct(JobRegistry, {"text": _Never()}, alive=lambda n: True, **options)
        await registry.submit("job", text(50), OWNER, 1.0)
        assert await registry.claim("job", "r1") == 1
        registry.fleet.lost("r1", "is gone")
        assert (await registry.get("job", OWNER)).state == "queued"

    async def restarted() -> None:
        registry = await construct(JobRegistry, {"text": _Never()}, alive=lambda n: True, **options)
        events, _, _ = await registry.events("job", OWNER, 0, 0.0)
        assert "requeued" not in [e.type for e in events]  # not kept: journal_events=0
        assert await registry.claim("job", "r2") is not None
        registry.fleet.lost("r2", "is gone")
        view = await registry.get("job", OWNER)
        assert view.state == "failed" and "run again 1 time already" in view.error

    asyncio.run(before())
    asyncio.run(restarted())
    assert '"op":"rerun"' in Journal(journal).path.read_text()  # the compaction on opening kept it


def test_the_setting_is_checked():
    with pytest.raises(ValueError, match="on_replica_loss must be one of fail, rerun"):
        RayOptions(models=[ModelSpec("text")], on_replica_loss="retry")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_reruns must be a whole number >= 0"):
        RayOptions(models=[ModelSpec("text")], on_replica_loss="rerun", max_reruns=-1)
    options = RayOptions(models=[ModelSpec("text")], on_replica_loss="rerun", max_reruns=3)
    assert (options.on_replica_loss, options.max_reruns) == ("rerun", 3)


def test_the_application_args_reach_the_registry():
    from stopcock.server.ray_deploy import app

    sized = {"replica_cpus": 1, "replica_gpus": 0}  # nothing left to fit to a cluster: none needed
    ingress = app({**sized, "on_replica_loss": "rerun", "max_reruns": "2"})._bound_deployment
    registry = ingress.init_args[0]._bound_deployment
    assert registry.name == "JobRegistry"
    assert (registry.init_kwargs["on_replica_loss"], registry.init_kwargs["max_reruns"]) == ("rerun", 2)
    with pytest.raises(ValueError, match="on_replica_loss must be one of fail, rerun, got 'retry'"):
        app({**sized, "on_replica_loss": "retry"})


async def rerun_reaches(engine: RayEngine, job_id: str, step: int) -> None:
    """Once the job's re-run (after its ``requeued`` event) has reached ``step``."""
    requeued = False
    async for event in engine.events(job_id, OWNER):
        assert event.type != "done", f"the job ended before its re-run reached step {step}"
        requeued = requeued or event.type == "requeued"
        if requeued and event.type == "progress" and event.data["step"] >= step:
            return


async def _step_of(engine: RayEngine, job_id: str, step: int) -> int:
    await reach(engine, job_id, step)
    return (await engine.get(job_id, OWNER)).step


@pytest.mark.timeout(120)
def test_the_web_page_keeps_the_text_a_requeued_event_keeps(server_backends):
    """The page's event handler, given a job's stream with a ``requeued`` event: the text shown is
    the kept part and what the re-run sends, not the lost run's text twice."""
    from browser import chromium  # tests/ is on sys.path under pytest

    from stopcock.server.testing import serving

    stream = [
        {"type": "started"},
        {"type": "text", "text": "Once", "step": 1},
        {"type": "text", "text": " upon", "step": 2},
        {"type": "requeued", "replica": "r1", "from_step": 1, "text_kept": 4},
        {"type": "started", "resumed_from": 1},
        {"type": "text", "text": " upon a", "step": 3},
    ]
    with serving(server_backends, concurrency=1) as (url, _), chromium() as browser:
        page = browser.new_page()
        page.goto(url)
        play = "(stream) => { stream.forEach(handle); return $('output').textContent; }"
        shown = page.evaluate(play, stream)
        assert shown == "Once upon a"


async def opened(registry: JobRegistry, known: set[str]) -> str:
    """The id of the job submitted next (not in ``known``), once the registry has it."""
    for _ in range(100_000):
        new = set(registry.book.jobs) - known
        if new:
            return new.pop()
        await asyncio.sleep(0)  # a turn of the event loop, where the request is served
    raise AssertionError("no job was submitted")


@pytest.mark.parametrize("seed", [7, None])
def test_an_openai_stream_through_a_loss_never_repeats_its_text(server_backends, tmp_path, seed):
    """An OpenAI stream cannot take text back: through a re-run it streams only what it had not
    (the same text as a run never interrupted, for a seeded job), or, for a job that samples
    without a seed, whose re-run's text differs, it ends with an error that names the fix."""
    import json

    import httpx

    from stopcock.server.app import create_app

    body = {"model": "tiny-text", "prompt": "Once upon a time", "max_tokens": 24, "temperature": 1.0,
            "top_p": 0.9, "seed": seed, "stream": True}

    def streamed(response: httpx.Response) -> tuple[str, list[dict[str, Any]]]:
        lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        chunks = [json.loads(line) for line in lines if line != "[DONE]"]
        return "".join(c["choices"][0]["text"] for c in chunks if c.get("choices")), chunks

    async def main() -> None:
        engine, registry, fleet = await killable(server_backends["text"], 2, str(tmp_path))
        transport = httpx.ASGITransport(app=create_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://stopcock", timeout=120) as http:
            alone = await http.post("/v1/completions", json=body)
            uninterrupted, _ = streamed(alone)
            fleet.route = ["replica-1"]
            streaming = asyncio.ensure_future(http.post("/v1/completions", json=body))
            job_id = await opened(registry, set(registry.book.jobs))
            async for event in engine.events(job_id, "local"):  # the owner of a server without keys
                if event.type == "progress" and event.data["step"] >= 5:
                    break
            fleet.kill("replica-1")
            text, chunks = streamed(await streaming)
        events, _, _ = await registry.events(job_id, "local", 0, 0.0)
        assert "requeued" in [e.type for e in events]
        if seed is not None:
            assert text == uninterrupted != "" and chunks[-1]["choices"][0]["finish_reason"] == "length"
        else:
            error = chunks[-1]["error"]["message"]
            assert "replica" in error and "pass a seed" in error
        ended = await engine.wait(job_id, "local")  # its re-run's thread is over before the loop closes
        assert ended.state in ("stopped", "completed")

    asyncio.run(main())
