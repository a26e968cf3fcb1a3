"""Pause in place: hold a run at its next step boundary without leaving the call.

A :class:`PauseSignal` is passed with the other conditions (``stop=[stop, pause]``). ``pause()`` from
any thread holds each run it is part of at the run's next step boundary (a token, a denoising
step; never inside a model forward); ``resume()`` lets it go on. A held run stays inside the
library's call with its state intact (a UI's Pause button, no teardown), so it continues exactly
as if never held. A stop while held ends the run at once, at the step it had reached.
``pause(release=True)`` also moves the target's models that sit on an accelerator to the CPU while
held (and back before the next step): the memory is free for something else meanwhile.

It is a signal of its own rather than a state of :class:`~stopcock.StopSignal`: a stop is final and
idempotent, a pause comes and goes; one pause can hold many runs while each keeps its own stop.
A pause holds the runs of ``run()``, ``resume()`` and the streams, which bind it to the run (so
that a stop wakes it); anywhere else a paused signal raises rather than hold a run no stop can end.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Any

from .conditions import Condition, Signalled, top_level
from .signal import StopSignal
from .state import StepState

__all__ = ["PauseSignal", "holding"]


class PauseSignal(Condition):
    """Holds the runs it is part of at their next step boundary while paused (see the module docstring)."""

    reason = "paused"  # never stops a run: check() returns None
    fires_in_forward = False  # it holds runs at step boundaries only

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._paused = False
        self._release = False
        self._runs: dict[int, tuple[StopSignal, Any]] = {}  # thread -> (its run's token, its target)
        self._held: dict[int, StepState] = {}  # thread -> the state its run is held at

    def __repr__(self) -> str:
        return f"<PauseSignal {'paused' if self._paused else 'running'}>"

    @property
    def paused(self) -> bool:
        return self._paused

    def pause(self, *, release: bool = False) -> None:
        """Hold the runs at their next step boundary; with ``release``, offload their models meanwhile."""
        with self._cond:
            self._paused, self._release = True, release

    def resume(self) -> None:
        """Let the held runs go on (idempotent)."""
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def held(self) -> list[StepState]:
        """The states the runs are held at now (empty while none is)."""
        with self._cond:
            return list(self._held.values())

    def wait_held(self, timeout: float | None = None) -> StepState | None:
        """Wait until a run is held (or ``timeout`` seconds pass); the state it is held at, or None."""
        with self._cond:
            self._cond.wait_for(lambda: bool(self._held), timeout)
            return next(iter(self._held.values()), None)

    def check(self, state: StepState) -> str | None:
        if state.block or not self._paused:
            return None
        me = threading.get_ident()
        with self._cond:
            bound = self._runs.get(me)
            if bound is None:
                raise RuntimeError(
                    "a PauseSignal holds runs of stopcock.run(), stopcock.resume() and the streams, which"
                    " bind it to the run so that a stop can end it while held; this run is not one"
                )
            token, target = bound
            if not self._paused or token.stopped:
                return None
            self._held[me] = state
            self._cond.notify_all()
        restore = _release(target) if self._release else None
        try:
            with self._cond:
                self._cond.wait_for(lambda: not self._paused or token.stopped)
        finally:
            if restore is not None:
                restore()
            with self._cond:
                del self._held[me]
        return None

    @contextmanager
    def bound(self, token: StopSignal, target: Any) -> Iterator[None]:
        """Hold the calling thread's run (its ``token``, its ``target``) while paused, until it is stopped."""
        me = threading.get_ident()

        def wake() -> None:
            with self._cond:
                self._cond.notify_all()

        with self._cond:
            self._runs[me] = (token, target)
        remove = token.on_stop(wake)
        try:
            yield
        finally:
            remove()
            with self._cond:
                self._runs.pop(me, None)


_NOT_HELD: AbstractContextManager[None] = nullcontext()  # reusable: it holds no state


def holding(condition: Condition | None, token: StopSignal, target: Any) -> AbstractContextManager[Any]:
    """Bind every :class:`PauseSignal` at the top level of a run's conditions to the run."""
    if type(condition) is Signalled:  # stop=signal, the usual case: nothing to bind
        return _NOT_HELD
    pauses = [leaf for leaf in top_level(condition) if isinstance(leaf, PauseSignal)]
    return _held(pauses, token, target) if pauses else _NOT_HELD


@contextmanager
def _held(pauses: list[PauseSignal], token: StopSignal, target: Any) -> Iterator[None]:
    with ExitStack() as stack:
        for pause in pauses:
            stack.enter_context(pause.bound(token, target))
        yield


def _models(target: Any) -> list[Any]:
    """The torch modules of a target: itself, a diffusers pipeline's components, a pipeline's model."""
    import torch

    if isinstance(target, torch.nn.Module):
        return [target]
    components = getattr(target, "components", None)
    if isinstance(components, dict):
        return [c for c in components.values() if isinstance(c, torch.nn.Module)]
    model = getattr(target, "model", None)
    return [model] if isinstance(model, torch.nn.Module) else []


def _release(target: Any) -> Callable[[], None]:
    """Move the target's models that sit on an accelerator to the CPU; returns what moves them back.

    A model under accelerate's CPU offload (``_hf_hook``) is left for its hook to bring back at its
    next forward; one whose weights are not materialised (``meta``, sequential offload) is not moved.
    """
    import torch

    back: list[tuple[Any, torch.device]] = []
    freed: set[str] = set()
    for model in _models(target):
        first = next(model.parameters(), None)
        if first is None or first.device.type in ("cpu", "meta"):
            continue
        model.to("cpu")
        freed.add(first.device.type)
        if not hasattr(model, "_hf_hook"):
            back.append((model, first.device))
    for kind in freed:
        empty_cache = getattr(getattr(torch, kind, None), "empty_cache", None)
        if callable(empty_cache):
            empty_cache()

    def restore() -> None:
        for model, device in back:
            model.to(device)

    return restore
