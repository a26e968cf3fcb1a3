"""What a command-line run shows and how it reacts: progress on stderr, text echoed as it is
generated, and Ctrl+C handling by phase (see :class:`CtrlC`)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, TextIO

from .events import RowDecoder
from .signal import StopSignal
from .state import StepState

__all__ = ["AFTER_ITEM", "INTERRUPTED", "CtrlC", "Progress", "TextEcho", "say"]

INTERRUPTED = "interrupted"
AFTER_ITEM = "after_item"  # the reason of a stop after the current prompt (SIGUSR2)


class Progress:
    """The ``on_step`` hook of a CLI run: remembers the last state and shows progress.

    ``style`` is "bar" (one redrawn line), "lines" (one line per step, for logs and for tests
    that follow a run) or "none". ``echo`` is called first with each state (text streaming).
    """

    def __init__(
        self, style: str, *, unit: str = "step", echo: Callable[[StepState], None] | None = None
    ) -> None:
        self.style = style
        self.unit = unit
        self.echo = echo
        self.stream = sys.stderr
        self.last: StepState | None = None
        self.started = time.monotonic()

    def __call__(self, state: StepState) -> None:
        self.last = state
        if self.echo is not None:
            self.echo(state)
        if self.style == "none":
            return
        total = state.total
        eta = state.elapsed / state.step * (total - state.step) if total and state.step else None
        eta_text = "?" if eta is None else f"{eta:.1f}s"
        if self.style == "lines":
            print(f"{self.unit} {state.step}/{total or '?'} elapsed {state.elapsed:.2f}s eta {eta_text}",
                  file=self.stream, flush=True)
            return
        width = 30
        filled = width * state.step // total if total else 0
        bar = f"[{'#' * filled}{'.' * (width - filled)}]" if total else ""
        self.stream.write(f"\r{self.unit} {state.step}/{total or '?'} {bar} eta {eta_text}   ")
        self.stream.flush()

    def close(self) -> None:
        if self.style == "bar" and self.last is not None:
            self.stream.write("\n")
            self.stream.flush()


class TextEcho:
    """Prints the generated text (batch row 0) to ``out`` as tokens arrive.

    Decoding is :class:`stopcock.events.RowDecoder`'s, as in streams and the server: a character
    split across tokens is printed whole once complete.
    """

    def __init__(self, tokenizer: Any, out: TextIO) -> None:
        self.rows = RowDecoder(tokenizer)
        self.out = out

    def __call__(self, state: StepState) -> None:
        if state.input_ids is not None:
            self._show("".join(chunk.text for chunk in self.rows.chunks(state) if chunk.row == 0))

    def finish(self) -> None:
        self._show("".join(chunk.text for chunk in self.rows.flush() if chunk.row == 0) + "\n")

    def _show(self, text: str) -> None:
        if text:
            self.out.write(text)
            self.out.flush()


class CtrlC:
    """SIGINT handling for one command (main thread only), by the phase it is in.

    ``"starting"`` (imports, arguments, everything outside the phases below): a press stops
    ``stop`` (reason ``"interrupted"``) and is acknowledged, nothing is raised: an import cut short
    by ``KeyboardInterrupt`` can leave a library unusable for the rest of the process. The command
    then ends before its run, or its run stops before its first step, and says so (exit 130, the
    JSON with ``--json``).
    ``"interruptible"`` (inside :meth:`interruptible`: loading the model, the demo, the server):
    ``KeyboardInterrupt`` at once; there is nothing to keep.
    ``"running"``: the first press calls ``stop.stop("interrupted")``. The run is in finish mode, so it
    ends at the next step boundary and the library builds its normal (partial) output, which the CLI
    saves. The second press raises ``KeyboardInterrupt`` from the handler. A run started in finish
    mode has no block hooks to abort through, so the exception itself abandons the step in flight,
    wherever the main thread is (inside the model forward, or in the VAE decode); the adapters'
    cleanup runs on the way out. The CLI then reports mode "abort" with what the last finished step
    produced.
    ``"ended"`` (saving and reporting the result): a press is acknowledged, and only stops the
    prompts not started yet, so the saved file and the JSON are never cut off half-written.
    The handler raises ``KeyboardInterrupt`` once at most: it moves to ``"ended"`` as it raises, so
    the command unwinds and reports whatever else is pressed. Every press is acknowledged on stderr
    at once. Presses counted by the handler this one replaces (``stopcock``'s first one, see
    ``_stopcock_launch``) count as presses while starting. With several prompts, SIGUSR1 skips the
    current one and SIGUSR2 lets it finish and starts no other (both also work with one prompt: a
    skip ends its run).
    """

    def __init__(self) -> None:
        self.stop = StopSignal()
        self.presses = 0
        self.phase = "starting"

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.presses += 1
        first = self.stop.stop(INTERRUPTED)  # in every phase: with several prompts, no other one starts
        if self.phase == "ended":
            say("\nstopcock: the run has ended: saving and reporting its result first\n")
            return
        if self.phase == "starting":
            say("\nstopcock: interrupted: ending before the run starts\n")
            return
        if self.phase == "running" and first:
            say("\nstopcock: interrupted: stopping at the next step and keeping the partial result"
                " (Ctrl+C again to abort now)\n")
            return
        say("\nstopcock: aborting now\n" if self.phase == "running" else "\nstopcock: interrupted\n")
        self.phase = "ended"
        raise KeyboardInterrupt

    def skip(self, signum: int, frame: FrameType | None) -> None:
        """SIGUSR1: end the current prompt and go on with the next (a single prompt: end the run)."""
        self.stop.skip()
        say("\nstopcock: skipping the current prompt\n")

    def stop_after_item(self, signum: int, frame: FrameType | None) -> None:
        """SIGUSR2: let the current prompt finish, then start no other."""
        self.stop.stop_after_item(AFTER_ITEM)
        say("\nstopcock: stopping once the current prompt is done\n")

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """A press within the block raises ``KeyboardInterrupt`` at once; so does entering it after one."""
        self.phase = "interruptible"
        try:
            if self.stop.stopped:
                raise KeyboardInterrupt
            yield
        finally:
            if self.phase == "interruptible":
                self.phase = "starting"

    @contextlib.contextmanager
    def installed(self) -> Iterator[CtrlC]:
        """Handle SIGINT (and, where they exist, SIGUSR1: skip, SIGUSR2: stop after the current prompt)
        while the block runs; a no-op off the main thread (Python delivers signals there). SIGINT is
        left alone where it is ignored (a command started in the background keeps ignoring it)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        handlers: dict[int, Callable[[int, FrameType | None], None]] = {}
        if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            handlers[signal.SIGINT] = self
        for name, handler in (("SIGUSR1", self.skip), ("SIGUSR2", self.stop_after_item)):
            if hasattr(signal, name):
                handlers[getattr(signal, name)] = handler
        previous: dict[int, Any] = {sig: signal.signal(sig, handler) for sig, handler in handlers.items()}
        for _ in range(getattr(previous.get(signal.SIGINT), "presses", 0)):  # read once it can count no more
            self(signal.SIGINT, None)
        try:
            yield self
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)


def say(message: str) -> None:
    """Write to stderr from a signal handler: a raw write, never the (maybe busy) buffered stream."""
    with contextlib.suppress(OSError):
        os.write(2, message.encode())
