"""Stop diffusers pipelines (``DiffusionPipeline`` and modular pipelines) at a step boundary.

How a run is bound (one mechanism for every pipeline kind, decided at run time):

- **Step boundary**: each scheduler of the pipeline has its ``step`` wrapped for the run, and so do
  the copies the pipeline makes of it during the call. Every denoising loop in diffusers (classic,
  combined and modular) ends each step with a scheduler step, whatever its callback API, so this
  counts steps where classifier-free guidance batching or separate conditional/unconditional
  denoiser calls would make counting denoiser forwards wrong. It also sees the latents and the
  scheduler's estimate of the clean sample (x0), used for ``partial="denoised"``. Stages (a combined
  pipeline's prior, then decoder) add up; a second scheduler stepped within the same loop, or a copy
  stepped again with no model call in between (one per frame chunk), is not counted twice. While
  nothing can stop the run at a step (no ``on_step``, no ``max_steps`` or condition that sees each
  step) the counted loop's step is only counted, until :meth:`~stopcock.control.RunControl.arming`
  arms the run's ``steps_wire`` (a stop, a ``skip()``, a time limit 50 ms away); the latents and
  x0 estimate of the last step are read from its arguments only when needed.
- **Finish**: at the boundary where the stop is seen, the pipeline's own ``_interrupt`` flag is raised
  (inside the call, after the pipeline reset it, so it cannot be lost), and the models called in that
  step are held (:mod:`stopcock.adapters.diffusers_loop`). A loop that checks the flag skips its
  remaining steps (path ``"interrupt"``). A loop that goes on is fast-forwarded (path
  ``"fast-forward"``): its models answer from the stop step without computing and its scheduler steps
  hold the sample, so it runs to its end at no compute cost. Either way the pipeline then decodes and
  builds its output with its own code. With ``partial="denoised"`` the stop step's result is the x0
  estimate. After a stop in a combined pipeline's first stage the next stage runs on what it produced
  (``stage="next"``), or the run ends with that stage's output (``stage="current"``).
- **Abort** (``mode="abort"``): :class:`~stopcock.control.Abort` is raised at the step boundary, and
  a forward pre-hook on every module call, armed once a stop is possible
  (:meth:`~stopcock.control.RunControl.intercept`), raises it at the next module call while a forward
  is under way. No VAE decode, no safety checker, no next stage. A finish-mode stop escalated by
  ``escalate_after=`` aborts the same way.

Users' own ``callback_on_step_end`` / legacy ``callback`` arguments are left untouched (a loop that
is fast-forwarded still calls them, with the held latents).
"""

from __future__ import annotations

import functools
import inspect
import math
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any, Literal, NoReturn, cast, get_args

import torch
from diffusers import DiffusionPipeline, ModularPipeline
from diffusers.callbacks import MultiPipelineCallbacks, PipelineCallback
from diffusers.schedulers.scheduling_utils import SchedulerMixin

from ..binding import bound, unbind
from ..conditions import StopLike, refuse_row_conditions
from ..control import Abort, Flag, RunControl
from ..events import StreamEvents
from ..hooks import input_hooks
from ..intercept import intercepted, subclass
from ..outcome import Outcome
from ..pipeline_facts import GENERATE_ONLY, call_honours_interrupt
from ..previews import previewer
from ..state import StepState
from ..types import PARTIALS, Mode, Partial, choice
from .diffusers_loop import LoopModels

__all__ = ["ADAPTER", "DiffusersAdapter", "attach", "step_callback", "guard", "honours_interrupt", "Handle"]

#: Where a stop in a combined pipeline's stage ends the run: the next stages run on what it produced, or
#: the run ends with that stage.
Stage = Literal["next", "current"]
STAGES: tuple[Stage, ...] = get_args(Stage)

_active: weakref.WeakSet[Any] = weakref.WeakSet()  # pipelines with a binding installed
_active_lock = threading.Lock()


def _is_pipeline(target: object) -> bool:
    return isinstance(target, (DiffusionPipeline, ModularPipeline))


def honours_interrupt(pipe: object) -> bool:
    """Whether ``pipe.__call__`` checks ``self.interrupt`` at every step (so it can finish early).

    Decided by static analysis of the source of the class that defines the ``__call__`` actually run
    (:func:`stopcock.pipeline_facts.call_honours_interrupt`, the same facts the linter uses), so a
    subclass that overrides it is judged by its own ``__call__``; :func:`guard`'s subclass is looked
    through. A class whose source cannot be read answers False. ``run``/``attach`` do not ask: they
    decide at run time.
    """
    for cls in type(pipe).__mro__:
        if "__call__" in vars(cls) and not vars(cls).get("_stopcock_guarded", False):
            return call_honours_interrupt(cls)
    return False


