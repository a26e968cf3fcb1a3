"""Stream events, and turning a run's steps into them: text decoded as it is generated, diffusion steps.

No threads here: :mod:`stopcock.worker` carries these events from a run to its consumer, and the
CLI and the server use the same :class:`RowDecoder` for their own text output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .outcome import Outcome
from .state import StepState

__all__ = ["Done", "Event", "EventMaker", "RowDecoder", "Step", "StreamEvents", "TextChunk", "TextDecoder"]


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


class RowDecoder:
    """The new text of every generated row, step by step, as :class:`TextChunk` events.

    Reads the new tokens from each text :class:`~stopcock.state.StepState` (past its
    ``prompt_length``); a new ``generation`` (the next prompt of a pipeline) flushes the rows of the
    previous one and starts new rows, numbered on across the run.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._decoders: list[TextDecoder] = []
        self._first_row = 0
        self._generation: int | None = None
        self._read = 0  # tokens of the current generation's rows already decoded, prompt included
        self._step = 0

    def chunks(self, state: StepState) -> list[TextChunk]:
        ids = state.input_ids
        events: list[TextChunk] = []
        if state.generation != self._generation:
            events = self.flush()
            self._first_row += len(self._decoders)
            self._decoders = [TextDecoder(self._tokenizer) for _ in range(ids.shape[0])]
            self._generation = state.generation
            self._read = state.prompt_length or 0
        new, self._read, self._step = ids[:, self._read :], ids.shape[1], state.step
        for row, decoder in enumerate(self._decoders):
            events += self._chunk(decoder.push(new[row].tolist()), row)
        return events

    def flush(self) -> list[TextChunk]:
        """The text still held back in every row."""
        events: list[TextChunk] = []
        for row, decoder in enumerate(self._decoders):
            events += self._chunk(decoder.flush(), row)
        return events

    def _chunk(self, text: str, row: int) -> list[TextChunk]:
        return [TextChunk(text, self._step, self._first_row + row)] if text else []


class EventMaker(Protocol):
    """Turns a run's steps into stream events (one per stream; made by the target's adapter)."""

    def on_step(self, state: StepState) -> list[Event]: ...

    def flush(self) -> list[Event]:
        """What is still held back when the run has returned."""
        ...


class StreamEvents:
    """Text chunks for steps that carry tokens, a :class:`Step` (with an optional preview) otherwise."""

    def __init__(
        self, tokenizer: Any = None, preview: Callable[[Any], Any] | None = None, preview_every: int = 1
    ) -> None:
        if isinstance(preview_every, bool) or not isinstance(preview_every, int) or preview_every < 1:
            raise ValueError(f"preview_every must be an int >= 1, got {preview_every!r}")
        self._rows = None if tokenizer is None else RowDecoder(tokenizer)
        self._preview = preview
        self._every = preview_every

    def on_step(self, state: StepState) -> list[Event]:
        if state.input_ids is not None:
            if self._rows is None:
                raise ValueError("stream() needs tokenizer= to decode the generated text")
            return list(self._rows.chunks(state))
        image = None
        if self._preview is not None and state.latents is not None and state.step % self._every == 0:
            image = self._preview(state.latents)
        return [Step(state.step, state.total, state.latents, image)]

    def flush(self) -> list[Event]:
        return [] if self._rows is None else list(self._rows.flush())
