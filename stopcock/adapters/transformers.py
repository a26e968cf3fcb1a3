"""The transformers adapter: ``model.generate`` and every transformers pipeline.

Generation is stopped through transformers' own machinery: one :class:`StoppingCriteria` of our
own type (so generate appends it to the built-ins and to the user's criteria, never replacing one
through its exact-type merge rule) that counts tokens, evaluates the run's conditions and applies
``stop_strings`` per row with transformers' :class:`StopStringCriteria`. Rows that hit a stop
string end (padded) while the others go on; in beam search an item ends when its best candidate
hits one. The text that triggered a stop is kept in the output, as transformers keeps it.

A pipeline that generates (its own ``_pipeline_calls_generate`` flag, and a model that can) gets
the criterion bound to its model's ``generate`` for the duration of the run, on the run's thread
only: every generate call the pipeline makes takes it, whatever the pipeline does with the
arguments given at call time (document- and table-question-answering drop them). A ``generate``
that runs its own loop without criteria but ends on a stop-probability head (SpeechT5) is ended
through that head. Several inputs (a list, a dataset, a generator) are run item by item
(:mod:`stopcock.items`), so a stop ends the run between tokens and keeps the finished items.

``mode="abort"`` (or a finish-mode stop escalated by ``escalate_after=``) arms a forward pre-hook
on every module call once a stop is possible, so a stop during a long prefill abandons the forward
at the next module call.

**Zero cost until stopped.** With transformers' own ``generate`` (and its greedy or sampling loop,
a decoder-only model, and nothing that must see every token: no ``on_step``, stop strings,
``max_steps``, or condition of your own), the criterion is not in the loop at all until a stop
becomes possible: it takes the list generate builds for the call (``_get_stopping_criteria``) and
appends itself to it when the run's control arms it (:meth:`RunControl.arming`: a stop, a skip, or a
time limit about to expire), from the thread that stops; the loop's next check of its list, one
token later, sees it. The tokens are then counted from the output (or, after an abort, read from
the loop's ``input_ids``). Otherwise the criterion is in the list from the start.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, nullcontext
from types import TracebackType
from typing import Any, Protocol

import torch
from torch.utils.data import Dataset
from transformers import (
    DocumentQuestionAnsweringPipeline,
    GenerationMixin,
    Pipeline,
)
from transformers.utils.chat_template_utils import is_valid_message

from ..binding import bound
from ..conditions import refuse_row_conditions
from ..control import Abort, RunControl
from ..events import Event, EventMaker, Step, StreamEvents
from ..items import run_items
from ..outcome import Outcome
from ..state import StepState
from .transformers_criteria import (
    _configure,
    _make_criteria,
    _plain_generate,
    _RunCriteria,
    _Settings,
    _TakingPart,
    _users,
    _why_rows_ended,
)
from .transformers_loops import (
    _ABORTED_FRAMES,
    _ABORTED_NO_FRAMES,
    _delaying,
    _OwnLoop,
    _padding_codebooks,
    _stop_head,
)

__all__ = ["ADAPTER", "TransformersAdapter", "generates"]

_ABORTED = "aborted inside the model forward; output holds the token ids generated so far"
_ABORTED_ITEMS = "aborted inside the model forward; output holds the results of the items done"
class _ReadsAbort(Protocol):
    """What reads a generate call's progress from an abort's traceback (the criterion, SpeechT5's loop)."""

    def aborted(self, tb: TracebackType | None, model: Any) -> None: ...


def _guarded(
    control: RunControl, call: Callable[[], Any], criteria: _ReadsAbort | None = None, model: Any = None
) -> tuple[Any, bool]:
    """``call()`` with a check before every module call, armed when a stop makes it needed (abort
    mode, or an escalating finish-mode stop). Returns (result, aborted): this run's :class:`Abort`
    (from the check, or where a finish cannot end well) ends it there; ``criteria`` then reads what
    ``model``'s generate call made so far from the abort's traceback."""
    try:
        with control.intercept():
            return call(), False
    except Abort as exc:
        if exc.control is not control:
            raise
        if criteria is not None:
            criteria.aborted(exc.__traceback__, model)
        return None, True


def _end_streamer(streamer: Any, criteria: _RunCriteria, aborted: bool) -> None:
    """``streamer.end()`` where generate could not call it: after an abort, or when no generate ran.

    A reader waiting on the streamer (e.g. a ``TextIteratorStreamer``) then gets the end instead of
    waiting forever.
    """
    if streamer is not None and (aborted or (criteria.base == 0 and criteria.last_ids is None)):
        streamer.end()


def _prompt(args: tuple[Any, ...], kwargs: dict[str, Any], model: Any = None) -> torch.Tensor | None:
    """The main input tensor of a generate call: the first positional one, or the model's input."""
    first = args[0] if args else None
    if isinstance(first, torch.Tensor):  # the usual generate(input_ids, ...)
        return first
    for name in (getattr(model, "main_input_name", None), "input_ids", "inputs"):
        if first is None and name:
            first = kwargs.get(name)
    return first if isinstance(first, torch.Tensor) else None


def _decoder_only(model: Any) -> bool:
    config = getattr(model, "config", None)
    try:
        # the instance's own attribute, read past PretrainedConfig's __getattribute__ overrides:
        # they run Python code on every read
        flag = object.__getattribute__(config, "__dict__")["is_encoder_decoder"]
    except (AttributeError, KeyError):
        flag = getattr(config, "is_encoder_decoder", False)
    return not flag


#: the reasons a row condition gives a row (:class:`~.transformers_rows.RowEnds`)
_ROW_REASONS = ("stop_string", "repetition", "timeout", "deadline")


def _outcome(
    control: RunControl, criteria: _RunCriteria | None, output: Any, aborted: bool, **fields: Any
) -> Outcome:
    reasons = criteria.row_reasons if criteria is not None else []
    completed = "completed"
    if reasons and all(r == "eos" for r in reasons):
        completed = "eos"
    elif "length" in reasons:
        completed = "length"
    # the first row condition that ended a row, in the order they are checked
    by_rows = next((r for r in _ROW_REASONS if r in reasons), None)
    return control.outcome(
        output,
        completed=completed,
        row_reasons=reasons or None,
        # the last call of the criterion is when the last row met its row condition
        rows_stopped_at=criteria.last_call_at if criteria is not None and by_rows is not None else None,
        rows_reason=by_rows or "stop_string",
        **fields,
    )


def _run_generate(model: Any, args: tuple[Any, ...], kwargs: dict[str, Any], control: RunControl) -> Outcome:
    settings = _Settings(kwargs, model)
    prompt = _prompt(args, kwargs)
    decoder_only = _decoder_only(model)
    head, delayed = _stop_head(model), _delaying(model)
    notes: list[str] = []
    note = notes.append
    fields: dict[str, Any] = {}
    if head is not None or delayed is not None:
        refuse_row_conditions(control.condition, f"a {type(model).__name__}, which makes no text")
    # a decoder-only model continues the prompt; an encoder-decoder starts its own decoder ids
    criteria = _make_criteria(control, kwargs.get("tokenizer"))
    _configure(criteria, settings, prompt.shape[-1] if decoder_only and prompt is not None else None)
    if criteria.max_new_tokens is not None:
        control.total = criteria.max_new_tokens
    elif criteria.max_length is not None and prompt is not None and decoder_only:
        control.total = criteria.max_length - prompt.shape[-1]
    kwargs = dict(kwargs)
    start = prompt if decoder_only or prompt is None else prompt[:, :0]
    if control.check():
        output, aborted = start, False
    elif head is not None:  # a loop of its own (SpeechT5): no criteria, its stop head ends it
        loop = _OwnLoop(model, head, criteria, settings, kwargs, note)
        with loop:
            output, aborted = _guarded(control, lambda: model.generate(*args, **kwargs), loop, model)
        if aborted:
            output = loop.frames
    else:
        codebooks = nullcontext() if delayed is None else _padding_codebooks(delayed, criteria, control, note)
        with _TakingPart(criteria, model, kwargs, plain=_plain_generate(model)), codebooks:
            with control.arming(criteria.joins) if criteria.joins.may_wait else nullcontext():
                output, aborted = _guarded(control, lambda: model.generate(*args, **kwargs), criteria, model)
        if aborted:
            output = criteria.so_far(start, int(settings.get("num_return_sequences") or 1))
        else:
            criteria.returned(output)
    _end_streamer(kwargs.get("streamer"), criteria, aborted)
    what = _ABORTED if head is None else _ABORTED_FRAMES if output is not None else _ABORTED_NO_FRAMES
    detail = "; ".join(([what] if aborted else []) + notes) or None
    if aborted:  # in finish mode too, where a finish could not end well (MusicGen before its first frame)
        fields["mode"] = "abort"
    sequences = getattr(output, "sequences", output)
    if head is not None:  # a spectrogram or a waveform: no token rows to read reasons from
        return _outcome(control, None, output, aborted, detail=detail, **fields)
    if delayed is not None and criteria.last_ids is not None:
        # the codebooks' rows (or the audio) of each item: the reasons are read from its first codebook
        criteria.row_reasons = _why_rows_ended(criteria, criteria.last_ids[:: delayed.num_codebooks])
    elif isinstance(sequences, torch.Tensor):
        criteria.row_reasons = _why_rows_ended(criteria, sequences)
        if criteria.rows_per_item > 1:  # beam search: the rows returned for an item end with the item
            per_item = int(settings.get("num_return_sequences") or 1)
            criteria.row_reasons = _item_reasons(criteria.row_reasons, per_item)
    return _outcome(control, criteria, output, aborted, detail=detail, **fields)


def _item_reasons(reasons: list[str], per_item: int) -> list[str]:
    """Beam search returns ``per_item`` rows per item; rows cut short by their item's stop string say so."""
    out = []
    for i in range(0, len(reasons), per_item):
        group = reasons[i : i + per_item]
        out += ["stop_string" if "stop_string" in group and r == "completed" else r for r in group]
    return out


# -- pipelines -----------------------------------------------------------------------------------


def generates(pipe: Pipeline) -> bool:
    """Whether ``pipe`` calls its model's ``generate``: the pipeline's own flag, and a model that can."""
    model = getattr(pipe, "model", None)
    return bool(getattr(pipe, "_pipeline_calls_generate", False)) and bool(
        getattr(model, "can_generate", lambda: False)()
    )


def _many(inputs: Any) -> tuple[Iterable[Any], int | None] | None:
    """The items of a pipeline's first argument, read as the pipeline reads it, with their count;
    None for a single input (a string, one chat, an audio array, a dict, a tuple...)."""
    if isinstance(inputs, list):
        if inputs and is_valid_message(inputs[0]):  # one chat (a list of messages), not several inputs
            return None
        return inputs, len(inputs)
    if isinstance(inputs, Dataset):  # e.g. a KeyDataset
        return (inputs[i] for i in range(len(inputs))), len(inputs)  # type: ignore[arg-type]
    if isinstance(inputs, Iterator):
        return inputs, None
    return None


class _PipelineRun:
    """One run of a pipeline: the criterion bound to its model's generate, the items, the Outcome."""

    def __init__(
        self, pipe: Pipeline, kwargs: dict[str, Any], control: RunControl, calls: int | None
    ) -> None:
        self.pipe, self.model, self.control = pipe, pipe.model, control
        self.calls = calls  # the generate calls planned (one per item or batch), when known
        self.criteria: _RunCriteria | None = None
        self.plain = False  # the model's generate is transformers' own (read before it is bound)
        self.notes: list[str] = []
        self.cut_texts: list[str] = []  # the text so far of each row of a generate call a stop cut short
        self.head: torch.nn.Module | None = None  # the model's stop-probability head (SpeechT5)
        self.delayed: Any = None  # what builds the model's delay pattern (MusicGen)
        if not generates(pipe):
            refuse_row_conditions(control.condition, f"a {type(pipe).__name__}")
            return
        self.head, self.delayed = _stop_head(self.model), _delaying(self.model)
        text_out = "text" in (getattr(self.model, "output_modalities", None) or ())
        if not text_out or self.head is not None:
            refuse_row_conditions(control.condition, f"a {type(pipe).__name__}, whose model makes no text")
        self.criteria = _make_criteria(control, pipe.tokenizer)
        _users(kwargs.get("stopping_criteria"))  # a wrong type fails before the run
        self.plain = _plain_generate(self.model)

    def arming(self) -> AbstractContextManager[None]:
        """For the run, the criterion may wait to be armed (see the module docstring)."""
        criteria = self.criteria
        if criteria is not None and self.plain and criteria.can_wait:
            return self.control.arming(criteria.joins)
        return nullcontext()

    def bound(self) -> AbstractContextManager[None]:
        """For the run, the model's generate takes the criterion (on this thread only); enter
        :meth:`arming` first."""
        return nullcontext() if self.criteria is None else bound(self.model, "generate", self._wrap)

    def _wrap(self, generate: Callable[..., Any]) -> Callable[..., Any]:
        def with_criteria(*args: Any, **kwargs: Any) -> Any:
            assert self.criteria is not None
            criteria = self.criteria
            criteria.start()
            prompt = _prompt(args, kwargs, self.model)
            settings = _Settings(kwargs, self.model)
            prompt_len = prompt.shape[-1] if _decoder_only(self.model) and prompt is not None else None
            _configure(criteria, settings, prompt_len)
            head = self.head
            if head is not None:
                with self._own_loop(head, settings, kwargs):
                    result = generate(*args, **kwargs)
            else:
                if criteria.limit is not None and self.calls is not None:
                    self.control.total = criteria.limit * self.calls
                with _TakingPart(criteria, self.model, kwargs, plain=self.plain), self._delay_pattern():
                    result = generate(*args, **kwargs)
            criteria.returned(result)
            if criteria.last_ids is None:
                self._note(f"{type(self.model).__name__}.generate ran no stopping criterion: stopped between"
                           " items only")
            elif head is None:
                rows = prompt.shape[0] if prompt is not None else criteria.last_ids.shape[0]
                self._row_reasons(rows * int(settings.get("num_return_sequences") or 1))
                if self.control.seen or self.control.skipping:  # cut short: each row's text so far
                    tokenizer: Any = self.pipe.tokenizer
                    new = criteria.last_ids[:, criteria.prompt_len :]
                    self.cut_texts = tokenizer.batch_decode(new, skip_special_tokens=True)
            return result

        return with_criteria

    def _row_reasons(self, returned: int) -> None:
        """Close the generate call's rows: one reason per row it returned (not for beam search)."""
        criteria = self.criteria
        assert criteria is not None and criteria.last_ids is not None
        ids = criteria.last_ids
        if criteria.rows_per_item > 1:
            return
        if ids.shape[0] != returned and returned and ids.shape[0] % returned == 0:
            ids = ids[:: ids.shape[0] // returned]  # several rows per output (MusicGen's codebooks)
        criteria.row_reasons += _why_rows_ended(criteria, ids)

    def _note(self, note: str) -> None:
        if note not in self.notes:
            self.notes.append(note)

    def _own_loop(self, head: torch.nn.Module, settings: _Settings, kwargs: dict[str, Any]) -> _OwnLoop:
        assert self.criteria is not None
        return _OwnLoop(self.model, head, self.criteria, settings, kwargs, self._note)

    def _delay_pattern(self) -> AbstractContextManager[None]:
        """See :func:`_padding_codebooks`."""
        decoder = self.delayed
        assert self.criteria is not None
        if decoder is None:
            return nullcontext()
        return _padding_codebooks(decoder, self.criteria, self.control, self._note)

    def answered(self, results: list[Any]) -> list[Any]:
        """``results`` with the answers a stop left open given their text so far.

        Donut's document-question-answering keeps an answer only once its closing tag is
        generated, so an answer cut short by a stop would come back as None.
        """
        if not isinstance(self.pipe, DocumentQuestionAnsweringPipeline):
            return results
        texts, self.cut_texts = self.cut_texts, []
        cut = results[len(results) - len(texts) :] if len(texts) <= len(results) else []
        for result, text in zip(cut, texts, strict=False):  # the last call's rows are the last items
            for answer in result if isinstance(result, list) else [result]:
                if isinstance(answer, dict) and answer.get("answer") is None and text.strip():
                    answer["answer"] = text.strip()
                    self._note("a stopped answer holds the text generated so far (it has no closing tag)")
        return results

    def call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[[list[Any]], list[Any]]:
        """``run(chunk)`` for :func:`run_items`: the pipeline called with the chunk as a list, the form
        every pipeline accepts (some take no generator); a pipeline that answers a list of one with
        the bare result (table-question-answering) has it put back in a list."""

        def run(chunk: list[Any]) -> list[Any]:
            out = self.pipe(chunk, *args[1:], **kwargs)
            if len(chunk) == 1 and not (isinstance(out, list) and len(out) == 1):
                out = [out]
            return self.answered(list(out))

        return run


def _run_pipeline(
    pipe: Pipeline, args: tuple[Any, ...], kwargs: dict[str, Any], control: RunControl
) -> Outcome:
    if kwargs.get("num_workers"):
        raise ValueError("stopcock feeds the pipeline its inputs in this process: drop num_workers=")
    many = _many(args[0]) if args else None
    batch = int(kwargs.get("batch_size") or getattr(pipe, "_batch_size", None) or 1)
    calls = 1 if many is None else (None if many[1] is None else -(-many[1] // batch))
    run = _PipelineRun(pipe, kwargs, control, calls)
    criteria = run.criteria
    streamer = kwargs.get("streamer", getattr(pipe, "_forward_params", {}).get("streamer"))
    if criteria is None:
        control.total = many[1] if many else 1

    results: list[Any] = []

    def go() -> None:
        with run.arming(), run.bound():
            if many is None:
                results.extend(run.answered([pipe(*args, **kwargs)]))
                if criteria is None:
                    control.step(1)
            else:
                run_items(control, many[0], run.call(args, kwargs), batch=batch, step_items=criteria is None,
                          into=results)

    aborted = False
    if not control.check():
        _, aborted = _guarded(control, go, criteria, pipe.model)
    output = results if many else (results[0] if results else [])
    extra: dict[str, Any] = {"items": len(results)} if many else {}
    if criteria is None:
        return control.outcome(output, extra=extra, detail=_ABORTED_ITEMS if aborted else None)
    if aborted and criteria.last_ids is not None:
        extra["partial_ids"] = criteria.so_far(None)
    _end_streamer(streamer, criteria, aborted)
    notes = [_ABORTED_ITEMS] if aborted and control.mode == "abort" else []
    detail = "; ".join(notes + run.notes) or None
    mode = "abort" if aborted else control.mode
    return _outcome(control, criteria, output, aborted, extra=extra, detail=detail, mode=mode)


def _refuse_beams(kwargs: dict[str, Any], default_config: Any) -> None:
    config = kwargs.get("generation_config", default_config)
    beams = kwargs.get("num_beams", getattr(config, "num_beams", 1))
    if beams is not None and beams > 1:
        raise ValueError(
            f"stream() cannot stream beam search (num_beams={beams}): the beams are reordered at every"
            " step, so no text is final before the end. Use stopcock.run(), or num_beams=1"
        )


class _StepEvents:
    """A :class:`Step` per step, for generation that makes no text (audio codes, spectrograms)."""

    def on_step(self, state: StepState) -> list[Event]:
        return [Step(state.step, state.total)]

    def flush(self) -> list[Event]:
        return []


class TransformersAdapter:
    """The adapter for ``model.generate`` and transformers pipelines (see the module docstring)."""

    name = "transformers"
    options: frozenset[str] = frozenset()

    def accepts(self, target: object) -> bool:
        # a model first: isinstance of Pipeline (an ABC) runs Python code
        if isinstance(target, (GenerationMixin, torch.nn.Module)):
            return callable(getattr(target, "generate", None))
        return isinstance(target, Pipeline)

    def run(
        self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], control: RunControl, **options: Any
    ) -> Outcome:
        """Run a generate call or a pipeline call with ``control`` attached."""
        if not isinstance(target, torch.nn.Module) and isinstance(target, Pipeline):
            return _run_pipeline(target, args, kwargs, control)
        return _run_generate(target, args, kwargs, control)

    def stream_events(
        self, target: Any, kwargs: dict[str, Any], *, tokenizer: Any, preview: str | None, preview_every: int
    ) -> EventMaker:
        """Text events, decoded with ``tokenizer`` (a model's generate gets it too, for stop strings;
        a pipeline's own by default). Beam search cannot stream; previews are for diffusion."""
        if preview is not None:
            raise ValueError(f"preview= shows diffusion steps; a {type(target).__name__} has none to show")
        if isinstance(target, Pipeline):
            if generates(target) and "text" not in (getattr(target.model, "output_modalities", None) or ()):
                return _StepEvents()
            tokenizer = tokenizer if tokenizer is not None else getattr(target, "tokenizer", None)
            if generates(target):
                # what the pipeline passes to generate: its defaults (ASR: 5 beams) under the call's
                settings = {**kwargs, **(kwargs.get("generate_kwargs") or {})}
                prepare = getattr(target, "_prepare_generate_kwargs", None)
                _refuse_beams(prepare(settings) if prepare else settings, target.model.generation_config)
            return StreamEvents(tokenizer, preview_every=preview_every)
        if tokenizer is not None:
            kwargs["tokenizer"] = tokenizer
        tokenizer = kwargs.get("tokenizer")
        if tokenizer is None:
            raise ValueError(
                "stream() decodes the generated text with a tokenizer: pass"
                " tokenizer=AutoTokenizer.from_pretrained(...) with a model target"
            )
        _refuse_beams(kwargs, getattr(target, "generation_config", None))
        return StreamEvents(tokenizer, preview_every=preview_every)


ADAPTER = TransformersAdapter()
