"""A stop is never lost, from a signal handler or a Ctrl+C, and nothing of stopcock runs at arbitrary
moments of the user's program (a garbage collection).

Bounded here; ``make soak`` (``STOPCOCK_SOAK=1``) runs the longer versions and prints the figures.
"""

from __future__ import annotations

import gc
import importlib
import random
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest

import stopcock

BOUND = 60  # seconds: a hang guard, never a timing assertion
PACKAGE = str(Path(stopcock.__file__).parent)

pytestmark = pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs POSIX signals")


# -- a stop from a signal handler (issue 11, item 4) ------------------------------------------------
def _storm(register: Callable[[stopcock.StopSignal], Callable[[], bool]], trials: int) -> int:
    """Register on ``trials`` fresh parents while an interval timer's handler stops the current one.

    The handler runs between two bytecodes of the main thread, so it lands at every point of
    ``register``, also between a registration's check and its effect. Returns how many
    registrations were wrong once the parent had stopped (``register``'s check says).
    """
    current = [stopcock.StopSignal()]
    previous = signal.signal(signal.SIGALRM, lambda *_: current[0].stop("alarm"))
    signal.setitimer(signal.ITIMER_REAL, 1e-4, 1e-4)
    wrong = 0
    try:
        for _ in range(trials):
            parent = stopcock.StopSignal()
            current[0] = parent
            ok = register(parent)
            parent.stop("main")  # stopped now, by the handler or here
            wrong += not ok()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    return wrong


def _child(parent: stopcock.StopSignal) -> Callable[[], bool]:
    kid = parent.child()
    return lambda: kid.reason in ("alarm", "main") and kid.reason == parent.reason


def _callback(parent: stopcock.StopSignal) -> Callable[[], bool]:
    calls: list[int] = []
    parent.on_stop(lambda: calls.append(1))
    return lambda: calls == [1]  # exactly once


def test_signal_handler_storms_never_lose_a_child_or_a_callback(figures):
    trials = figures.trials(ci=20_000, soak=500_000)
    children, callbacks = _storm(_child, trials), _storm(_callback, trials)
    figures.record("signal-handler storms (setitimer, 0.1 ms)", 2 * trials, "registrations", failures={
        "children_never_stopped": children, "callbacks_not_run_exactly_once": callbacks})
    assert (children, callbacks) == (0, 0)


# -- nothing of stopcock inside a garbage collection (item 1) ---------------------------------------
def test_importing_stopcock_adds_no_gc_callback():
    importlib.import_module("stopcock.aio")  # with stopcock.stream and stopcock.worker: every stream
    assert [cb for cb in gc.callbacks if getattr(cb, "__module__", "").startswith("stopcock")] == []


def test_collecting_an_abandoned_stream_runs_no_stopcock_code(text_model, tokenizer):
    """A stream left to the cyclic collector: the collection runs nothing of stopcock; the worker
    notices that its stream is gone and ends the run at its next step."""
    reached, release, steps = threading.Event(), threading.Event(), []

    def hold(state):
        steps.append(state.step)
        if state.step == 2:
            reached.set()
            release.wait(BOUND)

    s = stopcock.stream(text_model, **tokenizer(["Hello"], return_tensors="pt"), tokenizer=tokenizer,
                        max_new_tokens=200, on_step=hold)
    worker = s._thread
    s.cycle = s  # only the cyclic garbage collector can free it
    alive = weakref.ref(s)
    assert reached.wait(BOUND)
    del s
    called: list[str] = []

    def profile(frame, event, arg):
        if event in ("call", "c_call") and frame.f_code.co_filename.startswith(PACKAGE):
            called.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        gc.collect()
    finally:
        sys.setprofile(None)
    assert alive() is None and called == []
    release.set()
    worker.join(BOUND)
    assert not worker.is_alive() and steps == [1, 2]  # step 2's check saw the stream gone


# -- Ctrl+C in the user's own program (item 1) ------------------------------------------------------
# The child imports stopcock, then allocates containers in a loop (a collection every few hundred
# allocations). A KeyboardInterrupt that something swallows reaches sys.unraisablehook: the child
# then says "lost" instead of "interrupted".
ALLOCATING = """
import os, sys
import stopcock, stopcock.aio, stopcock.stream
swallowed = []
sys.unraisablehook = lambda unraisable: swallowed.append(unraisable.exc_type)
os.write(1, b"ready\\n")
try:
    while not swallowed:
        junk = [[i] for i in range(300)]
        loop = [junk]
        loop.append(loop)
except KeyboardInterrupt:
    os.write(1, b"interrupted\\n")
    sys.exit(0)
os.write(1, f"lost {swallowed}\\n".encode())
sys.exit(1)
"""


