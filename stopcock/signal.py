"""The stop token: one thread-safe, idempotent "please stop" with a reason."""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable

from ._callbacks import Callbacks
from ._wake import loop_waker

__all__ = ["StopSignal"]


class StopSignal:
    """A thread-safe stop token.

    ``stop()`` may be called from any thread, from an event loop and from a signal handler: the
    state lives behind a re-entrant lock that is held only for a few assignments, so a handler that
    interrupts the main thread inside one of these methods never deadlocks. The first reason wins.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        # {"reason": (reason,)} once stopped. dict.setdefault claims and sets the reason in one atomic
        # step, so even a signal handler that interrupts stop() on the same thread cannot overwrite it.
        self._claim: dict[str, tuple[str]] = {}
        self._stopped_at: float | None = None
        self._callbacks = Callbacks(self._lock)
        self._skip_callbacks: Callbacks | None = None  # made by the first on_skip()
        self._children: weakref.WeakSet[StopSignal] | None = None  # made by the first child()
        self._parent: StopSignal | None = None  # a child keeps its parent (and so the chain) alive
        self._skips = 0  # skip() calls: a run compares it with the count when its current item began
        self._after_item: tuple[str] | None = None  # the reason given to stop_after_item()

    def __repr__(self) -> str:
        state = f"stopped, reason={self.reason!r}" if self.stopped else "running"
        return f"<StopSignal {state}>"

    @property
    def stopped(self) -> bool:
        return "reason" in self._claim

    @property
    def reason(self) -> str | None:
        """Why it was stopped (the first reason given), or None while not stopped."""
        claim = self._claim.get("reason")
        return None if claim is None else claim[0]

    @property
    def stopped_at(self) -> float | None:
        """``time.monotonic()`` at the moment of the stop, or None."""
        return self._stopped_at

    def stop(self, reason: str = "user") -> bool:
        """Request a stop. Returns True if this call stopped it, False if it was already stopped.

        Callbacks registered with :meth:`on_stop` and child signals run on the calling thread, after
        the state is set; if a callback raises, the others still run and the first error is raised.
        """
        if not isinstance(reason, str) or not reason:
            raise TypeError(f"reason must be a non-empty str, got {reason!r}")
        mine = (reason,)
        with self._lock:
            if self._claim.setdefault("reason", mine) is not mine:
                return False
            self._stopped_at = time.monotonic()
            callbacks = self._callbacks.drain()
            children = self._kids()
        for child in children:
            child.stop(reason)
        _run_all(callbacks)
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """Block until stopped or ``timeout`` seconds pass; returns :attr:`stopped`."""
        if not self.stopped:
            stopped = threading.Event()
            remove = self.on_stop(stopped.set)  # set at once if the stop came in between
            try:
                stopped.wait(timeout)
            finally:
                remove()
        return self.stopped

    def _kids(self) -> list[StopSignal]:
        """The live children (the caller holds the lock)."""
        return [] if self._children is None else list(self._children)

    async def wait_async(self) -> str:
        """Wait without blocking the event loop; returns the reason."""
        if self.reason is not None:
            return self.reason
        future, wake = loop_waker()
        remove = self.on_stop(wake)
        try:
            await future
        finally:
            remove()
        reason = self.reason
        assert reason is not None
        return reason

    def on_stop(self, fn: Callable[[], object]) -> Callable[[], None]:
        """Run ``fn()`` once when stopped (at once if already stopped). Returns a remover.

        Registered first, then checked: a stop that lands in between, even from a signal handler
        interrupting this call on the same thread, either drains the registration (and runs it)
        or finds it claimed back here (and this call runs it). Exactly once either way.
        """
        registration = self._callbacks.add(fn)
        if self.stopped and registration.cancel():
            fn()
        return registration

    def child(self) -> StopSignal:
        """A new signal stopped (with the same reason) when this one stops, and stoppable alone.

        The parent holds its children weakly (a child no longer used costs nothing); a child holds
        its parent, so ``root.child().child()`` still follows ``root``. Added first, then checked,
        as in :meth:`on_stop` (stopping a child twice is harmless).
        """
        kid = StopSignal()
        kid._parent = self
        with self._lock:
            if self._children is None:
                self._children = weakref.WeakSet()
            self._children.add(kid)
            kid._after_item = self._after_item  # after the add: a stop_after_item in between reaches it
        if self.stopped:
            kid.stop(self._claim["reason"][0])
        return kid

    # -- multi-item runs: skip the current item, or stop once it is done ----------------------------
    @property
    def skips(self) -> int:
        """How many times :meth:`skip` was called."""
        return self._skips

    @property
    def after_item(self) -> str | None:
        """The reason given to :meth:`stop_after_item` (the first one), or None."""
        claim = self._after_item
        return None if claim is None else claim[0]

    def skip(self) -> None:
        """End the current item of a run and go on with the next one (a run of one item ends).

        Seen at the run's next step, as a stop is; a skip made when no item is running is ignored
        by the items that start later. Children are skipped too. Safe from any thread and from a
        signal handler.
        """
        with self._lock:
            self._skips += 1
            children = self._kids()
        for child in children:
            child.skip()
        callbacks = self._skip_callbacks
        if callbacks is not None:
            _run_all(callbacks.snapshot())

    def on_skip(self, fn: Callable[[], object]) -> Callable[[], None]:
        """Run ``fn()`` after each :meth:`skip` (on the skipping thread). Returns a remover."""
        callbacks = self._skip_callbacks
        if callbacks is None:  # the first: made under the lock, so two threads make one
            with self._lock:
                if self._skip_callbacks is None:
                    self._skip_callbacks = Callbacks(self._lock)
                callbacks = self._skip_callbacks
        return callbacks.add(fn)

    def stop_after_item(self, reason: str = "user") -> bool:
        """Let the current item of a run finish, then start no new one; the run ends with ``reason``.

        It does not stop this signal: :attr:`stopped` stays False, and a later :meth:`stop` still
        stops at the next step. The first reason wins; returns whether this call set it. Children
        follow.
        """
        if not isinstance(reason, str) or not reason:
            raise TypeError(f"reason must be a non-empty str, got {reason!r}")
        with self._lock:
            if self._after_item is not None:
                return False
            self._after_item = (reason,)
            children = self._kids()
        for child in children:
            child.stop_after_item(reason)
        return True


def _run_all(callbacks: list[Callable[[], object]]) -> None:
    """Call each callback; if some raise, the others still run and the first error is raised."""
    errors: list[BaseException] = []
    for fn in callbacks:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - re-raised below, after every callback ran
            errors.append(exc)
    if errors:
        raise errors[0]
