"""The server's contract: what the app needs from an engine, and what an engine needs from a model.

Everything an engine implementation is written against lives here: the :class:`Engine` protocol
the app calls, the :class:`Backend`/:class:`Lane` protocols of the models, the :class:`RunContext`
a lane gets for one job, the JSON-able job spec, views and events, the job states and the errors
the app turns into HTTP answers. :class:`~stopcock.server.engine.LocalEngine` (in-process) is one
implementation; a distributed engine is another, written against this module alone.

Job states: ``queued`` -> ``running`` -> ``stopping`` (a stop was requested) -> ``stopped`` |
``completed`` | ``failed``; a queued job that is stopped goes straight to ``stopped`` without
running. A running job can also be held with its checkpoint: ``paused`` by its owner (until
``resume``, which queues it again), or ``preempted`` by a job of higher ``priority`` (it waits in
the queue and resumes from its checkpoint when a worker is free); a held job that is stopped ends
at once as ``stopped``. Events (``JobEvent.type``): ``queued``, ``started`` (``resumed_from``: the
checkpoint's step when it resumes), ``progress`` (step, total), ``text`` (a chunk of generated
text), ``preview`` (a PNG of the current step, base64), ``item`` (an item of a job with several
prompts started or ended: index, prompt, state, reason, steps), ``paused`` and ``preempted`` (step,
checkpoint_step), ``resumed`` (queued again), ``done`` (the final view, with the Outcome summary).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, get_args, runtime_checkable

from ..conditions import Condition
from ..outcome import Outcome
from ..signal import StopSignal
from ..state import StepState

if TYPE_CHECKING:
    from ..checkpoint import Checkpoint

__all__ = [
    "FINAL_STATES",
    "HELD_STATES",
    "JOB_STATES",
    "PAUSED",
    "PREEMPTED",
    "Backend",
    "Engine",
    "JobEvent",
    "InvalidJob",
    "JobNotFound",
    "JobSpec",
    "JobState",
    "JobStateConflict",
    "JobView",
    "KindNotServed",
    "Lane",
    "Pausable",
    "QueueFull",
    "RESPONSE_ID_PREFIXES",
    "RunContext",
    "Unavailable",
    "job_id_of",
]

#: A job's state, the same in every engine (the transitions are in the module docstring).
JobState = Literal["queued", "running", "stopping", "paused", "preempted", "stopped", "completed", "failed"]
JOB_STATES: tuple[JobState, ...] = get_args(JobState)
FINAL_STATES: frozenset[JobState] = frozenset({"stopped", "completed", "failed"})
#: A held job's state, which is also the reason its run was stopped with (its checkpoint is kept).
PAUSED: Literal["paused"] = "paused"
PREEMPTED: Literal["preempted"] = "preempted"
HELD_STATES: frozenset[JobState] = frozenset({PAUSED, PREEMPTED})

#: The OpenAI-compatible responses' ids are the job id behind one of these prefixes; a job id never
#: starts with one (nor with ``-``, which command-line tools read as an option): see
#: :func:`stopcock.server.jobs.new_id`, which every engine uses.
RESPONSE_ID_PREFIXES = ("cmpl-", "chatcmpl-")


def job_id_of(public_id: str) -> str:
    """The job id in ``public_id``: a job id as it is, or an OpenAI response id without its prefix."""
    for prefix in RESPONSE_ID_PREFIXES:
        if public_id.startswith(prefix):
            return public_id[len(prefix) :]
    return public_id


class JobNotFound(LookupError):
    """No job with this id for this owner (another owner's job is not found either)."""


class QueueFull(RuntimeError):
    """The queue holds ``queue_size`` jobs already: try again later."""


class Unavailable(RuntimeError):
    """No replica of the job's kind is ready (starting, or the cluster cannot place one): a 503 with
    ``Retry-After``, answered at once."""


class KindNotServed(LookupError):
    """The server has no model for this kind of job."""


class InvalidJob(ValueError):
    """The job does not fit the model (e.g. a prompt longer than its context)."""


class JobStateConflict(RuntimeError):
    """The job is not in a state that allows this (e.g. pausing a finished job): a 409."""


@dataclass(frozen=True)
class JobSpec:
    """What to run: validated, JSON-able, backend-agnostic.

    ``prompt`` is the text prompt, or None when ``messages`` (chat) or ``prompts`` is given.
    ``prompts`` are several prompts, run one after the other (the items of the job: each can be
    skipped, and a stop can wait for the current one). ``params`` are the generation parameters of
    the kind; ``stop`` the stop conditions as options (timeout, deadline, max_steps, stop_strings:
    :func:`stopcock.conditions.from_options`), applied to each item's run. A job of higher
    ``priority`` runs first, and preempts a running job of lower priority when every worker is busy.
    """

    kind: str
    prompt: str | None
    params: Mapping[str, Any] = field(default_factory=dict)
    stop: Mapping[str, Any] = field(default_factory=dict)
    messages: tuple[Mapping[str, str], ...] | None = None
    prompts: tuple[str, ...] | None = None
    priority: int = 0


@dataclass(frozen=True)
class JobEvent:
    """One job event; ``seq`` counts from 1 in the order of the job's events."""

    seq: int
    type: str
    data: Mapping[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "type": self.type, **self.data}


@dataclass(frozen=True)
class JobView:
    """A snapshot of a job, as the API shows it. ``checkpoint_step`` is the step of the checkpoint a
    held job keeps (None when it has none); ``saved_steps`` counts the steps its resumes did not
    recompute; ``preemptions`` how often a higher-priority job preempted it."""

    id: str
    kind: str
    state: JobState
    step: int
    total: int | None
    reason: str | None
    stop_step: int | None
    created: float
    started: float | None
    finished: float | None
    outcome: Mapping[str, Any] | None
    error: str | None
    priority: int = 0
    checkpoint_step: int | None = None
    saved_steps: int = 0
    preemptions: int = 0

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


class RunContext(Protocol):
    """What a lane gets for one job from the engine that runs it.

    ``signal`` is the job's stop signal. The lane runs ``stopcock.run(..., stop=ctx.stop(conditions),
    on_step=ctx.on_step(report), escalate_after=ctx.escalate_after, checkpoint=True)``, or, when
    ``checkpoint`` is set (the job was paused or preempted), ``stopcock.resume(..., checkpoint,
    record=True)`` with the same ``stop=`` and ``on_step=``; it reports text, previews and the result
    through the others. ``escalate_after`` is the engine's grace period: a stop that a step has not
    honoured after that many seconds aborts the run (None: never).
    """

    signal: StopSignal
    escalate_after: float | None
    checkpoint: Checkpoint | None

    def stop(self, conditions: Iterable[Condition]) -> list[Condition | StopSignal]:
        """The run's ``stop=``: the job's signal (and what the engine needs to watch) and ``conditions``."""
        ...

    def on_step(self, report: Callable[[StepState], None]) -> Callable[[StepState], None]:
        """The run's ``on_step``: calls ``report(state)``, then records and publishes the progress."""
        ...

    def text(self, chunk: str, step: int) -> None: ...

    def preview(self, image: Any, step: int) -> None:
        """Publish a PIL image as the job's current preview."""
        ...

    def set_result(self, **result: Any) -> None: ...

    def item(self, index: int, prompt: str, outcome: Outcome | None = None) -> None:
        """Publish that item ``index`` (of ``JobSpec.prompts``) started (``outcome`` None) or ended."""
        ...


class Lane(Protocol):
    """A worker's own instance of one kind of model; runs one job at a time. ``execute`` returns the
    run's Outcome, with its ``checkpoint`` so that the job can be paused or preempted (a run stopped
    for ``PAUSED``/``PREEMPTED`` without one ends as stopped)."""

    def execute(self, spec: JobSpec, ctx: RunContext) -> Outcome: ...


class Backend(Protocol):
    """One kind of model: checks a job before it is queued, and builds a lane per worker.

    A backend may also have ``validator()``: a light, picklable copy that only validates, which an
    engine that queues jobs away from the model uses (the built-in backends have one; without it,
    the Ray engine checks a job on the model replica, and an invalid job fails instead of a 400)."""

    kind: str
    name: str
    description: str

    def validate(self, spec: JobSpec) -> None: ...

    def lane(self) -> Lane: ...


class Engine(Protocol):
    """What the app needs from a job engine. ``owner`` scopes every lookup.

    ``models`` maps each served kind to ``{"id": ..., "description": ...}``. ``stop`` with
    ``wait`` answers once the stop took effect (the run returned), with the final view. An engine
    that can hold jobs is also :class:`Pausable`.
    """

    models: Mapping[str, Mapping[str, str]]

    async def submit(self, spec: JobSpec, owner: str) -> JobView: ...

    async def get(self, job_id: str, owner: str) -> JobView: ...

    async def list(self, owner: str, limit: int = 100) -> list[JobView]: ...

    async def stop(
        self, job_id: str, owner: str, reason: str = "user", wait: bool = True, at: str = "now"
    ) -> JobView:
        """``at="now"``: stop at the next step (see the class docstring). ``at="item"``: let the
        current item finish and start no other (``StopSignal.stop_after_item``); answers at once."""
        ...

    async def skip(self, job_id: str, owner: str) -> JobView:
        """End the job's current item and go on with the next (``StopSignal.skip``; a job of one
        item ends, reason ``"skipped"``); answers at once. A job not running is left as it is."""
        ...

    async def wait(self, job_id: str, owner: str, timeout: float | None = None) -> JobView: ...

    def events(self, job_id: str, owner: str, after: int = 0) -> AsyncIterator[JobEvent]: ...

    async def result(self, job_id: str, owner: str) -> dict[str, Any]: ...

    def stats(self) -> dict[str, int] | Awaitable[dict[str, int]]:
        """Queue and worker counts: a dict, or an awaitable of one (an engine whose counts live
        elsewhere, as the Ray engine's, which live in its registry)."""
        ...

    async def aclose(self) -> None: ...


@runtime_checkable
class Pausable(Protocol):
    """An engine's capability to hold jobs with their checkpoint (``LocalEngine`` has it).

    ``pause`` holds the job (a running one at its next step, its worker then free; a queued one
    leaves the queue) and answers once it is held; ``resume`` queues a paused job again, to continue
    from its checkpoint. Both raise :class:`JobStateConflict` for a job that has ended, and the app
    answers a 400 on an engine without the capability.
    """

    async def pause(self, job_id: str, owner: str) -> JobView: ...

    async def resume(self, job_id: str, owner: str) -> JobView: ...
