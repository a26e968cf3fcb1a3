"""The Ray job registry's journal (an append-only JSON-lines log, compacted when opened and when it
has grown to twice what it keeps) and the record of a job it rebuilds."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..contract import FINAL_STATES, JobEvent
from ..jobs import Job
from .wire import spec_to_json

__all__ = ["EVENTS_KEPT", "Journal", "Record", "event_entry", "journaled"]

log = logging.getLogger("stopcock.server.ray")

#: The events of an unfinished job that the journal keeps (its latest), unless told otherwise.
EVENTS_KEPT = 256
#: Events never journaled: ``queued`` (the registry emits it again), ``done`` (its view is in the
#: ``end`` entry) and ``preview`` (an image, replaced by the next one).
UNJOURNALED = frozenset({"queued", "done", "preview"})


def journaled(event: JobEvent) -> bool:
    """Whether the journal keeps ``event`` (see :data:`UNJOURNALED`)."""
    return event.type not in UNJOURNALED


class Journal:
    """The registry's append-only log (JSON lines): jobs submitted, claimed, held, stopped, run again,
    ended, forgotten, and the events of unfinished jobs.

    Each entry is written and flushed to the operating system before the registry acknowledges what
    it records, so a registry process that dies (and is restarted by Serve) reads back every stop it
    acknowledged. ``fsync=True`` also survives the machine's crash, at a disk sync per entry (not
    per batch of events: they are synced with the next entry, so a crash can lose the latest). On
    opening, the log is read back and rewritten with only what is still needed (compaction).

    Events are bounded: an unfinished job keeps its latest ``events`` events (``started``,
    ``progress``, ``text``, ``item``...: not ``queued``, ``done`` or ``preview``, see
    :func:`journaled`); a finished job keeps none (its ``end`` entry has its final view and result).
    Between compactions the log may hold more; reading it back keeps the latest.
    """

    def __init__(
        self, path: str | os.PathLike[str], *, fsync: bool = False, events: int = EVENTS_KEPT
    ) -> None:
        if events < 0:
            raise ValueError(f"the journal's events per job must be >= 0, got {events!r}")
        self.path = Path(path)
        self.fsync = fsync
        self.keep_events = events
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.entries = self._read()
        self._file = self.path.open("a", encoding="utf-8")
        self.written = 0  # entries written since the last compaction
        self.kept = len(self.entries)  # entries the last compaction kept (before it: the log's length)

    def _read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        entries = []
        for line in self.path.read_text("utf-8").splitlines():
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut short by a crash mid-write: it was never acknowledged
                log.warning("journal %s: skipping a cut line", self.path)
        return entries

    def by_job(self) -> dict[str, dict[str, dict[str, Any]]]:
        """The entries read back, as ``{job_id: {op: entry}}`` for the jobs not forgotten."""
        entries: dict[str, dict[str, dict[str, Any]]] = {}
        for entry in self.entries:
            op, job_id = entry["op"], entry["id"]
            if op == "submit":
                entries[job_id] = {"submit": entry}
            elif op == "forget":
                entries.pop(job_id, None)
            elif op != "event" and job_id in entries:
                entries[job_id][op] = entry
        return entries

    def events(self) -> dict[str, list[JobEvent]]:
        """The events read back, as ``{job_id: [event, ...]}`` (by ``seq``, each once, the latest
        ``events`` of each) for the jobs not forgotten and not ended."""
        found: dict[str, dict[int, JobEvent]] = {}
        for entry in self.entries:
            op, job_id = entry["op"], entry["id"]
            if op == "submit":
                found[job_id] = {}
            elif op in ("forget", "end"):
                found.pop(job_id, None)
            elif op == "event" and job_id in found:
                found[job_id][entry["seq"]] = JobEvent(entry["seq"], entry["type"], entry["data"])
        keep = self.keep_events
        return {
            job_id: [e for _, e in sorted(by_seq.items())][-keep:] if keep else []
            for job_id, by_seq in found.items()
        }

    def write(self, op: str, **fields: Any) -> None:
        self._write_lines([{"op": op, **fields}])

    def write_events(self, events: Iterable[tuple[str, JobEvent]]) -> None:
        """Journal jobs' events, ``(job_id, event)`` (those :func:`journaled` keeps), with one flush
        and never a disk sync of their own (the next entry's sync takes them along)."""
        if self.keep_events:
            self._write_lines([event_entry(job_id, e) for job_id, e in events if journaled(e)], sync=False)

    def _write_lines(self, entries: list[dict[str, Any]], sync: bool = True) -> None:
        if not entries:
            return
        self._file.writelines(json.dumps(e, separators=(",", ":")) + "\n" for e in entries)
        self._file.flush()
        if self.fsync and sync:
            os.fsync(self._file.fileno())
        self.written += len(entries)

    def due(self, floor: int) -> bool:
        """Whether the log is worth compacting: more than ``floor`` entries written since the last
        compaction, and more than it kept then (so a compaction's cost is paid by as many writes)."""
        return self.written > max(floor, self.kept)

    def rewrite(self, entries: list[dict[str, Any]]) -> None:
        """Replace the log with ``entries`` (atomically: a crash leaves the old one or the new one)."""
        fresh = self.path.with_suffix(".tmp")
        with fresh.open("w", encoding="utf-8") as out:
            out.writelines(json.dumps(e, separators=(",", ":")) + "\n" for e in entries)
            out.flush()
            os.fsync(out.fileno())
        self._file.close()
        os.replace(fresh, self.path)
        self._file = self.path.open("a", encoding="utf-8")
        self.written = 0
        self.kept = len(entries)

    def close(self) -> None:
        self._file.close()


class Record:
    """The registry's record of a job: a :class:`~stopcock.server.jobs.Job` fed by its replica's
    reports, who claimed it, and the stop asked for it."""

    def __init__(self, job: Job, position: int) -> None:
        self.job = job
        self.position = position
        self.number = 0  # its place in the order the registry took the jobs in (see RecordBook.add)
        self.claimed_by: str | None = None
        self.stop: str | None = None  # the reason, once a stop was asked
        self.stop_applied = False  # the replica said it applied the stop
        self.asks: list[tuple[str, str]] = []  # (action, reason) for its replica: "skip", "after_item"
        self.journaled_end = False
        self.hold: dict[str, Any] | None = None  # the latest ``hold`` entry (see :mod:`.hold_log`)
        self.reruns = 0  # the times it was run again after losing its replica (see :mod:`.reruns`)

    @property
    def final(self) -> bool:
        return self.job.state in FINAL_STATES

    def entries(self, events: int = EVENTS_KEPT) -> list[dict[str, Any]]:
        """The journal entries that rebuild this record (what compaction keeps of it): with its
        latest ``events`` events while it is unfinished."""
        job = self.job
        entries = [
            {
                "op": "submit",
                "id": job.id,
                "owner": job.owner,
                "spec": spec_to_json(job.spec),
                "created": job.created,
                "position": self.position,
            }
        ]
        if self.claimed_by is not None:
            entries.append({"op": "claim", "id": job.id, "replica": self.claimed_by})
        if self.stop is not None:
            entries.append({"op": "stop", "id": job.id, "reason": self.stop})
        if self.hold is not None and not self.journaled_end:
            entries.append(self.hold)
        if self.reruns and not self.journaled_end:
            entries.append({"op": "rerun", "id": job.id, "count": self.reruns})
        if not self.journaled_end and events:
            entries += [event_entry(job.id, e) for e in self.latest_events(events)]
        if self.journaled_end:
            with job.lock:
                done, result = len(job.events), job.result
            view = job.view().to_json()
            entries.append({"op": "end", "id": job.id, "view": view, "result": result, "done": done})
        return entries

    def latest_events(self, count: int) -> list[JobEvent]:
        """The job's latest ``count`` events that the journal keeps, oldest first."""
        latest: list[JobEvent] = []
        with self.job.lock:
            for event in reversed(self.job.events):
                if len(latest) >= count:
                    break
                if event is not None and journaled(event):
                    latest.append(event)
        return latest[::-1]


def event_entry(job_id: str, event: JobEvent) -> dict[str, Any]:
    return {"op": "event", "id": job_id, "seq": event.seq, "type": event.type, "data": dict(event.data)}
