"""Checkpoint and resume text generation: ``generate`` and the text-generation pipeline.

Recording binds the model's ``generate`` for the run, on the run's thread
(:func:`stopcock.binding.bound`, as the adapter does), so one mechanism serves a model and a pipeline
(which calls ``generate`` itself). Each call is made
with ``return_dict_in_generate=True`` (and answered as its caller asked), which gives back the KV
cache; when the call ends the recorder keeps its prompt and mask, the token ids so far (stopcock's
own criterion saw every step), the rows already ended (end of text, stop string), the RNG state and
the cache as data: the tensors and counters of its layers, for any cache class of transformers'
``cache_utils`` made of those (dynamic, static, sliding window).

Resuming makes the same call; its ``generate`` is continued instead of started: ``input_ids`` = the
ids so far, the mask extended over them, ``cache`` = the cache rebuilt, the new-token budgets less
what was done, ended rows held at the pad token, the RNG state put back when sampling. Greedy
decoding and sampling then give the tokens of the run never stopped, bit for bit. Where the cache
could not be kept (a run aborted inside a forward, a cache holding other state) the continuation
recomputes it from the ids: the same tokens in practice, not guaranteed bit-identical (a prefill
adds up in another order than one token at a time), and the Outcome says so. Beam search, assisted
and contrastive decoding, and per-step outputs (scores) cannot be continued exactly: refused before
any token, with the reason.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    Pipeline,
    StoppingCriteria,
    StoppingCriteriaList,
    cache_utils,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..binding import bound
from ..checkpoint import (
    Checkpoint,
    CheckpointError,
    CheckpointMismatch,
    ObjectState,
    config_data,
    digest,
    freeze_call,
    model_fingerprint,
    restore_rng,
    rng_state,
    versions,
    vocab_digest,
)
from ..control import RunControl
from ..outcome import Outcome
from .resumable import ResumeScaffold
from .transformers import TransformersAdapter
from .transformers_criteria import _RunCriteria, _Settings, _why_rows_ended

__all__ = ["ADAPTER", "ResumableTransformersAdapter", "fingerprint"]

# generate() settings a continuation cannot reproduce exactly when set (to other than their neutral
# value), with the reason given to the user.
_NOT_RESUMABLE: dict[str, tuple[object, str]] = {
    "num_beams": (
        1,
        "beam search keeps every candidate's scores inside generate, which a call cannot be given back",
    ),
    "assistant_model": (None, "assisted decoding keeps the assistant's own cache and counters"),
    "prompt_lookup_num_tokens": (None, "prompt lookup decoding keeps candidate state inside generate"),
    "penalty_alpha": (0, "contrastive search keeps past hidden states inside generate"),
    "dola_layers": (None, "DoLa decoding keeps per-layer state inside generate"),
    "guidance_scale": (1, "classifier-free guidance keeps its own unconditional cache"),
    "exponential_decay_length_penalty": (None, "it counts from where generate started"),
    "begin_suppress_tokens": (None, "it applies where generate started"),
    "output_scores": (False, "the scores of the steps before the stop are not kept"),
    "output_logits": (False, "the logits of the steps before the stop are not kept"),
    "output_attentions": (False, "the attentions of the steps before the stop are not kept"),
    "output_hidden_states": (False, "the hidden states of the steps before the stop are not kept"),
}
_CACHE_CLASSES = {
    name: cls
    for name, cls in vars(cache_utils).items()
    if isinstance(cls, type)
    and (issubclass(cls, cache_utils.Cache) or issubclass(cls, cache_utils.CacheLayerMixin))
}


def _refuse(settings: _Settings, model: Any) -> None:
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        raise CheckpointError(
            f"checkpoint=True resumes decoder-only models; {type(model).__name__} is an encoder-decoder"
        )
    for name, (neutral, why) in _NOT_RESUMABLE.items():
        value = settings.get(name)
        if value not in (None, False, [], (), neutral):
            raise CheckpointError(
                f"{name}={value!r} cannot be resumed exactly ({why}): run it without checkpoint=True,"
                " or use greedy decoding or sampling"
            )


# -- the cache as data --------------------------------------------------------------------------------
def _as_data(value: Any) -> Any:
    """A cache (or a part of one) as data; tensors copied (a static cache is reused by later calls)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(_as_data(v) for v in value)
    if type(value) is dict:
        return {k: _as_data(v) for k, v in value.items()}
    if type(value).__name__ in _CACHE_CLASSES and _CACHE_CLASSES[type(value).__name__] is type(value):
        return ObjectState(type(value).__name__, {k: _as_data(v) for k, v in vars(value).items()})
    raise TypeError(f"a {type(value).__name__} in the cache")


