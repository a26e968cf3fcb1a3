"""An engine's worker threads: each takes the next job (or batch) from the queue, runs it on its own
lane, frees its slot once the run has returned, then holds the job or records its end."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence

from ..signal import StopSignal
from .batching import Batching
from .contract import HELD_STATES, PAUSED, PREEMPTED, Lane
from .held import Holding
from .jobs import INTERRUPTED, Ended, Job, run_lane
from .ledger import Ledger
from .queueing import Running, RunQueue

__all__ = ["Workers"]


class Workers:
    """One worker thread per mapping of ``lanes`` (kind -> lane), over the engine's ``queue``.

    ``lock`` is the engine's; every count here changes under it. Invariants: a worker takes the next
    job only once its current run has returned, so a stopped job frees its slot when its pipeline has
    actually stopped, never before, and two runs never overlap on one lane; :attr:`active` holds the
    jobs the workers run, :attr:`busy` the workers running a job or a batch, :attr:`running` the
    jobs running (a batch runs several); once :attr:`closing`, no worker takes another job."""

    def __init__(
        self,
        lock: threading.Condition,
        queue: RunQueue[Job],
        batch: Batching,
        holding: Holding,
        ledger: Ledger,
        lanes: Sequence[Mapping[str, Lane]],
        *,
        step_delay: float,
        stop_grace: float | None,
    ) -> None:
        self._lock = lock
        self._queue = queue
        self._batch = batch
        self._holding = holding
        self._ledger = ledger
        self._step_delay = step_delay
        self._stop_grace = stop_grace
        self.active: set[Job] = set()
        self.busy = 0
        self.running = 0
        self.closing = False
        self.threads = [
            threading.Thread(target=self._work, args=(lane,), name=f"stopcock-worker-{i}", daemon=True)
            for i, lane in enumerate(lanes)
        ]
        for thread in self.threads:
            thread.start()

    def alive(self) -> int:
        return sum(thread.is_alive() for thread in self.threads)

    def offer(self, job: Job) -> int:
        """Under the lock: queue ``job`` in its place, wake the workers, and preempt for it if no
        worker will take it; its position in the queue."""
        position = self._queue.put(job)
        self._lock.notify_all()  # a worker gathering a batch waits for it too
        self._preempt()
        return position

    def _preempt(self) -> None:
        """Under the lock: interrupt the running jobs the queue's policy names, to be held as
        preempted. A worker whose job is being interrupted counts as free; a row of a batch keeps no
        checkpoint, so it is never preempted."""
        free = len(self.threads) - self.busy + sum(job.interrupt.stopped for job in self.active)
        running = [Running(job, job.spec.priority, job.started or 0.0)
                   for job in self.active - self._batch.rows if not job.interrupt.stopped]
        for victim in self._queue.preempted(running, free):
            victim.interrupt.stop(PREEMPTED)

    def join(self, timeout: float | None) -> None:
        """Not under the lock: wait for each worker to return (once :attr:`closing` is set, and the
        lock notified, under the lock)."""
        for thread in self.threads:
            thread.join(timeout)

    def _work(self, lanes: Mapping[str, Lane]) -> None:
        while True:
            with self._lock:
                taken = self._batch.take(self._queue.jobs, self._lock, lambda: self.closing, lanes)
                if taken is None:
                    return
                self.running, self.busy = self.running + len(taken), self.busy + 1
                self.active.update(map(_started, taken))
            ended, lane, batched = INTERRUPTED, lanes[taken[0].spec.kind], taken[0] in self._batch.rows
            try:
                if batched:  # each job ends as soon as its row does
                    self._batch.run(taken, lane, self._end, self._step_delay)
                else:
                    ended = run_lane(taken[0], lane, self._step_delay, self._stop_grace)
            finally:  # the slot is free once the run has returned; then the job's end is told
                with self._lock:
                    self.busy -= 1
                if not batched:
                    self._end(taken[0], ended)

    def _end(self, job: Job, ended: Ended) -> None:
        """The job's run has returned: free its slot, then hold the job or record its end."""
        state, reason, summary, error = ended
        with self._lock:
            self.running -= 1
            self.active.discard(job)
            self._batch.rows.discard(job)
            held = state in HELD_STATES and not job.signal.stopped and not self.closing
            if held:  # an owner's pause wins over a preemption
                self._holding.hold(job, PAUSED if job.pause_wanted else state)
        if not held and state in HELD_STATES:  # stopped (or shut down) while being held
            self._holding.end(job, job.signal.reason or "shutdown")
        elif not held:
            self._ledger.finish(job, state, reason, outcome=summary, error=error)


def _started(job: Job) -> Job:
    """Mark a job the engine takes from its queue as running (or stopping, if stopped meanwhile)."""
    with job.lock:
        job.state = "stopping" if job.signal.stopped else "running"
        job.started = job.started or time.time()
        job.interrupt = StopSignal()
    return job