def test_ctrl_c_is_never_lost_in_an_allocation_heavy_loop(figures):
    trials = figures.trials(ci=20, soak=300)
    rng = random.Random(0)
    lost = hangs = 0
    for _ in range(trials):
        child = subprocess.Popen([sys.executable, "-c", ALLOCATING], stdout=subprocess.PIPE, text=True)
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        time.sleep(rng.uniform(0, 0.05))  # the press lands at a random moment of the loop (not a sync)
        child.send_signal(signal.SIGINT)
        try:
            out, _ = child.communicate(timeout=BOUND)
        except subprocess.TimeoutExpired:
            child.kill()
            out, _ = child.communicate()
            hangs += 1
            continue
        lost += out != "interrupted\n" or child.returncode != 0
    figures.record("Ctrl+C in an allocation-heavy loop with stopcock imported", trials, "presses",
                   failures={"lost": lost, "hangs": hangs})
    assert (lost, hangs) == (0, 0)



# -- abandoned streams leave nothing behind (item 1's other half) ------------------------------------
def _workers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("stopcock-worker-")]


def _hooks(*models) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for model in models for m in model.modules())


def test_a_stream_freed_by_the_collector_while_its_worker_waits_for_room_ends(text_model, tokenizer):
    """The worker is held by a full buffer (nobody reads) when the collector frees the stream: it
    notices that its consumer is gone and ends the run (nothing told it; it looks while it waits)."""
    s = stopcock.stream(text_model, **tokenizer(["Hello"], return_tensors="pt"), tokenizer=tokenizer,
                        max_new_tokens=200, buffer=1)
    channel, worker = s._channel, s._thread
    assert channel.stalled.wait(BOUND)
    s.cycle = s
    del s
    gc.collect()
    worker.join(BOUND)
    assert not worker.is_alive() and channel.outcome is not None
    assert channel.outcome.stopped and channel.outcome.reason == "cancelled"


def test_abandoned_streams_leave_no_thread_and_no_hook(text_model, tokenizer, image_pipe, figures):
    """Streams left every way (break, close, stop, to the collector, to the collector with a full
    buffer), on both libraries and both modes: no worker thread and no hook outlives them."""
    import torch

    torch.set_num_threads(1)
    inputs = tokenizer(["Hello"], return_tensors="pt")
    ways = ("break", "close", "stop", "garbage", "garbage, full buffer")
    trials = figures.trials(ci=20, soak=600)
    rng = random.Random(0)
    for i in range(trials):
        how, mode = ways[i % len(ways)], rng.choice(["finish", "abort"])
        buffer = 1 if how.endswith("full buffer") else 64
        image = i % 3 == 0
        if not image:
            s = stopcock.stream(text_model, **inputs, tokenizer=tokenizer, max_new_tokens=300, mode=mode,
                                buffer=buffer)
        else:
            s = stopcock.stream(image_pipe, "a cat", num_inference_steps=50, mode=mode, buffer=buffer,
                                generator=torch.Generator().manual_seed(i))
        if buffer == 1:
            assert s._channel.stalled.wait(BOUND)
        else:
            next(s)
        if how == "close":
            s.close()
        elif how == "stop":
            s.stop("user")
            list(s)
        elif how.startswith("garbage"):
            s.cycle = s
        del s  # "break" and the others: the last reference goes
        if image:  # a pipeline runs one call at a time: its stream must be gone before the next
            gc.collect()
            for worker in _workers():
                worker.join(BOUND)
    gc.collect()
    for worker in _workers():
        worker.join(BOUND)
    models = [text_model, *(c for c in image_pipe.components.values() if isinstance(c, torch.nn.Module))]
    threads, hooks = len(_workers()), _hooks(*models)
    figures.record("streams left early (5 ways, 2 libraries, 2 modes)", trials, "streams", failures={
        "threads_left": threads, "hooks_left": hooks, "interrupt_flags_left": int(image_pipe._interrupt)})
    assert (threads, hooks, image_pipe._interrupt) == (0, 0, False)
