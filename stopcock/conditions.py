"""Composable stop conditions: ``timeout(5) | max_steps(20)``.

A condition is a reusable, stateless description. ``check(state)`` returns the reason to stop, or
None. Time is measured from the start of each run (``state.elapsed``), so one condition object can
serve many runs, concurrently too. ``|`` stops when any part does, ``&`` when all parts do.
"""

from __future__ import annotations

import datetime as _dt
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from .signal import StopSignal
from .state import StepState

__all__ = [
    "Condition",
    "AnyOf",
    "AllOf",
    "Signalled",
    "Timeout",
    "Deadline",
    "MaxSteps",
    "StopStrings",
    "When",
    "timeout",
    "deadline",
    "max_steps",
    "stop_strings",
    "when",
    "StopLike",
    "as_condition",
    "from_options",
    "refuse_row_conditions",
    "stop_strings_of",
    "top_level",
]


class Condition:
    """Base class. Subclasses set ``reason`` and implement :meth:`check`.

    A *row condition* (``per_row = True``, e.g. :class:`StopStrings`) ends each generated row on
    its own; it never fires from :meth:`check`, and only the adapters that can apply it per row
    accept it (see :func:`stop_strings_of` and :func:`refuse_row_conditions`).

    A condition of your own sees every step. ``fires_in_forward = False`` says its :meth:`check`
    returns None on a state inside a forward (``state.block``): abort mode then arms its in-forward
    checks only once something else makes a stop possible, instead of from the start of the run.
    """

    reason: str = "condition"
    per_row = False
    fires_in_forward = True

    def check(self, state: StepState) -> str | None:
        raise NotImplementedError

    def __or__(self, other: object) -> AnyOf:
        return AnyOf(self, as_condition(other))

    def __ror__(self, other: object) -> AnyOf:
        return AnyOf(as_condition(other), self)

    def __and__(self, other: object) -> AllOf:
        return AllOf(self, as_condition(other))

    def __rand__(self, other: object) -> AllOf:
        return AllOf(as_condition(other), self)

    def parts(self) -> Iterable[Condition]:
        """The leaf conditions inside this one (itself for a leaf)."""
        yield self


class _Composite(Condition):
    def __init__(self, *conditions: Condition | StopSignal) -> None:
        flat: list[Condition] = []
        for c in map(as_condition, conditions):
            flat.extend(c.conditions if type(c) is type(self) else [c])  # type: ignore[attr-defined]
        self.conditions: tuple[Condition, ...] = tuple(flat)

    def parts(self) -> Iterable[Condition]:
        for c in self.conditions:
            yield from c.parts()

    def __repr__(self) -> str:
        return "(" + f" {self._op} ".join(map(repr, self.conditions)) + ")"

    _op = "?"


class AnyOf(_Composite):
    """Stops when any part stops; the reason is that of the first part that fires."""

    _op = "|"

    def check(self, state: StepState) -> str | None:
        for c in self.conditions:
            reason = c.check(state)
            if reason is not None:
                return reason
        return None


class AllOf(_Composite):
    """Stops when every part would stop; the reason joins theirs with ``&``."""

    _op = "&"

    def check(self, state: StepState) -> str | None:
        reasons = []
        for c in self.conditions:
            reason = c.check(state)
            if reason is None:
                return None
            reasons.append(reason)
        return "&".join(reasons)


class Signalled(Condition):
    """A :class:`StopSignal` as a condition; the reason is the one given to ``stop()``."""

    def __init__(self, signal: StopSignal) -> None:
        self.signal = signal

    def check(self, state: StepState) -> str | None:
        return self.signal.reason

    def __repr__(self) -> str:
        return repr(self.signal)


class Timeout(Condition):
    """Stops once ``seconds`` have passed since the start of the run."""

    reason = "timeout"

    def __init__(self, seconds: float) -> None:
        seconds = float(seconds)
        if not seconds >= 0 or math.isinf(seconds):
            raise ValueError(f"timeout needs a finite number of seconds >= 0, got {seconds!r}")
        self.seconds = seconds

    def check(self, state: StepState) -> str | None:
        return self.reason if state.elapsed >= self.seconds else None

    def __repr__(self) -> str:
        return f"timeout({self.seconds:g})"


class Deadline(Condition):
    """Stops at a wall-clock time (epoch seconds, or a timezone-aware datetime)."""

    reason = "deadline"

    def __init__(self, when: float | _dt.datetime) -> None:
        if isinstance(when, _dt.datetime):
            if when.tzinfo is None:
                raise ValueError(
                    "deadline needs an aware datetime (e.g. datetime.now(timezone.utc) + ...)"
                    " or epoch seconds; got a naive datetime"
                )
            when = when.timestamp()
        if isinstance(when, bool) or not isinstance(when, (int, float)) or math.isnan(when):
            raise TypeError(f"deadline takes epoch seconds or an aware datetime, got {when!r}")
        self.when = float(when)

    def check(self, state: StepState) -> str | None:
        return self.reason if time.time() >= self.when else None

    def __repr__(self) -> str:
        return f"deadline({self.when!r})"


class MaxSteps(Condition):
    """Stops once ``n`` steps are done (tokens generated, denoising steps, items)."""

    reason = "max_steps"

    def __init__(self, n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"max_steps needs an int >= 0, got {n!r}")
        self.n = n

    def check(self, state: StepState) -> str | None:
        return self.reason if state.step >= self.n else None

    def __repr__(self) -> str:
        return f"max_steps({self.n})"


