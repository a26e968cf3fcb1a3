"""The parts of a diffusers run, each with one job (:mod:`stopcock.adapters.diffusers_run` puts them
together and moves the run's phase on).

- What a run reads from a pipeline and a step: its components, the x0 estimate, the steps left, a
  model's timestep.
- What it puts on the pipeline for the run's thread: the scheduler methods and combined-pipeline
  stages that stand in for theirs. They know nothing of stops: each reports to the run
  (:class:`Run`), which decides.
- What it keeps track of: :class:`StepCounter` (where the run is in its loops),
  :class:`InterruptFlag` (the pipeline's own ``_interrupt``), :class:`FastForward` (the loop after
  the stop step) and :class:`KeptLatents` (the latents and x0 estimate of ``partial=``).
"""

from __future__ import annotations

import functools
import inspect
import math
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Literal, Protocol, cast

import torch
from diffusers import DiffusionPipeline
from diffusers.schedulers.scheduling_utils import SchedulerMixin

from ..binding import bound
from ..control import RunControl
from ..types import Partial
from .diffusers_loop import Answers, LoopModels

__all__ = [
    "FastForward",
    "InterruptFlag",
    "KeptLatents",
    "LoopStart",
    "Run",
    "SchedulerMethod",
    "StageCall",
    "StepCounter",
    "StepWrapper",
    "components",
    "cut_short",
    "denoised_estimate",
    "remaining_steps",
    "schedulers_of",
    "timestep_of",
    "with_sample",
]


