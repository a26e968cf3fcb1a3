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
garbage collector is stopped without waiting. ``stop(reason)`` stops the run but keeps the
stream open, so the text made before the stop and the final :class:`Done` still arrive. An
exception inside the run is raised to the consumer after the events before it. The buffer between
the worker and the consumer holds at most ``buffer`` events: a slow consumer holds the worker in
its step (a consumer that goes away releases it).
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .conditions import Condition, as_condition
from .outcome import Outcome
from .runner import adapter_for, run
from .signal import StopSignal
from .state import StepState

__all__ = [
    "Done",
    "Event",
    "Step",
    "Stream",
    "TextChunk",
    "TextDecoder",
    "latent_preview",
    "stream",
]

PREVIEWS = ("latent", "decode")


@dataclass(frozen=True)
class TextChunk:
    """New text of generated row ``row``, available after ``step`` steps."""

    text: str
    step: int
    row: int = 0


@dataclass(frozen=True)
class Step:
    """Step ``step`` of ``total`` is done; ``preview`` is an image when asked for."""

    step: int
    total: int | None
    latents: Any = None
    preview: Any = None


@dataclass(frozen=True)
class Done:
    """The run ended; the last event."""

    outcome: Outcome


Event = TextChunk | Step | Done


# -- text --------------------------------------------------------------------------------------------
class TextDecoder:
    """Incremental decoding of one row of tokens.

    Each :meth:`push` returns the text the new tokens complete. Text is held back while the tail
    decodes to an incomplete character (U+FFFD), and each step decodes only a short window (the
    tokens since the last emitted text, plus those before them for context), so the cost per step
    stays constant and leading spaces come out as the tokenizer joins them.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # start of the context window
        self._read = 0  # tokens already turned into text

    def push(self, ids: Sequence[int]) -> str:
        self._ids.extend(int(i) for i in ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """The text still held back (an incomplete character at the end comes out as decoded)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        done = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if len(text) <= len(done) or (text.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(done) :]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True) if ids else ""