class StopStrings(Condition):
    """Stops a text row once its generated text contains one of ``strings``.

    Applied per row by the transformers adapter through transformers' own ``StopStringCriteria``
    (it needs the tokenizer, which the adapter supplies); it has no meaning for other targets.
    """

    reason = "stop_string"
    per_row = True

    def __init__(self, strings: Sequence[str]) -> None:
        if isinstance(strings, str):
            strings = [strings]
        strings = list(strings)
        if not strings or not all(isinstance(s, str) and s for s in strings):
            raise ValueError(f"stop_strings needs a list of non-empty strings, got {strings!r}")
        self.strings = strings

    def check(self, state: StepState) -> str | None:
        return None  # a row condition: applied per row by the adapter, see the class docstring

    def __repr__(self) -> str:
        return f"stop_strings({self.strings!r})"


class When(Condition):
    """Stops when ``predicate(state)`` is true; checked at step boundaries only."""

    def __init__(self, predicate: Callable[[StepState], Any], reason: str = "condition") -> None:
        if not callable(predicate):
            raise TypeError(f"when() needs a callable taking a StepState, got {predicate!r}")
        if not isinstance(reason, str) or not reason:  # checked now, not when the stop comes mid-run
            raise TypeError(f"when() needs a non-empty str reason=, got {reason!r}")
        self.predicate = predicate
        self.reason = reason

    def check(self, state: StepState) -> str | None:
        if state.block:
            return None
        return self.reason if self.predicate(state) else None

    def __repr__(self) -> str:
        return f"when({getattr(self.predicate, '__name__', self.predicate)!r}, reason={self.reason!r})"


def timeout(seconds: float) -> Timeout:
    """Stop ``seconds`` after the start of each run."""
    return Timeout(seconds)


def deadline(when: float | _dt.datetime) -> Deadline:
    """Stop at a wall-clock time: epoch seconds or an aware datetime."""
    return Deadline(when)


def max_steps(n: int) -> MaxSteps:
    """Stop after ``n`` steps."""
    return MaxSteps(n)


def stop_strings(strings: Sequence[str]) -> StopStrings:
    """Stop each text row once it has produced one of ``strings``."""
    return StopStrings(strings)


def when(predicate: Callable[[StepState], Any], reason: str = "condition") -> When:
    """Stop when ``predicate(state)`` is true, reporting ``reason``."""
    return When(predicate, reason)


#: What ``stop=`` accepts: a signal, a condition, or a non-empty list of these (any of them stops).
StopLike = StopSignal | Condition | Sequence[StopSignal | Condition]


def as_condition(stop: object) -> Condition:
    """Normalise what ``stop=`` accepts (:data:`StopLike`) into one condition."""
    if isinstance(stop, Condition):
        return stop
    if isinstance(stop, StopSignal):
        return Signalled(stop)
    if isinstance(stop, (list, tuple)) and stop:
        return AnyOf(*(as_condition(s) for s in stop))
    got = f"an empty {type(stop).__name__}" if isinstance(stop, (list, tuple)) else type(stop).__name__
    raise TypeError(
        "stop= accepts a stopcock.StopSignal, a condition (stopcock.timeout, deadline, max_steps,"
        f" stop_strings, when, combined with | and &), or a non-empty list of these; got {got}"
    )


def top_level(condition: Condition | None) -> tuple[Condition, ...]:
    """The parts any of which stops the run on its own: those of a top-level ``|``, or the condition."""
    if condition is None:
        return ()
    return condition.conditions if isinstance(condition, AnyOf) else (condition,)


def stop_strings_of(condition: Condition | None) -> list[str]:
    """The strings of the ``stop_strings`` conditions, which end rows at the top level only.

    A row condition inside an ``&`` could not end its row on its own: a ValueError names the fix.
    """
    found = [c for c in top_level(condition) if isinstance(c, StopStrings)]
    nested = sum(c.per_row for c in condition.parts()) if condition is not None else 0
    if nested > len(found):
        raise ValueError(
            "stop_strings(...) ends each row on its own, so it cannot be part of an & (AllOf) condition;"
            " combine it with | instead, e.g. stop=signal | stopcock.stop_strings([...])"
        )
    return [s for c in found for s in c.strings]


def refuse_row_conditions(
    condition: Condition | None,
    target: str,
    fix: str = "use a StopSignal, timeout(), deadline(), max_steps() or when()",
) -> None:
    """A ValueError if ``condition`` holds a row condition, which ``target`` cannot apply."""
    if condition is not None and any(c.per_row for c in condition.parts()):
        raise ValueError(f"stop_strings() applies to text generation only, not to {target}; {fix}")


#: The options of :func:`from_options`, each with the condition it builds.
OPTIONS: dict[str, Callable[[Any], Condition]] = {
    "timeout": Timeout,
    "deadline": Deadline,
    "max_steps": MaxSteps,
    "stop_strings": StopStrings,
}


def from_options(options: Mapping[str, Any]) -> list[Condition]:
    """The conditions named in an options mapping (a server job's ``stop``, the CLI's flags):
    ``{"timeout": 5, "max_steps": 20, "stop_strings": ["\\n"]}``; None or empty values are skipped."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"unknown stop option(s) {unknown}; known: {sorted(OPTIONS)}")
    return [OPTIONS[name](options[name]) for name in OPTIONS if options.get(name) not in (None, [], ())]
