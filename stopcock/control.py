"""One run's stop machinery, shared by every adapter.

A :class:`RunControl` binds the user's ``stop=`` to one run: it owns the run's own token, links
the user's signals to it so a stop lands at once, counts steps, evaluates the conditions at each
check, raises :class:`Abort` in abort mode, and builds the :class:`Outcome`. For runs over several
items (:mod:`stopcock.items`) it also marks the item boundaries, where ``skip()`` and
``stop_after_item()`` of the user's signals take effect.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from .conditions import Condition, Signalled, StopLike, as_condition, top_level
from .outcome import Outcome
from .signal import StopSignal
from .state import StepState
from .types import MODES, Mode, choice

__all__ = ["Abort", "RunControl", "MODES"]


class Abort(BaseException):
    """Raised inside the target to abandon a run in abort mode.

    A BaseException, so that a user's ``except Exception`` around a step cannot swallow it; only
    the adapter that started the run catches it, by this exact class.
    """

    def __init__(self, control: RunControl) -> None:
        super().__init__(control.token.reason)
        self.control = control


class RunControl:
    """Per-run binding of the stop conditions. Use as a context manager around the run."""

    def __init__(
        self,
        stop: StopLike | None = None,
        *,
        mode: Mode = "finish",
        on_step: Callable[[StepState], object] | None = None,
    ) -> None:
        self.mode: Mode = choice(
            "mode", mode, MODES, hint="; to pass a mode to the target itself, use kwargs={'mode': ...}"
        )
        self.condition: Condition | None = None if stop is None else as_condition(stop)
        self.on_step = on_step
        # the user's signals whose skip() and stop_after_item() this run follows
        self._signals = tuple(c.signal for c in top_level(self.condition) if isinstance(c, Signalled))
        self._skip_base = 0  # skip() calls seen when the current item began
        self._in_items = False  # the run goes item by item (start_item was called)
        self.skipping = False  # the current item is being skipped
        self.item_reasons: list[str] | None = None
        self.token = StopSignal()
        self.steps = 0
        self.total: int | None = None
        self.seen = False
        self.started = time.monotonic()
        self._unlink: list[Callable[[], None]] = []
        self._ended: float | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    def __enter__(self) -> RunControl:
        self.started = time.monotonic()
        self._skip_base = self._skips()
        for leaf in top_level(self.condition):
            if isinstance(leaf, Signalled):
                self._unlink.append(leaf.signal.on_stop(self._forward(leaf.signal)))
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Unlink from the user's signals (idempotent); later stops no longer reach this run."""
        if self._ended is None:
            self._ended = time.monotonic()
        while self._unlink:
            self._unlink.pop()()

    def _forward(self, signal: StopSignal) -> Callable[[], None]:
        def forward() -> None:
            self.token.stop(signal.reason or "user")

        return forward

    # -- checks ----------------------------------------------------------------------------------
    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def state(self, *, block: bool = False, **tensors: Any) -> StepState:
        return StepState(step=self.steps, total=self.total, elapsed=self.elapsed, block=block, **tensors)

    def should_stop(self, state: StepState) -> bool:
        """Evaluate the conditions on ``state``; on a stop, stop the token and remember it was seen."""
        if not self.token.stopped and self.condition is not None:
            reason = self.condition.check(state)
            if reason is not None:
                self.token.stop(reason)
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
        return self.should_stop(self.state(**tensors))

    # -- items ---------------------------------------------------------------------------------------
    def _skips(self) -> int:
        return sum(signal.skips for signal in self._signals)

    def _skip_seen(self) -> bool:
        """Whether ``skip()`` was called since the current item began: it ends that item, or, in a
        run that is not item by item, the run (reason ``"skipped"``). Checked at every step, so the
        usual case (one signal, no skip) reads one counter."""
        if self.skipping:
            return True
        signals = self._signals
        if not signals:
            return False
        count = signals[0].skips if len(signals) == 1 else self._skips()
        if count == self._skip_base:
            return False
        if self._in_items:
            self.skipping = True
        else:
            self.token.stop("skipped")
            self.seen = True
        return True

    def start_item(self) -> bool:
        """Before each item of a run that goes item by item: whether it may start.

        It may not once the run is stopped, or once a signal asked to stop after the current item
        (the run then stops with that reason).
        """
        self._in_items = True
        if not self.token.stopped:
            reason = next((s.after_item for s in self._signals if s.after_item is not None), None)
            if reason is not None:
                self.token.stop(reason)
        if self.check():
            return False
        self._skip_base, self.skipping = self._skips(), False
        return True

    def end_item(self, count: int = 1) -> None:
        """The current item (or the ``count`` items of a batch) ended: record why in ``item_reasons``:
        ``"skipped"``, the stop reason when a stop cut it short, else ``"completed"``."""
        if self.skipping:
            reason = "skipped"
        elif self.seen and self.token.reason is not None:
            reason = self.token.reason
        else:
            reason = "completed"
        self.item_reasons = [*(self.item_reasons or ()), *[reason] * count]
        self.skipping = False

    def poll(self) -> None:
        """A check inside a model forward: in abort mode raise :class:`Abort` if stopped.

        Only called from forward pre-hooks, and only on the run's own thread.
        """
        if self.token.stopped or (
            self.condition is not None and self.should_stop(self.state(block=True))
        ):
            self.seen = True
            raise Abort(self)

    # -- result ----------------------------------------------------------------------------------
    def outcome(
        self,
        output: Any,
        *,
        completed: str = "completed",
        rows_stopped_at: float | None = None,
        **fields: Any,
    ) -> Outcome:
        """Build the Outcome; ``completed`` is the reason used when no stop took effect.

        ``rows_stopped_at`` is when the last row ended by a row condition (a stop string), if any
        did: with no other stop, the run is then ``stopped`` for ``"stop_string"``, its latency
        measured from that moment.
        """
        self.close()
        assert self._ended is not None
        stopped = self.seen and self.token.reason is not None
        reason = self.token.reason if stopped else completed
        latency = None
        if stopped and self.token.stopped_at is not None:
            latency = max(0.0, self._ended - max(self.token.stopped_at, self.started))
        if not stopped and rows_stopped_at is not None:
            stopped, reason, latency = True, "stop_string", max(0.0, self._ended - rows_stopped_at)
        fields.setdefault("mode", self.mode)
        fields.setdefault("item_reasons", self.item_reasons)
        return Outcome(
            stopped=stopped,
            reason=reason,  # type: ignore[arg-type]
            steps=self.steps,
            total_steps=self.total,
            elapsed=self._ended - self.started,
            stop_latency=latency,
            output=output,
            **fields,
        )
