"""A run's checks inside a model forward, armed only when needed.

Abort mode's check (:meth:`~stopcock.control.RunControl.poll`, the part of it past the fast path:
:meth:`ForwardChecks.abort_if_stopped`) and an escalating finish-mode stop's
(:meth:`ForwardChecks.escalation`) run before every module call on the run's thread, from a
:class:`~stopcock.hooks.Tripwire` that :meth:`ForwardChecks.intercept` makes and the run's
:class:`~stopcock.wires.Wires` arm the moment a stop becomes possible (abort) or has waited
``escalate_after`` seconds unseen (escalate). Until then nothing is installed in any model.

Both checks run only on the run's own thread, inside a forward: a stop seen here ends the run by
raising the run's ``Abort`` (a BaseException), which only the adapter that started the run catches.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, Protocol

from .conditions import Condition
from .limits import TimeLimits
from .signal import StopSignal
from .state import StepState
from .wires import Arming, Wires, tripwire

if TYPE_CHECKING:
    from torch import nn

__all__ = ["ForwardChecks"]

_NO_CHECKS: AbstractContextManager[None] = nullcontext()  # reusable: it holds no state


class _Run(Protocol):
    """What the checks read and set of their run (a :class:`~stopcock.control.RunControl`)."""

    token: StopSignal
    condition: Condition | None
    escalate_after: float | None
    limits: TimeLimits
    seen: bool  # a check (at a step boundary or here) has seen the stop
    escalated: float | None

    @property
    def mode(self) -> str: ...

    def should_stop(self, state: StepState) -> bool: ...

    def state(self, *, block: bool = False, **tensors: Any) -> StepState: ...

    def poll(self) -> None: ...


class ForwardChecks:
    """One run's checks inside the forward. ``abort(run)`` builds the exception that ends the run."""

    __slots__ = ("_abort", "_run", "_wires")

    def __init__(self, run: _Run, wires: Wires, abort: Callable[[Any], BaseException]) -> None:
        self._run, self._wires, self._abort = run, wires, abort

    def stopped(self) -> bool:
        """Whether the run is stopped, its conditions evaluated on a state inside the forward."""
        run = self._run
        return run.token.stopped or (run.condition is not None and run.should_stop(run.state(block=True)))

    def abort_if_stopped(self) -> None:
        """Abort mode's check once a stop is possible: raise the run's abort if it is stopped."""
        if self.stopped():
            run = self._run
            run.seen = True
            raise self._abort(run)

    def escalation(self, _module: nn.Module) -> None:
        """The check of an escalated finish-mode stop: abort unless a step boundary saw the stop
        already (the library is then finishing as asked, e.g. decoding the image)."""
        run = self._run
        if run.seen:
            return
        if self.stopped():
            now = time.monotonic()
            run.seen = True
            run.escalated = now - run.limits.requested_by(run.token.stopped_at, now)
            raise self._abort(run)

    def intercept(self, abort: bool | None) -> AbstractContextManager[None]:
        """A check before every module call on this thread (the run's models, any module the run
        calls) during the ``with`` block, armed only when needed: in abort mode (``mode="abort"``,
        or ``abort=True`` for a target that cannot finish early) once a stop is possible, in
        finish mode with ``escalate_after`` once a stop has waited that long unseen; otherwise
        nothing is ever installed."""
        run = self._run
        abort = run.mode == "abort" if abort is None else abort
        if not abort and run.escalate_after is None:
            return _NO_CHECKS
        wire = tripwire()(None, (lambda _m: run.poll()) if abort else self.escalation)
        return Arming(self._wires, wire, "abort" if abort else "escalate", closes=wire)
