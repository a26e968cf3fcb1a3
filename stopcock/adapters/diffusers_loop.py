"""Fast-forward: how a stopped diffusers loop runs to its own end without computing.

After a finish-mode stop a pipeline's loop may go on: it ignores ``interrupt`` or has none (LCM,
Kandinsky 3, DDPM, modular pipelines, ...). Its remaining iterations are then fast-forwarded: each
model called in the stop step answers every later call with its output of that step (a reference,
not a copy) instead of computing, and the scheduler holds the sample (the step wrapper in
:mod:`stopcock.adapters.diffusers`). What the pipeline does after its loop (decode, post-processing,
its output class) is its own code and runs once.

A forward hook cannot skip a computation, so a held model's class is swapped, for the run, for a
subclass of the same name whose ``__call__`` answers on the run's thread only: a model shared with a
pipeline running in another thread keeps computing there. An answered call runs none of the model's
hooks (nor accelerate's or diffusers' wrappers of its ``forward``): to them it did not happen. The
outputs are recorded by torch forward hooks.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

from torch import nn

from ..hooks import output_hooks

__all__ = ["Answers", "Handler", "LoopModels", "intercepted"]

#: ``handler(call, args, kwargs)``: what an intercepted call returns (``call`` computes, as usual).
Handler = Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]
#: ``answers(module, args, kwargs)``: whether a held model answers this call (False: it computes).
Answers = Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], bool]

# model -> thread -> its handlers, innermost last
_handlers: weakref.WeakKeyDictionary[nn.Module, dict[int, list[Handler]]] = weakref.WeakKeyDictionary()
_subclasses: dict[type, type] = {}  # a model class -> its intercepting subclass
_lock = threading.Lock()


def _intercepting(cls: type[nn.Module]) -> type[nn.Module]:
    """``cls`` with a ``__call__`` that hands this thread's calls to its handler, if it has one."""
    if cls not in _subclasses:

        def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            handlers = _handlers.get(self, {}).get(threading.get_ident())
            if not handlers:
                return cls.__call__(self, *args, **kwargs)
            return handlers[-1](functools.partial(cls.__call__, self), args, kwargs)

        attrs = {"__call__": __call__, "__module__": cls.__module__, "__qualname__": cls.__qualname__}
        _subclasses[cls] = type(cls.__name__, (cls,), attrs)
    return _subclasses[cls]


@contextmanager
def intercepted(module: nn.Module, handler: Handler) -> Iterator[None]:
    """While active, this thread's calls of ``module`` return ``handler(call, args, kwargs)`` instead
    of ``call(*args, **kwargs)`` (the innermost one, when nested); other threads' calls are untouched.
    The last one out puts the module's class back."""
    ident = threading.get_ident()
    with _lock:
        if type(module) not in _subclasses.values():
            module.__class__ = _intercepting(type(module))
        _handlers.setdefault(module, {}).setdefault(ident, []).append(handler)
    try:
        yield
    finally:
        with _lock:
            threads = _handlers.get(module, {})
            mine = threads.get(ident, [])
            mine.remove(handler)
            if not mine:
                threads.pop(ident, None)
            if not threads:
                _handlers.pop(module, None)
                if type(module) in _subclasses.values():
                    module.__class__ = type(module).__mro__[1]


class LoopModels:
    """A run's model components: what each returned in the current step, and, once held, their answers.

    ``next_step()`` is called at each step boundary; ``hold()`` at the stop makes the models called
    in that step answer from it; ``release()`` lets them compute again (a next stage runs).
    """

    def __init__(self, models: list[nn.Module]) -> None:
        self.models = models
        self.outputs: dict[nn.Module, Any] = {}  # the current step's: model -> its last output
        self.forwarded = False  # a model ran since the last step boundary
        self.calls = 0  # model calls since the last step boundary, answered ones included
        self.answered = 0  # calls answered without computing
        self._held = ExitStack()
        self._holding: set[nn.Module] = set()

    def recording(self) -> AbstractContextManager[None]:
        """Record each model's output, on this thread, for the ``with`` block."""
        return output_hooks(self.models, self._record)

    def _record(self, module: nn.Module, output: Any) -> None:
        self.outputs[module] = output
        self.forwarded = True
        self.calls += 1

    def next_step(self) -> None:
        """A step ended: outputs recorded from now on are the next step's."""
        self.outputs = {}
        self.forwarded = False
        self.calls = 0

    def hold(self, answers: Answers) -> None:
        """From now on each model called in this step answers from its output in it, when
        ``answers(module, args, kwargs)`` says so (it may also raise, to end the run)."""
        for module, output in self.outputs.items():
            if module not in self._holding:
                self._holding.add(module)
                self._held.enter_context(intercepted(module, self._answer(module, output, answers)))

    def _answer(self, module: nn.Module, output: Any, answers: Answers) -> Handler:
        def answer(call: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if not answers(module, args, kwargs):
                return call(*args, **kwargs)
            self.answered += 1
            self.forwarded = True
            self.calls += 1
            return output

        return answer

    def release(self) -> None:
        """The held models compute again."""
        self._held.close()
        self._holding.clear()
