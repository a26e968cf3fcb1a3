"""The models behind the engine: one :class:`Backend` per kind of job, one lane per worker.

A backend loads a model once, checks a job against it before the job is queued (``validate``),
and builds a lane for each worker (``lane()``): its own pipeline object sharing the weights, so
concurrent runs never share a pipeline's per-call state (a diffusers scheduler, ``_interrupt``).
A lane runs one job with :func:`stopcock.run`: the job's stop signal plus its conditions as
``stop=``, and ``on_step`` reporting progress, text and previews to the engine.
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
from ..loading import load_image_pipeline, load_text_model, resolve_model
from ..outcome import Outcome
from ..previews import latent_preview, previewable
from ..runner import run
from ..state import StepState
from ..tiny.demo import DESCRIPTIONS
from .contract import Backend, InvalidJob, JobSpec, RunContext
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
    (on the scores' device); only the drawn token is left finite."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.generator: torch.Generator | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.generator is None:
            self.generator = torch.Generator(scores.device).manual_seed(self.seed)
        drawn = torch.multinomial(scores.float().softmax(-1), 1, generator=self.generator)
        return scores.new_full(scores.shape, -math.inf).scatter_(1, drawn, 0.0)  # type: ignore[return-value]


class TextLane:
    def __init__(self, backend: TextBackend, pipe: Any) -> None:
        self.backend = backend
        self.pipe = pipe

    @staticmethod
    def decoding(params: Mapping[str, Any]) -> dict[str, Any]:
        """``generate`` arguments: greedy at temperature 0 (and below ``MIN_SAMPLING_TEMPERATURE``,
        whose division overflows), else sampling with the job's own generator.

        ``generate``'s own sampling draws from torch's global generator, which every worker shares,
        so a seed would be exact only with one worker. Instead the temperature and top-p warpers
        are followed by :class:`_Draw`, which samples with a generator seeded from ``seed`` (at
        random without one) and leaves the drawn token the only choice for greedy decoding.
        """
        if params["temperature"] < MIN_SAMPLING_TEMPERATURE:
            return {"do_sample": False}
        seed = params.get("seed")
        draw = _Draw(secrets.randbits(63) if seed is None else seed)
        warpers = [TemperatureLogitsWarper(params["temperature"]), TopPLogitsWarper(params["top_p"])]
        return {"do_sample": False, "logits_processor": LogitsProcessorList([*warpers, draw])}

    def execute(self, spec: JobSpec, ctx: RunContext) -> Outcome:
        params = spec.params

        def one(prompt: str) -> tuple[Outcome, dict[str, Any]]:
            prompt_len = len(self.pipe.tokenizer(prompt)["input_ids"])
            rows = RowDecoder(self.pipe.tokenizer)
            pieces: list[str] = []

            def publish(chunks: list[Any], step: int) -> None:
                for chunk in chunks:
                    pieces.append(chunk.text)
                    ctx.text(chunk.text, step)

            outcome = run(
                self.pipe,
                prompt,
                stop=ctx.stop(from_options(spec.stop)),
                on_step=ctx.on_step(lambda state: publish(rows.chunks(state), state.step)),
                max_new_tokens=params["max_tokens"],
                return_full_text=False,
                **self.decoding(params),
            )
            publish(rows.flush(), outcome.steps)
            text = "".join(pieces)
            return outcome, {"text": text, "prompt_tokens": prompt_len, "completion_tokens": outcome.steps}

        return each_item(spec, ctx, self.backend.prompts(spec), one)


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
        xl = "XL" in type(self.pipe).__name__
        preview = params["previews"] and getattr(self.pipe, "vae", None) is not None

        def report(state: StepState) -> None:
            if preview and previewable(state.latents):
                ctx.preview(latent_preview(state.latents, xl=xl), state.step)

        def one(prompt: str) -> tuple[Outcome, dict[str, Any]]:
            generator.manual_seed(seed)  # each prompt from the same seed
            outcome = run(
                self.pipe,
                prompt=prompt,
                stop=ctx.stop(from_options(spec.stop)),
                on_step=ctx.on_step(report),
                partial=params["partial"],
                generator=generator,
                **self.backend.call_kwargs(params),
            )
            images = getattr(outcome.output, "images", None)
            return outcome, {"image": None if not images else png_base64(images[0]), "detail": outcome.detail}

        prompts = spec.prompts if spec.prompts is not None else (spec.prompt or "",)
        return each_item(spec, ctx, prompts, one)


def each_item(
    spec: JobSpec, ctx: RunContext, prompts: tuple[str, ...],
    one: Callable[[str], tuple[Outcome, dict[str, Any]]],
) -> Outcome:
    """Run ``one(prompt)`` and set the job's result: for a job of one prompt, that run's result; for
    several (``spec.prompts``), one run per prompt while the job's signal allows
    (:func:`stopcock.items.run_each`: skip, stop after the current item), each item announced with
    ``ctx.item`` and its result in ``items``."""
    if spec.prompts is None:
        outcome, result = one(prompts[0])
        ctx.set_result(**result)
        return outcome
    items: list[dict[str, Any]] = []
    order = iter(range(len(prompts)))

    def run_one(prompt: str) -> Outcome:
        index = next(order)
        ctx.item(index, prompt)
        outcome, result = one(prompt)
        items.append({"prompt": prompt, "reason": outcome.reason, **result})
        ctx.item(index, prompt, outcome)
        return outcome

    _, overall = run_each(ctx.signal, prompts, run_one)
    ctx.set_result(items=items)
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
