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
    "Repetition",
    "SoftTimeout",
    "SoftDeadline",
    "Converged",
    "When",
    "timeout",
    "deadline",
    "max_steps",
    "stop_strings",
    "repetition",
    "converged",
    "when",
    "StopLike",
    "as_condition",
    "from_options",
    "refuse_row_conditions",
    "row_conditions_of",
    "stop_strings_of",
    "at_boundary",
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


#: What a soft deadline's ``grace=`` may be: the boundary a row ends at once the time is up.
GRACES = ("sentence", "line")
#: Characters that end a sentence, and those that may follow its end (closing quotes and brackets).
_SENTENCE_ENDS = ".!?\u2026\u3002\uff01\uff1f"
_CLOSERS = "\"')]}\u201d\u2019\u00bb"


def at_boundary(text: str, grace: str) -> bool:
    """Whether ``text`` ends at a ``grace`` boundary: a line (``"line"``: it ends with a newline) or
    a sentence (``"sentence"``: a newline, or ``.``, ``!``, ``?`` perhaps followed by closing quotes,
    brackets or spaces)."""
    if grace == "line":
        return text.endswith("\n")
    stripped = text.rstrip(" \t")
    if stripped.endswith("\n"):
        return True
    stripped = stripped.rstrip(_CLOSERS)
    return bool(stripped) and stripped[-1] in _SENTENCE_ENDS


def _grace_of(grace: object, grace_max: object, what: str) -> tuple[str, float]:
    if grace not in GRACES:
        raise ValueError(f"{what}(grace=...) takes one of {list(GRACES)}, got {grace!r}")
    if isinstance(grace_max, bool) or not isinstance(grace_max, (int, float)):
        raise TypeError(f"{what}(grace_max=...) takes seconds (a number >= 0), got {grace_max!r}")
    limit = float(grace_max)
    if not limit >= 0 or math.isinf(limit):
        raise ValueError(f"{what}(grace_max=...) needs a finite number of seconds >= 0, got {grace_max!r}")
    return str(grace), limit


class SoftTimeout(Timeout):
    """A timeout with grace: once ``seconds`` have passed, each text row ends at its next ``grace``
    boundary (:func:`at_boundary` on its decoded text) with reason ``"timeout"``; ``grace_max``
    seconds later the run stops whatever the rows say (the hard limit).

    A row condition (applied per row by the transformers adapter, which decodes each row with the
    tokenizer); :meth:`check` is the hard limit, checked at step boundaries.
    """

    per_row = True
    fires_in_forward = False

    def __init__(self, seconds: float, grace: str = "sentence", grace_max: float = 10.0) -> None:
        super().__init__(seconds)
        self.grace, self.grace_max = _grace_of(grace, grace_max, "timeout")

    def due(self, elapsed: float) -> bool:
        """Whether the time is up (the grace has begun), ``elapsed`` seconds into the run."""
        return elapsed >= self.seconds

    def check(self, state: StepState) -> str | None:
        if state.block:
            return None
        return self.reason if state.elapsed >= self.seconds + self.grace_max else None

    def __repr__(self) -> str:
        return f"timeout({self.seconds:g}, grace={self.grace!r}, grace_max={self.grace_max:g})"


class SoftDeadline(Deadline):
    """A deadline with grace: once the wall-clock time ``when`` has come, each text row ends at its
    next ``grace`` boundary with reason ``"deadline"``; ``grace_max`` seconds later the run stops
    whatever the rows say (the hard limit). A row condition, as :class:`SoftTimeout` is."""

    per_row = True
    fires_in_forward = False

    def __init__(self, when: float | _dt.datetime, grace: str = "sentence", grace_max: float = 10.0) -> None:
        super().__init__(when)
        self.grace, self.grace_max = _grace_of(grace, grace_max, "deadline")

    def due(self, elapsed: float) -> bool:
        """Whether the time is up (the grace has begun); ``elapsed`` is unused (wall-clock time)."""
        return time.time() >= self.when

    def check(self, state: StepState) -> str | None:
        if state.block:
            return None
        return self.reason if time.time() >= self.when + self.grace_max else None

    def __repr__(self) -> str:
        return f"deadline({self.when!r}, grace={self.grace!r}, grace_max={self.grace_max:g})"


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


