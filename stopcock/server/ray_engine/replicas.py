"""The model replicas the job registry knows: who registered, the jobs each has claimed, their long
polls (stops and asks handed over), and liveness (a part of
:class:`~stopcock.server.ray_engine.registry.JobRegistry`)."""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .journal import Record
from .records import RecordBook
from .wire import POLL_S, SILENT_S

__all__ = ["ReplicaSet"]


@dataclass
class _Replica:
    name: str
    kind: str
    concurrency: int
    seen: float
    peak: int = 0
    busy: int = 0
    batch: dict[str, int] = field(default_factory=dict)  # its batch occupancy (Batching.counts)


class ReplicaSet:
    """The registered model replicas (``replicas``), the validator each kind handed over, and the
    replicas' long polls. ``book`` is the registry's record book (its records and claims);
    ``alive(name)`` asks Ray whether a replica actor lives."""

    def __init__(self, book: RecordBook, alive: Callable[[str], bool]) -> None:
        self.book = book
        self.jobs = book.jobs
        self.claims = book.claims
        self.alive = alive
        self.replicas: dict[str, _Replica] = {}
        self.validators: dict[str, bytes | None] = {}
        self.changed = asyncio.Event()
        self._kind_ready: dict[str, asyncio.Event] = collections.defaultdict(asyncio.Event)
        self._pollers: dict[str, asyncio.Event] = {}
        self._arrived: set[str] = set()  # kinds a replica newly registered for, until the watch looks
        self._arrival = asyncio.Event()
        self._started = time.monotonic()
        #: what becomes of an unfinished job of a lost replica, ``(record, replica, why)``: it fails
        #: (see :class:`~.reruns.Reruns` for the jobs run again)
        self.orphaned: Callable[[Record, str, str], None] = self._fail

    def register(self, kind: str, replica: str, concurrency: int, validator: bytes | None) -> None:
        """A model replica of ``kind`` has started (or finds a restarted registry)."""
        if replica not in self.replicas:
            self._arrived.add(kind)  # it may replace one that died: the watch asks Ray now
            self._arrival.set()
        self.replicas[replica] = _Replica(replica, kind, concurrency, time.monotonic())
        self.changed.set()
        if kind not in self.validators:
            self.validators[kind] = validator
            self._kind_ready[kind].set()

    async def registered(self, kind: str, timeout: float) -> bool:
        """Whether a replica of ``kind`` has registered (waiting up to ``timeout`` seconds for one)."""
        if kind not in self.validators:
            try:
                await asyncio.wait_for(self._kind_ready[kind].wait(), timeout)
            except asyncio.TimeoutError:
                return False
        return True

    def ready(self, kind: str) -> int:
        """How many replicas of ``kind`` are registered and live."""
        return sum(1 for r in self.replicas.values() if r.kind == kind)

    def counts(self, kept: int) -> dict[str, int]:
        """The running jobs, ``kept`` (the records kept), the replicas' lanes and pipelines (``stats``)."""
        replicas = list(self.replicas.values())
        return {
            "running": sum(len(jobs) for jobs in self.claims.values()),
            "jobs": kept,
            "workers_alive": sum(r.concurrency for r in replicas),
            "replicas": len(replicas),
            "pipelines_peak": max((r.peak for r in replicas), default=0),
            "concurrency": min((r.concurrency for r in replicas), default=0),
            **_occupancy([r.batch for r in replicas]),
        }

    def seen(self, replica: str, peak: int | None = None, busy: int | None = None) -> None:
        known = self.replicas.get(replica)
        if known is not None:
            known.seen = time.monotonic()
            if peak is not None and busy is not None:
                known.peak, known.busy = max(known.peak, peak), busy

    def wake(self, replica: str) -> None:
        """Answer ``replica``'s long poll now: something is waiting for it."""
        poller = self._pollers.get(replica)
        if poller is not None:
            poller.set()

    async def poll(
        self, replica: str, applied: list[str], running: list[str], peak: int, busy: int, timeout: float
    ) -> tuple[dict[str, str], bool, list[tuple[str, str, str]]]:
        """A replica's long poll: the stops asked for its jobs that it has not applied yet, as
        ``{job_id: reason}`` (waiting up to ``timeout`` for one), whether this registry knows the
        replica (False after a registry restart: it then registers again), and the other asks for
        its jobs as ``(job_id, action, reason)`` (see :meth:`.stops.Stops.ask`)."""
        self.seen(replica, peak, busy)
        for job_id in applied:
            record = self.jobs.get(job_id)
            if record is not None and record.claimed_by == replica:
                record.stop_applied = True
        for job_id in running:  # after a restart: the replica still runs them
            record = self.jobs.get(job_id)
            if record is not None and record.claimed_by == replica and not record.final:
                self.claims[replica].add(job_id)
        pending = self._pending(replica)
        if not pending and not self._asks(replica, take=False):
            event = self._pollers[replica] = asyncio.Event()
            try:
                await asyncio.wait_for(event.wait(), timeout)
            except asyncio.TimeoutError:
                pass
            pending = self._pending(replica)
        return pending, replica in self.replicas, self._asks(replica, take=True)

    def _asks(self, replica: str, *, take: bool) -> list[tuple[str, str, str]]:
        """The asks waiting for ``replica``'s jobs; ``take`` hands them over (cleared here)."""
        found = []
        for job_id in self.claims.get(replica, ()):
            record = self.jobs[job_id]
            found += [(job_id, action, reason) for action, reason in record.asks]
            if take:
                record.asks = []
        return found

    def _pending(self, replica: str) -> dict[str, str]:
        pending = {}
        for job_id in self.claims.get(replica, ()):
            record = self.jobs[job_id]
            if record.stop is not None and not record.stop_applied and not record.final:
                pending[job_id] = record.stop
        return pending

    def lost(self, replica: str, why: str) -> None:
        """``replica`` is gone: its unfinished jobs fail, or run again (:attr:`orphaned` says)."""
        self.replicas.pop(replica, None)
        self.changed.set()
        for job_id in list(self.claims.pop(replica, ())):
            record = self.jobs[job_id]
            if not record.final:
                self.orphaned(record, replica, why)

    def _fail(self, record: Record, replica: str, why: str) -> None:
        message = f"the model replica running this job ({replica}) {why}; the job was not run again"
        self.book.fail(record, message)

    async def watch(self) -> None:
        """Every few seconds: a replica that has been silent for a while, and that Ray says is gone,
        takes its unfinished jobs with it (this catches the replicas whose jobs no dispatch call
        watches, after a registry restart, and the replicas that were scaled away). Once a new
        replica of a kind has registered, every replica of that kind is asked about at the next
        look, however recently heard of: a dead one a new one replaces then stops counting as
        lanes (for preemption and health) without waiting to be silent for long."""
        while True:
            arrival = asyncio.ensure_future(self._arrival.wait())
            try:  # every POLL_S, or at once on an arrival (asyncio.wait: a cancel is never swallowed)
                await asyncio.wait({arrival}, timeout=POLL_S)
            finally:
                arrival.cancel()
            self._arrival.clear()
            now, arrived = time.monotonic(), set(self._arrived)
            self._arrived.clear()
            suspects = [r for r in self.replicas.values() if now - r.seen > SILENT_S or r.kind in arrived]
            for replica in suspects:
                if not await asyncio.to_thread(self.alive, replica.name):
                    self.lost(replica.name, "is gone")
            # claimed by a replica this registry never heard of (restored from the journal)
            for name in [n for n, jobs in self.claims.items() if jobs and n not in self.replicas]:
                if now - self._started > SILENT_S and not await asyncio.to_thread(self.alive, name):
                    self.lost(name, "is gone")

    def describe(self, kind: str) -> list[dict[str, Any]]:
        """The live replicas of ``kind`` as dicts (name, kind, concurrency, seen, peak, busy)."""
        return [dict(r.__dict__) for r in self.replicas.values() if r.kind == kind]


def _occupancy(counts: list[dict[str, int]]) -> dict[str, int]:
    """The replicas' batch occupancy (their ``Batching.counts``) in one: the rows running, batches
    run and jobs batched summed; the largest batch size and wait (1 and 0 before any report)."""
    summed = ("batch_rows_running", "batches_run", "batched_jobs")
    return {
        "batch_size": max((c.get("batch_size", 1) for c in counts), default=1),
        "batch_wait_ms": max((c.get("batch_wait_ms", 0) for c in counts), default=0),
        **{name: sum(c.get(name, 0) for c in counts) for name in summed},
    }