def _rebuilt(value: Any, device: torch.device) -> Any:
    """The cache from :func:`_as_data`, its tensors copied to ``device``; only cache_utils' own classes."""
    if isinstance(value, torch.Tensor):
        return value.to(device=device, copy=True)
    if isinstance(value, (list, tuple)):
        return type(value)(_rebuilt(v, device) for v in value)
    if type(value) is dict:
        return {k: _rebuilt(v, device) for k, v in value.items()}
    if isinstance(value, ObjectState):
        cls = _CACHE_CLASSES.get(value.cls)
        if cls is None:
            raise CheckpointError(
                f"the checkpoint's cache is a {value.cls!r}, not a transformers cache class"
            )
        obj: Any = cls.__new__(cls)
        vars(obj).update({k: _rebuilt(v, device) for k, v in value.attributes.items()})
        if isinstance(vars(obj).get("device"), torch.device):
            obj.device = device
        return obj
    return value


# -- the generate handler -------------------------------------------------------------------------------
class _HeldRows(LogitsProcessor):
    """Rows that had ended before the stop keep producing the pad token, as generate pads ended rows."""

    def __init__(self, rows: list[int], pad: int) -> None:
        self.rows, self.pad = rows, pad

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        held = scores[self.rows].fill_(-torch.inf)
        held[:, self.pad] = 0
        scores[self.rows] = held
        return scores


class _EndedRows(StoppingCriteria):
    """Reports the rows that had ended before the stop as done (generate starts a call with none done)."""

    def __init__(self, rows: list[int]) -> None:
        self.rows = rows

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        done[self.rows] = True
        return done  # type: ignore[return-value]


def _left(saved: dict[str, Any], settings: _Settings) -> int | None:
    """New tokens the saved call may still generate, when known."""
    if saved["left"] is not None:
        return int(saved["left"])
    length = settings.get("max_length")
    return None if length is None else int(length) - saved["sequences"].shape[1]


