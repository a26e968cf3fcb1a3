"""One run's stop machinery, shared by every adapter.

A :class:`RunControl` binds the user's ``stop=`` to one run: it owns the run's own token and
state, counts steps, evaluates the conditions at each check and raises :class:`Abort` in abort
mode. Its parts: :class:`Links` links the user's signals to the token so a stop lands at once;
:class:`~stopcock.limits.TimeLimits` places the timeouts and deadlines; :class:`Items` marks the
item boundaries of runs over several items (:mod:`stopcock.items`), where ``skip()`` and
``stop_after_item()`` of the user's signals take effect; :class:`~stopcock.wires.Wires` and
:class:`~stopcock.forward_checks.ForwardChecks` arm and run the checks that wait; :func:`outcome_of`
builds the :class:`Outcome`.

**Zero cost until stopped.** What can stop a run is known when it starts (:class:`Watch`): its
signals, the moments its timeouts and deadlines expire, the step its ``max_steps`` ends at. While
none of them can fire, a step boundary costs a few flag reads (:meth:`RunControl.quiet_step`: no
:class:`StepState` built, no condition walked), and the checks inside the model forward are not
installed at all: :meth:`RunControl.intercept` arms them (:class:`~stopcock.hooks.Tripwire`, one
hook for every module call on the run's thread, so arming costs the same whatever the model's size)
the moment a stop becomes possible: a signal stops (armed by the stopping thread before ``stop()``
returns), a timeout or deadline is :data:`~stopcock.wires.ARM_AHEAD` seconds away (armed by a timer
thread), or at once for a condition of your own, which may fire at any moment. In finish mode with
``escalate_after=S``, the same checks are armed S seconds after a stop request that no step boundary
has seen yet, and abort the run at the next module call. An adapter whose step check itself can wait
(transformers' criterion joins generate's list only then; diffusers' wrapped ``scheduler.step`` only
counts the step until then) has it armed the same way by :meth:`RunControl.arming`, and also by a
``skip()``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Literal, NamedTuple

from .conditions import (
    Condition,
    Deadline,
    MaxSteps,
    Signalled,
    StopLike,
    StopStrings,
    Timeout,
    When,
    as_condition,
    top_level,
)
from .forward_checks import ForwardChecks
from .limits import TimeLimits
from .outcome import Outcome
from .ranks import Agreement
from .signal import StopSignal
from .state import StepState
from .types import MODES, Mode, choice
from .wires import Arming, Wire, WireKind, Wires

__all__ = ["Abort", "Items", "Links", "Phase", "RunControl", "Watch", "outcome_of"]


class Abort(BaseException):
    """Raised inside the target to abandon a run in abort mode.

    A BaseException, so that a user's ``except Exception`` around a step cannot swallow it; only
    the adapter that started the run catches it, by this exact class.
    """

    def __init__(self, control: RunControl) -> None:
        super().__init__(control.token.reason)
        self.control = control


class Watch(NamedTuple):
    """What in a condition can stop a run, and when (read once, when the run is bound).

    ``every_step``: a part must see each step's state (``when()``, or a condition class of your
    own); ``in_forward``: a part may fire inside a forward at any moment (a condition of your own,
    unless its class says ``fires_in_forward = False``); ``per_row``: a part is a row condition
    (``stop_strings``). Conditions are matched by exact class: a subclass is treated as a condition
    of your own. A named tuple: every run builds one, and a named tuple builds faster than a frozen dataclass.
    """

    signals: tuple[StopSignal, ...] = ()
    timeouts: tuple[float, ...] = ()  # seconds from the start of the run
    deadlines: tuple[float, ...] = ()  # epoch seconds
    max_steps: float = math.inf  # the lowest max_steps(n)
    every_step: bool = False
    in_forward: bool = False
    per_row: bool = False

    @classmethod
    def of(cls, condition: Condition | None) -> Watch:
        if type(condition) is Signalled:  # stop=signal, the usual case
            return cls(signals=(condition.signal,))
        signals: dict[StopSignal, None] = {}  # each once, in order
        timeouts: list[float] = []
        deadlines: list[float] = []
        max_steps, every_step, own, in_forward, per_row = math.inf, False, False, False, False
        for leaf in () if condition is None else condition.parts():
            # by exact class: a subclass may check differently
            if type(leaf) is Signalled:
                signals[leaf.signal] = None
            elif type(leaf) is Timeout:
                timeouts.append(leaf.seconds)
            elif type(leaf) is Deadline:
                deadlines.append(leaf.when)
            elif type(leaf) is MaxSteps:
                max_steps = min(max_steps, leaf.n)
            elif type(leaf) is When:
                every_step = True
            elif type(leaf) is StopStrings:
                per_row = True
            else:
                own = True
                in_forward = in_forward or leaf.fires_in_forward
                per_row = per_row or leaf.per_row
        return cls(
            signals=tuple(signals), timeouts=tuple(timeouts), deadlines=tuple(deadlines),
            max_steps=max_steps, every_step=every_step or own, in_forward=in_forward, per_row=per_row,
        )


class Links:
    """The user's signals a run follows (those at the top level of its stop): once the run is
    entered, a stop of one stops the run's token; their ``skip()`` and ``stop_after_item()`` apply
    to the run's items. Every callback the run registers on a signal is removed at the end."""

    __slots__ = ("_unlink", "followed", "forwarded")

    def __init__(self, condition: Condition | None) -> None:
        self.followed: tuple[StopSignal, ...] = (
            (condition.signal,)  # stop=signal, the usual case
            if type(condition) is Signalled
            else tuple(c.signal for c in top_level(condition) if isinstance(c, Signalled))
        )
        self.forwarded: tuple[StopSignal, ...] = ()  # the signals whose stops stop the token, once entered
        self._unlink: list[Callable[[], None]] = []

    def forward(self, stop: Callable[[str], None]) -> None:
        """From now on a stop of a followed signal calls ``stop(its reason)``."""
        for signal in self.followed:
            self._unlink.append(signal.on_stop(_forwarding(signal, stop)))
        self.forwarded = self.followed

    def add(self, unlink: Callable[[], None]) -> None:
        """Remove a callback of a signal (``unlink()``) when the run ends."""
        self._unlink.append(unlink)

    def close(self) -> None:
        while self._unlink:
            self._unlink.pop()()