class Run(Protocol):
    """What the wrappers report to (see :class:`stopcock.adapters.diffusers_run.PipelineRun`)."""

    copies: list[weakref.ref[Any]]

    def loop_starts(self, family: Any) -> None: ...

    def stepped(self, wrapper: StepWrapper, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any: ...

    def run_stage(self, stage: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any: ...


# -- the components ----------------------------------------------------------------------------------
@functools.cache
def _optional_parameters(cls: type[DiffusionPipeline]) -> frozenset[str]:
    """A pipeline class's optional ``__init__`` parameters that are not components (diffusers' own rule)."""
    return frozenset(cls._get_signature_keys(cls)[1])


def components(pipe: Any) -> dict[str, Any]:
    """The pipeline's components that are set, as diffusers' ``components`` reads them: from the
    config's names less the class's optional ``__init__`` parameters, which diffusers reads from the
    class signature at every call (here once per class)."""
    if isinstance(pipe, DiffusionPipeline) and type(pipe).components is DiffusionPipeline.components:
        optional = _optional_parameters(type(pipe))
        config: Any = cast(Any, pipe).config  # a ConfigMixin property diffusers' stubs do not show
        names = [k for k in config if not k.startswith("_") and k not in optional]
        found = {k: getattr(pipe, k) for k in names}
    else:
        found = dict(pipe.components)
    return {name: c for name, c in found.items() if c is not None}


def schedulers_of(found: dict[str, Any]) -> list[Any]:
    """The schedulers among ``found`` components, each once."""
    return list({id(c): c for c in found.values() if isinstance(c, SchedulerMixin)}.values())


# -- the x0 estimate --------------------------------------------------------------------------------
def denoised_estimate(scheduler: Any, model_output: Any, sample: Any, result: Any) -> torch.Tensor | None:
    """The scheduler's estimate of the clean sample at the step just taken, or None.

    Schedulers that return it (DDIM, DDPM, Euler, Euler ancestral, Heun, LCM, TCD, ...) give it as
    ``pred_original_sample`` / ``denoised``, or second in the tuple; DPM-Solver++ and UniPC keep it
    as their last converted model output; flow matching Euler: x0 = x_t - sigma * v.
    """
    prev = result[0]
    for name in ("pred_original_sample", "denoised"):
        x0 = getattr(result, name, None)
        if isinstance(x0, torch.Tensor):
            return x0
    if isinstance(result, tuple) and len(result) > 1:
        x0 = result[1]
        return x0 if isinstance(x0, torch.Tensor) and x0.shape == prev.shape else None
    config = getattr(scheduler, "config", {})
    outputs = getattr(scheduler, "model_outputs", None)
    if outputs and (
        str(config.get("algorithm_type", "")).endswith("dpmsolver++") or config.get("predict_x0", False)
    ):
        x0 = outputs[-1]
        return x0.to(prev.dtype) if isinstance(x0, torch.Tensor) and x0.shape == prev.shape else None
    if (
        type(scheduler).__name__.startswith("FlowMatchEuler")
        and getattr(scheduler, "step_index", None)
        and isinstance(sample, torch.Tensor)
        and isinstance(model_output, torch.Tensor)
    ):
        sigma = scheduler.sigmas[scheduler.step_index - 1]
        return (sample.float() - sigma * model_output.float()).to(prev.dtype)
    return None


def with_sample(result: Any, sample: torch.Tensor) -> Any:
    """``result`` of ``scheduler.step`` with its first element (prev_sample) replaced by ``sample``."""
    if isinstance(result, tuple):
        return (sample, *result[1:])
    fields = dict(result)
    fields[next(iter(fields))] = sample
    return type(result)(**fields)


def remaining_steps(scheduler: Any, timestep: Any) -> int | None:
    """Steps left in this scheduler's loop, counting the one at ``timestep`` (img2img starts late)."""
    timesteps = getattr(scheduler, "timesteps", None)
    if not isinstance(timesteps, torch.Tensor) or timesteps.ndim != 1 or timestep is None:
        return None
    t = torch.as_tensor(timestep, dtype=timesteps.dtype)
    if t.numel() != 1:
        return None
    schedule = timesteps.tolist()  # one copy to the host, then compared in Python: cheaper than kernels
    value = t.item()
    return len(schedule) - schedule.index(value) if value in schedule else None


def timestep_of(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> float | None:
    """The timestep a model is called at (its ``timestep`` argument; the first one of a batch), or None."""
    cls = type(module)
    if cls not in _forward_names:
        _forward_names[cls] = tuple(inspect.signature(cls.forward).parameters)[1:]  # without self
    for i, name in enumerate(_forward_names[cls]):
        if name in ("timestep", "timesteps"):
            value = kwargs.get(name, args[i] if i < len(args) else None)
            if isinstance(value, torch.Tensor):
                return float(value.flatten()[0]) if value.numel() else None
            return float(value) if isinstance(value, (int, float)) else None
    return None


_forward_names: dict[type, tuple[str, ...]] = {}  # a model class -> its forward's parameter names


def cut_short(remaining: int | None, planned: object) -> int | None:
    """The steps left, less any the pipeline cut from the end of its loop (SDXL's ``denoising_end``).

    ``planned`` is the pipeline's ``_num_timesteps``: the length of the loop it is about to run, set
    before the loop by most pipelines (the scheduler keeps the full schedule). Only ever lowers the count.
    """
    if not isinstance(planned, int) or isinstance(planned, bool) or planned <= 0:
        return remaining
    return planned if remaining is None else min(remaining, planned)


class SchedulerMethod:
    """One method of a scheduler for the run's thread (:func:`~stopcock.binding.bound`), on the
    pipeline's schedulers and on the copies the pipeline makes of them during the call (SkyReels V2's
    one per frame, LTX-2's audio stream): ``family`` is the pipeline's scheduler this one is, or is a
    copy of; ``original`` the method it wraps (or an outer wrapper of it)."""

    method = ""  # the name of the method stood in for

    def __init__(self, scheduler: Any, run: Run, family: Any, original: Callable[..., Any]) -> None:
        self.scheduler = scheduler
        self.run = run
        self.family = family
        self.original = original
        # Pipelines inspect the parameters (step's generator= and eta=, set_timesteps' timesteps=).
        self.__signature__, self._positional = _signature(self.original)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError  # each method's wrapper says what a call does

    @classmethod
    def binding_for(cls, scheduler: Any, run: Run) -> AbstractContextManager[None]:
        """The ``with`` block in which ``scheduler``'s method is this wrapper on the run's thread."""
        return bound(scheduler, cls.method, lambda original: cls(scheduler, run, scheduler, original))

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        copy = memo.get(id(self.scheduler))
        if copy is None:  # the wrapper alone is copied, not with its scheduler
            return self
        # The copy is being built: its state is not there yet, so its method is taken from its class.
        wrapper = type(self)(copy, self.run, self.family, getattr(type(copy), self.method).__get__(copy))
        self.run.copies.append(weakref.ref(copy))
        return wrapper


class LoopStart(SchedulerMethod):
    """``scheduler.set_timesteps``: a loop is about to start."""

    method = "set_timesteps"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.run.loop_starts(self.family)
        return self.original(*args, **kwargs)


class StepWrapper(SchedulerMethod):
    """``scheduler.step``: a step ends (or, fast-forwarding, is held): the run decides."""

    method = "step"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.run.stepped(self, args, kwargs)

    def named(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any, Any]:
        """(model_output, timestep, sample) of a call, by name: not every step() takes them first
        (CogVideoX's DPM). Positional arguments fill the first parameters (a call step() takes)."""
        named = {**dict(zip(self._positional, args, strict=False)), **kwargs}
        return named.get("model_output"), named.get("timestep"), named.get("sample")


class StageCall:
    """Stands in for a combined pipeline's stage (``prior_pipe``, ``decoder_pipe``) on the run's
    thread, so the run knows which stage runs and what it returned."""

    def __init__(self, pipe: Any, run: Run) -> None:
        self._pipe = pipe
        self._run = run

    @staticmethod
    def binding_for(pipe: Any, name: str, stage: Any, run: Run) -> AbstractContextManager[None]:
        """The ``with`` block in which ``pipe.<name>`` (``stage``) is a stand-in on the run's thread."""
        return bound(pipe, name, lambda original: StageCall(stage, run))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipe, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._run.run_stage(self._pipe, args, kwargs)


def _signature(step: Any) -> tuple[inspect.Signature, tuple[str, ...]]:
    """``inspect.signature(step)`` and its :func:`_positional_names`; a bound method's are read once per
    function (the same for every instance), as every run wraps each scheduler's step afresh."""
    func = getattr(step, "__func__", None)
    if func is None or getattr(step, "__self__", None) is None:
        signature = inspect.signature(step)
        return signature, _positional_names(signature)
    found = _step_signatures.get(func)
    if found is None:
        signature = inspect.signature(step)
        found = _step_signatures[func] = signature, _positional_names(signature)
    return found


#: a step function -> its signature as a bound method, and its positional names
_step_signatures: dict[Any, tuple[inspect.Signature, tuple[str, ...]]] = {}


def _positional_names(signature: inspect.Signature) -> tuple[str, ...]:
    """The names that positional arguments bind to, in order (up to a ``*args``)."""
    names = []
    for p in signature.parameters.values():
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            break
        names.append(p.name)
    return tuple(names)


# -- the run's parts, one job each ------------------------------------------------------------------
class StepCounter:
    """Where the run is in its loops. ``source`` says what counts the steps: ``"watching"`` (nothing
    yet: the denoiser's calls are watched), ``"scheduler"`` (a scheduler stepped) or ``"denoiser"`` (a
    loop with no scheduler step, such as ScoreSdeVe's: the denoiser's timestep moving on). It moves
    on from ``"watching"`` only, once: the first of the two to be found counts the run's steps."""

    def __init__(self) -> None:
        self.source: Literal["watching", "scheduler", "denoiser"] = "watching"
        self.pos = 0  # loop iterations so far, fast-forwarded ones included
        self.stepping: Any = None  # the scheduler (family) whose steps are counted: the current stage's
        self.stage_end = math.inf  # the iteration at which the current stage's loop ends, when known
        self.streams: list[Any] = []  # schedulers seen stepping beside the counted one
        self.denoiser: Any = None  # the first model called with a timestep
        self.denoiser_t: float | None = None

    def in_stage(self) -> bool:
        """The counted loop is under way and not past its end."""
        return self.stepping is not None and self.pos < self.stage_end

    def new_stage(self) -> None:
        """A combined pipeline's stage starts: its loop is a stage of its own, even on a shared scheduler."""
        self.stepping, self.streams = None, []

    def new_loop(self, wrapper: StepWrapper, timestep: Any, owner: Any, control: RunControl) -> None:
        """``wrapper``'s scheduler starts stepping a loop: its steps add up, and the run's total is known
        when the steps left are."""
        remaining = remaining_steps(wrapper.scheduler, timestep)
        if self.stepping is None:  # the first loop, a combined pipeline's stage, a next chunk: set just now
            remaining = cut_short(remaining, vars(owner).get("_num_timesteps"))
        self.stepping = wrapper.family
        self.stage_end = math.inf if remaining is None else self.pos + remaining
        if remaining is not None:
            control.total = control.steps + remaining

    def moved_on(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> float | None:
        """While watching: the timestep of a denoiser call at a next timestep with no scheduler step
        since (the loop has none), else None."""
        t = timestep_of(module, args, kwargs)
        if t is None:
            return None
        if self.denoiser is None:
            self.denoiser, self.denoiser_t = module, t
        elif module is self.denoiser and t != self.denoiser_t:
            return t
        return None


class InterruptFlag:
    """The pipeline's own ``_interrupt``: raised inside the call at the stop (so the pipeline's reset
    cannot lose it); at the end left False where the pipeline has one and not added where it had none."""

    def __init__(self, pipe: Any) -> None:
        self.pipe = pipe
        self._raised: tuple[Any, bool] | None = None  # (pipeline whose flag was raised, had it one)

    @property
    def own(self) -> bool:
        """The pipeline whose flag was raised had one of its own."""
        return self._raised is not None and self._raised[1]

    def raise_on(self, owner: Any) -> None:
        self._raised = (owner, "_interrupt" in vars(owner))
        owner._interrupt = True

    def lowered(self) -> bool:
        """The pipeline lowered the flag raised: it was called again (pipelines reset it first)."""
        return self._raised is not None and vars(self._raised[0]).get("_interrupt") is False

    def lower(self) -> None:
        if self._raised is not None:
            owner, had = self._raised
            if had:
                owner._interrupt = False
            else:
                vars(owner).pop("_interrupt", None)
        if "_interrupt" in vars(self.pipe):
            self.pipe._interrupt = False


class FastForward:
    """The stopped loop going on: the models called in the stop step answer from it, and each
    scheduler's step gives its stop-step result (its shape) with the sample it is given held."""

    def __init__(self, models: LoopModels) -> None:
        self.models = models
        self.results: dict[int, Any] = {}  # id(scheduler) -> its result in the stop step
        self.answered_at_stop = 0
        self.went_on = False  # the loop went on after the stop step
        self.iterations = 0  # loop iterations fast-forwarded

    def hold(self, answers: Answers) -> None:
        """The stop step: the models called in it answer from now on."""
        self.models.hold(answers)
        self.models.next_step()
        self.answered_at_stop = self.models.answered

    def called_since_stop(self) -> bool:
        return self.models.answered != self.answered_at_stop

    def next_iteration(self, answers: Answers) -> None:
        """The loop's next iteration begins: models first called after the stop answer too."""
        self.models.hold(answers)
        self.models.next_step()
        self.iterations += 1

    def step(self, wrapper: StepWrapper, sample: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A held step's result: the stop step's, with ``sample`` (its input) held."""
        result = self.results.get(id(wrapper.scheduler))
        if result is None:  # not stepped in the stop step: one real step gives the shape of its results
            result = self.results[id(wrapper.scheduler)] = wrapper.original(*args, **kwargs)
        return with_sample(result, result[0] if sample is None else sample)


class KeptLatents:
    """The latents a stopped run keeps: the last step's (``partial="raw"``) or its x0 estimate
    (``"denoised"``). A step the fast path went past is kept as its arguments, read only if needed."""

    def __init__(self, partial: Partial, notes: list[str], *, track: bool = False) -> None:
        self.partial = partial
        self.notes = notes
        self.latents: Any = None
        self.denoised: Any = None
        #: ``track``: each step's relative RMS change of the x0 estimate, for ``converged()``
        self.track = track
        self.changes: list[float] = []
        self._fresh = True  # no x0 estimate of the current loop yet
        self.kind: str | None = None  # "raw" or "denoised": what ``latents`` holds at a stop
        self._last: tuple[StepWrapper, tuple[Any, ...], dict[str, Any], Any] | None = None

    def went_past(
        self, wrapper: StepWrapper, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any
    ) -> None:
        self._last = (wrapper, args, kwargs, result)

    def read(self, scheduler: Any, model_output: Any, sample: Any, result: Any) -> None:
        """A step seen in full: its latents and x0 estimate."""
        self._last = None
        self.latents = result[0]
        previous = None if self._fresh else self.denoised
        self._fresh = False
        self.denoised = denoised_estimate(scheduler, model_output, sample, result)
        if self.track and previous is not None and self.denoised is not None:
            scale = float(previous.float().pow(2).mean().sqrt())
            change = float((self.denoised.float() - previous.float()).pow(2).mean().sqrt())
            self.changes.append(change / scale if scale > 0 else math.inf)

    def new_loop(self) -> None:
        """A new denoising loop begins: its x0 changes start afresh."""
        self._fresh = True
        self.changes = []

    def extra(self) -> dict[str, Any]:
        """What a step's state carries of the x0 estimate (``StepState.extra``)."""
        if self.denoised is None:
            return {}
        if self.track:
            return {"denoised": self.denoised, "denoised_changes": tuple(self.changes)}
        return {"denoised": self.denoised}

    def settle(self) -> None:
        """Read the step the fast path went past: the scheduler has not stepped since (an abort inside
        the next step's forward, or the run's end)."""
        if self._last is not None:
            wrapper, args, kwargs, result = self._last
            self._last = None
            model_output, _, sample = wrapper.named(args, kwargs)
            self.read(wrapper.scheduler, model_output, sample, result)

    def as_stopped(self, scheduler: Any, result: Any, model_output: Any, sample: Any, denoised: Any) -> Any:
        """A step's result in the stop step: with ``partial="denoised"`` the x0 estimate in place of x_t."""
        if self.partial == "denoised":
            if denoised is None:
                denoised = denoised_estimate(scheduler, model_output, sample, result)
            if denoised is None:
                note = f"no denoised estimate from {type(scheduler).__name__}: kept the raw latents"
                if note not in self.notes:
                    self.notes.append(note)
            else:
                result = with_sample(result, denoised)
        return result

    def stopped_with(self, result: Any) -> None:
        self.kind = "denoised" if self.denoised is not None and result[0] is self.denoised else "raw"
        self.latents = result[0]

    def after_abort(self) -> None:
        """Aborted inside a forward: the last finished step's latents, as ``partial=`` asks."""
        self.kind = "raw"
        if self.partial == "denoised" and self.denoised is not None:
            self.latents, self.kind = self.denoised, "denoised"
        elif self.partial == "denoised":
            self.notes.append("no denoised estimate from the last step: kept the raw latents")
