"""A list of callbacks, each added with a remover: the one mechanism behind ``StopSignal.on_stop``,
a stream channel's wakers and the server's change notifications."""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["Callbacks"]


class Callbacks:
    """Callbacks registered under the owner's ``lock``; each registration is removed on its own.

    The owner decides when they run: :meth:`drain` takes them all (for one-shot events),
    :meth:`snapshot` copies them (for repeated ones). Callbacks run outside the lock.
    """

    def __init__(self, lock: threading.Lock | threading.RLock | threading.Condition) -> None:
        self._lock = lock
        self._fns: list[Callable[[], object]] = []

    def add(self, fn: Callable[[], object]) -> Callable[[], None]:
        """Register ``fn``; returns a remover (idempotent, harmless once ``fn`` has been drained)."""
        entry = _Entry(fn)  # its own identity: the same function added twice is removed once per remover
        with self._lock:
            self._fns.append(entry)
        return lambda: self._remove(entry)

    def _remove(self, entry: _Entry) -> None:
        with self._lock:
            if entry in self._fns:
                self._fns.remove(entry)

    def drain(self) -> list[Callable[[], object]]:
        """Take every callback, leaving none (the caller holds the lock)."""
        fns, self._fns = self._fns, []
        return list(fns)

    def __len__(self) -> int:
        return len(self._fns)

    def snapshot(self) -> list[Callable[[], object]]:
        """A copy of the callbacks registered now."""
        with self._lock:
            return list(self._fns)


class _Entry:
    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[], object]) -> None:
        self.fn = fn

    def __call__(self) -> object:
        return self.fn()