class _Generate:
    """The run's handler of ``model.generate``: records each call; with ``resumed``, the first call
    continues that recorded call instead of starting over."""

    def __init__(self, model: Any, resumed: dict[str, Any] | None = None) -> None:
        self.model = model
        self.resumed = resumed
        self.calls = 0
        self.last: dict[str, Any] | None = None  # the record of the last call
        self.returned = False  # whether the last call returned (not aborted)

    def around(self, call: Callable[..., Any]) -> Callable[..., Any]:
        """The bound ``generate``: this handler around ``call``, the ``generate`` it was bound over."""
        return functools.partial(self, call)

    def __call__(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        settings = _Settings(kwargs, self.model)
        _refuse(settings, self.model)
        prompt = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
        if not isinstance(prompt, torch.Tensor):
            raise CheckpointError("checkpoint=True needs the prompt as token ids (input_ids=...)")
        criteria = next(
            (c for c in kwargs.get("stopping_criteria") or () if isinstance(c, _RunCriteria)), None
        )
        if criteria is None:
            raise CheckpointError("checkpoint=True records a generate call made by stopcock.run")
        mask = kwargs.get("attention_mask")
        wants_dict = bool(settings.get("return_dict_in_generate"))
        continued = self.resumed if self.calls == 0 else None
        self.calls += 1
        self.returned = False
        record: dict[str, Any] = {
            "inputs": prompt.detach().clone(),
            "attention_mask": None if mask is None else mask.detach().clone(),
            "do_sample": bool(settings.get("do_sample")),
        }
        given_prompt_len = criteria.given_prompt_len  # a continued call sets it for its own steps only
        if continued is not None:
            answer = self._continue(continued, prompt, kwargs, settings, criteria)
            if isinstance(answer, GenerateDecoderOnlyOutput):
                criteria.given_prompt_len = given_prompt_len
                self.last, self.returned = {**continued, **record, "base": criteria.base}, True
                return answer if wants_dict else answer.sequences
            args, kwargs = (), answer
        record["base"] = criteria.base
        result = None
        try:
            result = call(*args, **{**kwargs, "return_dict_in_generate": True})
        finally:
            criteria.given_prompt_len = given_prompt_len
            self.last = {**record, **self._ended(result, prompt, criteria, settings)}
            self.returned = result is not None
        return result if wants_dict else result.sequences

    def _ended(self, result: Any, prompt: torch.Tensor, criteria: _RunCriteria, settings: _Settings) -> dict:
        """What a resume needs from a call that ended (``result``) or was abandoned (None)."""
        if result is not None:
            sequences, cache = result.sequences, result.cache
        else:
            sequences, cache = criteria.so_far(prompt), None
        ended = []
        if criteria.last_ids is not None:  # the criterion saw a step, so it knows where the prompt ends
            reasons = _why_rows_ended(criteria, sequences)
            ended = [i for i, r in enumerate(reasons) if r in ("eos", "stop_string", "repetition")]
        kept, why = None, "the run was abandoned inside a forward (abort mode), so its cache was not complete"
        if cache is not None:
            try:
                kept, why = _as_data(cache), ""
            except TypeError as exc:
                why = f"its cache holds {exc}, which a checkpoint cannot keep"
        limit = settings.get("max_new_tokens")
        return {
            "sequences": sequences.detach().clone(),
            "cache": kept,
            "why": why,
            "ended": ended,
            "rng": rng_state(),
            "left": None if limit is None else int(limit) - (sequences.shape[1] - prompt.shape[1]),
        }

    def _continue(
        self,
        saved: dict[str, Any],
        prompt: torch.Tensor,
        kwargs: dict[str, Any],
        settings: _Settings,
        criteria: _RunCriteria,
    ) -> Any:
        """The kwargs that continue the saved call, or (nothing left to generate) its output."""
        if prompt.shape != saved["inputs"].shape or not torch.equal(prompt.cpu(), saved["inputs"].cpu()):
            raise CheckpointMismatch(
                "the resumed call's prompt does not tokenize to the checkpoint's: resume with the same"
                " tokenizer and chat template"
            )
        device = prompt.device
        sequences = saved["sequences"].to(device)
        done = sequences.shape[1] - prompt.shape[1]
        # stopcock's criterion counts the run's steps from the prompt, and the tokens of earlier calls
        criteria.given_prompt_len = criteria.prompt_len = prompt.shape[1]
        criteria.base = saved["base"]
        cache = None if saved["cache"] is None else _rebuilt(saved["cache"], device)
        rows = sequences.shape[0]
        left = _left(saved, settings)
        if len(saved["ended"]) == rows or (left is not None and left <= 0):
            criteria.last_ids = sequences  # nothing left to generate: the call's output is the saved one
            return GenerateDecoderOnlyOutput(sequences=sequences, cache=cache)
        kwargs = {k: v for k, v in kwargs.items() if k not in ("inputs", "input_ids")}
        kwargs["input_ids"] = sequences
        mask = saved["attention_mask"]
        mask = torch.ones_like(prompt) if mask is None else mask.to(device)
        per_prompt = int(settings.get("num_return_sequences") or 1)
        if per_prompt > 1:  # generate expanded the prompt into its rows already: not again
            mask = mask.repeat_interleave(per_prompt, dim=0)
            kwargs["num_return_sequences"] = 1
        kwargs["attention_mask"] = torch.cat([mask, mask.new_ones((rows, done))], dim=1)
        if saved["left"] is not None:
            kwargs["max_new_tokens"] = left
        if settings.get("min_new_tokens"):
            kwargs["min_new_tokens"] = max(0, int(settings.get("min_new_tokens")) - done)
        if cache is not None:
            kwargs["cache"], kwargs["cache_implementation"] = cache, None
            kwargs.pop("past_key_values", None)
        if saved["ended"]:  # rows that had ended stay ended: held at the pad token, counted as done
            pad = settings.get("pad_token_id")
            eos = settings.ids("eos_token_id")
            pad = int(pad) if pad is not None else eos[0]
            kwargs["logits_processor"] = LogitsProcessorList(
                [*(kwargs.get("logits_processor") or ()), _HeldRows(saved["ended"], pad)]
            )
            kwargs["stopping_criteria"] = StoppingCriteriaList(
                [*(kwargs.get("stopping_criteria") or ()), _EndedRows(saved["ended"])]
            )
        if saved["do_sample"]:
            restore_rng(saved["rng"])
        return kwargs


# -- fingerprint ------------------------------------------------------------------------------------------
def _model_of(target: Any) -> Any:
    return target.model if isinstance(target, Pipeline) else target


def fingerprint(target: Any) -> dict[str, Any]:
    model = _model_of(target)
    found: dict[str, Any] = {
        "kind": "transformers",
        "target": type(target).__name__,
        "versions": versions(target, model, getattr(target, "tokenizer", None)),
        "model": model_fingerprint(model),
    }
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        found["generation_config"] = digest(config_data(generation))
    tokenizer = getattr(target, "tokenizer", None)
    if tokenizer is not None:
        found["tokenizer"] = {"class": type(tokenizer).__name__, "vocab": vocab_digest(tokenizer)}
    return found


# -- record and resume ------------------------------------------------------------------------------------
def _many(target: Any, args: tuple[Any, ...]) -> bool:
    from .transformers import _many as many_inputs

    return isinstance(target, Pipeline) and bool(args) and many_inputs(args[0]) is not None


def _checkpoint(
    target: Any, call: dict[str, Any], handler: _Generate, outcome: Outcome, prior: dict[str, Any] | None
) -> Checkpoint:
    """The checkpoint after a run (``prior``: the state of the checkpoint it resumed, for a list's items).

    ``generate`` is the last generate call, which a resume continues (or, with nothing left to
    generate, answers as it ended); for a list of prompts, a call that ended is done, and its items
    are in ``done`` with their results.
    """
    last = handler.last
    many = _many(target, tuple(call["args"]))
    finished = (
        last is not None
        and handler.returned
        and (
            len(last["ended"]) == last["sequences"].shape[0]
            or (last["left"] is not None and last["left"] <= 0)
        )
    )
    continuing = None if many and finished else last
    state: dict[str, Any] = {"call": call, "generate": continuing}
    if many:
        results = list(outcome.output or [])
        reasons = list(outcome.row_reasons or [])
        if continuing is not None:  # the items of the call to continue are not done
            assert last is not None
            if handler.returned:
                results = results[: len(results) - int(last["inputs"].shape[0])]
            reasons = reasons[: len(reasons) - int(last["sequences"].shape[0])]
        state["done"] = [*(prior or {}).get("done", []), *results]
        state["reasons"] = [*(prior or {}).get("reasons", []), *reasons]
    return Checkpoint(
        kind="transformers",
        steps=outcome.steps,
        total=outcome.total_steps,
        fingerprint=fingerprint(target),
        state=state,
    )


class ResumableTransformersAdapter(ResumeScaffold, TransformersAdapter):
    """The transformers adapter with the :class:`~stopcock.adapters.base.Resumable` capability."""

    def record(
        self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], control: RunControl, **options: Any
    ) -> Outcome:
        """``run(...)`` with ``checkpoint=True``: the Outcome carries a :class:`Checkpoint`."""
        call = freeze_call(args, kwargs)
        handler = _Generate(_model_of(target))
        with bound(_model_of(target), "generate", handler.around):
            outcome = self.run(target, args, kwargs, control)
        outcome.checkpoint = _checkpoint(target, call, handler, outcome, None)
        return outcome

    def fingerprint(self, target: Any) -> dict[str, Any]:
        return fingerprint(target)

    def continued(
        self,
        target: Any,
        checkpoint: Checkpoint,
        control: RunControl,
        call: dict[str, Any],
        *,
        record: bool,
        **options: Any,
    ) -> tuple[Outcome, dict[str, Any]]:
        """Continue ``checkpoint`` on ``target`` from its cache (see the module docstring)."""
        state = checkpoint.state
        args, kwargs = tuple(call["args"]), dict(call["kwargs"])
        many = _many(target, args)
        done = list(state.get("done", []))
        if many:
            args = (list(args[0])[len(done) :], *args[1:])
        saved = state["generate"]
        control.steps = checkpoint.steps
        handler = _Generate(_model_of(target), saved)
        with bound(_model_of(target), "generate", handler.around):
            outcome = self.run(target, args, kwargs, control) if not many or args[0] else None
        if outcome is None:  # a list whose items were all done
            outcome = control.outcome([], completed="completed")
        exact = saved is None or saved["cache"] is not None
        if not exact:
            note = (
                f"resumed by recomputing the cache from the ids ({saved['why']}): the same tokens in"
                " practice, but not guaranteed bit-identical to the run never stopped"
            )
            outcome.detail = f"{outcome.detail}; {note}" if outcome.detail else note
        if many:
            outcome.output = [*done, *(outcome.output or [])]
            outcome.extra["items"] = len(outcome.output)
            outcome.row_reasons = [*state.get("reasons", []), *(outcome.row_reasons or [])] or None
            outcome.total_steps = checkpoint.total
        if record:
            outcome.checkpoint = _checkpoint(target, state["call"], handler, outcome, state if many else None)
        how = {"saved_steps": checkpoint.steps, "exact": exact, "how": "cache" if exact else "recompute"}
        return outcome, how


ADAPTER = ResumableTransformersAdapter()