# -- the x0 estimate --------------------------------------------------------------------------------
def _denoised(scheduler: Any, model_output: Any, sample: Any, result: Any) -> torch.Tensor | None:
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


def _with_sample(result: Any, sample: torch.Tensor) -> Any:
    """``result`` of ``scheduler.step`` with its first element (prev_sample) replaced by ``sample``."""
    if isinstance(result, tuple):
        return (sample, *result[1:])
    fields = dict(result)
    fields[next(iter(fields))] = sample
    return type(result)(**fields)


def _remaining_steps(scheduler: Any, timestep: Any) -> int | None:
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


def _timestep_of(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> float | None:
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


def _cut_short(remaining: int | None, planned: object) -> int | None:
    """The steps left, less any the pipeline cut from the end of its loop (SDXL's ``denoising_end``).

    ``planned`` is the pipeline's ``_num_timesteps``: the length of the loop it is about to run, set
    before the loop by most pipelines (the scheduler keeps the full schedule). Only ever lowers the count.
    """
    if not isinstance(planned, int) or isinstance(planned, bool) or planned <= 0:
        return remaining
    return planned if remaining is None else min(remaining, planned)


class _SchedulerMethod:
    """One method of a scheduler for the run's thread (:func:`~stopcock.binding.bound`), on the
    pipeline's schedulers and on the copies the pipeline makes of them during the call (SkyReels V2's
    one per frame, LTX-2's audio stream): ``family`` is the pipeline's scheduler this one is, or is a
    copy of; ``original`` the method it wraps (or an outer wrapper of it)."""

    method = ""  # the name of the method stood in for

    def __init__(self, scheduler: Any, binding: _Binding, family: Any, original: Callable[..., Any]) -> None:
        self.scheduler = scheduler
        self.binding = binding
        self.family = family
        self.original = original
        # Pipelines inspect the parameters (step's generator= and eta=, set_timesteps' timesteps=).
        self.__signature__, self._positional = _signature(self.original)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError  # each method's wrapper says what a call does

    @classmethod
    def binding_for(cls, scheduler: Any, binding: _Binding) -> AbstractContextManager[None]:
        """The ``with`` block in which ``scheduler``'s method is this wrapper on the run's thread."""
        return bound(scheduler, cls.method, lambda original: cls(scheduler, binding, scheduler, original))

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        copy = memo.get(id(self.scheduler))
        if copy is None:  # the wrapper alone is copied, not with its scheduler
            return self
        # The copy is being built: its state is not there yet, so its method is taken from its class.
        wrapper = type(self)(copy, self.binding, self.family, getattr(type(copy), self.method).__get__(copy))
        self.binding.copies.append(weakref.ref(copy))
        return wrapper


class _LoopStart(_SchedulerMethod):
    """``scheduler.set_timesteps``: a loop is about to start."""

    method = "set_timesteps"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.binding.loop_starts(self.family)
        return self.original(*args, **kwargs)


class _StepWrapper(_SchedulerMethod):
    """``scheduler.step``: a step ends (or, fast-forwarding, is held)."""

    method = "step"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        binding = self.binding
        if binding.stepping is self.scheduler and binding.stopped_in is None:
            # the counted loop's next step, no stop yet: nothing to decide before it
            result = self.original(*args, **kwargs)
            if not binding.steps_wire.armed:
                binding.went_past(self, args, kwargs, result)
                return result
            return binding.step_done(self, args, kwargs, result)
        held = binding.held(self, self.named(args, kwargs)[2], args, kwargs)
        if held is not None:
            return held
        return binding.step_done(self, args, kwargs, self.original(*args, **kwargs))

    def named(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any, Any]:
        """(model_output, timestep, sample) of a call, by name: not every step() takes them first
        (CogVideoX's DPM). Positional arguments fill the first parameters (a call step() takes)."""
        named = {**dict(zip(self._positional, args, strict=False)), **kwargs}
        return named.get("model_output"), named.get("timestep"), named.get("sample")



class _Stage:
    """Stands in for a combined pipeline's stage (``prior_pipe``, ``decoder_pipe``) during a run, so
    the binding knows which stage runs and what it returned."""

    def __init__(self, pipe: Any, binding: _Binding, original: object = None) -> None:
        self._pipe = pipe
        self._binding = binding

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipe, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._binding.run_stage(self._pipe, args, kwargs)


_NOTHING = object()


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


# -- the binding ------------------------------------------------------------------------------------
@functools.cache
def _optional_parameters(cls: type[DiffusionPipeline]) -> frozenset[str]:
    """A pipeline class's optional ``__init__`` parameters that are not components (diffusers' own rule)."""
    return frozenset(cls._get_signature_keys(cls)[1])


class _Binding:
    """One run's hooks on one pipeline: installed on enter, removed (and the pipeline reset) on exit.

    Finish mode, at the step where the stop is seen: the pipeline's own ``_interrupt`` is raised and
    the models called in that step are held (:class:`~stopcock.adapters.diffusers_loop.LoopModels`).
    A loop that checks the flag skips its remaining steps (path ``"interrupt"``); one that goes on is
    fast-forwarded: its models answer from the stop step and its scheduler steps hold the sample they
    are given (path ``"fast-forward"``). Either way the pipeline decodes and builds its output itself.
    """

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
        self.pipe = pipe
        self.control = control
        self.partial = partial or "raw"
        self.stage: Stage = stage or "next"
        self.one_call = one_call  # run(): the pipeline is called once; attach(): maybe several times
        self.models = LoopModels(list(self._models().values()))
        self.owner: Any = pipe  # the pipeline whose loop runs now: the pipe, or a combined pipeline's stage
        # progress
        self.stepping: Any = None  # the scheduler (family) whose steps are counted: the current stage's
        self.pos = 0  # loop iterations so far, fast-forwarded ones included
        self.stage_end = math.inf  # the iteration at which the current stage's loop ends, when known
        self.streams: list[Any] = []  # schedulers seen stepping beside the counted one
        self.copies: list[weakref.ref[Any]] = []  # copies of the schedulers made during the run
        self.denoiser: Any = None  # the first model called with a timestep: counted when no scheduler steps
        self.denoiser_t: float | None = None
        self.untimed = False  # no scheduler step: steps are counted where the denoiser's timestep moves
        self.results_seen = False  # a scheduler step returned during the run
        # the stop
        self.stopped_in: Any = None  # the pipeline (or stage) whose loop the stop landed in
        self.stop_family: Any = None
        self.flagged: tuple[Any, bool] | None = None  # (pipeline whose _interrupt we raised, had it one)
        self.answered_at_stop = 0
        self.forwarding = False  # the stop step is over and the loop goes on: fast-forwarding
        self.stage_over = False  # the stopped stage has ended: later stages run in full
        self.fast_forwarded = 0  # loop iterations fast-forwarded
        self.results: dict[int, Any] = {}  # id(scheduler) -> its result in the stop step: held steps' shape
        self.stage_output: Any = _NOTHING  # what the stopped stage returned (stage="current")
        self.aborted = False
        self.latents: Any = None
        self.denoised: Any = None
        self._last: tuple[_StepWrapper, tuple[Any, ...], dict[str, Any], Any] | None = None  # see _settle
        # armed once a step could stop the run (see RunControl.arming); until then a step is only counted
        self.steps_wire = Flag(armed=True)
        self.latents_kind: str | None = None  # "raw" or "denoised": what self.latents holds at a stop
        self.notes: list[str] = []
        self._stack = ExitStack()
        self._untimed_watch = ExitStack()  # the hook counting steps by the denoiser, until a scheduler steps

    # components
    @functools.cached_property
    def _components(self) -> dict[str, Any]:
        """Read once per run: as diffusers' ``components`` reads them, from the config's names less
        the class's optional ``__init__`` parameters, which diffusers reads from the class signature
        at every call (here once per class)."""
        pipe = self.pipe
        if isinstance(pipe, DiffusionPipeline) and type(pipe).components is DiffusionPipeline.components:
            optional = _optional_parameters(type(pipe))
            config: Any = cast(Any, pipe).config  # a ConfigMixin property diffusers' stubs do not show
            names = [k for k in config if not k.startswith("_") and k not in optional]
            found = {k: getattr(pipe, k) for k in names}
        else:
            found = dict(pipe.components)
        return {name: c for name, c in found.items() if c is not None}

    def _models(self) -> dict[str, torch.nn.Module]:
        return {n: c for n, c in self._components.items() if isinstance(c, torch.nn.Module)}

    def schedulers(self) -> list[Any]:
        return list({id(c): c for c in self._components.values() if isinstance(c, SchedulerMixin)}.values())

    @functools.cached_property
    def stages(self) -> dict[str, Any]:
        """A combined pipeline's stages, read once a run: its attributes that are pipelines."""
        return {name: v for name, v in vars(self.pipe).items() if isinstance(v, DiffusionPipeline)}

    # install / remove
    def __enter__(self) -> _Binding:
        with _active_lock:
            if self.pipe in _active:
                raise RuntimeError(
                    f"this {type(self.pipe).__name__} is already running under stopcock: diffusers pipelines"
                    " keep per-run state in their scheduler, so run one call per pipeline at a time (use one"
                    " pipeline per worker thread)"
                )
            _active.add(self.pipe)
        self._stack.callback(self._release)
        try:
            for scheduler in self.schedulers():
                for method in (_StepWrapper, _LoopStart):
                    if hasattr(scheduler, method.method):  # ScoreSdeVe's has step_pred/step_correct
                        self._stack.enter_context(method.binding_for(scheduler, self))
            self._stack.callback(self._unwrap_copies)
            for name, stage in self.stages.items():
                self._stack.enter_context(bound(self.pipe, name, functools.partial(_Stage, stage, self)))
            self._stack.enter_context(self.models.recording())
            self._stack.callback(self.models.release)
            self._stack.enter_context(self._untimed_watch)  # closed at the first scheduler step
            self._untimed_watch.enter_context(input_hooks(self.models.models, self._before_forward))
            if self.control.steps_wait:
                self.steps_wire.armed = False
                self._stack.enter_context(self.control.arming(self.steps_wire))
            # A check before every module call, armed once a stop makes it needed: abort mode, or
            # an escalating finish-mode stop.
            self._stack.enter_context(self.control.intercept())
        except BaseException:
            self._stack.close()
            raise
        return self

    def _release(self) -> None:
        with _active_lock:
            _active.discard(self.pipe)

    def _unwrap_copies(self) -> None:
        for ref in self.copies:
            copy = ref()
            for name in ("step", "set_timesteps"):
                if copy is not None:
                    unbind(copy, name)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> bool:
        try:
            if self.untimed and exc is None and self.stopped_in is None:
                self.pos += 1  # the loop's last step ended with the call
                self.control.step(timestep=self.denoiser_t)
            self._stack.close()
            self._lower_flag()
            if exc is not None:  # the pipeline's own clean-up (its last line) did not run
                _free_model_hooks(self.pipe)
        finally:
            self.control.close()
        if isinstance(exc, Abort) and exc.control is self.control:
            self.aborted = True
            return True
        return False

    def _raise_flag(self) -> None:
        """The loop's own interrupt flag, raised inside the call (so the pipeline's reset cannot lose it)."""
        self.flagged = (self.owner, "_interrupt" in vars(self.owner))
        self.owner._interrupt = True

    def _lower_flag(self) -> None:
        """``_interrupt`` is left False where the pipeline has one, and not added where it had none."""
        if self.flagged is not None:
            owner, had = self.flagged
            if had:
                owner._interrupt = False
            else:
                vars(owner).pop("_interrupt", None)
        if "_interrupt" in vars(self.pipe):
            self.pipe._interrupt = False

    def _abort_new_call(self) -> NoReturn:
        self.notes.append("a call made after the stop was aborted before its first step")
        raise Abort(self.control)

    def _flag_lowered(self) -> bool:
        """The pipeline lowered the flag we raised: it was called again (pipelines reset it first)."""
        return self.flagged is not None and vars(self.flagged[0]).get("_interrupt") is False

    def loop_starts(self, family: Any) -> None:
        """A scheduler's ``set_timesteps``. Before the stop: the counted loop starting again is a next
        chunk, whose steps add up. After it: another stage's loop ends the stopped stage (before that
        loop computes anything); the stopped loop starting again is the next chunk of the same call (in
        ``run``), or, in ``attach``, another call when the pipeline has no flag to say so."""
        if self.stopped_in is None:
            if family is self.stepping:  # the counted loop starts again (the next chunk): its steps add up
                self.stepping = None
            return
        if self.stage_over:
            return
        has_flag = self.flagged is not None and self.flagged[1]
        if self._flag_lowered() or (family is self.stop_family and not self.one_call and not has_flag):
            self._abort_new_call()
        if family is not self.stop_family:
            self._end_stopped_stage(type(self.stopped_in).__name__)

    def _answers(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether a held model answers a call (a new call, which lowered the flag, ends the run)."""
        if self._flag_lowered():
            self._abort_new_call()
        if self.untimed and module is self.denoiser:
            t = _timestep_of(module, args, kwargs)
            if t is not None and t != self.denoiser_t:
                self.denoiser_t = t
                self.fast_forwarded += 1
        return True

    # loops with no scheduler step (ScoreSdeVe's predictor-corrector steps): counted by the denoiser
    def _before_forward(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.results_seen or self.untimed:  # a scheduler steps: counted there
            return
        t = _timestep_of(module, args, kwargs)
        if t is None:
            return
        if self.denoiser is None:
            self.denoiser, self.denoiser_t = module, t
        elif module is self.denoiser and t != self.denoiser_t:
            # A next timestep with no scheduler step since: this loop has none. From now on each call of
            # the denoiser is checked before it computes (this one already does).
            self.untimed = True
            self._stack.enter_context(intercepted(module, "__call__", self._untimed_call))
            self._untimed_step(t, args, computing=True)

    def _untimed_call(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        t = _timestep_of(self.denoiser, args, kwargs)
        if self.stopped_in is None and t is not None and t != self.denoiser_t:
            self._untimed_step(t, args)
            if self.stopped_in is not None:  # held now: this call answers too
                return type(self.denoiser).__call__(self.denoiser, *args, **kwargs)
        return call(*args, **kwargs)

    def _untimed_step(self, t: float, args: tuple[Any, ...], computing: bool = False) -> None:
        """The denoiser moved on to ``t``: the step at the previous timestep is done (``computing``: the
        call that moved on is under way, too late to answer it)."""
        previous, self.denoiser_t = self.denoiser_t, t
        self.pos += 1
        self.latents = next((a for a in args if isinstance(a, torch.Tensor)), None)  # the sample it gets
        if not self.control.step(latents=self.latents, timestep=previous) or self.stage_over:
            self.models.next_step()
            return
        self.latents_kind = "raw"
        if self.control.mode == "abort":
            raise Abort(self.control)
        self.notes.append(
            f"{type(self.owner).__name__} steps no scheduler: its steps were counted by the denoiser's"
            " timestep; after the stop its loop went on with the models answering from the stop step,"
            " so what it integrated from them is in the output"
            + (" (a stop at the first step let one more denoiser call compute)" if computing else "")
        )
        if self.partial == "denoised":
            self.notes.append("no denoised estimate without a scheduler step: kept the raw latents")
        self.stopped_in = self.owner
        self.fast_forwarded = 1  # the iteration that just began
        self._raise_flag()
        self.models.hold(self._answers)
        self.models.next_step()
        self.answered_at_stop = self.models.answered

    # stages of a combined pipeline
    def run_stage(self, stage: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        outer, self.owner = self.owner, stage
        self.stepping, self.streams = None, []  # its loop is a stage of its own, even on a shared scheduler
        try:
            output = stage(*args, **kwargs)
        finally:
            self.owner = outer
        if self.stopped_in is stage and not self.stage_over:
            self._end_stopped_stage(type(stage).__name__, output)
        return output

    def _end_stopped_stage(self, name: str, output: Any = _NOTHING) -> None:
        """The stage the stop landed in is over: the next one runs in full (``stage="next"``) or the run
        ends here (``stage="current"``), with that stage's output when it is a pipeline of its own."""
        self.stage_over = True
        self.models.release()
        if self.stage == "current":
            self.stage_output = output
            what = "its output" if output is not _NOTHING else "no output (built in a later loop)"
            self.notes.append(f"stage='current': the run ended with the {name} stage, {what}")
            raise Abort(self.control)

    # events from the wrapped scheduler.step
    def held(self, wrapper: _StepWrapper, sample: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The result of a fast-forwarded step (the ``sample`` it is given, held), or None: step for real."""
        if self.stopped_in is None or self.stage_over:
            return None
        family = wrapper.family
        next_iteration = family is self.stop_family and (wrapper.scheduler is family or self.models.forwarded)
        if not self.forwarding:
            if self.models.answered == self.answered_at_stop and not next_iteration:
                return None  # the stop step's other streams and copies step for real
            self.forwarding = True
        if family is not self.stop_family and family not in self.streams and self.pos >= self.stage_end:
            return None  # a next stage's first step
        if next_iteration:
            self.models.hold(self._answers)  # models first called after the stop answer from now on
            self.models.next_step()
            self.pos += 1
            self.fast_forwarded += 1
        result = self.results.get(id(wrapper.scheduler))
        if result is None:  # not stepped in the stop step: one real step gives the shape of its results
            result = self.results[id(wrapper.scheduler)] = wrapper.original(*args, **kwargs)
        return _with_sample(result, result[0] if sample is None else sample)

    def went_past(
        self, wrapper: _StepWrapper, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any
    ) -> None:
        """A step of the counted loop while nothing can stop the run at a step (``steps_wire`` is not
        armed): counted; its latents and x0 estimate are read only if needed (:meth:`_settle`)."""
        self.pos += 1
        self.control.steps += 1
        self._last = (wrapper, args, kwargs, result)
        self.models.next_step()

    def step_done(
        self, wrapper: _StepWrapper, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any
    ) -> Any:
        family = wrapper.family
        scheduler = wrapper.scheduler
        model_output, timestep, sample = wrapper.named(args, kwargs)
        if not self.results_seen:  # a scheduler steps: the denoiser's calls need not count the steps
            self.results_seen = True
            self._untimed_watch.close()
        stopping = self.stopped_in is not None and not self.stage_over
        if family is not self.stepping:
            in_stage = self.stepping is not None and self.pos < self.stage_end
            if in_stage or family in self.streams:
                # A second stream stepped in the same loop (e.g. RFD4Proteina's): not a step of its own.
                if family not in self.streams:
                    self.streams.append(family)
                return self._as_stopped(scheduler, result, model_output, sample) if stopping else result
            self._new_stage(wrapper, timestep)
        elif stopping:
            return self._as_stopped(scheduler, result, model_output, sample)  # the stop step's copies
        elif scheduler is not family and not self.models.forwarded:
            return result  # another copy stepped with no model call since: the same step (one per frame)
        self.pos += 1
        if self.control.quiet_step(self.control.steps + 1):
            self._last = (wrapper, args, kwargs, result)  # latents and x0 estimate, read if needed
            self.models.next_step()
            return result
        self._last = None
        self.latents = result[0]
        self.denoised = _denoised(scheduler, model_output, sample, result)
        extra = {"denoised": self.denoised} if self.denoised is not None else {}
        if not self.control.step(latents=self.latents, timestep=timestep, extra=extra) or self.stage_over:
            self.models.next_step()
            return result
        return self._stop(wrapper, result)

    def _new_stage(self, wrapper: _StepWrapper, timestep: Any) -> None:
        """A new loop starts stepping (a combined pipeline's decoder after its prior): its steps add up."""
        if self.stopped_in is not None and not self.stage_over:
            self._end_stopped_stage(type(self.stopped_in).__name__)
        remaining = _remaining_steps(wrapper.scheduler, timestep)
        if self.stepping is None:  # the first loop, a combined pipeline's stage, a next chunk: set just now
            remaining = _cut_short(remaining, vars(self.owner).get("_num_timesteps"))
        self.stepping = wrapper.family
        self.stage_end = math.inf if remaining is None else self.pos + remaining
        if remaining is not None:
            self.control.total = self.control.steps + remaining

    def _stop(self, wrapper: _StepWrapper, result: Any) -> Any:
        result = self._as_stopped(wrapper.scheduler, result, denoised=self.denoised)
        self.latents_kind = "denoised" if self.denoised is not None and result[0] is self.denoised else "raw"
        self.latents = result[0]
        if self.control.mode == "abort":
            raise Abort(self.control)
        self.stopped_in, self.stop_family = self.owner, wrapper.family
        self._raise_flag()
        self.models.hold(self._answers)
        self.models.next_step()
        self.answered_at_stop = self.models.answered
        return result

    def _as_stopped(
        self, scheduler: Any, result: Any, model_output: Any = None, sample: Any = None, denoised: Any = None
    ) -> Any:
        """A step of the stop step: its result, with ``partial="denoised"`` the x0 estimate in place of
        x_t; kept as the shape of this scheduler's fast-forwarded steps."""
        if self.partial == "denoised":
            if denoised is None:
                denoised = _denoised(scheduler, model_output, sample, result)
            if denoised is None:
                note = f"no denoised estimate from {type(scheduler).__name__}: kept the raw latents"
                if note not in self.notes:
                    self.notes.append(note)
            else:
                result = _with_sample(result, denoised)
        self.results[id(scheduler)] = result
        return result

    def _settle(self) -> None:
        """The latents and x0 estimate of the last step the fast path went past, read now: the
        scheduler has not stepped since (an abort inside the next step's forward, or the run's end)."""
        if self._last is not None:
            wrapper, args, kwargs, result = self._last
            self._last = None
            model_output, _, sample = wrapper.named(args, kwargs)
            self.latents = result[0]
            self.denoised = _denoised(wrapper.scheduler, model_output, sample, result)

    def outcome(self, output: Any) -> Outcome:
        self._settle()
        if self.aborted and self.latents_kind is None and self.latents is not None:
            # aborted inside a forward: the last finished step's latents, as partial= asks
            self.latents_kind = "raw"
            if self.partial == "denoised" and self.denoised is not None:
                self.latents, self.latents_kind = self.denoised, "denoised"
            elif self.partial == "denoised":
                self.notes.append("no denoised estimate from the last step: kept the raw latents")
        stopped = self.control.seen
        ended_stage = self.stage_output is not _NOTHING
        aborted = self.aborted and not ended_stage
        answered = self.models.answered
        path = None  # not stopped, or stopped before the first step
        if aborted and stopped:
            path = "abort"
        elif self.stopped_in is not None:
            path = "fast-forward" if self.forwarding or answered else "interrupt"
        if path == "fast-forward" and not self.untimed:
            name = type(self.stopped_in).__name__
            self.notes.insert(
                0,
                f"fast-forward: {name} went on with its loop after the stop, so its last"
                f" {self.fast_forwarded} step(s) ran without computing ({answered} model call(s) answered"
                " from the stop step, the sample held), then it built its output as usual",
            )
        if ended_stage:
            output = self.stage_output
        elif aborted:
            output = None
        return self.control.outcome(
            output,
            mode="abort" if aborted else self.control.mode,
            latents=self.latents,
            partial=(self.latents_kind or "raw") if stopped and self.latents is not None else None,
            detail="; ".join(self.notes) or None,
            extra={
                "path": path,
                "denoised": self.denoised,
                "fast_forwarded": self.fast_forwarded,
                "answered": answered,
            },
        )


def _free_model_hooks(pipe: Any) -> None:
    """What a pipeline's last line does: reset cache hooks, re-arm CPU offload."""
    if hasattr(pipe, "maybe_free_model_hooks"):
        pipe.maybe_free_model_hooks()
        return
    for component in dict(pipe.components).values():  # modular pipelines: reset stateful cache hooks
        if hasattr(component, "_reset_stateful_cache"):
            component._reset_stateful_cache()


def _reject_generate_args(pipe: Any, kwargs: dict[str, Any]) -> None:
    """Refuse generate() arguments the pipeline does not declare (AudioLDM2 has its own max_new_tokens)."""
    declared = _declared_inputs(type(pipe), getattr(pipe, "blocks", None))
    wrong = sorted((GENERATE_ONLY & kwargs.keys()) - declared)
    if wrong:
        raise TypeError(
            f"{', '.join(wrong)} {'is a' if len(wrong) == 1 else 'are'} transformers generate() argument(s);"
            f" {type(pipe).__name__} would ignore or reject it. To stop a diffusers pipeline pass"
            " stop=... to stopcock.run() (a StopSignal, timeout(), deadline(), max_steps(), when()),"
            " or use stopcock.attach(pipe, stop) / callback_on_step_end=stopcock.step_callback(stop)"
        )


def _declared_inputs(cls: type, blocks: Any) -> frozenset[str]:
    """The inputs a pipeline names: its ``__call__`` parameters, or a modular pipeline's block inputs."""
    return _call_parameters(cls) | set(getattr(blocks, "input_names", ()))


@functools.cache
def _call_parameters(cls: type) -> frozenset[str]:
    return frozenset(inspect.signature(cls.__call__).parameters)


def _planned_steps(kwargs: dict[str, Any]) -> int | None:
    for name in ("timesteps", "sigmas"):
        if kwargs.get(name) is not None:
            return len(kwargs[name])
    steps = kwargs.get("num_inference_steps")
    return steps if isinstance(steps, int) else None


# -- public entry points ----------------------------------------------------------------------------
class DiffusersAdapter:
    """The adapter for diffusers pipelines (see the module docstring)."""

    name = "diffusers"
    options = frozenset({"partial", "stage"})

    def accepts(self, target: object) -> bool:
        return _is_pipeline(target)

    def run(
        self,
        target: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        control: RunControl,
        **options: Any,
    ) -> Outcome:
        """Behind ``stopcock.run(pipe, ...)`` for diffusers pipelines (``partial=``, ``stage=``)."""
        _reject_generate_args(target, kwargs)
        binding = _Binding(target, control, options.get("partial"), options.get("stage"))
        if len(binding.schedulers()) == 1 and not binding.stages:  # stages add up as each one starts
            control.total = _planned_steps(kwargs)
        output = None
        with binding:
            if control.check():
                binding.notes.append("stopped before the first step: the pipeline was not called")
            else:
                output = target(*args, **kwargs)
        return binding.outcome(output)

    def stream_events(
        self, target: Any, kwargs: dict[str, Any], *, tokenizer: Any, preview: str | None, preview_every: int
    ) -> StreamEvents:
        """A :class:`~stopcock.events.Step` per denoising step, with ``preview`` images when asked."""
        return StreamEvents(preview=previewer(target, preview), preview_every=preview_every)


ADAPTER = DiffusersAdapter()


class Handle:
    """What :func:`attach` yields. ``outcome`` is set when the ``with`` block exits.

    ``outcome.output`` is None: the pipeline's output is what your own call returned (nothing,
    if the run was aborted; the abort ends the ``with`` block).
    """

    def __init__(self) -> None:
        self.outcome: Outcome | None = None


@contextmanager
def attach(
    pipe: Any,
    stop: StopLike,
    *,
    mode: Mode = "finish",
    partial: Partial | None = None,
    on_step: Callable[[StepState], object] | None = None,
    stage: Stage | None = None,
) -> Iterator[Handle]:
    """Stop the calls of ``pipe`` made inside the ``with`` block on ``stop``.

    Installs what the pipeline needs (scheduler wrappers, model hooks) and removes it on exit; a finish
    works as in ``run`` (fast-forward included), and a call made after the stop is aborted before its
    loop computes. An abort raised inside the block ends the block quietly; ``handle.outcome`` says
    what happened.
    """
    if not _is_pipeline(pipe):
        raise TypeError(f"attach() takes a diffusers pipeline, got {type(pipe).__name__}")
    with RunControl(stop, mode=mode, on_step=on_step) as control:
        binding = _Binding(pipe, control, partial, stage, one_call=False)
        handle = Handle()
        with binding:
            yield handle
        handle.outcome = binding.outcome(None)


class _StepStopper:
    """A ``callback_on_step_end`` that runs the user's callback, then stops on ``stop``."""

    def __init__(
        self,
        stop: StopLike,
        on_step: Callable[[StepState], object] | None,
        callback: Callable[..., Any] | None = None,
    ) -> None:
        if callback is not None and not callable(callback):
            raise TypeError(
                f"callback must be a function, PipelineCallback or MultiPipelineCallbacks, got {callback!r}"
            )
        self.control = RunControl(stop, on_step=on_step)
        self.callback = callback

    def __call__(self, pipeline: Any, step_index: int, timestep: Any, callback_kwargs: dict[str, Any]) -> Any:
        if self.callback is not None:
            callback_kwargs = self.callback(pipeline, step_index, timestep, callback_kwargs)
            if not isinstance(callback_kwargs, dict):
                raise TypeError(
                    "a callback_on_step_end must return the callback_kwargs dict (diffusers pops from it);"
                    f" {self.callback!r} returned {type(callback_kwargs).__name__}"
                )
        if not honours_interrupt(pipeline):  # fail at the first step, not at the first stop
            _free_model_hooks(pipeline)  # the error skips the pipeline's own last line
            raise TypeError(
                f"{type(pipeline).__name__} ignores the interrupt flag, so step_callback() cannot"
                " stop it; use stopcock.run(pipe, ..., stop=...) or"
                " `with stopcock.attach(pipe, stop): pipe(...)`"
            )
        latents = callback_kwargs.get("latents")
        self.control.total = getattr(pipeline, "_num_timesteps", None)  # set by most loops before they start
        if self.control.step(steps=step_index + 1, latents=latents, timestep=timestep):
            pipeline._interrupt = True
        return callback_kwargs


class _StopperCallback(PipelineCallback):
    """:class:`_StepStopper` as a ``PipelineCallback`` (no tensor inputs of its own)."""

    tensor_inputs: list[str] = []

    def __init__(self, stopper: _StepStopper) -> None:
        super().__init__()
        self.stopper = stopper

    def callback_fn(
        self, pipeline: Any, step_index: int, timestep: Any, callback_kwargs: dict[str, Any]
    ) -> Any:
        return self.stopper(pipeline, step_index, timestep, callback_kwargs)


def step_callback(
    stop: StopLike,
    callback: Callable[..., Any] | PipelineCallback | MultiPipelineCallbacks | None = None,
    *,
    on_step: Callable[[StepState], object] | None = None,
) -> Any:
    """A ``callback_on_step_end`` that stops the pipeline (through its interrupt flag) on ``stop``.

    ``callback`` (a function, ``PipelineCallback`` or ``MultiPipelineCallbacks``) runs first at each
    step. A function keeps your ``callback_on_step_end_tensor_inputs``; for the callback objects the
    result is a ``MultiPipelineCallbacks`` with their tensor inputs. Timeouts count from this call:
    make one per run. As with diffusers' own interrupt, ``pipe.interrupt`` stays True after a stopped
    call until the next call resets it. Only for pipelines that honour interrupt; others raise a
    TypeError at their first step (use :func:`attach` or ``stopcock.run`` for them).
    """
    if isinstance(callback, (PipelineCallback, MultiPipelineCallbacks)):
        theirs = callback.callbacks if isinstance(callback, MultiPipelineCallbacks) else [callback]
        return MultiPipelineCallbacks([*theirs, _StopperCallback(_StepStopper(stop, on_step))])
    return _StepStopper(stop, on_step, callback)


def guard(pipe: Any) -> Any:
    """Make ``pipe`` reject transformers generate() arguments (``stopping_criteria=`` ...) with a clear error.

    Many pipelines take ``**kwargs`` and silently ignore them. Changes the instance's class to a
    subclass of the same name, built by the class's own metaclass (idempotent); returns ``pipe``.
    """
    if not _is_pipeline(pipe):
        raise TypeError(f"guard() takes a diffusers pipeline, got {type(pipe).__name__}")
    cls = type(pipe)
    if not vars(cls).get("_stopcock_guarded", False):
        attrs = {"__call__": _guarded_call, "_stopcock_guarded": True}
        pipe.__class__ = subclass(cls, "guard", lambda: attrs)
    return pipe


def _guarded_call(self: Any, *args: Any, **kwargs: Any) -> Any:
    _reject_generate_args(self, kwargs)
    return super(type(self), self).__call__(*args, **kwargs)
