"""``run()``: the one entry point. Picks the adapter for the target and returns an Outcome."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from .control import RunControl
from .outcome import Outcome
from .state import StepState

__all__ = ["run", "UnsupportedTarget", "adapter_for"]

# Adapter modules, tried in order. Each defines ``accepts(target) -> bool``, ``KIND`` (a phrase
# naming what it drives) and ``run(target, args, kwargs, control, **options) -> Outcome``.
_ADAPTER_MODULES = ("stopcock.adapters.transformers", "stopcock.adapters.diffusers")


class UnsupportedTarget(TypeError):
    """``run()`` was given something no adapter drives."""


class Adapter(Protocol):
    KIND: str

    def accepts(self, target: object) -> bool: ...

    def run(
        self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], control: RunControl, **options: Any
    ) -> Outcome: ...


def _adapters() -> Iterator[Adapter]:
    """The adapter modules, imported one at a time (a text run never pays for importing diffusers)."""
    for name in _ADAPTER_MODULES:
        try:
            yield importlib.import_module(name)
        except ImportError as exc:  # the library is not installed: its targets cannot exist either
            if exc.name not in ("transformers", "diffusers", "torch"):
                raise


def adapter_for(target: object) -> Adapter:
    """The adapter that drives ``target``, or :class:`UnsupportedTarget` listing what is supported."""
    adapters = []
    for adapter in _adapters():
        if adapter.accepts(target):
            return adapter
        adapters.append(adapter)
    kinds = "; ".join(a.KIND for a in adapters) or "none: install stopcock[transformers] or [diffusers]"
    raise UnsupportedTarget(f"stopcock cannot run a {type(target).__name__!r}. Supported targets: {kinds}.")


def run(
    target: Any,
    *args: Any,
    stop: object = None,
    mode: str = "finish",
    on_step: Callable[[StepState], object] | None = None,
    **kwargs: Any,
) -> Outcome:
    """Run ``target(*args, **kwargs)`` with the stop machinery attached.

    ``stop`` is a :class:`~stopcock.StopSignal`, a condition, or a list of them. ``mode="finish"``
    ends at the next step and returns the (partial) output the library builds; ``mode="abort"``
    abandons the run inside the model forward at the next block. ``on_step(state)`` is called after
    each step. Other keyword arguments go to the target unchanged, except adapter options such as
    ``partial=`` for diffusers.
    """
    control = RunControl(stop, mode=mode, on_step=on_step)  # validates stop= and mode= first
    adapter = adapter_for(target)
    options = {k: kwargs.pop(k) for k in ("partial",) if k in kwargs}
    with control:
        return adapter.run(target, args, kwargs, control, **options)
