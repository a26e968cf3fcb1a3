"""Stop conditions: reasons, composition with | and &, per-run time, validation."""

from __future__ import annotations

import datetime as dt
import time

import pytest

import stopcock
from stopcock.conditions import AllOf, AnyOf, Signalled, as_condition
from stopcock.state import StepState


def at(step: int = 0, elapsed: float = 0.0, **kw) -> StepState:
    return StepState(step=step, elapsed=elapsed, **kw)


def test_each_condition_reports_its_reason():
    assert stopcock.timeout(1).check(at(elapsed=1.0)) == "timeout"
    assert stopcock.timeout(1).check(at(elapsed=0.5)) is None
    assert stopcock.max_steps(3).check(at(step=3)) == "max_steps"
    assert stopcock.max_steps(3).check(at(step=2)) is None
    assert stopcock.deadline(time.time() - 1).check(at()) == "deadline"
    assert stopcock.deadline(time.time() + 3600).check(at()) is None
    assert stopcock.when(lambda s: s.step == 2, reason="quality").check(at(step=2)) == "quality"


def test_deadline_accepts_aware_datetimes_and_rejects_naive_ones():
    past = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=1)
    assert stopcock.deadline(past).check(at()) == "deadline"
    with pytest.raises(ValueError, match="aware"):
        stopcock.deadline(dt.datetime.now())
    with pytest.raises(TypeError):
        stopcock.deadline("tomorrow")  # type: ignore[arg-type]


def test_timeout_is_measured_per_run_so_one_object_serves_many_runs():
    t = stopcock.timeout(2)
    assert t.check(at(elapsed=2.5)) == "timeout"  # a long run
    assert t.check(at(elapsed=0.1)) is None  # the next run starts its own clock


def test_or_stops_on_any_with_the_first_firing_reason():
    c = stopcock.timeout(5) | stopcock.max_steps(3)
    assert isinstance(c, AnyOf)
    assert c.check(at(step=3)) == "max_steps"
    assert c.check(at(elapsed=9)) == "timeout"
    assert c.check(at(step=1, elapsed=1)) is None


def test_and_stops_only_when_all_fire_and_joins_reasons():
    c = stopcock.timeout(5) & stopcock.max_steps(3)
    assert isinstance(c, AllOf)
    assert c.check(at(step=3)) is None
    assert c.check(at(step=3, elapsed=5)) == "timeout&max_steps"


def test_composition_flattens_and_accepts_signals_on_either_side():
    s = stopcock.StopSignal()
    c = s | stopcock.timeout(1) | stopcock.max_steps(2)
    assert isinstance(c, AnyOf) and len(c.conditions) == 3
    assert isinstance(c.conditions[0], Signalled)
    assert c.check(at()) is None
    s.stop("clicked")
    assert c.check(at()) == "clicked"
    assert (stopcock.max_steps(1) | s).check(at()) == "clicked"


def test_signal_inside_and_needs_the_other_part_too():
    s = stopcock.StopSignal()
    c = s & stopcock.max_steps(4)
    s.stop()
    assert c.check(at(step=1)) is None
    assert c.check(at(step=4)) == "user&max_steps"


def test_when_is_not_evaluated_inside_a_forward():
    calls = []
    c = stopcock.when(lambda s: calls.append(s) or True)
    assert c.check(at(block=True)) is None and calls == []
    assert c.check(at()) == "condition" and len(calls) == 1


def test_predicate_sees_the_step_state():
    seen = []
    stopcock.when(seen.append).check(at(step=4, elapsed=1.5, latents="L", timestep=7))
    (s,) = seen
    assert (s.step, s.elapsed, s.latents, s.timestep) == (4, 1.5, "L", 7)


def test_as_condition_normalises_and_rejects_clearly():
    s = stopcock.StopSignal()
    assert isinstance(as_condition(s), Signalled)
    assert isinstance(as_condition([s, stopcock.timeout(1)]), AnyOf)
    for bad in (5, "stop", object(), [], [5]):
        with pytest.raises(TypeError, match="StopSignal"):
            as_condition(bad)
    with pytest.raises(TypeError, match="got an empty list"):
        as_condition([])


@pytest.mark.parametrize(
    "make, error",
    [
        (lambda: stopcock.timeout(-1), ValueError),
        (lambda: stopcock.timeout(float("nan")), ValueError),
        (lambda: stopcock.timeout(float("inf")), ValueError),
        (lambda: stopcock.max_steps(-1), ValueError),
        (lambda: stopcock.max_steps(2.5), ValueError),
        (lambda: stopcock.stop_strings([]), ValueError),
        (lambda: stopcock.stop_strings([""]), ValueError),
        (lambda: stopcock.when(42), TypeError),
        (lambda: stopcock.when(bool, reason=""), TypeError),
        (lambda: stopcock.when(bool, reason=None), TypeError),
    ],
)
def test_bad_arguments_raise_clear_errors(make, error):
    with pytest.raises(error):
        make()


def test_stop_strings_accepts_a_single_string_and_lists_its_parts():
    c = stopcock.stop_strings("\n\n")
    assert c.strings == ["\n\n"]
    combo = stopcock.timeout(1) | c
    assert [type(p).__name__ for p in combo.parts()] == ["Timeout", "StopStrings"]