def _forwarding(signal: StopSignal, stop: Callable[[str], None]) -> Callable[[], None]:
    def forward() -> None:
        stop(signal.reason or "user")

    return forward


class Items:
    """A run's item boundaries (:mod:`stopcock.items`): where ``skip()`` and ``stop_after_item()`` of
    the user's signals it follows take effect. It keeps the run's ``skipping`` (the current item is
    being skipped) and ``item_reasons`` (how each item ended).

    The run is ``skipping`` only while :meth:`skip_called`: the skip counts only grow, and
    :meth:`begin` resets the count it compares with and ``skipping`` together.
    """

    __slots__ = ("_run", "base", "by_item", "followed")

    def __init__(self, run: RunControl) -> None:
        self._run = run
        self.followed = run.links.followed
        self.base = 0  # skip() calls seen when the current item began
        self.by_item = False  # the run goes item by item (start_item was called)

    def skips(self) -> int:
        return sum(signal.skips for signal in self.followed)

    def skip_called(self) -> bool:
        """Whether ``skip()`` was called since the current item began (the usual case, one signal
        and no skip, reads one counter)."""
        signals = self.followed
        if not signals:
            return False
        count = signals[0].skips if len(signals) == 1 else self.skips()
        return count != self.base

    def stop_after_item(self) -> str | None:
        """The reason of the first signal that asked to stop after the current item, if any."""
        return next((s.after_item for s in self.followed if s.after_item is not None), None)

    def begin(self) -> None:
        self.base, self._run.skipping = self.skips(), False

    def start(self) -> bool:
        """Before each item of a run that goes item by item: whether it may start.

        It may not once the run is stopped, or once a signal asked to stop after the current item
        (the run then stops with that reason).
        """
        run = self._run
        self.by_item = True
        if not run.token.stopped:
            reason = self.stop_after_item()
            if reason is not None:
                run._stop(reason)
        if run.check():
            return False
        self.begin()
        return True

    def skip_seen(self) -> bool:
        """Whether ``skip()`` was called since the current item began: it ends that item, or, in a
        run that is not item by item, the run (reason ``"skipped"``). Checked at every step."""
        run = self._run
        if run.skipping:
            return True
        if not self.skip_called():
            return False
        if self.by_item:
            run.skipping = True
        else:
            run._stop("skipped")
            run.seen = True
        return True

    def end(self, count: int) -> None:
        """The current item (or ``count`` of them) ended: record why in the run's ``item_reasons``:
        ``"skipped"``, the stop reason when a stop cut it short, else ``"completed"``."""
        run = self._run
        reason = "skipped" if run.skipping else run.token.reason if run.seen else None
        run.item_reasons = [*(run.item_reasons or ()), *[reason or "completed"] * count]
        run.skipping = False


