"""The Ray job registry's journal (an append-only JSON-lines log, compacted when opened) and the
record of a job it rebuilds."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from ..contract import FINAL_STATES
from ..jobs import Job
from .wire import spec_to_json

__all__ = ["Journal", "Record"]

log = logging.getLogger("stopcock.server.ray")


class Journal:
    """The registry's append-only log (JSON lines): jobs submitted, claimed, stopped, ended, forgotten.

    Each entry is written and flushed to the operating system before the registry acknowledges what
    it records, so a registry process that dies (and is restarted by Serve) reads back every stop it
    acknowledged. ``fsync=True`` also survives the machine's crash, at a disk sync per entry. On
    opening, the log is read back and rewritten with only what is still needed (compaction).
    """

    def __init__(self, path: str | os.PathLike[str], *, fsync: bool = False) -> None:
        self.path = Path(path)
        self.fsync = fsync
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.entries = self._read()
        self._file = self.path.open("a", encoding="utf-8")
        self.written = 0

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
            elif job_id in entries:
                entries[job_id][op] = entry
        return entries

    def write(self, op: str, **fields: Any) -> None:
        self._file.write(json.dumps({"op": op, **fields}, separators=(",", ":")) + "\n")
        self._file.flush()
        if self.fsync:
            os.fsync(self._file.fileno())
        self.written += 1

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

    def close(self) -> None:
        self._file.close()


class Record:
    """The registry's record of a job: a :class:`~stopcock.server.jobs.Job` fed by its replica's
    reports, who claimed it, and the stop asked for it."""

    def __init__(self, job: Job, position: int) -> None:
        self.job = job
        self.position = position
        self.claimed_by: str | None = None
        self.stop: str | None = None  # the reason, once a stop was asked
        self.stop_applied = False  # the replica said it applied the stop
        self.asks: list[tuple[str, str]] = []  # (action, reason) for its replica: "skip", "after_item"
        self.journaled_end = False

    @property
    def final(self) -> bool:
        return self.job.state in FINAL_STATES

    def entries(self) -> list[dict[str, Any]]:
        """The journal entries that rebuild this record (what compaction keeps of it)."""
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
        if self.journaled_end:
            with job.lock:
                done, result = len(job.events), job.result
            view = job.view().to_json()
            entries.append({"op": "end", "id": job.id, "view": view, "result": result, "done": done})
        return entries
