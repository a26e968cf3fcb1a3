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

A run is :class:`~stopcock.adapters.diffusers_run.RunBinding` (installs and removes) over
:class:`~stopcock.adapters.diffusers_run.PipelineRun` (one explicit
:class:`~stopcock.adapters.diffusers_run.Phase`), whose parts are in
:mod:`stopcock.adapters.diffusers_parts`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from diffusers import DiffusionPipeline, ModularPipeline
from diffusers.callbacks import MultiPipelineCallbacks, PipelineCallback

from ..conditions import StopLike, as_condition, watches_x0
from ..control import RunControl
from ..events import StreamEvents
from ..intercept import subclass
from ..outcome import Outcome
from ..pipeline_facts import GENERATE_ONLY, call_honours_interrupt
from ..previews import previewer
from ..state import StepState
from ..types import Mode, Partial
from .diffusers_run import RunBinding, Stage, free_model_hooks

__all__ = ["ADAPTER", "DiffusersAdapter", "attach", "step_callback", "guard", "honours_interrupt", "Handle"]

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


def _reject_generate_args(pipe: Any, kwargs: dict[str, Any]) -> None:
    """Refuse generate() arguments the pipeline does not declare (AudioLDM2 has its own max_new_tokens)."""
    declared = _declared_inputs(type(pipe), getattr(pipe, "blocks", None))
    wrong = sorted((GENERATE_ONLY & kwargs.keys()) - declared)
    if wrong:
        name = type(pipe).__name__
        if len(wrong) == 1:
            what = f"{wrong[0]} is a transformers generate() argument; {name} would ignore or reject it"
        else:
            names = f"{', '.join(wrong[:-1])} and {wrong[-1]}"
            what = f"{names} are transformers generate() arguments; {name} would ignore or reject them"
        raise TypeError(
            f"{what}. To stop a diffusers pipeline pass"
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
        binding = RunBinding(target, control, options.get("partial"), options.get("stage"))
        if len(binding.schedulers) == 1 and not binding.stages:  # stages add up as each one starts
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
        binding = RunBinding(pipe, control, partial, stage, one_call=False)
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
            free_model_hooks(pipeline)  # the error skips the pipeline's own last line
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
    if watches_x0(as_condition(stop)):
        raise ValueError(
            "converged() watches the scheduler's x0 estimate, which a step callback does not see:"
            " use stopcock.run(pipe, ..., stop=...) or stopcock.attach(pipe, stop)"
        )
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
