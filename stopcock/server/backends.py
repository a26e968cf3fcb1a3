"""The models behind the engine: one :class:`Backend` per kind of job, one lane per worker.

A backend loads a model once, checks a job against it before the job is queued (``validate``),
and builds a lane for each worker (``lane()``): its own pipeline object sharing the weights, so
concurrent runs never share a pipeline's per-call state (a diffusers scheduler, ``_interrupt``).
A lane runs one job with :func:`stopcock.run`: the job's stop signal plus its conditions as
``stop=``, and ``on_step`` reporting progress, text and previews to the engine. Every run is
checkpointed, so that the engine can pause or preempt it; a job that has a checkpoint is resumed
from it (:func:`stopcock.resume`), with the result of the run never held. A job of several prompts
is checkpointed at the prompt it was held at, with the results of the prompts before.
"""

from __future__ import annotations

import copy
import inspect
import math
import secrets
from collections.abc import Callable, Mapping
from typing import Any

import torch
from transformers import LogitsProcessor, LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

from ..conditions import from_options
from ..errors import UserError
from ..events import RowDecoder
from ..files import png_base64
from ..items import run_each
from ..loading import load_image_pipeline, load_text_model, resolve_model, without_noise
from ..outcome import Outcome
from ..previews import decode_preview, estimate_preview
from ..resume import resume
from ..runner import run
from ..signal import StopSignal
from ..state import StepState
from ..tiny.demo import DESCRIPTIONS
from ..versions import versions
from .batching import run_batch
from .contract import HELD_STATES, Backend, InvalidJob, JobSpec, RunContext
from .schemas import MIN_SAMPLING_TEMPERATURE, ImageParameters

__all__ = ["ImageBackend", "TextBackend", "lane_components", "load_backends"]


def lane_components(components: Mapping[str, Any]) -> dict[str, Any]:
    """A lane's components: the models (torch modules, read-only in inference) shared, a copy of
    everything else. A scheduler keeps per-call state, and each tokenizer call sets the padding
    and truncation of the tokenizer it uses: two lanes sharing one can encode each other's prompt
    with the other's settings, and a seed then no longer gives the same image."""
    return {
        name: part if part is None or isinstance(part, torch.nn.Module) else copy.deepcopy(part)
        for name, part in components.items()
    }


class TextBackend:
    """A ``text-generation`` pipeline."""

    kind = "text"

    def __init__(self, pipe: Any, name: str, description: str = "") -> None:
        self.pipe = pipe
        self.name = name
        self.description = description
        self.tokenizer = pipe.tokenizer
        config = pipe.model.config
        versions(pipe, pipe.model, pipe.tokenizer)  # read once now, not by the first stop's checkpoint
        self.context = getattr(config, "max_position_embeddings", None) or getattr(
            config, "n_positions", None
        )

    @classmethod
    def load(cls, model: str, name: str | None = None, description: str = "") -> TextBackend:
        """Load a folder or hub id (a clear :class:`~stopcock.errors.UserError` if that fails)."""
        from transformers import pipeline

        lm, tokenizer = load_text_model(model)
        return cls(pipeline("text-generation", model=lm, tokenizer=tokenizer), name or model, description)

    def prompt(self, spec: JobSpec) -> str:
        """The prompt text; chat messages go through the tokenizer's chat template, if it has one."""
        if spec.messages is None:
            assert spec.prompt is not None
            return spec.prompt
        messages = [dict(m) for m in spec.messages]
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return str(text)
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"

    def prompts(self, spec: JobSpec) -> tuple[str, ...]:
        """The job's prompt texts: its several ``prompts``, or its one :meth:`prompt`."""
        return spec.prompts if spec.prompts is not None else (self.prompt(spec),)

    def validate(self, spec: JobSpec) -> None:
        for prompt in self.prompts(spec):
            tokens = len(self.tokenizer(prompt)["input_ids"])
            if tokens == 0:
                raise InvalidJob("the prompt is empty once tokenized; give some text")
            wanted = tokens + spec.params["max_tokens"]
            if self.context is not None and wanted > self.context:
                raise InvalidJob(
                    f"the prompt ({tokens} tokens) plus max_tokens ({spec.params['max_tokens']}) exceeds the"
                    f" model's context of {self.context} tokens; shorten the prompt or lower max_tokens"
                )

    def validator(self) -> TextBackend:
        """A copy without the model that checks jobs (:meth:`validate`) and cannot run them: light and
        picklable (the tokenizer), for an engine that queues jobs away from the model."""
        light = copy.copy(self)
        light.pipe = None
        return light

    def lane(self) -> TextLane:
        from transformers import pipeline

        model = self.pipe.model  # on the device it was moved to (the Ray engine's ModelSpec.device)
        parts = lane_components({"model": model, "tokenizer": self.tokenizer})
        return TextLane(self, pipeline("text-generation", **parts, device=model.device))


