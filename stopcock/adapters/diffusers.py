"""Stop diffusers pipelines (``DiffusionPipeline`` and modular pipelines) at a step boundary.

How a run is bound (one mechanism for every pipeline kind):

- **Step boundary**: each scheduler of the pipeline has its ``step`` wrapped for the run. Every
  denoising loop in diffusers (classic, combined and modular) ends each step with ``scheduler.step``,
  whatever its callback API, so this counts steps where classifier-free guidance batching or separate
  conditional/unconditional denoiser calls would make counting denoiser forwards wrong. It also sees
  the latents and the scheduler's estimate of the clean sample (x0), used for ``partial="denoised"``.
  Stages (a combined pipeline's prior, then decoder) add up; a second scheduler stepped within the
  same loop is not counted twice.
- **Finish** (pipelines whose loop checks ``self.interrupt`` at every step, as
  :func:`stopcock.pipeline_facts.call_honours_interrupt` reads their source): at the boundary where
  the stop is seen, set the pipeline's own ``_interrupt`` flag. This
  happens inside the call, after the pipeline reset the flag, so it cannot be lost; the loop skips
  the remaining steps and the pipeline decodes as usual. With ``partial="denoised"`` the scheduler's
  result at that step is replaced by the x0 estimate, so that is what gets decoded.
- **Abort** (``mode="abort"``, and every other pipeline): :class:`~stopcock.control.Abort` is raised
  at the step boundary, and forward pre-hooks on the blocks of every model component raise it at the
  next block while a forward is under way. No VAE decode, no safety checker, no next stage.

Users' own ``callback_on_step_end`` / legacy ``callback`` arguments are left untouched.
"""

from __future__ import annotations

import inspect
import math
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from diffusers import DiffusionPipeline, ModularPipeline
from diffusers.callbacks import MultiPipelineCallbacks, PipelineCallback
from diffusers.schedulers.scheduling_utils import SchedulerMixin

from ..conditions import StopLike, refuse_row_conditions
from ..control import Abort, RunControl
from ..events import StreamEvents
from ..hooks import find_blocks, pre_hooks
from ..outcome import Outcome
from ..pipeline_facts import GENERATE_ONLY, call_honours_interrupt
from ..previews import previewer
from ..state import StepState
from ..types import PARTIALS, Mode, Partial, choice

__all__ = [
    "ADAPTER", "DiffusersAdapter", "attach", "step_callback", "guard", "honours_interrupt", "Handle",
    "denoisers",
]

# Component names of the denoising models (unet, transformer, transformer_2, prior, prior_prior,
# decoder, ...): models other than these are not expected to run after a finish-mode stop but the decode.
DENOISER_WORDS = frozenset({"unet", "transformer", "prior", "decoder", "denoiser"})

_active: weakref.WeakSet[Any] = weakref.WeakSet()  # pipelines with a binding installed
_active_lock = threading.Lock()


def _is_pipeline(target: object) -> bool:
    return isinstance(target, (DiffusionPipeline, ModularPipeline))


def honours_interrupt(pipe: object) -> bool:
    """Whether ``pipe.__call__`` checks ``self.interrupt`` at every step (so it can finish early).

    Decided by static analysis of the source of the class that defines the ``__call__`` actually run
    (:func:`stopcock.pipeline_facts.call_honours_interrupt`, the same facts the linter uses), so a
    subclass that overrides it is judged by its own ``__call__``; :func:`guard`'s subclass is looked
    through. A class whose source cannot be read answers False and is stopped through hooks.
    """
    for cls in type(pipe).__mro__:
        if "__call__" in vars(cls) and not vars(cls).get("_stopcock_guarded", False):
            return call_honours_interrupt(cls)
    return False


def denoisers(pipe: Any) -> dict[str, torch.nn.Module]:
    """The denoising models by component name (unet, transformer, prior, decoder, ...)."""
    return {
        name: m
        for name, m in dict(pipe.components).items()
        if isinstance(m, torch.nn.Module)
        and DENOISER_WORDS & set(name.split("_"))
        and not {"text", "vae"} & set(name.split("_"))
    }


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
    t = torch.as_tensor(timestep, device=timesteps.device, dtype=timesteps.dtype).flatten()
    if t.numel() != 1:
        return None
    hits = (timesteps == t).nonzero()
    return len(timesteps) - int(hits[0]) if len(hits) else None


def _cut_short(remaining: int | None, planned: object) -> int | None:
    """The steps left, less any the pipeline cut from the end of its loop (SDXL's ``denoising_end``).

    ``planned`` is the pipeline's ``_num_timesteps``: the length of the loop it is about to run, set
    before the loop by most pipelines (the scheduler keeps the full schedule). Only ever lowers the count.
    """
    if not isinstance(planned, int) or isinstance(planned, bool) or planned <= 0:
        return remaining
    return planned if remaining is None else min(remaining, planned)


