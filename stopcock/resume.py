"""``stopcock.resume(target, checkpoint, ...)``: continue a checkpointed run where it stopped.

The checkpoint's own adapter resumes it (its ``kind``), after checking that ``target`` is the one
it was made with. The Outcome is that of the whole run (``steps`` count from its start) and says
how it resumed (``resumed``): by replay (diffusers), from the saved cache (text), or, where the
cache could not be kept, by recomputing it (not guaranteed bit-identical, said in the Outcome).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

from .adapters import REGISTRY, UnsupportedTarget, resolve
from .conditions import StopLike
from .control import RunControl
from .interrupt import catching, take
from .outcome import Outcome
from .runner import resumable, running
from .state import StepState
from .types import Mode

if TYPE_CHECKING:
    from .checkpoint import Checkpoint

__all__ = ["resume"]


def resume(
    target: Any,
    checkpoint: Checkpoint,
    *,
    stop: StopLike | None = None,
    mode: Mode = "finish",
    on_step: Callable[[StepState], object] | None = None,
    record: bool = False,
    kwargs: Mapping[str, Any] | None = None,
    **given: Any,
) -> Outcome:
    """Continue ``checkpoint`` (from ``run(..., checkpoint=True)`` or :meth:`Checkpoint.load`) on ``target``.

    The output equals, bit for bit, that of the same run never stopped (where ``outcome.resumed``
    says ``exact``). ``stop``, ``mode`` and ``on_step`` are this run's, as for :func:`stopcock.run`
    (``on_step`` is called from the first step after the checkpoint's). ``record=True`` puts a new
    checkpoint on the Outcome, to stop and resume again. The adapter's options (``partial=``) are
    taken as in ``run``; other keyword arguments (or ``kwargs=``) give again the call's arguments
    that a checkpoint file cannot hold (``checkpoint.live`` names them: callbacks, a tokenizer, ...).
    """
    from .checkpoint import Checkpoint, CheckpointMismatch  # torch: imported once a checkpoint exists

    if not isinstance(checkpoint, Checkpoint):
        raise TypeError(
            f"resume() takes a stopcock.Checkpoint (outcome.checkpoint, or Checkpoint.load(path)), got"
            f" {type(checkpoint).__name__}"
        )
    stop, interrupt = take(stop)  # interrupted(): a signal of this run, stopped by its SIGINT handler
    control = RunControl(stop, mode=mode, on_step=on_step)
    try:
        found, _ = resolve(target, REGISTRY, checkpoint.kind)
    except (UnsupportedTarget, ValueError):
        raise CheckpointMismatch(
            f"this is a {checkpoint.describe()}; {type(target).__name__} is not a target of the"
            f" {checkpoint.kind} adapter: resume it with the"
            f" {checkpoint.fingerprint.get('target', 'same target')} it was made with"
        ) from None
    given = {**given, **(kwargs or {})}
    options = {name: given.pop(name) for name in found.options if name in given}
    with catching(interrupt) if interrupt is not None else nullcontext(), running(control, target):
        return resumable(found).resume(target, checkpoint, control, given, record=record, **options)