def _grace(seconds: float | None, mode: str) -> float | None:
    """``escalate_after=``, checked: None, or seconds >= 0 in finish mode."""
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise TypeError(f"escalate_after= takes seconds (a number) or None, got {type(seconds).__name__}")
    if not 0 <= seconds < math.inf:
        raise ValueError(f"escalate_after= needs a finite number of seconds >= 0, got {seconds!r}")
    if mode != "finish":
        raise ValueError(
            "escalate_after= turns a finish-mode stop that has not taken effect into an abort; with"
            " mode='abort' the run aborts at the next module call already: drop escalate_after="
        )
    return float(seconds)


#: Where a run is (:attr:`RunControl.phase`).
Phase = Literal["bound", "running", "stopping", "stopped", "ended"]


class RunControl:
    """Per-run binding of the stop conditions. Use as a context manager around the run.

    It keeps the run's state (token, steps, :attr:`phase`, clock) and the methods adapters call; its
    parts have one job each: :class:`Watch`, :class:`~stopcock.limits.TimeLimits`, :class:`Links`,
    :class:`Items`, :class:`~stopcock.wires.Wires`, :class:`~stopcock.forward_checks.ForwardChecks`
    (the checks inside a forward), :func:`outcome_of`.
    """

    def __init__(
        self,
        stop: StopLike | None = None,
        *,
        mode: Mode = "finish",
        on_step: Callable[[StepState], object] | None = None,
        escalate_after: float | None = None,
    ) -> None:
        self.mode: Mode = choice(
            "mode", mode, MODES, hint="; to pass a mode to the target itself, use kwargs={'mode': ...}"
        )
        self.escalate_after = _grace(escalate_after, self.mode)
        self.condition: Condition | None = None if stop is None else as_condition(stop)
        self.watch = Watch.of(self.condition)
        self.on_step = on_step  # (sets whether quiet steps may take the fast path)
        self.links = Links(self.condition)
        self.items = Items(self)
        self.skipping = False  # the current item is being skipped
        self.item_reasons: list[str] | None = None  # how each item ended, once the run went item by item
        self.limits = TimeLimits(self.watch.timeouts, self.watch.deadlines)
        self.token = StopSignal()
        self.steps = 0
        self.total: int | None = None
        self.seen = False  # a check saw the stop: the run ends with it
        self.escalated: float | None = None  # seconds from the stop request to the escalation
        self.entered = False
        self.ended: float | None = None
        self._signals = (self.token, *self.watch.signals)  # what the fast path reads
        self._wires = Wires(self)
        self._checks = ForwardChecks(self, self._wires, Abort)
        self._start()

    @property
    def on_step(self) -> Callable[[StepState], object] | None:
        """Called with each step's state; while one is set (it may be set after the control is
        built: a recorder routes the steps through its own), every step makes the full check."""
        return self._on_step

    @on_step.setter
    def on_step(self, fn: Callable[[StepState], object] | None) -> None:
        self._on_step = fn
        # quiet steps before this step count take the fast path: none while something sees each step
        self._fast_below = self.watch.max_steps if fn is None and not self.watch.every_step else -math.inf

    @property
    def steps_wait(self) -> bool:
        """Whether a step boundary can stop the run only once :meth:`arming` arms its wire: no
        ``on_step``, no condition that sees each step, no ``max_steps`` (so a step check may stay out
        of the loop until then)."""
        return self._fast_below == math.inf

    @property
    def phase(self) -> Phase:
        """Where the run is: ``"bound"`` (not entered yet), ``"running"``, ``"stopping"`` (its token
        is stopped and no check has seen it yet), ``"stopped"`` (a check saw the stop: the run ends
        with it), ``"ended"`` (closed: later stops no longer reach it)."""
        if self.ended is not None:
            return "ended"
        if self.seen:
            return "stopped"
        if self.token.stopped:
            return "stopping"
        return "running" if self.entered else "bound"

    def _start(self) -> None:
        """Start the run's clock and place its time limits (copied for the fast path)."""
        self.started = time.monotonic()
        limits = self.limits
        limits.start(self.started, time.time)
        self._time_limit, self._wall_limit = limits.time_limit, limits.wall_limit

    # -- lifecycle -------------------------------------------------------------------------------
    def __enter__(self) -> RunControl:
        self._start()
        self.items.begin()
        self.links.forward(self._stop)  # the followed signals' stops reach the token from now on
        self.entered = True
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Unlink from the user's signals (idempotent); later stops no longer reach this run."""
        if self.ended is None:
            self.ended = time.monotonic()
        self.links.close()
        self._wires.close()

    def _stop(self, reason: str) -> None:
        """Stop the token (the first reason wins), and re-evaluate what is due: every stop of the
        token goes through here, so it needs no callback of its own (and a callback of the token
        that raises cannot keep the wires from being armed)."""
        try:
            self.token.stop(reason)
        finally:
            self._wires.stirred()

    # -- checks ----------------------------------------------------------------------------------
    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def state(self, *, block: bool = False, **tensors: Any) -> StepState:
        return StepState(step=self.steps, total=self.total, elapsed=self.elapsed, block=block, **tensors)

    def _quiet(self) -> bool:
        """Whether no signal has stopped and no time condition has expired (the cheap part)."""
        for signal in self._signals:
            if signal.stopped:
                return False
        if self._time_limit is not None and time.monotonic() >= self._time_limit:
            return False
        return self._wall_limit is None or time.time() < self._wall_limit

    def quiet_step(self, steps: int) -> bool:
        """The fast path of a step boundary: if nothing can stop the run at ``steps`` (steps done)
        and no ``on_step`` watches, record them and return True; the caller skips :meth:`step`.
        Otherwise return False and record nothing: the caller makes the full :meth:`step`. A
        ``stop()`` that has returned is seen here; one racing with this call is seen at the next step.
        No ``skip()`` called also means no item is being skipped (see :class:`Items`)."""
        if steps < self._fast_below and self._quiet() and not self.items.skip_called():
            self.steps = steps
            return True
        return False

    def should_stop(self, state: StepState) -> bool:
        """Evaluate the conditions on ``state``; on a stop, stop the token and remember it was seen."""
        if not self.token.stopped and self.condition is not None:
            reason = self.condition.check(state)
            if reason is not None:
                self._stop(reason)
        if self.token.stopped:
            self.seen = True
        return self.seen

    def step(self, steps: int | None = None, **tensors: Any) -> bool:
        """A step boundary: record progress (``steps`` done, default one more), report it, check.

        ``on_step`` runs before the check, so a stop (or a skip) it makes ends this very step.
        """
        self.steps = self.steps + 1 if steps is None else steps
        state = self.state(**tensors)
        if self.on_step is not None:
            self.on_step(state)
        return self.should_stop(state) or self.items.skip_seen()

    def check(self, **tensors: Any) -> bool:
        """A check with no new step done (e.g. before the first step)."""
        if self.steps < self._fast_below and self._quiet():
            return False
        return self.should_stop(self.state(**tensors))

    def poll(self) -> None:
        """A check inside a model forward (called from forward pre-hooks, only on the run's own
        thread): in abort mode raise :class:`Abort` if stopped."""
        if not self.watch.in_forward and self._quiet():
            return
        self._checks.abort_if_stopped()

    # -- items -----------------------------------------------------------------------------------
    def start_item(self) -> bool:
        """Before each item of a run that goes item by item: whether it may start (:meth:`Items.start`)."""
        return self.items.start()

    def end_item(self, count: int = 1) -> None:
        """The current item (or the ``count`` items of a batch) ended (:meth:`Items.end`)."""
        self.items.end(count)

    # -- what waits until needed: checks inside the forward, step checks -----------------------------
    def intercept(self, *, abort: bool | None = None) -> AbstractContextManager[None]:
        """A check before every module call on this thread during the ``with`` block, armed only
        when needed (:meth:`~stopcock.forward_checks.ForwardChecks.intercept`); it raises :class:`Abort`."""
        return self._checks.intercept(abort)

    def arming(self, wire: Wire, kind: WireKind = "step") -> AbstractContextManager[None]:
        """During the ``with`` block, ``wire.arm()`` is called (by the thread that stops, skips, or a
        timer thread; at once if it is due already) the moment ``kind`` needs it: see
        :data:`~stopcock.wires.WireKind` and the module docstring."""
        return Arming(self._wires, wire, kind)

    # -- result ----------------------------------------------------------------------------------
    def outcome(
        self, output: Any, *, completed: str = "completed", rows_stopped_at: float | None = None, **kw: Any
    ) -> Outcome:
        """The run's Outcome (see :func:`outcome_of`); closes the control."""
        self.close()
        return outcome_of(self, output, completed=completed, rows_stopped_at=rows_stopped_at, **kw)


