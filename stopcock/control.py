"""One run's stop machinery, shared by every adapter.

A :class:`RunControl` binds the user's ``stop=`` to one run: it owns the run's own token, links
the user's signals to it so a stop lands at once, counts steps, evaluates the conditions at each
check, raises :class:`Abort` in abort mode, and builds the :class:`Outcome`. For runs over several
items (:mod:`stopcock.items`) it also marks the item boundaries, where ``skip()`` and
``stop_after_item()`` of the user's signals take effect.

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
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, NamedTuple

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
from .outcome import Outcome
from .signal import StopSignal
from .state import StepState
from .types import MODES, Mode, choice
from .wires import Arming, Wire, WireKind, Wires, tripwire

if TYPE_CHECKING:
    from torch import nn


__all__ = ["Abort", "Items", "RunControl", "Watch", "outcome_of"]


_NO_CHECKS: AbstractContextManager[None] = nullcontext()  # reusable: it holds no state

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
    of your own. A named tuple: every run builds one, and a frozen dataclass costs twice as much.
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


class Items:
    """A run's item boundaries (:mod:`stopcock.items`): where ``skip()`` and ``stop_after_item()`` of
    the user's signals it follows take effect, and how each item ended (``reasons``)."""

    def __init__(self, followed: tuple[StopSignal, ...]) -> None:
        self.followed = followed
        self.base = 0  # skip() calls seen when the current item began
        self.by_item = False  # the run goes item by item (start_item was called)
        self.skipping = False  # the current item is being skipped
        self.reasons: list[str] | None = None

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
        self.base, self.skipping = self.skips(), False

    def end(self, stopped_for: str | None, count: int) -> None:
        """The current item (or ``count`` of them) ended: skipped, cut short by a stop for
        ``stopped_for``, or completed."""
        reason = "skipped" if self.skipping else stopped_for or "completed"
        self.reasons = [*(self.reasons or ()), *[reason] * count]
        self.skipping = False


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


