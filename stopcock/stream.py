"""Stream a run as events: text as it is generated, diffusion steps with optional previews.

``stopcock.stream(target, *args, stop=..., **kwargs)`` runs :func:`stopcock.run` in a worker thread
and yields events as the run makes progress. ``stopcock.astream`` is the async form; it starts its
run at the first iteration, so a stream that is never iterated runs nothing. The events, stable
names:

- :class:`TextChunk` ``(text, step, row)``: new text of one generated row (transformers), decoded
  incrementally: a character split across tokens comes out whole, once complete; chunks of a row
  joined equal ``tokenizer.decode(row_tokens, skip_special_tokens=True)``. ``step`` is the run's
  step count; ``row`` counts generated rows in order across the run (the row of ``generate``'s
  batch; for a pipeline given several prompts, rows continue from one ``generate`` call to the
  next). Beam search cannot stream (beams are reordered at every step): a clear error.
- :class:`Step` ``(step, total, latents, preview)``: one step done, for every target without text
  (diffusers; transformers pipelines over many inputs). ``latents`` is the step's latents tensor
  (do not modify it); ``preview`` is a PIL image when ``preview=`` asks for one.
- :class:`Done` ``(outcome)``: always the last event of a run that returned.

Leaving early, by ``break`` (the iterator is dropped), ``close()`` or ``with``, stops the run at
its next step with reason ``"cancelled"`` and waits until it has; a stream left to the cyclic
garbage collector is stopped by its worker, which notices at its next step that the stream is
gone (nothing of stopcock runs inside a garbage collection). ``stop(reason)`` stops the run but keeps the
stream open, so the text made before the stop and the final :class:`Done` still arrive. An
exception inside the run is raised to the consumer after the events before it. The buffer between
the worker and the consumer holds at most ``buffer`` events: a slow consumer holds the worker in
its step (a consumer that goes away releases it).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

from .conditions import StopLike
from .events import Done, Event, EventMaker, Step, TextChunk
from .outcome import Outcome
from .previews import latent_preview
from .runner import Bound
from .signal import StopSignal
from .worker import Channel, start_worker

# The events a stream yields and the latent preview are part of this module's documented API.
__all__ = [
    "Done",
    "Event",
    "RunHandle",
    "Step",
    "Stream",
    "TextChunk",
    "latent_preview",
    "stream",
]


def events_for(tokenizer: Any, preview: str | None, preview_every: int) -> Callable[[Bound], EventMaker]:
    """How a stream with these options makes its events: asked of the bound target's adapter."""

    def make(bound: Bound) -> EventMaker:
        return bound.adapter.stream_events(
            bound.target, bound.kwargs, tokenizer=tokenizer, preview=preview, preview_every=preview_every
        )

    return make


# -- the sync stream ---------------------------------------------------------------------------------
def _leave(channel: Channel, thread: threading.Thread) -> None:
    """End a stream's run: stop it, and wait for the worker (not from the worker's own thread).

    Waiting is what makes ``break`` leave nothing running. It runs when the stream is closed or
    its last reference goes, never inside a cyclic garbage collection (see :meth:`Channel.attach`).
    """
    channel.abandon()
    if threading.get_ident() != thread.ident:
        thread.join()


class RunHandle:
    """What a sync or async stream shares: its run's stop signal, ``stop()`` and Outcome."""

    _channel: Channel

    @property
    def signal(self) -> StopSignal:
        """The stream's own stop signal (``stop()`` stops it)."""
        return self._channel.signal

    @property
    def outcome(self) -> Outcome | None:
        """The run's Outcome once it has ended (also after the stream was closed), else None."""
        return self._channel.outcome

    def stop(self, reason: str = "user") -> bool:
        """Stop the run at its next step and keep streaming: the last events and Done still come."""
        return self._channel.signal.stop(reason)


class Stream(RunHandle, Iterator[Event]):
    """A running stream: iterate for events; ``stop()``, ``close()`` or leave to end it."""

    def __init__(self, channel: Channel, thread: threading.Thread) -> None:
        self._channel = channel
        self._thread = thread
        # The worker holds the channel, never this object: dropping the stream ends the run.
        self._dropped: weakref.ref[Stream] | None = channel.attach(self, partial(_leave, channel, thread))

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Event:
        try:
            return self._channel.get()
        except BaseException:
            if self._channel.finished:  # the end or the run's error: the worker is past its run
                self._thread.join()
            raise

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the run (reason ``"cancelled"``) and wait until its worker has ended.

        Events not read yet are dropped; an exception the run raised and the consumer has not
        received is raised here.
        """
        self._dropped = None  # left here, not when the stream is dropped
        _leave(self._channel, self._thread)
        if self._thread is not threading.current_thread():
            self._channel.raise_error()


def stream(
    target: Any,
    *args: Any,
    stop: StopLike | None = None,
    tokenizer: Any = None,
    preview: str | None = None,
    preview_every: int = 1,
    buffer: int = 64,
    **kwargs: Any,
) -> Stream:
    """Run ``target`` like :func:`stopcock.run` in a worker thread and iterate over its events.

    ``tokenizer`` decodes text (default: the pipeline's own; required for a model target).
    ``preview="latent"`` adds a cheap preview image to diffusion steps (a fixed linear map of SD
    latents), ``preview="decode"`` a VAE decode; ``preview_every=N`` makes one every N steps.
    ``buffer`` bounds the events held for a slow consumer. Other arguments (``mode=``,
    ``escalate_after=``, ``partial=``, ``on_step=``, ``adapter=``, ``kwargs=``, the target's own) go
    to :func:`stopcock.run`.
    """
    events = events_for(tokenizer, preview, preview_every)
    return Stream(*start_worker(target, args, kwargs, stop=stop, buffer=buffer, events=events))
