"""Request bodies, with the server's limits: every violation is a 422 with a JSON error.

Unknown fields are rejected (``extra="forbid"``) rather than silently ignored, so a client asking
for something this server does not do (``echo``, ``logprobs``, ``n > 1``...) is told so. Types are
strict: a number field takes a JSON number (``true`` is not 1, ``"5"`` is not 5), an integer field
an integer.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator

from ..conditions import AnyOf, from_options, refuse_row_conditions
from ..types import Partial
from .contract import JobSpec

# Limits. Prompt length is also checked in tokens against the model (see the text lane).
MAX_PROMPT_CHARS = 4000
MAX_PROMPTS = 16  # prompts of one job
MAX_TOKENS = 1024
MAX_STEPS = 200
MAX_IMAGE_SIDE = 512
MAX_STOP_STRINGS = 4
MAX_STOP_STRING_CHARS = 64
MAX_TIMEOUT_S = 3600.0
MAX_MESSAGES = 64
MAX_SEED = 2**32 - 1
MAX_PRIORITY = 100
MAX_EVENT_ID = 10**18 - 1  # an event id (``after=``, ``Last-Event-ID``) has at most 18 digits
#: Temperatures below this sample as greedy decoding does (their limit): dividing the scores by a
#: smaller one overflows to infinities, and a tiny positive one must not fail the job.
MIN_SAMPLING_TEMPERATURE = 1e-5

Prompt = Annotated[str, StringConstraints(min_length=1, max_length=MAX_PROMPT_CHARS)]
StopString = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]
Side = Annotated[int, Field(ge=64, le=MAX_IMAGE_SIDE, multiple_of=64)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class RepetitionOptions(Strict):
    """``stopcock.repetition()``'s settings; a missing one takes the library's default."""

    ngram: int | None = Field(default=None, ge=1, le=64, description="tokens in the n-gram (default 4)")
    repeats: int | None = Field(default=None, ge=2, le=64, description="times it recurs (default 3)")
    window: int | None = Field(
        default=None, ge=1, le=MAX_TOKENS, description="the last tokens looked at (default 64)"
    )


Repeats = bool | RepetitionOptions


class StopConditions(Strict):
    """When to stop a job on its own (besides ``POST /v1/jobs/{id}/stop``)."""

    timeout: float | None = Field(
        default=None, gt=0, le=MAX_TIMEOUT_S, description="seconds from the start of the run"
    )
    deadline: float | None = Field(default=None, gt=0, description="wall-clock time, epoch seconds")
    max_steps: int | None = Field(default=None, ge=0, description="tokens (text) or denoising steps (image)")
    stop_strings: list[StopString] | None = Field(
        default=None, max_length=MAX_STOP_STRINGS, description="text only"
    )
    repetition: Repeats | None = Field(
        default=None, description="text only: end each row that loops (true, or its settings)"
    )
    grace: Literal["sentence", "line"] | None = Field(
        default=None, description="text only: once the timeout or deadline is up, end each row at its"
        " next boundary",
    )
    grace_max: float | None = Field(
        default=None, ge=0, le=MAX_TIMEOUT_S, description="seconds of grace at most (default 10)"
    )

    @model_validator(mode="after")
    def _grace_needs_a_time(self) -> StopConditions:
        from_options(self.model_dump(exclude_none=True))  # grace without a time: a ValueError, a 422
        return self

    @field_validator("deadline")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        if value is not None and not math.isfinite(value):
            raise ValueError("deadline must be a finite number of epoch seconds")
        return value


class TextParameters(Strict):
    max_tokens: int = Field(default=64, ge=1, le=MAX_TOKENS, description="new tokens at most")
    temperature: float = Field(
        default=0.0, ge=0, le=2, description=f"0 = greedy (and below {MIN_SAMPLING_TEMPERATURE:g})"
    )
    top_p: float = Field(default=1.0, gt=0, le=1)
    seed: Seed | None = None


class ImageParameters(Strict):
    steps: int = Field(default=20, ge=1, le=MAX_STEPS, description="denoising steps")
    width: Side | None = Field(default=None, description="pixels, a multiple of 64; default: the model's")
    height: Side | None = Field(default=None, description="pixels, a multiple of 64; default: the model's")
    guidance_scale: float = Field(default=7.5, ge=0, le=30)
    negative_prompt: Annotated[str, StringConstraints(max_length=MAX_PROMPT_CHARS)] | None = None
    seed: Seed | None = None
    previews: bool = Field(default=True, description="send a preview image with each step")
    partial: Partial = Field(
        default="denoised", description="what a stopped image shows: the denoised estimate or the raw latents"
    )


def _repetition(value: Repeats) -> bool | dict[str, int]:
    """The ``repetition`` stop option of a request's value (its set fields only)."""
    return value if isinstance(value, bool) else value.model_dump(exclude_none=True) or True


class _JobBody(Strict):
    """A job body; each kind narrows ``kind`` and ``parameters``. ``prompt``, or ``prompts``: several,
    run one after the other (each can be skipped; a stop can wait for the current one)."""

    kind: str
    prompt: Prompt | None = None
    prompts: list[Prompt] | None = Field(default=None, min_length=1, max_length=MAX_PROMPTS)
    parameters: Strict
    stop: StopConditions = Field(default_factory=lambda: StopConditions())
    priority: int = Field(
        default=0, ge=-MAX_PRIORITY, le=MAX_PRIORITY,
        description="higher runs first; when every worker is busy, it preempts a running job of lower"
        " priority, which resumes afterwards where it was",
    )

    @model_validator(mode="after")
    def _one_prompt_field(self) -> _JobBody:
        if (self.prompt is None) == (self.prompts is None):
            raise ValueError("give either prompt (one) or prompts (a list), not both and not neither")
        return self

    def spec(self) -> JobSpec:
        prompts = None if self.prompts is None else tuple(self.prompts)
        stop = self.stop.model_dump(exclude_none=True)
        if self.stop.repetition is not None:
            stop["repetition"] = _repetition(self.stop.repetition)
        return JobSpec(
            self.kind, self.prompt, self.parameters.model_dump(), stop,
            prompts=prompts,
            priority=self.priority,
        )


