"""Pause in place: a run held at a step boundary from another thread goes on exactly as if never held;
a stop while held ends it at once at the step it had reached; nothing is left running."""

from __future__ import annotations

import threading

import pytest
import torch

import stopcock
from tiny import image as tiny


class Runner:
    """``stopcock.run`` in a thread; its Outcome (or error) once joined."""

    def __init__(self, *args, **kwargs):
        self.outcome = self.error = None
        self.thread = threading.Thread(target=self._run, args=args, kwargs=kwargs, name="pause-test-run")
        self.thread.start()

    def _run(self, *args, **kwargs):
        try:
            self.outcome = stopcock.run(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread, which raises it
            self.error = exc

    def join(self):
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.outcome


def paused_at(step: int, pause: stopcock.PauseSignal, **pause_options):
    """An ``on_step`` that, at ``step``, has the test thread pause the run (then waits for it to have)."""
    asked, done = threading.Event(), threading.Event()

    def on_step(state):
        if state.step == step:
            asked.set()
            done.wait()

    def pause_from_the_test_thread():
        asked.wait()
        pause.pause(**pause_options)
        done.set()

    return on_step, pause_from_the_test_thread


@pytest.mark.parametrize("release", [False, True])
def test_a_diffusion_run_held_and_let_go_is_the_run_never_held(release):
    pipe = tiny.stable_diffusion_pipeline()
    kwargs = {"prompt": "a cat", "num_inference_steps": 6, "output_type": "pt"}
    reference = pipe(**kwargs, generator=torch.Generator().manual_seed(0)).images
    pause = stopcock.PauseSignal()
    on_step, do_pause = paused_at(2, pause, release=release)
    threads = threading.active_count()
    run = Runner(pipe, **kwargs, generator=torch.Generator().manual_seed(0), stop=pause, on_step=on_step)
    do_pause()
    held = pause.wait_held(timeout=120)
    # on_step runs before the step's check: a pause made while it runs holds the run at this boundary
    assert held is not None and held.step == 2 and pause.held() == [held]
    assert run.thread.is_alive() and pause.paused
    pause.resume()
    outcome = run.join()
    assert not outcome.stopped and outcome.steps == 6 and pause.held() == []
    assert torch.equal(outcome.output.images, reference)
    assert threading.active_count() == threads


def test_a_stop_while_held_ends_the_run_at_once(text_model, tokenizer):
    batch = tokenizer(["Once upon a time"], return_tensors="pt")
    stop, pause = stopcock.StopSignal(), stopcock.PauseSignal()
    on_step, do_pause = paused_at(4, pause)
    run = Runner(text_model, **batch, max_new_tokens=50, do_sample=False, stop=[stop, pause], on_step=on_step)
    do_pause()
    held = pause.wait_held(timeout=120)
    assert held is not None and held.step == 4
    stop.stop("user")
    outcome = run.join()
    assert outcome.stopped and outcome.reason == "user" and outcome.steps == 4 and pause.paused
    assert outcome.output.shape[1] == batch["input_ids"].shape[1] + 4


def test_a_held_text_stream_continues_exactly(text_model, tokenizer):
    batch = tokenizer(["Once upon a time"], return_tensors="pt")
    reference = text_model.generate(**batch, max_new_tokens=12, do_sample=False)
    pause = stopcock.PauseSignal()
    pause.pause()  # before the start: held at the first check
    events = stopcock.stream(
        text_model, **batch, max_new_tokens=12, do_sample=False, tokenizer=tokenizer, stop=pause
    )
    held = pause.wait_held(timeout=120)
    assert held is not None and held.step == 0
    pause.resume()
    with events:
        done = [e for e in events if isinstance(e, stopcock.Done)]
    assert torch.equal(done[0].outcome.output, reference)


def test_a_pause_holds_only_the_runs_that_bind_it():
    pipe = tiny.stable_diffusion_pipeline()
    pause = stopcock.PauseSignal()
    pause.pause()
    with pytest.raises(RuntimeError, match=r"PauseSignal holds runs of stopcock\.run"):
        with stopcock.attach(pipe, pause):
            pipe("a cat", num_inference_steps=2, output_type="pt")