class _Rows:
    """Turns the ``input_ids`` of successive steps into :class:`TextChunk` events, row by row."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._decoders: list[TextDecoder] = []
        self._first_row = 0
        self._last_ids: Any = None
        self._last_step = 0

    def chunks(self, state: StepState) -> list[TextChunk]:
        ids = state.input_ids
        last = self._last_ids
        if (
            last is not None
            and ids.shape[0] == last.shape[0]
            and ids.shape[1] > last.shape[1]
            and bool((ids[:, : last.shape[1]] == last).all())
        ):
            new = ids[:, last.shape[1] :]
            events: list[TextChunk] = []
        else:  # a new generate call (the first, or the next prompt of a pipeline)
            events = self.flush(state.step)
            self._first_row += len(self._decoders)
            self._decoders = [TextDecoder(self._tokenizer) for _ in range(ids.shape[0])]
            # tokens generated by this call so far: the step count since the last call, or per call
            made = state.step - self._last_step if state.step > self._last_step else state.step
            new = ids[:, ids.shape[1] - min(max(made, 1), ids.shape[1]) :]
        self._last_ids, self._last_step = ids, state.step
        for row, decoder in enumerate(self._decoders):
            events += self._chunk(decoder.push(new[row].tolist()), state.step, row)
        return events

    def flush(self, step: int) -> list[TextChunk]:
        events: list[TextChunk] = []
        for row, decoder in enumerate(self._decoders):
            events += self._chunk(decoder.flush(), step, row)
        return events

    def _chunk(self, text: str, step: int, row: int) -> list[TextChunk]:
        return [TextChunk(text, step, self._first_row + row)] if text else []


# -- previews ----------------------------------------------------------------------------------------
# Fixed linear maps from Stable Diffusion latents to RGB (factors and bias, as ComfyUI's latent
# formats publish them): a cheap, rough preview with no VAE call.
_SD_RGB = ([[0.3512, 0.2297, 0.3227], [0.3250, 0.4974, 0.2350], [-0.2829, 0.1762, 0.2721],
            [-0.2120, -0.2616, -0.7177]], [0.0, 0.0, 0.0])  # fmt: skip
_SDXL_RGB = ([[0.3651, 0.4232, 0.4341], [-0.2533, -0.0042, 0.1068], [0.1076, 0.1111, -0.0362],
              [-0.3165, -0.2492, -0.2188]], [0.1084, -0.0175, -0.0011])  # fmt: skip


def _image_4d(latents: Any, what: str) -> Any:
    if getattr(latents, "ndim", None) != 4:
        shape = tuple(getattr(latents, "shape", ()))
        raise ValueError(
            f"{what} needs image latents shaped (batch, channels, height, width); this pipeline's"
            f" latents are {shape or type(latents).__name__} (packed latents, e.g. Flux, are not"
            " supported): stream without preview=, or decode the latents yourself in on_step"
        )
    return latents


def _to_image(rgb: Any) -> Any:
    """(batch, 3, h, w) in [0, 1] -> one PIL image, the batch items side by side."""
    import torch
    from PIL import Image

    b, _, h, w = rgb.shape
    tiled = rgb.permute(2, 0, 3, 1).reshape(h, b * w, 3)
    return Image.fromarray((tiled * 255).round().to(torch.uint8).cpu().numpy())


def latent_preview(latents: Any, *, xl: bool = False) -> Any:
    """A rough RGB preview of 4-channel Stable Diffusion latents by a fixed linear map (no VAE).

    One pixel per latent pixel (1/8 of the image size); a batch is laid out side by side.
    ``xl=True`` uses the SDXL map.
    """
    import torch

    latents = _image_4d(latents, "latent_preview")
    if latents.shape[1] != 4:
        raise ValueError(
            f"latent_preview maps 4-channel (Stable Diffusion 1/2/XL) latents; these have"
            f" {latents.shape[1]} channels: use preview='decode' for this pipeline"
        )
    factors, bias = _SDXL_RGB if xl else _SD_RGB
    x = latents.detach().float().cpu()
    rgb = torch.einsum("bchw,cr->brhw", x, torch.tensor(factors)) + torch.tensor(bias)[:, None, None]
    return _to_image(((rgb + 1) / 2).clamp(0, 1))


def _decode_preview(pipe: Any, latents: Any) -> Any:
    """A full VAE decode of ``latents`` (exact, costs one decoder call)."""
    import torch

    vae = pipe.vae
    scaled = _image_4d(latents, "preview='decode'") / vae.config.scaling_factor
    shift = getattr(vae.config, "shift_factor", None)
    if shift is not None:
        scaled = scaled + shift
    with torch.no_grad():
        image = vae.decode(scaled.to(vae.dtype), return_dict=False)[0]
    return _to_image((image.float() / 2 + 0.5).clamp(0, 1))


def _previewer(target: Any, preview: str | None) -> Callable[[Any], Any] | None:
    if preview is None:
        return None
    if preview not in PREVIEWS:
        raise ValueError(f"preview must be None, 'latent' or 'decode', got {preview!r}")
    if preview == "decode":
        if getattr(target, "vae", None) is None:
            raise ValueError("preview='decode' needs a pipeline with a .vae; use preview='latent'")
        return lambda latents: _decode_preview(target, latents)
    xl = "XL" in type(target).__name__
    return lambda latents: latent_preview(latents, xl=xl)


class _Events:
    """What the worker emits for each step: text chunks when the state has tokens, else a Step."""

    def __init__(self, tokenizer: Any, preview: Callable[[Any], Any] | None, preview_every: int) -> None:
        self._rows = None if tokenizer is None else _Rows(tokenizer)
        self._preview = preview
        self._every = preview_every
        self._step = 0

    def on_step(self, state: StepState) -> list[Event]:
        self._step = state.step
        if state.input_ids is not None:
            if self._rows is None:
                raise ValueError("stream() needs tokenizer= to decode the generated text")
            return list(self._rows.chunks(state))
        image = None
        if self._preview is not None and state.latents is not None and state.step % self._every == 0:
            image = self._preview(state.latents)
        return [Step(state.step, state.total, state.latents, image)]

    def flush(self) -> list[Event]:
        return [] if self._rows is None else list(self._rows.flush(self._step))


# -- the worker and its channel ----------------------------------------------------------------------
class Channel:
    """The bounded hand-off from one worker thread to one consumer, sync or async.

    ``signal`` stops the run. ``abandon()`` says the consumer is gone: the run is stopped with
    reason ``"cancelled"`` and the worker no longer waits for room in the buffer. ``stalled`` is
    set once the worker has had to wait for the consumer (back-pressure).
    """

    def __init__(self, size: int) -> None:
        self.signal = StopSignal()
        self.stalled = threading.Event()
        self.finished = False
        self.outcome: Outcome | None = None
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._items: deque[Event] = deque()
        self._size = size
        self._abandoned = False
        self._wakers: list[Callable[[], None]] = []

    # worker side
    def put(self, event: Event) -> None:
        """Hand ``event`` over, waiting for room; dropped if the consumer is gone."""
        with self._cond:
            if len(self._items) >= self._size:
                self.stalled.set()
                self._cond.wait_for(lambda: len(self._items) < self._size or self._abandoned)
            if self._abandoned:
                return
            self._items.append(event)
            self._cond.notify_all()
        self._wake()

    def finish(self, outcome: Outcome | None, error: BaseException | None) -> None:
        with self._cond:
            self.outcome, self._error = outcome, error
            if error is None and outcome is not None and not self._abandoned:
                self._items.append(Done(outcome))  # beyond the bound: the end is never held back
            self.finished = True
            self._cond.notify_all()
        self._wake()

    # consumer side
    def abandon(self) -> None:
        """The consumer is gone: stop the run, drop what it will not read, end the iteration."""
        with self._cond:
            self._abandoned = True
            self._items.clear()
            self._cond.notify_all()
        self.signal.stop("cancelled")

    def raise_error(self) -> None:
        """Raise the run's exception if the consumer has not received it yet."""
        with self._cond:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def get(self) -> Event:
        """The next event, blocking until there is one; StopIteration at the end."""
        with self._cond:
            self._cond.wait_for(self.ready)
            return self._take()

    def ready(self) -> bool:
        """Whether :meth:`get_nowait` has something to return (an event or the end)."""
        return bool(self._items) or self.finished or self._abandoned

    def get_nowait(self) -> Event | None:
        """The next event, or None if there is none yet; StopIteration at the end."""
        with self._cond:
            return self._take() if self.ready() else None

    def _take(self) -> Event:
        if self._items:
            self._cond.notify_all()  # room for the worker
            return self._items.popleft()
        if self._error is not None and not self._abandoned:
            error, self._error = self._error, None
            raise error
        raise StopIteration

    def result(self) -> Outcome:
        """The run's Outcome once finished, or its exception raised."""
        if self._error is not None:
            raise self._error
        assert self.outcome is not None
        return self.outcome

    def add_waker(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Call ``fn()`` (on the worker's thread) after each event and at the end. Returns a remover."""
        with self._cond:
            self._wakers.append(fn)
        return lambda: self._remove_waker(fn)

    def _remove_waker(self, fn: Callable[[], None]) -> None:
        with self._cond:
            if fn in self._wakers:
                self._wakers.remove(fn)

    def _wake(self) -> None:
        with self._cond:
            wakers = list(self._wakers)
        for fn in wakers:
            fn()


def start_worker(
    target: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    stop: object = None,
    buffer: int = 64,
    events: _Events | None = None,
    started: bool = True,
) -> tuple[Channel, threading.Thread]:
    """``stopcock.run(target, *args, **kwargs)`` in a worker thread feeding a new channel.

    The run stops when the user's ``stop`` does or when the channel's own signal does. With
    ``events``, each step's events go through the channel; else only the end does. Bad arguments
    that can be seen before the run (the target, ``stop=``) raise here, in the caller's thread.
    With ``started=False`` the thread is returned not started: the caller starts it, or calls
    ``channel.finish(None, None)`` if it never will.
    """
    if isinstance(buffer, bool) or not isinstance(buffer, int) or buffer < 1:
        raise ValueError(f"buffer must be an int >= 1 (events held for a slow consumer), got {buffer!r}")
    adapter_for(target)
    channel = Channel(buffer)
    condition: list[Condition] = [as_condition(channel.signal)]
    if stop is not None:
        condition.append(as_condition(stop))
    user_on_step: Callable[[StepState], object] | None = kwargs.pop("on_step", None)

    def on_step(state: StepState) -> None:
        if events is not None:
            for event in events.on_step(state):
                channel.put(event)
        if user_on_step is not None:
            user_on_step(state)

    def work() -> None:
        outcome, error = None, None
        try:
            outcome = run(target, *args, stop=condition, on_step=on_step, **kwargs)
            for event in events.flush() if events is not None else ():
                channel.put(event)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, who raises it
            error = exc
        finally:
            channel.finish(outcome, error)

    thread = threading.Thread(target=work, name=f"stopcock-worker-{id(channel):x}", daemon=True)
    if started:
        thread.start()
    return channel, thread


def make_events(
    target: Any,
    kwargs: dict[str, Any],
    *,
    tokenizer: Any,
    preview: str | None,
    preview_every: int,
) -> _Events:
    """The event maker for a stream of ``target``; bad streaming options raise here."""
    if isinstance(preview_every, bool) or not isinstance(preview_every, int) or preview_every < 1:
        raise ValueError(f"preview_every must be an int >= 1, got {preview_every!r}")
    if hasattr(target, "generate"):  # a model: generate() takes the tokenizer too (stop strings)
        if tokenizer is not None:
            kwargs["tokenizer"] = tokenizer
        tokenizer = kwargs.get("tokenizer")
        if tokenizer is None:
            raise ValueError(
                "stream() decodes the generated text with a tokenizer: pass"
                " tokenizer=AutoTokenizer.from_pretrained(...) with a model target"
            )
        _refuse_beams(kwargs, getattr(target, "generation_config", None))
    else:  # a pipeline: its own tokenizer unless one is given for decoding
        tokenizer = tokenizer if tokenizer is not None else getattr(target, "tokenizer", None)
        if hasattr(getattr(target, "model", None), "generate"):
            _refuse_beams(kwargs, getattr(target.model, "generation_config", None))
    return _Events(tokenizer, _previewer(target, preview), preview_every)


def _refuse_beams(kwargs: dict[str, Any], default_config: Any) -> None:
    config = kwargs.get("generation_config", default_config)
    beams = kwargs.get("num_beams", getattr(config, "num_beams", 1))
    if beams is not None and beams > 1:
        raise ValueError(
            f"stream() cannot stream beam search (num_beams={beams}): the beams are reordered at every"
            " step, so no text is final before the end. Use stopcock.run(), or num_beams=1"
        )


# -- the sync stream ---------------------------------------------------------------------------------
_collecting: set[int] = set()  # threads running a cyclic garbage collection now


def _track_collections(phase: str, info: dict[str, Any]) -> None:
    (_collecting.add if phase == "start" else _collecting.discard)(threading.get_ident())


gc.callbacks.append(_track_collections)


def _leave(channel: Channel, thread: threading.Thread) -> None:
    """End a stream's run: stop it, and wait for the worker unless that could deadlock.

    Waiting is what makes ``break`` leave nothing running. It is skipped on the worker's own
    thread and inside a cyclic garbage collection, which may run on any thread, holding any lock
    the worker might need; the run still stops at its next step.
    """
    channel.abandon()
    here = threading.get_ident()
    if here != thread.ident and here not in _collecting:
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
        self._finalizer = weakref.finalize(self, _leave, channel, thread)

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
        self._finalizer()
        if self._thread is not threading.current_thread():
            self._channel.raise_error()


def stream(
    target: Any,
    *args: Any,
    stop: object = None,
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
    ``partial=``, ``on_step=``, the target's own) go to :func:`stopcock.run`.
    """
    events = make_events(target, kwargs, tokenizer=tokenizer, preview=preview, preview_every=preview_every)
    return Stream(*start_worker(target, args, kwargs, stop=stop, buffer=buffer, events=events))
