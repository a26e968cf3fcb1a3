"""The requests waiting for jobs to end (a stop that waits, ``wait``), each woken once, at the end."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from .._wake import loop_waker
from .contract import FINAL_STATES
from .jobs import Job

__all__ = ["Waiters"]


class Waiters:
    """Waits for jobs to end, woken once at the end and not at each event as a wait on the job's
    changes is: a batch of rows makes two events per row and token, and each wake-up of a waiting
    request takes the event loop (and the interpreter) from the batch.

    Invariant: a job's state is final before :meth:`tell` is called for it, so a wait that starts
    before the end is woken by it and one that starts after returns at once: no end is missed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wakers: dict[str, list[Callable[[], None]]] = {}

    async def wait(self, job: Job, timeout: float | None) -> None:
        """Return once ``job`` is in a final state (or after ``timeout`` seconds)."""
        future, wake = loop_waker()
        with self._lock:  # the state is final before tell() takes the lock: no end is missed
            if job.state in FINAL_STATES:
                return
            self._wakers.setdefault(job.id, []).append(wake)
        try:
            await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            with self._lock:
                waiting = self._wakers.get(job.id, [])
                if wake in waiting:
                    waiting.remove(wake)
                if not waiting:
                    self._wakers.pop(job.id, None)

    def tell(self, job: Job) -> None:
        """``job`` has ended: wake whoever waits for it."""
        with self._lock:
            wakers = self._wakers.pop(job.id, [])
        for wake in wakers:
            wake()