class Repetition(Condition):
    """Stops a text row once it loops: the ``ngram`` tokens it ends with have occurred ``repeats``
    times within its last ``window`` generated tokens (the newest occurrence included).

    Applied per row by the transformers adapter, with reason ``"repetition"``; a loop whose period
    is longer than ``window / repeats`` tokens is not caught. :meth:`loops` is the rule on one row.
    """

    reason = "repetition"
    per_row = True
    fires_in_forward = False  # it never fires from check(): abort mode needs no in-forward checks for it

    def __init__(self, ngram: int = 4, repeats: int = 3, window: int = 64) -> None:
        for name, value, least in (("ngram", ngram, 1), ("repeats", repeats, 2), ("window", window, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"repetition({name}=...) needs an int >= {least}, got {value!r}")
        if window < ngram * repeats:
            raise ValueError(
                f"repetition(window={window}) cannot hold {repeats} repeats of a {ngram}-token n-gram:"
                f" use window >= ngram * repeats ({ngram * repeats})"
            )
        self.ngram, self.repeats, self.window = ngram, repeats, window

    def loops(self, generated: Sequence[int]) -> bool:
        """Whether a row whose generated tokens are ``generated`` loops by this rule."""
        n = self.ngram
        tail = list(generated[-self.window :])
        if len(tail) < n * self.repeats:
            return False
        last = tail[-n:]
        count = sum(tail[i : i + n] == last for i in range(len(tail) - n + 1))
        return count >= self.repeats

    def check(self, state: StepState) -> str | None:
        return None  # a row condition: applied per row by the adapter, see the class docstring

    def __repr__(self) -> str:
        return f"repetition(ngram={self.ngram}, repeats={self.repeats}, window={self.window})"


class Converged(Condition):
    """Stops a diffusion run once its estimate of the clean image (x0) stops changing: ``patience``
    steps in a row each moved it by less than ``tol`` (relative RMS change, 0.02 = 2%).

    The diffusers adapter reports the changes as ``state.extra["denoised_changes"]`` when a run's
    condition holds this one, and keeps the x0 estimate as the result (``partial="denoised"`` unless
    ``partial=`` says otherwise). A loop whose scheduler gives no x0 estimate never converges.
    A shorter schedule often beats it: see the docs' quality-stops page.
    """

    reason = "converged"
    fires_in_forward = False

    def __init__(self, tol: float = 0.02, patience: int = 2) -> None:
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not 0 < tol < math.inf:
            raise ValueError(f"converged(tol=...) needs a relative change > 0 (e.g. 0.02), got {tol!r}")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ValueError(f"converged(patience=...) needs an int >= 1, got {patience!r}")
        self.tol, self.patience = float(tol), patience

    def check(self, state: StepState) -> str | None:
        if state.block:
            return None
        changes = state.extra.get("denoised_changes") or ()
        recent = changes[-self.patience :]
        return self.reason if len(recent) == self.patience and max(recent) < self.tol else None

    def __repr__(self) -> str:
        return f"converged(tol={self.tol:g}, patience={self.patience})"


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


def timeout(seconds: float, grace: str | None = None, grace_max: float = 10.0) -> Timeout:
    """Stop ``seconds`` after the start of each run.

    With ``grace="sentence"`` or ``"line"`` (text generation), each row ends at its next sentence or
    line boundary once the time is up, and the run stops ``grace_max`` seconds later at the latest.
    """
    return Timeout(seconds) if grace is None else SoftTimeout(seconds, grace, grace_max)


def deadline(when: float | _dt.datetime, grace: str | None = None, grace_max: float = 10.0) -> Deadline:
    """Stop at a wall-clock time: epoch seconds or an aware datetime.

    ``grace=`` and ``grace_max=`` as for :func:`timeout`: each text row ends at its next boundary.
    """
    return Deadline(when) if grace is None else SoftDeadline(when, grace, grace_max)


def max_steps(n: int) -> MaxSteps:
    """Stop after ``n`` steps."""
    return MaxSteps(n)


def stop_strings(strings: Sequence[str]) -> StopStrings:
    """Stop each text row once it has produced one of ``strings``."""
    return StopStrings(strings)


def repetition(ngram: int = 4, repeats: int = 3, window: int = 64) -> Repetition:
    """Stop each text row once it loops: its last ``ngram`` tokens seen ``repeats`` times within
    its last ``window`` tokens (reason ``"repetition"``)."""
    return Repetition(ngram, repeats, window)


def converged(tol: float = 0.02, patience: int = 2) -> Converged:
    """Stop a diffusion run once its x0 estimate moved by less than ``tol`` (relative) for
    ``patience`` steps in a row, keeping that estimate (reason ``"converged"``)."""
    return Converged(tol, patience)


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


def watches_x0(condition: Condition | None) -> bool:
    """Whether ``condition`` holds a :class:`Converged`, which needs each step's x0 change."""
    return condition is not None and any(isinstance(c, Converged) for c in condition.parts())


def top_level(condition: Condition | None) -> tuple[Condition, ...]:
    """The parts any of which stops the run on its own: those of a top-level ``|``, or the condition."""
    if condition is None:
        return ()
    return condition.conditions if isinstance(condition, AnyOf) else (condition,)


def row_conditions_of(condition: Condition | None) -> list[Condition]:
    """The row conditions (``stop_strings``, ``repetition``, a timeout with grace), which end rows
    at the top level only.

    A row condition inside an ``&`` could not end its row on its own: a ValueError names the fix.
    """
    found = [c for c in top_level(condition) if c.per_row]
    nested = sum(c.per_row for c in condition.parts()) if condition is not None else 0
    if nested > len(found):
        raise ValueError(
            "stop_strings(...), repetition() and timeout/deadline(grace=...) end each row on their own,"
            " so they cannot be part of an & (AllOf) condition; combine them with | instead,"
            " e.g. stop=signal | stopcock.stop_strings([...])"
        )
    return found


def stop_strings_of(condition: Condition | None) -> list[str]:
    """The strings of the ``stop_strings`` conditions, which end rows at the top level only
    (a ValueError for one inside an ``&``: see :func:`row_conditions_of`)."""
    return [s for c in row_conditions_of(condition) if isinstance(c, StopStrings) for s in c.strings]


def refuse_row_conditions(
    condition: Condition | None,
    target: str,
    fix: str = "use a StopSignal, timeout(), deadline(), max_steps() or when()",
) -> None:
    """A ValueError if ``condition`` holds a row condition, which ``target`` cannot apply."""
    if condition is not None and any(c.per_row for c in condition.parts()):
        raise ValueError(
            "stop_strings(), repetition() and timeout/deadline(grace=...) apply to text generation only,"
            f" not to {target}; {fix}"
        )


def _repetition_option(value: Any) -> Repetition:
    """``"repetition": true`` (the defaults) or ``{"ngram": 4, "repeats": 3, "window": 64}`` (any of them)."""
    if value is True:
        return Repetition()
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - {"ngram", "repeats", "window"})
        if unknown:
            raise ValueError(f"unknown repetition option(s) {unknown}; known: ['ngram', 'repeats', 'window']")
        return Repetition(**value)
    raise ValueError(f'repetition takes true or {{"ngram": 4, "repeats": 3, "window": 64}}, got {value!r}')


