"""When a run arms its wires: the checks that cost nothing until a stop makes them needed.

A :class:`Wire` is armed (from any thread, idempotently) the moment its kind needs it
(:data:`WireKind`): abort mode's in-forward checks once a stop is possible, an escalating
finish-mode stop's once it has waited ``escalate_after`` seconds unseen, an adapter's step check
once a step could stop the run. :class:`Wires` keeps one run's wires and arms them: at once when
a signal of the run stops or skips (on the thread that calls ``stop()``/``skip()``, before it
returns), and from a timer thread (:class:`_Alarm`) for what is due later (a time limit
:data:`ARM_AHEAD` seconds away, an escalation). :class:`~stopcock.control.RunControl` hands out
the ``with`` blocks (:meth:`~stopcock.control.RunControl.arming`,
:meth:`~stopcock.control.RunControl.intercept`).
"""

from __future__ import annotations

import functools
import math
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, Protocol

from .signal import StopSignal

if TYPE_CHECKING:
    from .hooks import Tripwire
    from .limits import TimeLimits

__all__ = ["ARM_AHEAD", "Arming", "Flag", "Wire", "WireKind", "Wires", "tripwire"]

#: Seconds before a timeout or deadline expires at which abort mode arms its in-forward checks.
ARM_AHEAD = 0.05


class Wire(Protocol):
    """Something a run arms (from any thread) the moment it is needed: a :class:`~stopcock.hooks.Tripwire`,
    or a step check that waits to be armed. ``arm()`` is idempotent."""

    armed: bool

    def arm(self) -> None: ...


class Flag:
    """The plainest :class:`Wire`: a flag that a hot path reads (``armed``), raised when armed."""

    def __init__(self, armed: bool = False) -> None:
        self.armed = armed

    def arm(self) -> None:
        self.armed = True


#: What a wire is armed for: abort mode's in-forward checks, an escalating finish-mode stop's, or
#: the checks at step boundaries (armed when a step could stop the run: a stop, a skip, a time limit).
WireKind = Literal["abort", "escalate", "step"]


class _Run(Protocol):
    """What :class:`Wires` reads of its run (a :class:`~stopcock.control.RunControl`)."""

    token: StopSignal
    seen: bool
    escalate_after: float | None
    watch: Any
    limits: TimeLimits
    _signals: tuple[StopSignal, ...]

    @property
    def links(self) -> _Links: ...

    @property
    def items(self) -> _Items: ...


class _Links(Protocol):
    """What :class:`Wires` reads of the user's signals a run follows (a :class:`~stopcock.control.Links`)."""

    followed: tuple[StopSignal, ...]
    forwarded: tuple[StopSignal, ...]

    def add(self, unlink: Callable[[], None]) -> None: ...


class _Items(Protocol):
    def skip_called(self) -> bool: ...


class Wires:
    """One run's wires, each with its kind, armed when due (see the module docstring)."""

    def __init__(self, run: _Run) -> None:
        self._run = run
        self._wires: list[tuple[Wire, WireKind]] = []
        self._lock = threading.RLock()  # re-entrant: stop() may run in a signal handler
        self._alarm: _Alarm | None = None

    def add(self, wire: Wire, kind: WireKind) -> None:
        """:class:`Arming`'s start: ``wire`` joins the run's wires (taken out again by
        :meth:`drop`, even when this raises), armed at once if it is due."""
        run, links = self._run, self._run.links
        with self._lock:
            first = not self._wires
            skips = kind == "step" and (first or all(k != "step" for _, k in self._wires))
            self._wires.append((wire, kind))
        if first and run.watch.signals != links.forwarded:  # every stop of a signal of the run
            # re-evaluates what is due (the token's, in _stop; those forwarded to the token reach it there)
            for signal in run.watch.signals:
                if signal not in links.forwarded:
                    links.add(signal.on_stop(self.stirred))
        if skips:  # and so does a skip, for the step checks
            for signal in links.followed:
                links.add(signal.on_skip(self.stirred))
        # a thread to wait for what is due later (made here, not in a stop() callback)
        if self._alarm is None and (kind == "escalate" or run.limits.due is not None):
            self._alarm = _Alarm(self.arm_due)
        self.stirred()

    def drop(self, wire: Wire, kind: WireKind) -> None:
        with self._lock:
            self._wires.remove((wire, kind))

    def _arm_at(self, kind: WireKind, stopped: bool) -> float | None:
        """When the wires of ``kind`` are due (monotonic), or None: not yet known; ``stopped``: a
        signal of the run has stopped."""
        run = self._run
        if kind == "escalate":
            assert run.escalate_after is not None
            requested = run.limits.requested(run.token.stopped_at)
            return None if requested is None else requested + run.escalate_after
        if stopped or (kind == "abort" and run.watch.in_forward):
            return -math.inf
        if kind == "step" and run.items.skip_called():
            return -math.inf
        due = run.limits.due
        return None if due is None else due - ARM_AHEAD

    def arm_due(self) -> float | None:
        """Arm the wires whose moment has come; return the next moment one will, if any."""
        now, run = time.monotonic(), self._run
        later: list[float] = []
        with self._lock:
            stopped = False
            for signal in run._signals:
                if signal.stopped:
                    stopped = True
                    break
            for wire, kind in list(self._wires):
                if wire.armed:
                    continue
                at = self._arm_at(kind, stopped)
                if at is None:
                    continue
                if at > now:
                    later.append(at)
                elif kind != "escalate" or not run.seen:
                    wire.arm()
        return min(later, default=None)

    def stirred(self) -> None:
        """Something changed (a signal stopped or skipped, a wire was added): arm what is due now
        and wake the alarm thread, which waits for what is due later."""
        self.arm_due()
        alarm = self._alarm
        if alarm is not None:
            alarm.poke()

    def close(self) -> None:
        """Stop the timer thread, if one was started."""
        alarm, self._alarm = self._alarm, None
        if alarm is not None:
            alarm.close()


@functools.cache
def tripwire() -> type[Tripwire]:
    """:class:`~stopcock.hooks.Tripwire`, imported at the first run that needs it (importing stopcock
    must not import torch), once: an import statement would otherwise run on every run's path."""
    from .hooks import Tripwire

    return Tripwire


class Arming:
    """The ``with`` block in which ``wire`` is one of ``wires`` (:meth:`RunControl.arming
    <stopcock.control.RunControl.arming>`; and :meth:`~stopcock.control.RunControl.intercept`, whose
    tripwire it ``closes`` at the end)."""

    __slots__ = ("_closes", "_kind", "_wire", "_wires")

    def __init__(self, wires: Wires, wire: Wire, kind: WireKind, *, closes: Tripwire | None = None) -> None:
        self._wires, self._wire, self._kind, self._closes = wires, wire, kind, closes

    def __enter__(self) -> None:
        entered = False
        try:
            self._wires.add(self._wire, self._kind)
            entered = True
        finally:
            if not entered:
                self.__exit__()

    def __exit__(self, *exc: object) -> None:
        try:
            self._wires.drop(self._wire, self._kind)
        finally:
            if self._closes is not None:
                self._closes.close()


class _Alarm:
    """A thread that calls ``due()`` when the moment it last returned comes (or when poked), until
    ``due()`` returns None or :meth:`close`. ``due()`` arms what is due and returns the next moment."""

    def __init__(self, due: Callable[[], float | None]) -> None:
        self._due = due
        self._cond = threading.Condition(threading.RLock())
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="stopcock-alarm", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                at = self._due()
                self._cond.wait(None if at is None else max(0.0, at - time.monotonic()))

    def poke(self) -> None:
        with self._cond:
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join()