class _Draw(LogitsProcessor):
    """Draws the next token from the (warped) scores with its own generator, seeded with ``seed``
    (on the scores' device), or put back at a saved ``state`` (:meth:`saved`); only the drawn token
    is left finite."""

    def __init__(self, seed: int, state: Mapping[str, Any] | None = None) -> None:
        self.seed = seed
        self.state = state
        self.generator: torch.Generator | None = None

    def saved(self) -> dict[str, Any] | None:
        """The generator's device and state, for a checkpoint's notes (None before the first draw)."""
        g = self.generator
        return None if g is None else {"device": str(g.device), "state": g.get_state()}

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.generator is None and self.state is not None:
            self.generator = torch.Generator(self.state["device"]).set_state(self.state["state"])
        elif self.generator is None:
            self.generator = torch.Generator(scores.device).manual_seed(self.seed)
        drawn = torch.multinomial(scores.float().softmax(-1), 1, generator=self.generator)
        return scores.new_full(scores.shape, -math.inf).scatter_(1, drawn, 0.0)  # type: ignore[return-value]


def _sampler(processors: Any) -> _Draw | None:
    """The job's own sampler among a call's logits processors, if it samples."""
    found = [p for p in processors if isinstance(p, _Draw)] if isinstance(processors, list) else []
    return found[0] if found else None