def outcome_of(
    control: RunControl,
    output: Any,
    *,
    completed: str = "completed",
    rows_stopped_at: float | None = None,
    rows_reason: str = "stop_string",
    **fields: Any,
) -> Outcome:
    """A closed run's Outcome; ``completed`` is the reason used when no stop took effect.

    ``rows_stopped_at`` is when the last row ended by a row condition (a stop string), if any
    did: with no other stop, the run is then ``stopped`` for ``rows_reason``, its latency
    measured from that moment. An escalated run reports ``mode="abort"`` and says so in ``detail``.
    The latency counts from the token's stop, the stop request; in a run agreed across ranks, whose
    token stops only at the agreed step, from when this rank knew of the stop
    (:attr:`Agreement.known_at <stopcock.ranks.Agreement.known_at>`).
    """
    ended, token, condition = control.ended, control.token, control.condition
    assert ended is not None
    stopped = control.seen and token.reason is not None
    reason = token.reason if stopped else completed
    requested = token.stopped_at
    if isinstance(condition, Agreement) and condition.known_at is not None:
        requested = condition.known_at
    latency = None
    if stopped and requested is not None:
        latency = max(0.0, ended - max(requested, control.started))
    if not stopped and rows_stopped_at is not None:
        stopped, reason, latency = True, rows_reason, max(0.0, ended - rows_stopped_at)
    fields.setdefault("mode", control.mode)
    if control.escalated is not None:
        fields["mode"] = "abort"
        note = (
            f"finish mode had not taken effect {control.escalate_after:g} s after the stop request:"
            f" escalated to abort after {control.escalated:.3f} s"
        )
        fields["detail"] = "; ".join(filter(None, [note, fields.get("detail")]))
    fields.setdefault("item_reasons", control.item_reasons)
    return Outcome(
        stopped=stopped,
        reason=reason,  # type: ignore[arg-type]
        steps=control.steps,
        total_steps=control.total,
        elapsed=ended - control.started,
        stop_latency=latency,
        output=output,
        **fields,
    )
