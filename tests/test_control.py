"""RunControl (one run's binding), block pre-hooks and run()'s dispatch errors."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import stopcock
from stopcock.control import Abort, RunControl
from stopcock.limits import TimeLimits
from tiny.blocks import find_blocks, pre_hooks


def test_a_stop_before_the_run_is_seen_at_the_first_check():
    s = stopcock.StopSignal()
    s.stop("early")
    with RunControl(s) as control:
        assert control.check() is True
    out = control.outcome("partial")
    assert out.stopped and out.reason == "early" and out.steps == 0 and out.output == "partial"
    assert out.stop_latency is not None and out.stop_latency >= 0


def test_steps_are_counted_and_conditions_checked_at_each_step():
    states = []
    with RunControl(stopcock.max_steps(3), on_step=states.append) as control:
        control.total = 10
        results = [control.step(latents=i) for i in range(5)]
    assert results == [False, False, True, True, True]
    assert [s.step for s in states] == [1, 2, 3, 4, 5]
    assert states[0].total == 10 and states[2].latents == 2
    out = control.outcome(None)
    assert out.stopped and out.reason == "max_steps" and out.total_steps == 10


def test_a_stop_no_check_saw_does_not_count():
    s = stopcock.StopSignal()
    with RunControl(s) as control:
        control.step()
    s.stop()  # after the last check: the run completed
    out = control.outcome("full", completed="eos")
    assert not out.stopped and out.reason == "eos" and out.stop_latency is None


def test_the_users_signal_is_unlinked_after_the_run():
    s = stopcock.StopSignal()
    with RunControl(s | stopcock.timeout(60)) as control:
        assert len(s._callbacks) == 1
    assert len(s._callbacks) == 0
    s.stop()
    assert not control.token.stopped


def test_a_signal_stops_the_run_token_at_once():
    s = stopcock.StopSignal()
    with RunControl([stopcock.timeout(60), s]) as control:
        s.stop("now")
        assert control.token.reason == "now"


def test_poll_raises_abort_only_when_stopped():
    s = stopcock.StopSignal()
    with RunControl(s, mode="abort") as control:
        control.poll()
        s.stop()
        with pytest.raises(Abort) as info:
            control.poll()
    assert info.value.control is control
    assert control.outcome(None).stopped


def test_abort_is_not_caught_by_except_exception():
    assert not issubclass(Abort, Exception)


def test_poll_evaluates_time_conditions_but_not_predicates():
    calls = []
    with RunControl(stopcock.when(lambda s: calls.append(1) or True), mode="abort") as control:
        control.poll()
    assert calls == []
    with RunControl(stopcock.timeout(0), mode="abort") as control, pytest.raises(Abort):
        control.poll()


def test_bad_mode_is_rejected():
    with pytest.raises(ValueError, match="finish"):
        RunControl(None, mode="later")


def test_the_phase_follows_the_run_from_bound_to_ended():
    s = stopcock.StopSignal()
    control = RunControl(s)
    assert control.phase == "bound"
    with control:
        assert control.phase == "running" and control.quiet_step(1)
        s.stop("now")  # forwarded to the token at once; no check has seen it yet
        assert control.phase == "stopping"
        assert control.step(2) and control.phase == "stopped"
    assert control.phase == "ended"
    s2 = stopcock.StopSignal()
    with RunControl(s2) as unseen:
        s2.stop()
    assert unseen.phase == "ended" and not unseen.outcome(None).stopped


def test_time_limits_are_placed_on_the_runs_clock_from_its_start():
    limits = TimeLimits((5.0, 2.0), (1_000.0,))
    assert (limits.time_limit, limits.wall_limit, limits.due) == (None, None, None)
    assert limits.requested(None) is None
    limits.start(100.0, lambda: 990.0)  # the deadline is 10 s away on the wall clock
    assert (limits.time_limit, limits.wall_limit, limits.due) == (102.0, 1_000.0, 102.0)
    assert limits.requested(101.0) == 101.0 and limits.requested(None) == 102.0
    assert limits.requested_by(None, now=101.0) == 101.0  # nothing requested yet: now
    assert limits.requested_by(103.0, now=104.0) == 102.0  # the timeout expired before the stop
    deadline_first = TimeLimits((60.0,), (1_000.0,))
    deadline_first.start(100.0, lambda: 995.0)
    assert deadline_first.due == 105.0
    untimed = TimeLimits((), ())
    untimed.start(100.0, lambda: pytest.fail("no deadline: the wall clock is not read"))
    assert untimed.due is None


def test_a_skip_ends_the_item_and_then_keeps_the_fast_path_off_until_the_next_item():
    s = stopcock.StopSignal()
    with RunControl(s) as control:
        assert control.start_item() and control.quiet_step(1)
        s.skip()
        assert not control.quiet_step(2)  # a skip: the full step
        assert control.step(2) and control.skipping
        assert not control.quiet_step(3)  # skipping: still the full step
        control.end_item()
        assert not control.skipping and not control.quiet_step(3)  # until the next item begins
        assert control.start_item() and control.quiet_step(3)
        control.end_item()
    assert control.outcome(None).item_reasons == ["skipped", "completed"]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.parts = nn.ModuleList([nn.Linear(4, 4), nn.ReLU()])  # nested: not a block of the model

    def forward(self, x):
        for part in self.parts:
            x = part(x)
        return x


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.layers = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_find_blocks_returns_the_outermost_module_list_items():
    model = Tiny()
    assert find_blocks(model) == list(model.layers)
    assert find_blocks(nn.Linear(2, 2)) == []


def test_pre_hooks_run_before_each_block_and_are_always_removed():
    model = Tiny()
    seen = []
    with pytest.raises(RuntimeError, match="stop here"), pre_hooks(find_blocks(model), seen.append):
        model(torch.zeros(1, 4))
        assert len(seen) == 3
        raise RuntimeError("stop here")
    assert all(not m._forward_pre_hooks for m in model.modules())
    model(torch.zeros(1, 4))
    assert len(seen) == 3


def test_pre_hooks_ignore_other_threads():
    model = Tiny()
    seen = []
    with pre_hooks(find_blocks(model), seen.append):
        t = threading.Thread(target=model, args=(torch.zeros(1, 4),))
        t.start()
        t.join()
        assert seen == []
        model(torch.zeros(1, 4))
        assert len(seen) == 3


def test_run_rejects_unsupported_targets_listing_supported_kinds():
    with pytest.raises(stopcock.UnsupportedTarget, match="Supported targets") as info:
        stopcock.run(lambda: None)
    assert isinstance(info.value, TypeError)


def test_run_rejects_bad_stop_types():
    with pytest.raises(TypeError, match="stop= accepts"):
        stopcock.run(object(), stop=3.5)