class _StepWrapper:
    """Stands in for ``scheduler.step`` during a run; a deep copy of the scheduler gets the plain step."""

    def __init__(self, scheduler: Any, binding: _Binding) -> None:
        self.scheduler = scheduler
        self.binding = binding
        self.original = scheduler.step  # bound method (or an outer wrapper)
        # Pipelines inspect step()'s parameters to decide whether to pass generator= and eta=.
        self.__signature__ = inspect.signature(self.original)
        self.owner = threading.get_ident()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        result = self.original(*args, **kwargs)
        if threading.get_ident() != self.owner:
            return result
        # By name: not every step() takes (model_output, timestep, sample) first (CogVideoX's DPM).
        named = self.__signature__.bind(*args, **kwargs).arguments
        return self.binding.step_done(
            self.scheduler, named.get("model_output"), named.get("timestep"), named.get("sample"), result
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        copy = memo.get(id(self.scheduler))
        # A copy of the scheduler (e.g. LTX-2's audio scheduler) steps itself, unobserved.
        return self if copy is None else type(copy).step.__get__(copy)


# -- the binding ------------------------------------------------------------------------------------
class _Binding:
    """One run's hooks on one pipeline: installed on enter, removed (and the pipeline reset) on exit."""

    def __init__(self, pipe: Any, control: RunControl, partial: Partial | None = None) -> None:
        choice("partial", partial, PARTIALS, optional=True)
        refuse_row_conditions(control.condition, "a diffusers pipeline")
        self.pipe = pipe
        self.control = control
        self.partial = partial or "raw"
        self.native = control.mode == "finish" and honours_interrupt(pipe)
        self.mode = "finish" if self.native else "abort"
        self.flagged = False  # we set pipe._interrupt
        self.aborted = False
        self.latents: Any = None
        self.denoised: Any = None
        self.latents_kind: str | None = None  # "raw" or "denoised": what self.latents holds at a stop
        self.stepping: Any = None  # the scheduler whose steps are counted (the current stage's)
        self.stage_end = math.inf  # the step count at which the current stage ends, when known
        self.streams: list[Any] = []  # schedulers seen stepping beside the counted one
        self.notes: list[str] = []
        self._stack = ExitStack()

    # components
    def _components(self) -> dict[str, Any]:
        return {name: c for name, c in dict(self.pipe.components).items() if c is not None}

    def _models(self) -> dict[str, torch.nn.Module]:
        return {n: c for n, c in self._components().items() if isinstance(c, torch.nn.Module)}

    def denoisers(self) -> list[torch.nn.Module]:
        return list(denoisers(self.pipe).values())

    def schedulers(self) -> list[Any]:
        return list({id(c): c for c in self._components().values() if isinstance(c, SchedulerMixin)}.values())

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
                self._stack.enter_context(_wrapped_step(scheduler, self))
            if self.native:
                # Safety net: a denoiser forward after we set the flag means the loop ignored it.
                self._stack.enter_context(pre_hooks(self.denoisers(), self._after_flag))
            else:
                models = list(self._models().values())
                blocks = [b for m in models for b in find_blocks(m)]
                self._stack.enter_context(pre_hooks(models + blocks, lambda _m: self.control.poll()))
        except BaseException:
            self._stack.close()
            raise
        return self

    def _release(self) -> None:
        with _active_lock:
            _active.discard(self.pipe)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> bool:
        try:
            self._stack.close()
            if hasattr(self.pipe, "_interrupt"):
                self.pipe._interrupt = False
            if exc is not None:  # the pipeline's own clean-up (its last line) did not run
                _free_model_hooks(self.pipe)
        finally:
            self.control.close()
        if isinstance(exc, Abort) and exc.control is self.control:
            self.aborted = True
            return True
        return False

    def _after_flag(self, _module: torch.nn.Module) -> None:
        if self.flagged:
            if self.pipe._interrupt:  # still up: this loop ignored it (a new call resets it)
                name = type(self.pipe).__name__
                self.notes.append(f"{name} kept denoising after interrupt: aborted instead")
            else:
                self.notes.append("a call made after the stop was aborted before its first step")
            self.mode = "abort"
            raise Abort(self.control)

    # events from the wrapped scheduler.step
    def step_done(self, scheduler: Any, model_output: Any, timestep: Any, sample: Any, result: Any) -> Any:
        if scheduler is not self.stepping:
            in_stage = self.stepping is not None and self.control.steps < self.stage_end
            if in_stage or scheduler in self.streams:
                # A second stream stepped in the same loop (e.g. RFD4Proteina's): not a step of its own.
                if scheduler not in self.streams:
                    self.streams.append(scheduler)
                return result
            # A new stage (a combined pipeline's decoder after its prior): its steps add up.
            remaining = _remaining_steps(scheduler, timestep)
            if self.stepping is None:
                remaining = _cut_short(remaining, vars(self.pipe).get("_num_timesteps"))
            self.stepping = scheduler
            if remaining is not None:
                self.stage_end = self.control.total = self.control.steps + remaining
        self.latents = result[0]
        self.denoised = _denoised(scheduler, model_output, sample, result)
        extra = {"denoised": self.denoised} if self.denoised is not None else {}
        if not self.control.step(latents=self.latents, timestep=timestep, extra=extra):
            return result
        self.latents_kind = "raw"
        if self.partial == "denoised":
            if self.denoised is None:
                name = type(scheduler).__name__
                self.notes.append(f"no denoised estimate from {name}: kept the raw latents")
            else:
                self.latents, self.latents_kind = self.denoised, "denoised"
                result = _with_sample(result, self.denoised)
        if not self.native:
            raise Abort(self.control)
        self.pipe._interrupt = self.flagged = True
        return result

    def outcome(self, output: Any) -> Outcome:
        if self.control.mode == "finish" and not self.native and self.aborted:
            name = type(self.pipe).__name__
            self.notes.insert(0, f"{name} cannot finish early (it ignores interrupt): aborted instead")
        stopped = self.control.seen
        return self.control.outcome(
            None if self.aborted else output,
            mode=self.mode if stopped else self.control.mode,
            latents=self.latents,
            partial=(self.latents_kind or "raw") if stopped and self.latents is not None else None,
            detail="; ".join(self.notes) or None,
            extra={"path": "interrupt" if self.native else "hooks", "denoised": self.denoised},
        )


@contextmanager
def _wrapped_step(scheduler: Any, binding: _Binding) -> Iterator[None]:
    had_own = "step" in vars(scheduler)
    previous = vars(scheduler).get("step")
    scheduler.step = _StepWrapper(scheduler, binding)
    try:
        yield
    finally:
        if had_own:
            scheduler.step = previous
        else:
            del scheduler.step


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


def _declared_inputs(cls: type, blocks: Any) -> set[str]:
    """The inputs a pipeline names: its ``__call__`` parameters, or a modular pipeline's block inputs."""
    declared = set(inspect.signature(cls.__call__).parameters)
    return declared | set(getattr(blocks, "input_names", ()))


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
    options = frozenset({"partial"})

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
        """The adapter behind ``stopcock.run(pipe, ...)`` for diffusers pipelines (``partial=``)."""
        _reject_generate_args(target, kwargs)
        binding = _Binding(target, control, options.get("partial"))
        if len(binding.schedulers()) == 1:  # a combined pipeline's stages add up, known as each one starts
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
) -> Iterator[Handle]:
    """Stop the calls of ``pipe`` made inside the ``with`` block on ``stop``.

    Installs what the pipeline needs (scheduler step wrapper, forward pre-hooks) and removes it on
    exit. An abort raised inside the block ends the block quietly; ``handle.outcome`` says what happened.
    """
    if not _is_pipeline(pipe):
        raise TypeError(f"attach() takes a diffusers pipeline, got {type(pipe).__name__}")
    with RunControl(stop, mode=mode, on_step=on_step) as control:
        binding = _Binding(pipe, control, partial)
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


_guarded: dict[type, type] = {}  # pipeline class -> its guarded subclass


def guard(pipe: Any) -> Any:
    """Make ``pipe`` reject transformers generate() arguments (``stopping_criteria=`` ...) with a clear error.

    Many pipelines take ``**kwargs`` and silently ignore them. Changes the instance's class to a
    subclass of the same name (idempotent); returns ``pipe``.
    """
    if not _is_pipeline(pipe):
        raise TypeError(f"guard() takes a diffusers pipeline, got {type(pipe).__name__}")
    cls = type(pipe)
    if not vars(cls).get("_stopcock_guarded", False):
        if cls not in _guarded:
            attrs = {"__call__": _guarded_call, "_stopcock_guarded": True, "__module__": cls.__module__}
            _guarded[cls] = type(cls.__name__, (cls,), attrs)
        pipe.__class__ = _guarded[cls]
    return pipe


def _guarded_call(self: Any, *args: Any, **kwargs: Any) -> Any:
    _reject_generate_args(self, kwargs)
    return super(type(self), self).__call__(*args, **kwargs)
