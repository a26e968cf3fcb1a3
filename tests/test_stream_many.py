"""200 streams left early, every way, on both libraries: no thread or hook is left behind."""

from __future__ import annotations

import gc
import itertools
import threading

import pytest
import torch

import stopcock
from stopcock.stream import Done

BOUND = 60  # seconds: a hang guard for joins, never a timing assertion
MODES = ("finish", "abort")


def _hooks(models) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for model in models for m in model.modules())


def _leave(s, how: str, kept: list, outcomes: list) -> None:
    """Read one event, then leave the stream ``how``."""
    assert not isinstance(next(s), Done)
    if how == "close":
        s.close()
        outcomes.append(s.outcome)
    elif how == "stop":
        s.stop("user")
        assert isinstance(list(s)[-1], Done)
        outcomes.append(s.outcome)
    elif how == "garbage":
        s.cycle = s  # freed only by the cyclic collector (which does not wait for the worker)
        kept.append(s)
    # "break": the caller drops the only reference, which stops the run and waits for it


@pytest.mark.slow
def test_200_streams_left_early_leave_nothing_behind(text_model, tokenizer, image_pipe):
    torch.set_num_threads(1)
    before = set(threading.enumerate())
    inputs = tokenizer(["Hello"], return_tensors="pt")

    def text(mode):
        return stopcock.stream(text_model, **inputs, tokenizer=tokenizer, max_new_tokens=500, mode=mode)

    def image(mode):
        seed = torch.Generator().manual_seed(0)
        return stopcock.stream(image_pipe, "a cat", num_inference_steps=100, generator=seed, mode=mode)

    # A diffusers pipeline runs one call at a time, so its streams are never left to the collector
    # while the next one starts; text streams left to it pile up until the collection below.
    plan = [*itertools.product([text], ["close", "break", "stop", "garbage"], MODES)] * 18
    plan += [*itertools.product([image], ["close", "break", "stop"], MODES)] * 9
    plan += [(text, "close", "finish"), (image, "garbage", "abort")]
    assert len(plan) == 200
    kept: list = []
    outcomes: list = []
    for call, how, mode in plan:
        _leave(call(mode), how, kept, outcomes)
        del kept[:]  # garbage now
    gc.collect()
    for thread in threading.enumerate():
        if thread.name.startswith("stopcock-worker"):
            thread.join(BOUND)
    assert set(threading.enumerate()) - before == set()  # no extra thread
    assert _hooks([text_model]) == 0
    assert _hooks(c for c in image_pipe.components.values() if isinstance(c, torch.nn.Module)) == 0
    assert not image_pipe._interrupt
    assert len(outcomes) == 18 * 4 + 9 * 4 + 1
    assert all(o.stopped and o.reason in ("cancelled", "user") and o.steps < o.total_steps for o in outcomes)
