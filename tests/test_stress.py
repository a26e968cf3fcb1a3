"""Hundreds of generations stopped from other threads at random moments: all return, all consistent."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

import stopcock
from tiny.blocks import find_blocks

RUNS = 300
NEW = 16
MOMENTS = ("before", "prefill", "mid", "end")
BOUND = 60  # seconds; only a bound on a hang, never reached by a working run


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def run_once(model, batch, *, moment: str, mode: str, stop_step: int, reason: str):
    """One generation; another thread stops it at ``moment``.

    Returns (outcome, signal, times): ``times["steps"]`` the step reports, ``times["checks"]`` maps
    each step checked to a time taken just before that check read the signal, ``times["stopped"]``
    when ``stop()`` had returned, ``times["returned"]`` when the run had returned.
    """
    signal, trigger = stopcock.StopSignal(), threading.Event()
    step_times: dict[int, float] = {}
    checks: dict[int, float] = {}
    times: dict = {"steps": step_times, "checks": checks}
    result: dict[str, stopcock.Outcome] = {}

    def stopper() -> None:
        trigger.wait()
        signal.stop(reason)
        times["stopped"] = time.monotonic()

    def before_signal_read(state) -> bool:
        checks[state.step] = time.monotonic()  # never stops: ``|`` then reads the signal
        return False

    def on_step(state) -> None:
        step_times[state.step] = time.monotonic()
        if moment == "mid" and state.step == stop_step:
            trigger.set()

    def in_prefill(module, args) -> None:
        if moment == "prefill" and not step_times:
            trigger.set()

    def generate() -> None:
        stop = stopcock.when(before_signal_read) | signal
        result["outcome"] = stopcock.run(
            model, **batch, max_new_tokens=NEW, do_sample=False, stop=stop, mode=mode, on_step=on_step
        )
        times["returned"] = time.monotonic()

    thread = threading.Thread(target=stopper)
    thread.start()
    if moment == "before":
        trigger.set()
        thread.join()
    hook = find_blocks(model)[0].register_forward_pre_hook(in_prefill)
    worker = threading.Thread(target=generate)
    try:
        worker.start()
        worker.join(BOUND)
        assert not worker.is_alive(), f"a run ({moment}, {mode}) hangs"
    finally:
        hook.remove()
    trigger.set()  # "end": the stop comes after the run returned; a no-op for the other moments
    thread.join(BOUND)
    assert not thread.is_alive()
    return result["outcome"], signal, times


def test_random_stops_from_other_threads(text_model, tokenizer):
    rng = random.Random(1234)
    prompts = tokenizer(["Hello world", "The quick brown fox jumps over"], return_tensors="pt", padding=True)
    prompt_len = prompts["input_ids"].shape[1]
    seen = set()

    for i in range(RUNS):
        moment, mode, rows = rng.choice(MOMENTS), rng.choice(("finish", "abort")), rng.choice((1, 2))
        batch = {k: v[:rows] for k, v in prompts.items()}
        outcome, signal, times = run_once(
            text_model, batch, moment=moment, mode=mode, stop_step=rng.randint(1, NEW), reason=f"stop-{i}"
        )
        seen.add((moment, outcome.stopped))

        # every Outcome is consistent with the output and with when the stop came
        step_times, checks = times["steps"], times["checks"]
        assert outcome.steps == len(step_times) <= NEW
        output = outcome.output
        assert output.shape[0] == rows and output.shape[1] == prompt_len + outcome.steps
        assert torch.equal(output[:, :prompt_len], batch["input_ids"])
        if outcome.stopped:
            assert outcome.reason == f"stop-{i}" and signal.stopped
            assert outcome.stop_latency is not None and outcome.stop_latency >= 0
            # a row that reached max_new_tokens at the step where the stop was seen says "length"
            expected = "length" if outcome.steps == NEW else outcome.reason
            assert outcome.row_reasons == [expected] * rows
        else:
            assert (outcome.reason, outcome.steps, outcome.stop_latency) == ("length", NEW, None)
        if moment == "before":
            assert outcome.stopped and outcome.steps == 0
        if moment == "end":
            assert not outcome.stopped
        # stopped <=> the stop was requested before the end: a stopped run saw a request made before
        # it returned; a run that was not stopped made its last check before stop() had returned
        assert signal.stopped_at is not None
        if outcome.stopped:
            assert signal.stopped_at <= times["returned"]
        else:
            assert times["stopped"] >= checks[outcome.steps]
        # within one step: the first check that began after stop() returned saw it
        after = [step for step, t in checks.items() if t > times["stopped"]]
        if after:
            assert outcome.stopped and outcome.steps <= min(after)

    assert [h for m in text_model.modules() for h in m._forward_pre_hooks.values()] == []
    assert {("before", True), ("mid", True), ("end", False)} <= seen
    assert any(moment == "prefill" for moment, _ in seen)
