"""Fast-forward: how a stopped diffusers loop runs to its own end without computing.

After a finish-mode stop a pipeline's loop may go on: it ignores ``interrupt`` or has none (LCM,
Kandinsky 3, DDPM, modular pipelines, ...). Its remaining iterations are then fast-forwarded: each
model called in the stop step answers every later call with its output of that step (a reference,
not a copy) instead of computing, and the scheduler holds the sample (the step wrapper in
:mod:`stopcock.adapters.diffusers`). What the pipeline does after its loop (decode, post-processing,
its output class) is its own code and runs once.

A forward hook cannot skip a computation, so a held model's ``__call__`` is intercepted on the run's
thread only (:func:`stopcock.intercept.intercepted`: a same-named subclass for the run): a model shared
with a pipeline running in another thread keeps computing there. An answered call runs none of the model's
hooks (nor accelerate's or diffusers' wrappers of its ``forward``): to them it did not happen. The
outputs are recorded by a wrapper of each model's call bound for the run's thread
(:func:`stopcock.hooks.output_hooks`), not by torch hooks.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from typing import Any

from torch import nn

from ..hooks import output_hooks
from ..intercept import intercepted

__all__ = ["Answers", "LoopModels"]

#: ``answers(module, args, kwargs)``: whether a held model answers this call (False: it computes).
Answers = Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], bool]


class LoopModels:
    """A run's model components: what each returned in the current step, and, once held, their answers.

    ``next_step()`` is called at each step boundary; ``hold()`` at the stop makes the models called
    in that step answer from it; ``release()`` lets them compute again (a next stage runs).
    """

    def __init__(self, models: list[nn.Module]) -> None:
        self.models = models
        self.outputs: dict[nn.Module, Any] = {}  # the current step's: model -> its last output
        self.forwarded = False  # a model ran since the last step boundary
        self.answered = 0  # calls answered without computing
        self._held = ExitStack()
        self._holding: set[nn.Module] = set()

    def recording(self) -> AbstractContextManager[None]:
        """Record each model's output, on this thread, for the ``with`` block."""
        return output_hooks(self.models, self._record)

    def _record(self, module: nn.Module, output: Any) -> None:
        self.outputs[module] = output
        self.forwarded = True

    def next_step(self) -> None:
        """A step ended: outputs recorded from now on are the next step's."""
        self.outputs = {}
        self.forwarded = False

    def hold(self, answers: Answers) -> None:
        """From now on each model called in this step answers from its output in it, when
        ``answers(module, args, kwargs)`` says so (it may also raise, to end the run)."""
        for module, output in self.outputs.items():
            if module not in self._holding:
                self._holding.add(module)
                answer = self._answer(module, output, answers)
                self._held.enter_context(intercepted(module, "__call__", answer))

    def _answer(self, module: nn.Module, output: Any, answers: Answers) -> Callable[..., Any]:
        def answer(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            if not answers(module, args, kwargs):
                return call(*args, **kwargs)
            self.answered += 1
            self.forwarded = True
            return output

        return answer

    def release(self) -> None:
        """The held models compute again."""
        self._held.close()
        self._holding.clear()