class RunControl:
    """Per-run binding of the stop conditions. Use as a context manager around the run."""

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
        # the user's signals whose skip() and stop_after_item() this run follows
        condition = self.condition
        self._followed: tuple[StopSignal, ...] = (
            (condition.signal,)  # stop=signal, the usual case
            if type(condition) is Signalled
            else tuple(c.signal for c in top_level(condition) if isinstance(c, Signalled))
        )
        self.items = Items(self._followed)
        self.token = StopSignal()
        self.steps = 0
        self.total: int | None = None
        self.seen = False
        self.escalated: float | None = None  # seconds from the stop request to the escalation
        self._signals = (self.token, *self.watch.signals)
        self._unlink: list[Callable[[], None]] = []
        self._forwarded: tuple[StopSignal, ...] = ()  # the signals whose stops stop the token (once entered)
        self.ended: float | None = None
        self._wires = Wires(self)
        self._start()

    @property
    def on_step(self) -> Callable[[StepState], object] | None:
        """Called with each step's state; while one is set (it may be set after the control is
        built: a recorder routes the steps through its own), every step makes the full check."""
        return self._on_step

    @on_step.setter
    def on_step(self, fn: Callable[[StepState], object] | None) -> None:
        self._on_step = fn
        self._unwatched = fn is None and not self.watch.every_step  # quiet steps may take the fast path

    @property
    def steps_wait(self) -> bool:
        """Whether a step boundary can stop the run only once :meth:`arming` arms its wire: no
        ``on_step``, no condition that sees each step, no ``max_steps`` (so a step check may stay out
        of the loop until then)."""
        return self._unwatched and self.watch.max_steps == math.inf

    def _start(self) -> None:
        self.started = time.monotonic()
        if not (self.watch.timeouts or self.watch.deadlines):  # no time condition: the usual case
            self._time_limit = self._wall_limit = self._due = None
            return
        timeouts = [self.started + s for s in self.watch.timeouts]
        deadlines = [self.started + (when - time.time()) for when in self.watch.deadlines]
        self._time_limit = min(timeouts, default=None)
        self._wall_limit = min(self.watch.deadlines, default=None)
        self._due = min(timeouts + deadlines, default=None)  # when the first time condition expires

    # -- lifecycle -------------------------------------------------------------------------------
    def __enter__(self) -> RunControl:
        self._start()
        self.items.begin()
        for signal in self._followed:
            self._unlink.append(signal.on_stop(self._forward(signal)))
        self._forwarded = self._followed  # their stops reach the token from now on
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Unlink from the user's signals (idempotent); later stops no longer reach this run."""
        if self.ended is None:
            self.ended = time.monotonic()
        while self._unlink:
            self._unlink.pop()()
        self._wires.close()

    def _forward(self, signal: StopSignal) -> Callable[[], None]:
        def forward() -> None:
            self._stop(signal.reason or "user")

        return forward

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
        """
        if (
            self._unwatched
            and steps < self.watch.max_steps
            and self._quiet()
            and not self.items.skipping
            and not self.items.skip_called()
        ):
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
        return self.should_stop(state) or self._skip_seen()

    def check(self, **tensors: Any) -> bool:
        """A check with no new step done (e.g. before the first step)."""
        if self._unwatched and self.steps < self.watch.max_steps and self._quiet():
            return False
        return self.should_stop(self.state(**tensors))

    # -- items ---------------------------------------------------------------------------------------
    @property
    def skipping(self) -> bool:
        """The current item is being skipped."""
        return self.items.skipping

    @property
    def item_reasons(self) -> list[str] | None:
        """How each item ended, once the run went item by item."""
        return self.items.reasons

    @item_reasons.setter
    def item_reasons(self, reasons: list[str] | None) -> None:
        self.items.reasons = reasons

    def _skip_called(self) -> bool:
        return self.items.skip_called()

    def _skip_seen(self) -> bool:
        """Whether ``skip()`` was called since the current item began: it ends that item, or, in a
        run that is not item by item, the run (reason ``"skipped"``). Checked at every step."""
        items = self.items
        if items.skipping:
            return True
        if not items.skip_called():
            return False
        if items.by_item:
            items.skipping = True
        else:
            self._stop("skipped")
            self.seen = True
        return True

    def start_item(self) -> bool:
        """Before each item of a run that goes item by item: whether it may start.

        It may not once the run is stopped, or once a signal asked to stop after the current item
        (the run then stops with that reason).
        """
        self.items.by_item = True
        if not self.token.stopped:
            reason = self.items.stop_after_item()
            if reason is not None:
                self._stop(reason)
        if self.check():
            return False
        self.items.begin()
        return True

    def end_item(self, count: int = 1) -> None:
        """The current item (or the ``count`` items of a batch) ended: record why in ``item_reasons``:
        ``"skipped"``, the stop reason when a stop cut it short, else ``"completed"``."""
        self.items.end(self.token.reason if self.seen else None, count)

    def poll(self) -> None:
        """A check inside a model forward: in abort mode raise :class:`Abort` if stopped.

        Only called from forward pre-hooks, and only on the run's own thread.
        """
        if not self.watch.in_forward and self._quiet():
            return
        if self._stopped_in_forward():
            self.seen = True
            raise Abort(self)

    def _stopped_in_forward(self) -> bool:
        """Whether the run is stopped, its conditions evaluated on a state inside the forward."""
        return self.token.stopped or (self.condition is not None and self.should_stop(self.state(block=True)))

    def _poll_escalation(self, _module: nn.Module) -> None:
        """The in-forward check of an escalated finish-mode stop: abort unless a step boundary saw
        the stop already (the library is then finishing as asked, e.g. decoding the image)."""
        if self.seen:
            return
        if self._stopped_in_forward():
            now = time.monotonic()
            self.seen = True
            self.escalated = now - self._requested(now)
            raise Abort(self)

    def _requested(self, now: float) -> float:
        """When the stop was requested: the token's stop, or the first time condition's expiry."""
        times = [t for t in (self.token.stopped_at, self._due) if t is not None and t <= now]
        return min(times, default=now)

    # -- checks inside the forward, armed when needed ------------------------------------------------
    def intercept(self, *, abort: bool | None = None) -> AbstractContextManager[None]:
        """A check before every module call on this thread during the ``with`` block (the run's
        models, and any other module the run calls), armed only when needed.

        As abort mode arms it (``mode="abort"``, or ``abort=True`` for a target that cannot
        finish early): once a stop is possible, see the module docstring; the check raises
        :class:`Abort`. In finish mode with ``escalate_after``: once a stop has waited that long
        unseen. Otherwise nothing is ever installed.
        """
        abort = self.mode == "abort" if abort is None else abort
        if not abort and self.escalate_after is None:
            return _NO_CHECKS
        wire = tripwire()(None, (lambda _m: self.poll()) if abort else self._poll_escalation)
        return Arming(self._wires, wire, "abort" if abort else "escalate", closes=wire)

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
    """
    ended, token = control.ended, control.token
    assert ended is not None
    stopped = control.seen and token.reason is not None
    reason = token.reason if stopped else completed
    latency = None
    if stopped and token.stopped_at is not None:
        latency = max(0.0, ended - max(token.stopped_at, control.started))
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