#: The options of :func:`from_options`, each with the condition it builds.
OPTIONS: dict[str, Callable[[Any], Condition]] = {
    "timeout": Timeout,
    "deadline": Deadline,
    "max_steps": MaxSteps,
    "stop_strings": StopStrings,
    "repetition": _repetition_option,
}
#: Options that change others: ``grace`` and ``grace_max`` make ``timeout`` and ``deadline`` soft.
MODIFIERS = ("grace", "grace_max")


def from_options(options: Mapping[str, Any]) -> list[Condition]:
    """The conditions named in an options mapping (a server job's ``stop``, the CLI's flags):
    ``{"timeout": 5, "max_steps": 20, "stop_strings": ["\\n"], "repetition": true}``; None, False
    or empty values are skipped. ``"grace": "sentence"`` (and ``"grace_max": seconds``) gives the
    timeout and the deadline a grace (see :func:`timeout`)."""
    unknown = sorted(set(options) - set(OPTIONS) - set(MODIFIERS))
    if unknown:
        raise ValueError(f"unknown stop option(s) {unknown}; known: {sorted([*OPTIONS, *MODIFIERS])}")
    given = {
        name: options[name] for name in OPTIONS
        if options.get(name) not in (None, [], ()) and options.get(name) is not False
    }
    grace, grace_max = options.get("grace"), options.get("grace_max")
    if grace is None and grace_max is not None:
        raise ValueError("grace_max applies to a timeout or deadline with grace: give grace too")
    if grace is None:
        return [OPTIONS[name](value) for name, value in given.items()]
    if "timeout" not in given and "deadline" not in given:
        raise ValueError("grace applies to a timeout or a deadline: give one of them too")
    limit = 10.0 if grace_max is None else grace_max
    soft: dict[str, Callable[[Any], Condition]] = {
        "timeout": lambda value: SoftTimeout(value, grace, limit),
        "deadline": lambda value: SoftDeadline(value, grace, limit),
    }
    return [soft.get(name, OPTIONS[name])(value) for name, value in given.items()]
