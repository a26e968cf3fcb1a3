"""The engines' queue order and preemption policy (server/queueing.py), on its own: it is pure, so
these tests give it jobs (names), their priorities and the running jobs, and read its answers."""

from __future__ import annotations

import pytest

from stopcock.server.queueing import Running, RunQueue

pytestmark = pytest.mark.timeout(30)


def _queue(priorities: dict[str, int], *queued: str) -> RunQueue[str]:
    queue: RunQueue[str] = RunQueue(priorities.__getitem__)
    for job in queued:
        queue.put(job)
    return queue


def test_jobs_of_one_priority_run_first_in_first_out_after_any_of_a_higher_one():
    priorities = {"a": 0, "b": 0, "c": 0, "urgent": 5, "later": -1}
    queue = _queue(priorities)
    assert [queue.put(job) for job in ("a", "b", "c")] == [1, 2, 3]
    assert queue.put("urgent") == 1
    assert queue.put("later") == 5
    assert queue.jobs == ["urgent", "a", "b", "c", "later"]
    assert len(queue) == 5 and "b" in queue and "z" not in queue


def test_a_job_queued_again_goes_back_to_its_place_until_it_is_forgotten():
    queue = _queue({"a": 0, "b": 0, "c": 0}, "a", "b", "c")
    assert queue.remove("a") and not queue.remove("a")
    assert queue.put("a") == 1  # queued before b and c: back ahead of them
    assert queue.jobs == ["a", "b", "c"]
    queue.remove("a")
    queue.forget("a")
    assert queue.put("a") == 3  # a new job now: after those queued before it
    assert queue.take_all() == ["b", "c", "a"] and queue.jobs == [] and len(queue) == 0


def test_a_queued_job_preempts_the_lowest_priority_running_job_the_newest_first():
    queue = _queue({"urgent": 2}, "urgent")
    running = [Running("low-old", 0, 1.0), Running("low-new", 0, 2.0), Running("mid", 1, 0.5)]
    assert queue.preempted(running, free=0) == ["low-new"]


def test_equal_priorities_never_preempt_each_other():
    queue = _queue({"second": 1}, "second")
    assert queue.preempted([Running("first", 1, 1.0)], free=0) == []
    assert queue.preempted([Running("above", 3, 1.0)], free=0) == []


def test_no_preemption_for_the_jobs_free_workers_take():
    queue = _queue({"urgent": 2, "next": 2}, "urgent", "next")
    running = [Running("low", 0, 1.0), Running("lower", -1, 2.0)]
    assert queue.preempted(running, free=2) == []
    assert queue.preempted(running, free=1) == ["lower"]  # only "next" waits for a worker
    assert queue.preempted(running, free=-1) == ["lower", "low"]  # fewer than none free: none free


def test_each_queued_job_preempts_at_most_one_running_job_each_named_once():
    queue = _queue({"p3": 3, "p2": 2, "p2-later": 2}, "p2", "p3", "p2-later")
    running = [Running("r0", 0, 1.0), Running("r1", 1, 1.0)]
    assert queue.jobs == ["p3", "p2", "p2-later"]
    assert queue.preempted(running, free=0) == ["r0", "r1"]  # p2-later finds none left


def test_once_a_queued_job_finds_none_to_preempt_none_behind_it_does():
    queue = _queue({"high": 2, "mid": 1}, "mid", "high")
    running = [Running("r-mid", 1, 1.0)]
    assert queue.preempted(running, free=0) == ["r-mid"]  # for high; mid finds no lower one
    assert queue.preempted([Running("r-high", 2, 1.0)], free=0) == []
