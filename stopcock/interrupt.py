"""Ctrl+C and a notebook's Interrupt as a stop: ``run(..., stop=stopcock.interrupted())``.

Without it, ``KeyboardInterrupt`` lands inside the model's forward and the whole generation is
lost. With it, for the span of that one run (and nothing outside it), SIGINT is handled: the
first press stops the run with reason ``"interrupted"`` at its next step, and the run returns its
Outcome with the partial result; every later press raises ``KeyboardInterrupt`` (from wherever the
main thread is, as Python's own handler does), for a step that would take too long. The handler
that was there before is put back when the run ends, however it ends.

Python delivers signals to the main thread only, so a run with ``interrupted()`` must run there
(not in a stream's or ``arun``'s worker thread): anywhere else is a clear error. Where SIGINT is
ignored (a process started in the background), it is left alone.

:func:`interrupted` is a description, like every condition: :func:`take` swaps it for a new
:class:`~stopcock.StopSignal` of each run when ``run()`` (or ``resume()``) binds it, so a run watches it as it
watches any signal (no cost until it is stopped), and :func:`catching` installs the handler that
stops that signal.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType

from .conditions import AnyOf, Condition, Signalled, StopLike, as_condition, top_level
from .signal import StopSignal
from .state import StepState

__all__ = ["INTERRUPTED", "Interrupted", "catching", "interrupted", "take"]

#: The reason of a run stopped by Ctrl+C (the CLI's too).
INTERRUPTED = "interrupted"


class Interrupted(Condition):
    """Ctrl+C (SIGINT) stops the run; see the module docstring. Made by :func:`interrupted`."""

    reason = INTERRUPTED
    fires_in_forward = False

    def check(self, state: StepState) -> str | None:
        # run() swaps this condition for a signal of the run (take()); a check means no swap was made
        raise TypeError(
            "stopcock.interrupted() works in stopcock.run() and stopcock.resume() on the main thread,"
            " at the top level of stop= (alone, in a list, or joined with |); elsewhere, stop the run"
            " with a StopSignal and call signal.stop('interrupted') yourself"
        )

    def __repr__(self) -> str:
        return "interrupted()"


def interrupted() -> Interrupted:
    """Stop the run on Ctrl+C (or a notebook's Interrupt) and keep its partial result; a second
    press raises ``KeyboardInterrupt``. Main thread only; the handler lives only as long as the run."""
    return Interrupted()


def take(stop: StopLike | None) -> tuple[StopLike | None, StopSignal | None]:
    """``stop`` with its :func:`interrupted` parts swapped for a new signal, and that signal
    (None, and ``stop`` unchanged, when it has none)."""
    if stop is None or isinstance(stop, StopSignal):  # the usual cases, at no cost
        return stop, None
    condition = as_condition(stop)
    if not any(type(part) is Interrupted for part in condition.parts()):
        return stop, None
    parts = top_level(condition)
    if sum(type(part) is Interrupted for part in parts) != sum(
        type(part) is Interrupted for part in condition.parts()
    ):
        raise ValueError(
            "stopcock.interrupted() stops the run on its own, so it cannot be part of an & (AllOf)"
            " condition; combine it with | instead, e.g. stop=signal | stopcock.interrupted()"
        )
    pressed = StopSignal()
    swapped = [Signalled(pressed) if type(part) is Interrupted else part for part in parts]
    return (pressed if len(swapped) == 1 else AnyOf(*swapped)), pressed


class _Handler:
    """The SIGINT handler of one run: the first press stops ``pressed``, the others raise."""

    def __init__(self, pressed: StopSignal) -> None:
        self.pressed = pressed
        self.presses = 0

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.presses += 1
        if self.presses == 1:
            self.pressed.stop(INTERRUPTED)
            _say("\nstopcock: interrupted: stopping at the next step and keeping the partial result"
                 " (interrupt again to abort now)\n")
            return
        raise KeyboardInterrupt


@contextlib.contextmanager
def catching(pressed: StopSignal) -> Iterator[None]:
    """Within the block, SIGINT stops ``pressed`` (then raises); the previous handler is restored after."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            "stopcock.interrupted() catches Ctrl+C, which Python delivers to the main thread only, and"
            f" this run is on the thread {threading.current_thread().name!r} (a stream or arun() runs in"
            " a worker thread): call stopcock.run() on the main thread, or pass a StopSignal that your"
            " main thread stops"
        )
    previous = signal.getsignal(signal.SIGINT)
    if previous is signal.SIG_IGN or previous is None:  # ignored, or not Python's to restore
        yield
        return
    signal.signal(signal.SIGINT, _Handler(pressed))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _say(message: str) -> None:
    """Write to stderr from a signal handler: a raw write, never the (maybe busy) buffered stream."""
    with contextlib.suppress(OSError):
        os.write(2, message.encode())
