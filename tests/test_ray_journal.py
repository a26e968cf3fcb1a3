"""The Ray job registry's journal keeps the events of unfinished jobs, bounded: a restarted registry
(in this process, read back from the same file) shows a running job's events from before the
restart, then the ones its replica reports after it, numbered on. No cluster: the registry is
built as Serve builds it (``ray_doubles.construct``); ``tests/test_ray_cluster.py`` does it on a
multi-node cluster."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray")

from ray_doubles import construct  # tests/ is on sys.path under pytest

from stopcock.server.contract import JobEvent, JobSpec
from stopcock.server.jobs import Job
from stopcock.server.ray_engine.journal import Journal
from stopcock.server.ray_engine.registry import JobRegistry

OWNER = "me"


def text(max_tokens: int) -> JobSpec:
    return JobSpec("text", "Once upon a time", {"max_tokens": max_tokens, "temperature": 0.0, "top_p": 1.0})


class _Never:
    """A model deployment stand-in whose replicas never answer (the test claims and reports itself)."""

    def __getattr__(self, method: str) -> Any:
        class _Run:
            @staticmethod
            def remote(*args: Any) -> Any:
                return asyncio.get_running_loop().create_future()  # never resolved

        return _Run


async def registry_on(journal: Path, **options: Any) -> JobRegistry:
    registry: JobRegistry = await construct(
        JobRegistry, {"text": _Never()}, journal=str(journal), alive=lambda name: True, **options
    )
    return registry


def replica_job(job_id: str, seq: int) -> Job:
    """The replica's copy of a job, numbering its events after the registry's ``seq``."""
    job = Job(text(1000), OWNER, id=job_id, seq=seq)
    job.state = "running"
    return job


async def report(registry: JobRegistry, job: Job, events: list[JobEvent]) -> None:
    await registry.report("r1", [(job.id, e) for e in events], {job.id: job.view().to_json()}, {})


def emitted(job: Job, count: int, start: int = 0) -> list[JobEvent]:
    """``count`` steps of a text job (a progress and a text event each) after ``start``, emitted."""
    before = len(job.events)
    for step in range(start + 1, start + count + 1):
        job.emit("progress", step=step, total=1000)
        job.emit("text", text=f" w{step}", step=step)
    return [e for e in job.events[before:] if e is not None]


def journaled(registry_events: list[JobEvent]) -> list[tuple[int, str, dict[str, Any]]]:
    return [(e.seq, e.type, dict(e.data)) for e in registry_events]


def test_a_restarted_registry_keeps_the_events_of_a_running_job(tmp_path):
    path = tmp_path / "registry.jsonl"

    async def main() -> None:
        registry = await registry_on(path)
        await registry.submit("running", text(1000), OWNER, 1.0)
        await registry.submit("ended", text(3), OWNER, 1.0)
        job = replica_job("running", await registry.claim("running", "r1"))
        job.emit("started")
        await report(registry, job, [e for e in job.events if e is not None] + emitted(job, 5))
        job.emit("preview", step=5, image="iVBOR")  # an image: never journaled
        await report(registry, job, [job.events[-1]])  # type: ignore[list-item]
        before, cursor, _ = await registry.events("running", OWNER, 0, 0.0)
        assert [e.type for e in before][:3] == ["queued", "started", "progress"]
        assert before[-1].type == "preview"

        ended = replica_job("ended", await registry.claim("ended", "r1"))
        ended.emit("started")
        ended.state, ended.step, ended.outcome = "completed", 3, {"steps": 3}
        ended.emit("done", **ended.view().to_json())
        await registry.report(
            "r1", [("ended", e) for e in ended.events if e is not None], {}, {"ended": {"text": "!"}}
        )
        registry.journal.close()  # type: ignore[union-attr]

        again = await registry_on(path)  # the registry restarted: it reads its journal back
        after, after_cursor, done = await again.events("running", OWNER, 0, 0.0)
        assert not done and after_cursor == cursor - 1 == before[-1].seq - 1  # all but the preview
        assert journaled(after) == journaled(before[:-1])  # the same events, the same numbers
        # the replica reports on (it numbers from where it was); a follower's cursor goes on
        more = emitted(job, 2, start=5)
        await report(again, job, more)
        followed, _, _ = await again.events("running", OWNER, cursor, 0.0)
        assert journaled(followed) == journaled(more)
        # a finished job keeps its final view, result and done event (its other events are not kept)
        found = await again.result("ended", OWNER)
        assert found["job"]["state"] == "completed" and found["result"] == {"text": "!"}
        ended_events, _, over = await again.events("ended", OWNER, 0, 0.0)
        assert over and [e.type for e in ended_events] == ["queued", "done"]

    asyncio.run(main())


def test_the_journal_keeps_the_latest_events_of_each_job_within_its_bound(tmp_path):
    path = tmp_path / "registry.jsonl"

    async def main() -> None:
        registry = await registry_on(path, retain=1, journal_events=4)
        await registry.submit("job", text(1000), OWNER, 1.0)
        job = replica_job("job", await registry.claim("job", "r1"))
        sent = emitted(job, 100)  # 200 events, one report each
        for event in sent:
            await report(registry, job, [event])
        lines = [json.loads(line) for line in path.read_text("utf-8").splitlines()]
        # compacted as it grew: far fewer event lines than events reported
        assert 4 <= sum(1 for e in lines if e["op"] == "event") < len(sent)
        registry.journal.close()  # type: ignore[union-attr]

        again = await registry_on(path, retain=1, journal_events=4)
        kept, _, _ = await again.events("job", OWNER, 0, 0.0)
        assert journaled(kept) == [(1, "queued", {"position": 1}), *journaled(sent[-4:])]
        lines = [json.loads(line) for line in path.read_text("utf-8").splitlines()]
        assert [e["seq"] for e in lines if e["op"] == "event"] == [e.seq for e in sent[-4:]]

        none = await registry_on(path, retain=1, journal_events=0)  # no events kept at all
        assert [e.type for e in (await none.events("job", OWNER, 0, 0.0))[0]] == ["queued"]
        assert (await none.get("job", OWNER)).state == "running"  # the rest of the record is kept

    asyncio.run(main())


def test_a_journal_refuses_a_negative_bound(tmp_path):
    with pytest.raises(ValueError, match="events per job must be >= 0"):
        Journal(tmp_path / "j.jsonl", events=-1)
