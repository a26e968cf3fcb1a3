"""``run()``: the one entry point. Resolves the target's adapter once, binds the stop machinery, runs.

``run(target, *args, stop=, mode=, escalate_after=, on_step=, adapter=, kwargs=, checkpoint=,
**target_kwargs)``: the keyword arguments that are not ``run()``'s own go to the target, except the
options of its adapter (such as diffusers' ``partial=``). A target argument whose name ``run()`` or
an adapter uses itself (WanAnimatePipeline's own ``mode``) goes in the explicit ``kwargs=`` mapping,
which reaches the target unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from .adapters import REGISTRY, Adapter, UnsupportedTarget, resolve
from .adapters.base import Resumable
from .conditions import StopLike
from .control import RunControl
from .interrupt import catching, take
from .outcome import Outcome
from .pause import holding
from .ranks import Agreement, agreement
from .signal import StopSignal
from .state import StepState
from .types import Mode

__all__ = ["RUN_OPTIONS", "Bound", "UnsupportedTarget", "bind", "resumable", "run", "running"]

#: ``run()``'s own keyword arguments besides ``stop=``, which the streams pass through to it.
RUN_OPTIONS = ("mode", "escalate_after", "on_step", "adapter", "kwargs", "checkpoint", "group")


def resumable(adapter: Adapter) -> Resumable:
    """``adapter`` as one that can checkpoint and resume runs; a TypeError if it cannot."""
    if not (callable(getattr(adapter, "record", None)) and callable(getattr(adapter, "resume", None))):
        raise TypeError(f"the {adapter.name} adapter cannot checkpoint or resume a run (no record/resume)")
    return adapter  # type: ignore[return-value]


@contextmanager
def running(control: RunControl, target: Any) -> Iterator[RunControl]:
    """The span of one run: its control entered, and its pause signals bound to it."""
    with control, holding(control.condition, control.token, target):
        yield control


@dataclass
class Bound:
    """A call ready to run: its adapter (resolved once), the target's arguments, the adapter's
    options, and the run's control (built in the caller's thread, so bad ``stop=``/``mode=`` raise there)."""

    adapter: Adapter
    target: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    options: dict[str, Any]
    control: RunControl
    checkpoint: bool = False
    interrupt: StopSignal | None = None  # stopped by Ctrl+C during the run (stop=interrupted())
    agreement: Agreement | None = None  # the stop agreed across the ranks of a process group

    def __call__(self) -> Outcome:
        if self.interrupt is not None:
            with catching(self.interrupt):
                return self._run()
        return self._run()

    def _run(self) -> Outcome:
        control = self.control
        # running()'s two context managers, entered here directly: every call of run() enters them
        with control, holding(control.condition, control.token, self.target):
            run = resumable(self.adapter).record if self.checkpoint else self.adapter.run
            if self.agreement is None:
                return run(self.target, self.args, self.kwargs, control, **self.options)
            with self.agreement.guard():  # a peer gone mid-collective: a clear error
                return run(self.target, self.args, self.kwargs, control, **self.options)


def bind(
    target: Any,
    args: tuple[Any, ...],
    target_kwargs: dict[str, Any],
    *,
    stop: StopLike | None = None,
    mode: Mode = "finish",
    escalate_after: float | None = None,
    on_step: Callable[[StepState], object] | None = None,
    adapter: str | Adapter | None = None,
    kwargs: Mapping[str, Any] | None = None,
    checkpoint: bool = False,
    group: Any = None,
) -> Bound:
    """Check everything that can be checked before the run and bind it (see :func:`run`)."""
    stop, interrupt = take(stop)  # interrupted(): a signal of this run, stopped by its SIGINT handler
    # validates stop=, mode= and escalate_after= first
    control = RunControl(stop, mode=mode, on_step=on_step, escalate_after=escalate_after)
    found, foreign = resolve(target, REGISTRY, adapter)
    if not isinstance(checkpoint, bool):
        raise TypeError(f"checkpoint= takes True or False, got {checkpoint!r}")
    if checkpoint:
        resumable(found)
    target_kwargs = dict(target_kwargs)
    options = {name: target_kwargs.pop(name) for name in found.options if name in target_kwargs}
    if not foreign.isdisjoint(target_kwargs):
        wrong = sorted(foreign & target_kwargs.keys())
        names = ", ".join(f"{name}=" for name in wrong)
        raise TypeError(
            f"{names} is an option of another stopcock adapter, not of the {found.name} adapter that"
            f" drives a {type(target).__name__} (e.g. partial= is for diffusers pipelines); to pass it"
            f" to the target itself, use kwargs={{{wrong[0]!r}: ...}}"
        )
    if kwargs is not None:
        if not isinstance(kwargs, Mapping):
            raise TypeError(
                f"kwargs= takes a mapping of the target's keyword arguments, got {type(kwargs).__name__}"
            )
        twice = sorted(kwargs.keys() & target_kwargs.keys())
        if twice:
            raise TypeError(
                f"{', '.join(twice)} given both in kwargs= and as a keyword argument: give it once"
            )
        target_kwargs.update(kwargs)
    # a model sharded over a process group (or group=): the stop is agreed across its ranks
    agreed = agreement(target, stop, group, escalate_after=escalate_after)
    if agreed is not None:
        control = RunControl(agreed, mode=mode, on_step=on_step)
    return Bound(found, target, args, target_kwargs, options, control, checkpoint, interrupt, agreed)


def run(
    target: Any,
    *args: Any,
    stop: StopLike | None = None,
    mode: Mode = "finish",
    escalate_after: float | None = None,
    on_step: Callable[[StepState], object] | None = None,
    adapter: str | Adapter | None = None,
    kwargs: Mapping[str, Any] | None = None,
    checkpoint: bool = False,
    group: Any = None,
    **target_kwargs: Any,
) -> Outcome:
    """Run ``target(*args, **target_kwargs)`` with the stop machinery attached.

    ``stop`` is a :class:`~stopcock.StopSignal`, a condition, or a list of them
    (``stopcock.interrupted()``: Ctrl+C stops the run and keeps its partial). ``mode="finish"``
    ends at the next step and returns the (partial) output the library builds; ``mode="abort"``
    abandons the run inside the model forward at the next module call. ``escalate_after=S``
    (finish mode): a stop that no step boundary has seen S seconds after it was requested (a slow
    step) escalates to abort, keeping the last finished step's partial result; the Outcome then
    says ``mode="abort"`` and ``detail`` how long it waited. ``on_step(state)`` is called after
    each step. ``adapter`` names the adapter to use ("transformers", "diffusers", or an adapter
    object) instead of detecting it. Keyword arguments go to the target unchanged, except the
    adapter's own options (``partial=`` for diffusers); ``kwargs=`` is a mapping of target
    arguments passed as they are, for a name that ``run()`` itself uses (e.g. a pipeline's ``mode``).
    ``checkpoint=True`` records what :func:`stopcock.resume` needs to continue the run bit for bit
    later (here or in another process): ``outcome.checkpoint``, stopped or not. ``group=`` (a
    ``torch.distributed`` process group; found on a sharded model by itself, ``group=False`` turns
    that off): a stop on any rank stops every rank of the group at the same step
    (:mod:`stopcock.ranks`).
    """
    return bind(
        target, args, target_kwargs, stop=stop, mode=mode, escalate_after=escalate_after, on_step=on_step,
        adapter=adapter, kwargs=kwargs, checkpoint=checkpoint, group=group,
    )()
