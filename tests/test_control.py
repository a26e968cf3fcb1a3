"""RunControl (one run's binding), block pre-hooks and run()'s dispatch errors."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import stopcock
from stopcock.control import Abort, RunControl
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
