"""One run's stop machinery, shared by every adapter.

A :class:`RunControl` binds the user's ``stop=`` to one run: it owns the run's own token, links
the user's signals to it so a stop lands at once, counts steps, evaluates the conditions at each
check, raises :class:`Abort` in abort mode, and builds the :class:`Outcome`.
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
        """A step boundary: record progress (``steps`` done, default one more), report it, check."""
        self.steps = self.steps + 1 if steps is None else steps
        state = self.state(**tensors)
        stop = self.should_stop(state)
        if self.on_step is not None:
            self.on_step(state)
        return stop

    def check(self, **tensors: Any) -> bool:
        """A check with no new step done (e.g. before the first step)."""
        return self.should_stop(self.state(**tensors))

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
