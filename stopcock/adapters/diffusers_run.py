"""One diffusers run on one pipeline, as a small state machine (what a stop does is told in
:mod:`stopcock.adapters.diffusers`).

The run's :class:`Phase` is the one record of where it stands with its stop; it only moves forward:
``RUNNING`` -> ``STOP_STEP`` -> ``FAST_FORWARDING`` -> ``STAGE_OVER`` (a phase may be skipped).
:class:`PipelineRun` holds the phase and moves it on as the scheduler wrappers and stage stand-ins
report, using parts that each have one job (:mod:`stopcock.adapters.diffusers_parts`):
:class:`~stopcock.adapters.diffusers_parts.StepCounter`,
:class:`~stopcock.adapters.diffusers_parts.InterruptFlag`,
:class:`~stopcock.adapters.diffusers_parts.FastForward` and
:class:`~stopcock.adapters.diffusers_parts.KeptLatents`; here :class:`DenoiserSteps` counts the steps
of a loop with no scheduler step, and :func:`outcome_of` builds the Outcome. :class:`RunBinding` only
installs all of it on enter and removes it on exit.
"""

from __future__ import annotations

import enum
import threading
import weakref
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any, Literal, NoReturn, get_args

import torch
from diffusers import DiffusionPipeline

from ..binding import unbind
from ..conditions import refuse_row_conditions, watches_x0
from ..control import Abort, RunControl
from ..hooks import input_hooks
from ..intercept import intercepted
from ..outcome import Outcome
from ..types import PARTIALS, Partial, choice
from ..wires import Flag
from .diffusers_loop import LoopModels
from .diffusers_parts import (
    FastForward,
    InterruptFlag,
    KeptLatents,
    LoopStart,
    StageCall,
    StepCounter,
    StepWrapper,
    components,
    schedulers_of,
    timestep_of,
)

__all__ = ["STAGES", "Phase", "PipelineRun", "RunBinding", "Stage", "free_model_hooks", "outcome_of"]

#: Where a stop in a combined pipeline's stage ends the run: the next stages run on what it produced, or
#: the run ends with that stage.
Stage = Literal["next", "current"]
STAGES: tuple[Stage, ...] = get_args(Stage)

_NO_OUTPUT = object()  # a stopped stage that returned nothing of its own (its output is built later)

_active: weakref.WeakSet[Any] = weakref.WeakSet()  # pipelines with a run installed
_active_lock = threading.Lock()


class Phase(enum.Enum):
    """Where a run stands with its stop."""

    RUNNING = "running"  # no stop yet: steps are counted (and checked once the steps wire is armed)
    STOP_STEP = "stop step"  # stopped at a step boundary: flag raised, the step's models held
    FAST_FORWARDING = "fast-forwarding"  # the loop went on: models answer, scheduler steps hold
    STAGE_OVER = "stage over"  # the stopped stage has ended: later stages run in full

    @property
    def stopping(self) -> bool:
        """Inside the stopped stage, after the stop."""
        return self is Phase.STOP_STEP or self is Phase.FAST_FORWARDING


