"""A list of callbacks, each added with a remover: the one mechanism behind ``StopSignal.on_stop``,
a stream channel's wakers and the server's change notifications."""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["Callbacks", "Registration"]


class Callbacks:
    """Callbacks registered under the owner's ``lock``; each registration is removed on its own.

    The owner decides when they run: :meth:`drain` claims them all (for one-shot events),
    :meth:`snapshot` copies them (for repeated ones). Callbacks run outside the lock.
    """

    def __init__(self, lock: threading.Lock | threading.RLock | threading.Condition) -> None:
        self._lock = lock
        self._registrations: list[Registration] = []

    def add(self, fn: Callable[[], object]) -> Registration:
        """Register ``fn``; returns its :class:`Registration`, which removes it when called."""
        registration = Registration(fn, self)  # its own identity: the same function added twice is two
        with self._lock:
            self._registrations.append(registration)
        return registration

    def _discard(self, registration: Registration) -> None:
        with self._lock:
            try:  # one call: a same-thread drain cannot split it
                self._registrations.remove(registration)
            except ValueError:  # drained already
                pass

    def drain(self) -> list[Callable[[], object]]:
        """Claim every callback, leaving none (the caller holds the lock): each is returned to run once."""
        taken, self._registrations = self._registrations, []
        return [fn for fn in (r.take() for r in taken) if fn is not None]

    def __len__(self) -> int:
        return len(self._registrations)

    def snapshot(self) -> list[Callable[[], object]]:
        """A copy of the callbacks registered now."""
        with self._lock:
            return [fn for fn in (r.peek() for r in self._registrations) if fn is not None]


class Registration:
    """One registered callback. Calling it removes the callback (idempotent, harmless once drained).

    The callback is claimed at most once, by :meth:`take`: one ``dict.pop``, atomic even against a
    signal handler that interrupts the claimer on its own thread. So whoever claims it runs it,
    and nobody else does: a drain and a :meth:`cancel` that race never both run it, nor both skip it.
    """

    __slots__ = ("_owner", "_slot")

    def __init__(self, fn: Callable[[], object], owner: Callbacks) -> None:
        self._slot = {"fn": fn}
        self._owner = owner

    def __call__(self) -> None:
        """Remove the callback (:meth:`cancel`'s lines, inline: every run calls a few removers)."""
        self._slot.pop("fn", None)
        self._owner._discard(self)

    def cancel(self) -> bool:
        """Remove the callback; True if it had not been claimed yet (it will then never run)."""
        claimed = self.take() is not None
        self._owner._discard(self)
        return claimed

    def take(self) -> Callable[[], object] | None:
        """The callback, to the first caller only; None once claimed or cancelled."""
        return self._slot.pop("fn", None)

    def peek(self) -> Callable[[], object] | None:
        """The callback while it is registered, without claiming it (for repeated callbacks)."""
        return self._slot.get("fn")
