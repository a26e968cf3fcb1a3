"""Where the Ray engine keeps a held (paused or preempted) job's checkpoint, so that any model replica
of its kind can resume it: the Ray object store (the default) or a shared folder.

A store turns a :class:`~stopcock.checkpoint.Checkpoint` into a small picklable ``handle`` that the
registry keeps with the job and hands to the replica that resumes it, and back. The checkpoint
travels as the bytes of its file (:meth:`Checkpoint.save`), so a replica in another process or on
another machine reads exactly what was saved; the adapters resume it as they resume a file.
"""

from __future__ import annotations

import secrets
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ...checkpoint import Checkpoint, CheckpointError
from ..contract import HELD_STATES
from ..jobs import Ended, Job, finish

__all__ = ["CheckpointStore", "FolderStore", "Keeper", "ObjectStore", "Stored", "store_errors", "store_for"]


@dataclass(frozen=True)
class Stored:
    """A held job's checkpoint as the registry keeps it: its step (the job's ``checkpoint_step``)
    and the store's handle."""

    steps: int
    handle: Any


class CheckpointStore(Protocol):
    """Where held jobs' checkpoints are kept. A model replica saves a checkpoint as a picklable
    ``parcel`` that it reports to the registry; the registry keeps the parcel (:meth:`keep`: the
    handle it holds with the job) and hands the handle to the replica that resumes the job."""

    def save(self, job_id: str, checkpoint: Checkpoint) -> Any:
        """On a model replica: the parcel of ``checkpoint``."""
        ...

    def keep(self, parcel: Any) -> Any:
        """On the registry: keep a parcel; the handle to it."""
        ...

    def load(self, handle: Any) -> Checkpoint: ...

    def drop(self, handle: Any) -> None:
        """The checkpoint is no longer needed (the job was held again, or ended)."""
        ...

    def lasting(self, handle: Any) -> str | None:
        """On the registry: what the journal keeps of ``handle`` when the checkpoint outlives the
        registry (a file's path), else None (it is lost with the registry)."""
        ...

    def found(self, saved: str | None) -> Any:
        """On a restarted registry: the handle of a checkpoint the journal kept (``saved``: what
        :meth:`lasting` gave), if it is still there; else None."""
        ...


def to_bytes(checkpoint: Checkpoint) -> bytes:
    with tempfile.TemporaryDirectory(prefix="stopcock-ckpt-") as folder:
        return checkpoint.save(Path(folder) / "checkpoint.safetensors").read_bytes()


def from_bytes(blob: bytes) -> Checkpoint:
    with tempfile.TemporaryDirectory(prefix="stopcock-ckpt-") as folder:
        path = Path(folder) / "checkpoint.safetensors"
        path.write_bytes(blob)
        return Checkpoint.load(path)


class ObjectStore:
    """Checkpoints in the Ray object store, put there by the registry, which owns them: an object
    owned by the model replica that made it would be lost with that replica. The parcel is the
    checkpoint file's bytes (reported to the registry); the handle a one-item list holding the
    ObjectRef (nested, so that Ray passes the reference, not the bytes). An object is freed once the
    registry drops its reference; a registry that restarts loses them."""

    def save(self, job_id: str, checkpoint: Checkpoint) -> Any:
        return to_bytes(checkpoint)

    def keep(self, parcel: Any) -> Any:
        import ray

        return [ray.put(parcel)]

    def load(self, handle: Any) -> Checkpoint:
        import ray

        return from_bytes(ray.get(handle[0]))

    def drop(self, handle: Any) -> None:
        """Nothing to do: the object goes with the registry's last reference to it."""

    def lasting(self, handle: Any) -> str | None:
        return None  # the registry owns the object: a restarted registry has lost it

    def found(self, saved: str | None) -> Any:
        return None


class FolderStore:
    """Checkpoints as files in ``folder``, a folder every model replica can read (a shared folder on a
    cluster of several machines). The parcel and the handle are the file's path; a dropped
    checkpoint is deleted. They outlive the registry and the replicas."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)

    def save(self, job_id: str, checkpoint: Checkpoint) -> Any:
        path = self.folder / f"{job_id}-{checkpoint.steps}-{secrets.token_hex(4)}.safetensors"
        return str(checkpoint.save(path))

    def keep(self, parcel: Any) -> Any:
        return parcel

    def load(self, handle: Any) -> Checkpoint:
        return Checkpoint.load(handle)

    def drop(self, handle: Any) -> None:
        Path(handle).unlink(missing_ok=True)

    def lasting(self, handle: Any) -> str | None:
        return str(handle)

    def found(self, saved: str | None) -> Any:
        return saved if saved is not None and Path(saved).is_file() else None


def store_for(checkpoint_dir: str | None) -> CheckpointStore:
    """The folder store of ``checkpoint_dir``, else the object store."""
    return ObjectStore() if checkpoint_dir is None else FolderStore(checkpoint_dir)


def store_errors() -> tuple[type[Exception], ...]:
    """The errors of a store that failed to keep or give back a checkpoint (a full disk, a lost
    object, a damaged file): the job then fails, saying why."""
    from ray.exceptions import RayError

    return (OSError, CheckpointError, RayError)


class Keeper:
    """A model replica's side of holds: a held job's checkpoint kept in ``store`` once its run has
    returned, and put back before a resumed run. ``news`` holds each held job's checkpoint (its
    parcel, steps, saved steps) until the hold is reported to the registry."""

    def __init__(self, store: CheckpointStore) -> None:
        self.store = store
        self.news: dict[str, dict[str, Any]] = {}
        self._expected: dict[str, Mapping[str, Any]] = {}

    def expect(self, job_id: str, held: Mapping[str, Any] | None) -> None:
        """The job about to run is held (``held``: its stored checkpoint and counts, as the registry
        sent them), or not (None)."""
        if held is not None:
            self._expected[job_id] = held

    def resumed(self, job: Job) -> Ended | None:
        """Put an expected held job's checkpoint and counts back (from the run's thread); the job's
        end if the checkpoint cannot be read, else None (the run goes on from it, if any)."""
        held = self._expected.pop(job.id, None)
        if held is None:
            return None
        job.saved_steps, job.preemptions = held["saved_steps"], held["preemptions"]
        try:
            job.checkpoint = self.store.load(held["handle"])
        except store_errors() as exc:
            return "failed", "error", None, f"its checkpoint could not be read: {type(exc).__name__}: {exc}"
        return None

    def news_of(self, job_id: str, job: Job) -> Any:
        """What the report of the job's hold or end carries: the stored checkpoint, or its result."""
        return self.news.pop(job_id) if job_id in self.news else job.result

    def settle(self, job: Job, ended: Ended) -> None:
        """The run has returned: hold the job (its checkpoint stored, then the hold emitted, which
        the report carries with :attr:`news`), or tell its end (stopped while being held: stopped)."""
        state, reason, summary, error = ended
        if state in HELD_STATES and not job.signal.stopped:
            try:
                parcel = self.store.save(job.id, job.checkpoint)
            except store_errors() as exc:
                state, reason, error = "failed", "error", f"its checkpoint could not be kept: {exc!r}"
            else:
                steps = job.checkpoint.steps
                self.news[job.id] = {"parcel": parcel, "steps": steps, "saved_steps": job.saved_steps}
                with job.lock:
                    job.state = state
                job.emit(state, step=job.step, checkpoint_step=steps)
                return
        elif state in HELD_STATES:
            state, reason = "stopped", job.signal.reason or reason
            summary = None if summary is None else {**summary, "reason": reason}
        finish(job, state, reason, outcome=summary, error=error)