class DenoiserSteps:
    """The steps of a loop with no scheduler step (ScoreSdeVe's predictor-corrector steps), counted
    where the denoiser's timestep moves on: each model call is watched until a scheduler steps; once
    such a loop is found, each call of the denoiser is checked before it computes."""

    def __init__(self, run: PipelineRun, stack: ExitStack) -> None:
        self.run, self.stack = run, stack

    def before_forward(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        run = self.run
        if run.counter.source != "watching":  # counted elsewhere
            return
        t = run.counter.moved_on(module, args, kwargs)
        if t is not None:  # a next timestep with no scheduler step since: this loop has none
            run.counter.source = "denoiser"
            self.stack.enter_context(intercepted(module, "__call__", self.call))
            self.step(t, args, computing=True)

    def call(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        run, denoiser = self.run, self.run.counter.denoiser
        t = timestep_of(denoiser, args, kwargs)
        if run.phase is Phase.RUNNING and t is not None and t != run.counter.denoiser_t:
            self.step(t, args)
            if run.phase is not Phase.RUNNING:  # held now: this call answers too
                return type(denoiser).__call__(denoiser, *args, **kwargs)
        return call(*args, **kwargs)

    def step(self, t: float, args: tuple[Any, ...], computing: bool = False) -> None:
        """The denoiser moved on to ``t``: the step at the previous timestep is done (``computing``: the
        call that moved on is under way, too late to answer it)."""
        run, counter = self.run, self.run.counter
        previous, counter.denoiser_t = counter.denoiser_t, t
        counter.pos += 1
        run.kept.latents = next((a for a in args if isinstance(a, torch.Tensor)), None)  # its sample
        if not run.control.step(latents=run.kept.latents, timestep=previous) or run.phase is Phase.STAGE_OVER:
            run.forward.models.next_step()
            return
        run.kept.kind = "raw"
        if run.control.mode == "abort":
            raise Abort(run.control)
        run.notes.append(
            f"{type(run.owner).__name__} steps no scheduler: its steps were counted by the denoiser's"
            " timestep; after the stop its loop went on with the models answering from the stop step,"
            " so what it integrated from them is in the output"
            + (" (a stop at the first step let one more denoiser call compute)" if computing else "")
        )
        if run.kept.partial == "denoised":
            run.notes.append("no denoised estimate without a scheduler step: kept the raw latents")
        run.stopped_in = run.owner
        run.forward.iterations = 1  # the iteration that just began
        run.stop_here()

    def last_step(self) -> None:
        """The call returned with no stop: the loop's last step ended with it."""
        run = self.run
        if run.counter.source == "denoiser" and run.phase is Phase.RUNNING:
            run.counter.pos += 1
            run.control.step(timestep=run.counter.denoiser_t)


def free_model_hooks(pipe: Any) -> None:
    """What a pipeline's last line does: reset cache hooks, re-arm CPU offload."""
    if hasattr(pipe, "maybe_free_model_hooks"):
        pipe.maybe_free_model_hooks()
        return
    for component in dict(pipe.components).values():  # modular pipelines: reset stateful cache hooks
        if hasattr(component, "_reset_stateful_cache"):
            component._reset_stateful_cache()


def _unwrap(copies: list[weakref.ref[Any]]) -> None:
    """Take the wrappers off the scheduler copies made during the run."""
    for ref in copies:
        copy = ref()
        if copy is not None:
            for name in (StepWrapper.method, LoopStart.method):
                unbind(copy, name)


def _claim(pipe: Any) -> None:
    with _active_lock:
        if pipe in _active:
            raise RuntimeError(
                f"this {type(pipe).__name__} is already running under stopcock: diffusers pipelines"
                " keep per-run state in their scheduler, so run one call per pipeline at a time (use one"
                " pipeline per worker thread)"
            )
        _active.add(pipe)


def _release(pipe: Any) -> None:
    with _active_lock:
        _active.discard(pipe)


class RunBinding:
    """One run on one pipeline: installs the run's parts on enter, removes them (and resets the
    pipeline) on exit; what happens in between is :class:`PipelineRun`'s. ``one_call``: ``run()``
    calls the pipeline once; ``attach()`` maybe several times."""

    def __init__(
        self,
        pipe: Any,
        control: RunControl,
        partial: Partial | None = None,
        stage: Stage | None = None,
        *,
        one_call: bool = True,
    ) -> None:
        choice("partial", partial, PARTIALS, optional=True)
        choice("stage", stage, STAGES, optional=True)
        refuse_row_conditions(control.condition, "a diffusers pipeline")
        self.pipe, self.control = pipe, control
        found = components(pipe)
        self.schedulers = schedulers_of(found)
        #: A combined pipeline's stages: its attributes that are pipelines.
        self.stages = {name: v for name, v in vars(pipe).items() if isinstance(v, DiffusionPipeline)}
        models = LoopModels([c for c in found.values() if isinstance(c, torch.nn.Module)])
        # converged() keeps the x0 estimate it watched, unless partial= says otherwise
        default: Partial = "denoised" if watches_x0(control.condition) else "raw"
        self.run = PipelineRun(pipe, control, models, partial or default, stage or "next", one_call=one_call)
        self.notes = self.run.notes
        self.stack = ExitStack()  # what the run installed
        self.denoiser = DenoiserSteps(self.run, self.stack)

    def __enter__(self) -> RunBinding:
        run, stack = self.run, self.stack
        _claim(self.pipe)
        stack.callback(_release, self.pipe)
        try:
            for scheduler in self.schedulers:
                for method in (StepWrapper, LoopStart):
                    if hasattr(scheduler, method.method):  # ScoreSdeVe's has step_pred/step_correct
                        stack.enter_context(method.binding_for(scheduler, run))
            stack.callback(_unwrap, run.copies)
            for name, stage in self.stages.items():
                stack.enter_context(StageCall.binding_for(self.pipe, name, stage, run))
            models = run.forward.models
            stack.enter_context(models.recording())
            stack.callback(models.release)
            stack.enter_context(run.watch)
            run.watch.enter_context(input_hooks(models.models, self.denoiser.before_forward))
            if self.control.steps_wait:
                run.steps_wire.armed = False
                stack.enter_context(self.control.arming(run.steps_wire))
            # A check before every module call, armed once a stop makes it needed: abort mode, or
            # an escalating finish-mode stop.
            stack.enter_context(self.control.intercept())
        except BaseException:
            stack.close()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> bool:
        try:
            if exc is None:
                self.denoiser.last_step()
            self.stack.close()
            self.run.flag.lower()
            if exc is not None:  # the pipeline's own clean-up (its last line) did not run
                free_model_hooks(self.pipe)
        finally:
            self.control.close()
        if isinstance(exc, Abort) and exc.control is self.control:
            self.run.aborted = True
            return True
        return False

    def outcome(self, output: Any) -> Outcome:
        return outcome_of(self.run, output)


class PipelineRun:
    """A run's phase and its parts, moved on by the reports of the scheduler wrappers and stage
    stand-ins (:class:`~stopcock.adapters.diffusers_parts.Run`)."""

    def __init__(
        self,
        pipe: Any,
        control: RunControl,
        models: LoopModels,
        partial: Partial,
        stage: Stage,
        *,
        one_call: bool,
    ) -> None:
        self.control, self.stage, self.one_call = control, stage, one_call
        self.phase = Phase.RUNNING
        self.owner: Any = pipe  # the pipeline whose loop runs now: the pipe, or a combined pipeline's stage
        self.stopped_in: Any = None  # the pipeline (or stage) whose loop the stop landed in
        self.stop_family: Any = None  # the scheduler (family) that stepped at the stop
        self.notes: list[str] = []
        self.counter = StepCounter()
        self.flag = InterruptFlag(pipe)
        self.forward = FastForward(models)
        self.kept = KeptLatents(partial, self.notes, track=watches_x0(control.condition))
        self.copies: list[weakref.ref[Any]] = []  # copies of the schedulers made during the run
        self.stage_output: Any = _NO_OUTPUT  # what the stopped stage returned (stage="current")
        self.aborted = False
        # armed once a step could stop the run (see RunControl.arming); until then a step is only counted
        self.steps_wire = Flag(armed=True)
        self.watch = ExitStack()  # the denoiser's calls watched: closed at the first scheduler step

    # the phase
    def stop_here(self) -> None:
        """RUNNING -> STOP_STEP: the flag is raised and the models called in this step are held."""
        self.phase = Phase.STOP_STEP
        self.flag.raise_on(self.owner)
        self.forward.hold(self._answers)

    def _end_stopped_stage(self, name: str, output: Any = _NO_OUTPUT) -> None:
        """-> STAGE_OVER: the next stage runs in full (``stage="next"``) or the run ends here
        (``stage="current"``), with that stage's output when it is a pipeline of its own."""
        self.phase = Phase.STAGE_OVER
        self.forward.models.release()
        if self.stage == "current":
            self.stage_output = output
            what = "its output" if output is not _NO_OUTPUT else "no output (built in a later loop)"
            self.notes.append(f"stage='current': the run ended with the {name} stage, {what}")
            raise Abort(self.control)

    def _abort_new_call(self) -> NoReturn:
        self.notes.append("a call made after the stop was aborted before its first step")
        raise Abort(self.control)

    def _answers(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether a held model answers a call (a new call, which lowered the flag, ends the run)."""
        if self.flag.lowered():
            self._abort_new_call()
        counter = self.counter
        if counter.source == "denoiser" and module is counter.denoiser:
            t = timestep_of(module, args, kwargs)
            if t is not None and t != counter.denoiser_t:
                counter.denoiser_t = t
                self.forward.iterations += 1
        return True

    # reports of the scheduler wrappers and stage stand-ins
    def loop_starts(self, family: Any) -> None:
        """A scheduler's ``set_timesteps``. Before the stop: the counted loop starting again is a next
        chunk, whose steps add up. After it: another stage's loop ends the stopped stage (before that
        loop computes anything); the stopped loop starting again is the next chunk of the same call (in
        ``run``), or, in ``attach``, another call when the pipeline has no flag to say so."""
        if self.phase is Phase.RUNNING:
            if family is self.counter.stepping:  # the next chunk: its steps add up
                self.counter.stepping = None
            return
        if self.phase is Phase.STAGE_OVER:
            return
        if self.flag.lowered() or (family is self.stop_family and not self.one_call and not self.flag.own):
            self._abort_new_call()
        if family is not self.stop_family:
            self._end_stopped_stage(type(self.stopped_in).__name__)

    def run_stage(self, stage: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        outer, self.owner = self.owner, stage
        self.counter.new_stage()
        try:
            output = stage(*args, **kwargs)
        finally:
            self.owner = outer
        if self.stopped_in is stage and self.phase.stopping:
            self._end_stopped_stage(type(stage).__name__, output)
        return output

    def stepped(self, wrapper: StepWrapper, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call of a scheduler's step: counted, checked, held or stepped for real."""
        if self.counter.stepping is wrapper.scheduler and self.phase is Phase.RUNNING:
            # the counted loop's next step, no stop yet: nothing to decide before it
            result = wrapper.original(*args, **kwargs)
            if self.steps_wire.armed:
                return self._step_done(wrapper, args, kwargs, result)
            self.counter.pos += 1  # nothing can stop the run at a step: only counted
            self.control.steps += 1
            self.kept.went_past(wrapper, args, kwargs, result)
            self.forward.models.next_step()
            return result
        if self.phase.stopping:
            held = self._held(wrapper, wrapper.named(args, kwargs)[2], args, kwargs)
            if held is not None:
                return held
        return self._step_done(wrapper, args, kwargs, wrapper.original(*args, **kwargs))

    def _held(self, wrapper: StepWrapper, sample: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The result of a fast-forwarded step, or None: step for real."""
        family, forward, counter = wrapper.family, self.forward, self.counter
        stop_loop = family is self.stop_family
        next_iteration = stop_loop and (wrapper.scheduler is family or forward.models.forwarded)
        if self.phase is Phase.STOP_STEP:
            if not forward.called_since_stop() and not next_iteration:
                return None  # the stop step's other streams and copies step for real
            self.phase, forward.went_on = Phase.FAST_FORWARDING, True
        if not stop_loop and family not in counter.streams and counter.pos >= counter.stage_end:
            return None  # a next stage's first step
        if next_iteration:
            forward.next_iteration(self._answers)
            counter.pos += 1
        return forward.step(wrapper, sample, args, kwargs)

    def _step_done(
        self, wrapper: StepWrapper, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any
    ) -> Any:
        family, scheduler, counter = wrapper.family, wrapper.scheduler, self.counter
        model_output, timestep, sample = wrapper.named(args, kwargs)
        if counter.source == "watching":  # a scheduler steps: the denoiser's calls need not count the steps
            counter.source = "scheduler"
            self.watch.close()
        stopping = self.phase.stopping
        if family is not counter.stepping:
            if counter.in_stage() or family in counter.streams:
                # A second stream stepped in the same loop (e.g. RFD4Proteina's): not a step of its own.
                if family not in counter.streams:
                    counter.streams.append(family)
                return self._as_stopped(scheduler, result, model_output, sample) if stopping else result
            if stopping:  # a new loop (a combined pipeline's decoder after its prior) ends the stopped stage
                self._end_stopped_stage(type(self.stopped_in).__name__)
            counter.new_loop(wrapper, timestep, self.owner, self.control)
            self.kept.new_loop()
        elif stopping:
            return self._as_stopped(scheduler, result, model_output, sample)  # the stop step's copies
        elif scheduler is not family and not self.forward.models.forwarded:
            return result  # another copy stepped with no model call since: the same step (one per frame)
        counter.pos += 1
        if self.control.quiet_step(self.control.steps + 1):
            self.kept.went_past(wrapper, args, kwargs, result)  # latents and x0 estimate, read if needed
            self.forward.models.next_step()
            return result
        self.kept.read(scheduler, model_output, sample, result)
        denoised = self.kept.denoised
        stops = self.control.step(latents=result[0], timestep=timestep, extra=self.kept.extra())
        if not stops or self.phase is Phase.STAGE_OVER:  # after the stopped stage, later ones run in full
            self.forward.models.next_step()
            return result
        result = self._as_stopped(scheduler, result, None, None, denoised)
        self.kept.stopped_with(result)
        if self.control.mode == "abort":
            raise Abort(self.control)
        self.stopped_in, self.stop_family = self.owner, family
        self.stop_here()
        return result

    def _as_stopped(
        self, scheduler: Any, result: Any, model_output: Any, sample: Any, denoised: Any = None
    ) -> Any:
        """A step of the stop step, kept as the shape of this scheduler's fast-forwarded steps."""
        result = self.forward.results[id(scheduler)] = self.kept.as_stopped(
            scheduler, result, model_output, sample, denoised
        )
        return result

def outcome_of(run: PipelineRun, output: Any) -> Outcome:
    """The run's Outcome: how it stopped (``path``), what it kept, and the notes that explain it."""
    kept, forward = run.kept, run.forward
    kept.settle()
    if run.aborted and kept.kind is None and kept.latents is not None:
        kept.after_abort()
    stopped = run.control.seen
    ended_stage = run.stage_output is not _NO_OUTPUT
    aborted = run.aborted and not ended_stage
    answered = forward.models.answered
    path = None  # not stopped, or stopped before the first step
    if aborted and stopped:
        path = "abort"
    elif run.stopped_in is not None:
        path = "fast-forward" if forward.went_on or answered else "interrupt"
    if path == "fast-forward" and run.counter.source != "denoiser":
        run.notes.insert(
            0,
            f"fast-forward: {type(run.stopped_in).__name__} went on with its loop after the stop, so its last"
            f" {forward.iterations} step(s) ran without computing ({answered} model call(s) answered"
            " from the stop step, the sample held), then it built its output as usual",
        )
    if ended_stage:
        output = run.stage_output
    elif aborted:
        output = None
    return run.control.outcome(
        output,
        mode="abort" if aborted else run.control.mode,
        latents=kept.latents,
        partial=(kept.kind or "raw") if stopped and kept.latents is not None else None,
        detail="; ".join(run.notes) or None,
        extra={
            "path": path,
            "denoised": kept.denoised,
            "fast_forwarded": forward.iterations,
            "answered": answered,
        },
    )