class TextLane:
    def __init__(self, backend: TextBackend, pipe: Any) -> None:
        self.backend = backend
        self.pipe = pipe

    @staticmethod
    def decoding(params: Mapping[str, Any], draw: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """``generate`` arguments: greedy at temperature 0 (and below ``MIN_SAMPLING_TEMPERATURE``,
        whose division overflows), else sampling with the job's own generator (put back at the
        ``draw`` state a checkpoint's notes keep, when resuming from a file).

        ``generate``'s own sampling draws from torch's global generator, which every worker shares,
        so a seed would be exact only with one worker. Instead the temperature and top-p warpers
        are followed by :class:`_Draw`, which samples with a generator seeded from ``seed`` (at
        random without one) and leaves the drawn token the only choice for greedy decoding.
        """
        if params["temperature"] < MIN_SAMPLING_TEMPERATURE:
            return {"do_sample": False}
        seed = params.get("seed")
        drawer = _Draw(secrets.randbits(63) if seed is None else seed, draw)
        warpers = [TemperatureLogitsWarper(params["temperature"]), TopPLogitsWarper(params["top_p"])]
        return {"do_sample": False, "logits_processor": LogitsProcessorList([*warpers, drawer])}

    def execute(self, spec: JobSpec, ctx: RunContext) -> Outcome:
        """Run each prompt, or resume one: the text published before is in the checkpoint's notes, and
        the resumed run's text (decoded again from the first token) is published from where it ended."""
        params = spec.params

        def one(prompt: str, checkpoint: Any) -> tuple[Outcome, dict[str, Any]]:
            prompt_len = len(self.pipe.tokenizer(prompt)["input_ids"])
            rows = RowDecoder(self.pipe.tokenizer)
            before = "" if checkpoint is None else str(checkpoint.notes.get("text", ""))
            pieces, skip = [before], len(before)

            def publish(chunks: list[Any], step: int) -> None:
                nonlocal skip
                for chunk in chunks:
                    text = chunk.text[skip:]
                    skip = max(0, skip - len(chunk.text))
                    if text:
                        pieces.append(text)
                        ctx.text(text, step)

            stop = ctx.stop(from_options(spec.stop))
            on_step = ctx.on_step(lambda state: publish(rows.chunks(state), state.step))
            if checkpoint is not None:
                # The decoding settings are the checkpoint's, its sampler too (in memory); from a
                # file, the sampler is made again at the state the notes keep.
                given = {k: v for k, v in self.decoding(params, checkpoint.notes.get("draw")).items()
                         if k in checkpoint.live}
                sampler = _sampler(given.get("logits_processor",
                                             checkpoint.state["call"]["kwargs"].get("logits_processor")))
                outcome = resume(self.pipe, checkpoint, stop=stop, on_step=on_step, record=True, **given)
            else:
                decoding = self.decoding(params)
                sampler = _sampler(decoding.get("logits_processor"))
                outcome = run(self.pipe, prompt, stop=stop, on_step=on_step, checkpoint=True,
                              escalate_after=ctx.escalate_after, max_new_tokens=params["max_tokens"],
                              return_full_text=False, **decoding)
            if outcome.reason not in HELD_STATES:  # a held run's last character may not be complete yet
                publish(rows.flush(), outcome.steps)
            text = "".join(pieces)
            if outcome.checkpoint is not None:
                outcome.checkpoint.notes["text"] = text
                if sampler is not None and sampler.saved() is not None:
                    outcome.checkpoint.notes["draw"] = sampler.saved()  # for a resume from a file
            return outcome, {"text": text, "prompt_tokens": prompt_len, "completion_tokens": outcome.steps}

        return each_item(spec, ctx, self.backend.prompts(spec), one)

    def execute_batch(self, jobs: list[Any], on_end: Callable[[Any, Any], None], step_delay: float) -> None:
        """Run greedy text jobs as the rows of one ``generate`` (see :mod:`stopcock.server.batching`)."""
        prompts = [self.backend.prompt(job.spec) for job in jobs]
        run_batch(self.pipe.model, self.pipe.tokenizer, jobs, prompts, on_end, step_delay)


# job parameter -> the diffusers pipeline argument
_PIPELINE_ARGS = {
    "steps": "num_inference_steps",
    "width": "width",
    "height": "height",
    "guidance_scale": "guidance_scale",
    "negative_prompt": "negative_prompt",
}


class ImageBackend:
    """A diffusers pipeline (text-to-image)."""

    kind = "image"

    def __init__(self, pipe: Any, name: str, description: str = "") -> None:
        self.pipe = pipe
        self.name = name
        self.description = description
        self.takes = set(inspect.signature(pipe.__call__).parameters)
        self.pipeline_class = type(pipe).__name__
        versions(pipe, *dict(pipe.components).values())  # read once now, not by the first stop's checkpoint
        if "prompt" not in self.takes:
            raise ValueError(f"{self.pipeline_class} takes no prompt: serve a text-to-image pipeline")

    @classmethod
    def load(cls, model: str, name: str | None = None, description: str = "") -> ImageBackend:
        """Load a folder or hub id (a clear :class:`~stopcock.errors.UserError` if that fails)."""
        try:
            return cls(load_image_pipeline(model), name or model, description)
        except ValueError as exc:
            raise UserError(f"{model}: {exc}") from None

    def call_kwargs(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """The pipeline's arguments for ``params``; a parameter set to something else than its
        default that this pipeline does not take is an :class:`InvalidJob`."""
        kwargs = {}
        for param, name in _PIPELINE_ARGS.items():
            value = params[param]
            if name in self.takes:
                if value is not None:
                    kwargs[name] = value
            elif value != ImageParameters.model_fields[param].default:
                raise InvalidJob(f"this image model ({self.pipeline_class}) takes no {param}: leave it out")
        return kwargs

    def validate(self, spec: JobSpec) -> None:
        self.call_kwargs(spec.params)

    def validator(self) -> ImageBackend:
        """A copy without the pipeline that checks jobs (:meth:`validate`) and cannot run them: light
        and picklable, for an engine that queues jobs away from the model."""
        light = copy.copy(self)
        light.pipe = None
        return light

    def lane(self) -> ImageLane:
        with without_noise((type(self.pipe).__module__,)):  # its __init__'s notices were the load's
            pipe = type(self.pipe)(**lane_components(self.pipe.components))
        pipe.set_progress_bar_config(disable=True)
        return ImageLane(self, pipe)


class ImageLane:
    def __init__(self, backend: ImageBackend, pipe: Any) -> None:
        self.backend = backend
        self.pipe = pipe

    def execute(self, spec: JobSpec, ctx: RunContext) -> Outcome:
        params = spec.params
        seed = params["seed"] if params.get("seed") is not None else 0
        generator = torch.Generator()
        preview = params["previews"] and getattr(self.pipe, "vae", None) is not None

        def report(state: StepState) -> None:  # the preview: the step's estimate of the clean image
            if not preview:
                return
            image = estimate_preview(self.pipe, state.latents, state.extra.get("denoised"))
            if image is not None:
                ctx.preview(image, state.step)

        def one(prompt: str, checkpoint: Any) -> tuple[Outcome, dict[str, Any]]:
            options = {"stop": ctx.stop(from_options(spec.stop)), "on_step": ctx.on_step(report),
                       "partial": params["partial"]}
            if checkpoint is not None:  # replayed: the call's arguments and seed are the checkpoint's
                outcome = resume(self.pipe, checkpoint, record=True, **options)
            else:
                generator.manual_seed(seed)  # each prompt from the same seed
                outcome = run(self.pipe, prompt=prompt, generator=generator, checkpoint=True,
                              escalate_after=ctx.escalate_after, **options,
                              **self.backend.call_kwargs(params))
            images = getattr(outcome.output, "images", None)
            image = images[0] if images else self._decoded(outcome.latents)  # escalated: the last step's
            return outcome, {"image": None if image is None else png_base64(image), "detail": outcome.detail}

        prompts = spec.prompts if spec.prompts is not None else (spec.prompt or "",)
        return each_item(spec, ctx, prompts, one)

    def _decoded(self, latents: Any) -> Any:
        """An aborted run's image (an escalated stop): its last finished step's latents, decoded by
        the VAE as the pipeline decodes them; None where there are none or they are not image
        latents (packed latents, e.g. Flux's)."""
        if getattr(latents, "ndim", None) != 4 or getattr(self.pipe, "vae", None) is None:
            return None
        return decode_preview(self.pipe, latents)


def each_item(
    spec: JobSpec, ctx: RunContext, prompts: tuple[str, ...],
    one: Callable[[str, Any], tuple[Outcome, dict[str, Any]]],
) -> Outcome:
    """Run ``one(prompt, checkpoint)`` and set the job's result: for a job of one prompt, that run's
    result; for several (``spec.prompts``), one run per prompt while the job's signals allow
    (:func:`stopcock.items.run_each`: skip, stop after the current item; a pause or preemption ends
    the sequence at the current prompt), each item announced with ``ctx.item`` and its result in
    ``items``. A held job's checkpoint is its current prompt's, with the index of that prompt and the
    results before it in its notes; resuming starts there."""
    checkpoint = ctx.checkpoint
    if spec.prompts is None:
        outcome, result = one(prompts[0], checkpoint)
        ctx.set_result(**result)
        return outcome
    notes = {} if checkpoint is None else checkpoint.notes
    first = int(notes.get("item", 0))
    # the prompts done by earlier runs of the job: their results, how they ended, their steps
    items: list[dict[str, Any]] = list(notes.get("items", []))
    earlier_reasons, earlier_steps = list(notes.get("item_reasons", [])), int(notes.get("steps", 0))
    reasons, steps = list(earlier_reasons), earlier_steps
    order = iter(range(first, len(prompts)))
    held: list[Outcome] = []

    def run_one(prompt: str) -> Outcome:
        nonlocal steps
        index = next(order)
        ctx.item(index, prompt)
        outcome, result = one(prompt, checkpoint if index == first else None)
        if outcome.reason in HELD_STATES and outcome.checkpoint is not None:
            outcome.checkpoint.notes.update(item=index, items=list(items), item_reasons=list(reasons),
                                            steps=steps)
            held.append(outcome)
        else:
            items.append({"prompt": prompt, "reason": outcome.reason, **result})
            reasons.append(outcome.reason if outcome.stopped else "completed")
            steps += outcome.steps
            ctx.item(index, prompt, outcome)
        return outcome

    signals = [s for s in ctx.stop(()) if isinstance(s, StopSignal)]  # the job's stop, and its pause
    outcomes, overall = run_each(signals, prompts[first:], run_one)
    ctx.set_result(items=items)
    overall.item_reasons = [*earlier_reasons, *(overall.item_reasons or ())]
    overall.steps += earlier_steps
    if held:
        overall.checkpoint = held[0].checkpoint
    if outcomes:
        overall.resumed = outcomes[0].resumed
    return overall


def load_backends(text_model: str | None, image_model: str | None) -> dict[str, Backend]:
    """The backends to serve: the models given, or both built-in demo models when none is.

    A model is a local folder or a hub id; one that cannot be loaded raises
    :class:`stopcock.errors.UserError` with a one-line message naming the fix.
    """
    demo = text_model is None and image_model is None
    backends: dict[str, Backend] = {}
    if demo or text_model is not None:
        backends["text"] = TextBackend.load(
            resolve_model(text_model, "text"),
            "stopcock-demo-text" if demo else None,
            DESCRIPTIONS["text"] if demo else "",
        )
    if demo or image_model is not None:
        backends["image"] = ImageBackend.load(
            resolve_model(image_model, "image"),
            "stopcock-demo-image" if demo else None,
            DESCRIPTIONS["image"] if demo else "",
        )
    return backends