class TextJob(_JobBody):
    kind: Literal["text"]
    parameters: TextParameters = Field(default_factory=lambda: TextParameters())


class ImageJob(_JobBody):
    kind: Literal["image"]
    parameters: ImageParameters = Field(default_factory=lambda: ImageParameters())

    @model_validator(mode="after")
    def _no_row_conditions(self) -> ImageJob:
        found = from_options(self.stop.model_dump(exclude_none=True))
        if found:
            fix = "remove stop.stop_strings, stop.repetition and stop.grace (for text jobs only)"
            refuse_row_conditions(AnyOf(*found), "image jobs", fix)
        return self


JobRequest = Annotated[TextJob | ImageJob, Field(discriminator="kind")]


# -- OpenAI-compatible bodies -------------------------------------------------------------------------
class _OpenAIText(Strict):
    model: Annotated[str, StringConstraints(max_length=256)]
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    temperature: float = Field(
        default=1.0, ge=0, le=2, description=f"0 = greedy (and below {MIN_SAMPLING_TEMPERATURE:g})"
    )
    top_p: float = Field(default=1.0, gt=0, le=1)
    n: Literal[1] = Field(default=1, description="only one choice per request is supported")
    stream: bool = False
    stream_options: dict[str, bool] | None = Field(default=None, description="include_usage")
    stop: StopString | list[StopString] | None = None
    repetition: Repeats | None = Field(
        default=None, description="stopcock extension: end the text when it loops (true, or its settings)"
    )
    seed: Seed | None = None
    user: Annotated[str, StringConstraints(max_length=256)] | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str] | None:
        value = [value] if isinstance(value, str) else value or None
        if value is not None and len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences")
        return value

    def text_spec(
        self, prompt: str | None, messages: tuple[dict[str, str], ...] | None, max_tokens: int
    ) -> JobSpec:
        params = TextParameters(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, seed=self.seed
        )
        stop: dict[str, Any] = {"stop_strings": self.stop} if self.stop else {}
        if self.repetition:
            stop["repetition"] = _repetition(self.repetition)
        return JobSpec("text", prompt, params.model_dump(), stop, messages)


class CompletionRequest(_OpenAIText):
    prompt: Prompt | Annotated[list[Prompt], Field(min_length=1, max_length=1)]

    def spec(self) -> JobSpec:
        prompt = self.prompt if isinstance(self.prompt, str) else self.prompt[0]
        return self.text_spec(prompt, None, self.max_tokens or 16)  # OpenAI's default for completions


class ChatMessage(Strict):
    role: Literal["system", "user", "assistant"]
    content: Annotated[str, StringConstraints(max_length=MAX_PROMPT_CHARS)]
    name: Annotated[str, StringConstraints(max_length=64)] | None = None


class ChatRequest(_OpenAIText):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)

    @model_validator(mode="after")
    def _total_length(self) -> ChatRequest:
        if sum(len(m.content) for m in self.messages) > MAX_PROMPT_CHARS:
            raise ValueError(f"the messages hold more than {MAX_PROMPT_CHARS} characters in all")
        return self

    def spec(self) -> JobSpec:
        messages = tuple({"role": m.role, "content": m.content} for m in self.messages)
        return self.text_spec(None, messages, self.max_completion_tokens or self.max_tokens or 64)


class ImageRequest(Strict):
    prompt: Prompt
    model: Annotated[str, StringConstraints(max_length=256)] | None = None
    n: Literal[1] = Field(default=1, description="only one image per request is supported")
    size: Annotated[str, StringConstraints(pattern=r"^(auto|\d{2,4}x\d{2,4})$")] = "auto"
    response_format: Literal["b64_json"] = Field(
        default="b64_json", description="URLs are not served: use b64_json"
    )
    steps: int = Field(default=20, ge=1, le=MAX_STEPS, description="stopcock extension: denoising steps")
    guidance_scale: float = Field(default=7.5, ge=0, le=30, description="stopcock extension")
    seed: Seed | None = Field(default=None, description="stopcock extension")
    user: Annotated[str, StringConstraints(max_length=256)] | None = None

    @field_validator("size")
    @classmethod
    def _size(cls, value: str) -> str:
        if value != "auto":
            for side in map(int, value.split("x")):
                if side % 64 or not 64 <= side <= MAX_IMAGE_SIDE:
                    raise ValueError(
                        f"size sides must be multiples of 64 from 64 to {MAX_IMAGE_SIDE}, e.g. 256x256"
                    )
        return value

    def spec(self) -> JobSpec:
        width, height = (None, None) if self.size == "auto" else map(int, self.size.split("x"))
        params = ImageParameters(
            steps=self.steps,
            width=width,
            height=height,
            guidance_scale=self.guidance_scale,
            seed=self.seed,
            previews=False,
            partial="denoised",
        )
        return JobSpec("image", self.prompt, params.model_dump())
