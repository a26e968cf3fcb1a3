"""Hundreds of streams left early, every way, on both libraries: no thread or hook is left behind."""

from __future__ import annotations

import gc
import itertools
import threading

import torch

import stopcock
from stopcock.stream import Done

BOUND = 60  # seconds: a hang guard for joins, never a timing assertion
LEAVE = ("close", "break", "garbage", "stop")


def _hooks(models) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for model in models for m in model.modules())


def _join_workers() -> None:
    for thread in threading.enumerate():
        if thread.name.startswith("stopcock-worker"):
            thread.join(BOUND)


def _leave(s, how: str, closed: list) -> None:
    """Read one event, then leave the stream ``how``."""
    first = next(s)
    assert not isinstance(first, Done)
    if how == "close":
        s.close()
        closed.append(s.outcome)
    elif how == "stop":
        s.stop("user")
        assert isinstance(list(s)[-1], Done)
        closed.append(s.outcome)
    elif how == "garbage":
        s.cycle = s  # freed only by the cyclic collector, which does not wait for the worker
        del s
        gc.collect()
        _join_workers()  # before the next run on the same pipeline
    # "break": the caller drops its only reference, which waits for the worker


def test_200_streams_left_early_leave_nothing_behind(text_model, tokenizer, image_pipe):
    torch.set_num_threads(1)
    before = set(threading.enumerate())
    inputs = tokenizer(["Hello"], return_tensors="pt")
    calls = [
        lambda mode: stopcock.stream(text_model, **inputs, tokenizer=tokenizer, max_new_tokens=500, mode=mode),
        lambda mode: stopcock.stream(
            image_pipe, "a cat", num_inference_steps=100, generator=torch.Generator().manual_seed(0), mode=mode
        ),
    ]
    closed: list = []
    combos = list(itertools.product(calls, LEAVE, ("finish", "abort")))
    for i in range(200):
        call, how, mode = combos[i % len(combos)]
        _leave(call(mode), how, closed)
    assert set(threading.enumerate()) == before
    assert _hooks([text_model]) == 0
    assert _hooks(c for c in image_pipe.components.values() if isinstance(c, torch.nn.Module)) == 0
    assert not image_pipe._interrupt
    assert len(closed) == 100
    assert all(o.stopped and o.reason in ("cancelled", "user") and o.steps < o.total_steps for o in closed)
