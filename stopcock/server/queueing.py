"""An engine's queue order and preemption policy, with no engine in it.

:class:`RunQueue` keeps the queued jobs in the order they run and says, given the running jobs that
may be preempted and the number of free workers, which of them the queued jobs preempt. It has no
lock, thread or clock and acts on nothing: an engine calls it under its own lock and acts on its
answers (the local engine interrupts the jobs it names; they are checkpointed and queued again).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["RunQueue", "Running"]

J = TypeVar("J", bound=Hashable)


@dataclass(frozen=True)
class Running(Generic[J]):
    """A running job that may be preempted: its priority, and when it started (on any clock that
    grows: a larger ``started`` is a more recent start)."""

    job: J
    priority: int
    started: float


class RunQueue(Generic[J]):
    """The queued jobs in run order, and the running jobs preempted for them.

    Invariants:

    - :attr:`jobs` is in run order: higher ``priority(job)`` first and, within a priority, the order
      in which the jobs were first queued (first in, first out). Its head runs next. A job is in it
      at most once.
    - A job keeps the number it got when it was first queued until :meth:`forget`: queued again
      (preempted, paused and resumed) it goes back ahead of the jobs of its priority queued after it.
    - :meth:`preempted`: the first ``free`` queued jobs are taken by free workers. Each queued job
      after them preempts at most one running job, and only one of a strictly lower priority: the
      lowest priority there is, the most recently started among those. Jobs of equal priority never
      preempt each other (they run first come, first served), and a running job is named at most
      once. Once a queued job finds none to preempt, neither does any job behind it (its priority is
      no higher and fewer running jobs are left).
    """

    def __init__(self, priority: Callable[[J], int]) -> None:
        self.jobs: list[J] = []
        self._priority = priority
        self._numbers: dict[J, int] = {}
        self._count = itertools.count()

    def __len__(self) -> int:
        return len(self.jobs)

    def __contains__(self, job: object) -> bool:
        return job in self.jobs

    def _key(self, job: J) -> tuple[int, int]:
        return (-self._priority(job), self._numbers[job])

    def put(self, job: J) -> int:
        """Queue ``job`` in its place; its position (1: it runs next)."""
        if job not in self._numbers:
            self._numbers[job] = next(self._count)
        at = bisect.bisect(self.jobs, self._key(job), key=self._key)
        self.jobs.insert(at, job)
        return at + 1

    def remove(self, job: J) -> bool:
        """Take ``job`` out of the queue (it keeps its number); whether it was queued."""
        if job in self.jobs:
            self.jobs.remove(job)
            return True
        return False

    def take_all(self) -> list[J]:
        """Empty the queue; the jobs it held, in run order."""
        taken = list(self.jobs)
        self.jobs.clear()
        return taken

    def forget(self, job: J) -> None:
        """``job`` will not be queued again: drop its number."""
        self._numbers.pop(job, None)

    def preempted(self, running: Iterable[Running[J]], free: int) -> list[J]:
        """The running jobs to preempt for the queued ones (see the class's invariants), in the
        order of the queued jobs they make way for. ``running``: the running jobs that may be
        preempted; ``free``: the workers that will take a queued job without a preemption."""
        left = list(running)
        chosen: list[J] = []
        for waiting in self.jobs[max(free, 0) :]:
            below = [r for r in left if r.priority < self._priority(waiting)]
            if not below:
                break
            victim = min(below, key=lambda r: (r.priority, -r.started))
            left.remove(victim)
            chosen.append(victim.job)
        return chosen
