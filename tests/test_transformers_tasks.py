"""Every transformers pipeline task that generates stops between tokens, on a tiny real model of each.

For each task: a stop requested from ``on_step`` ends the run with no model forward after the
request, ``steps`` counts the tokens, and the output is the pipeline's own, built from the tokens
so far (text, transcription, answers, audio). Lists are still stopped between items.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

import stopcock
from tiny import text as tiny
from tiny.text import CASE_TOKENS as NEW  # tokens a full run makes, where the call sets the length
from tiny.text import TASK_CASES, TaskCase, task_case

AT = 5  # the step whose on_step asks for the stop


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="module", params=TASK_CASES)
def case(request) -> TaskCase:
    return task_case(request.param)


def stop_at(step: int, module: torch.nn.Module, signal: stopcock.StopSignal, how=None):
    """An on_step that requests a stop (``how(signal)``, default ``stop("button")``) at ``step``,
    and a record of the module's forwards: all of them, and those done when the stop was requested."""
    seen = {"forwards": 0, "at_request": None}

    def count(m, args, out):
        seen["forwards"] += 1

    def on_step(state):
        if state.step == step and seen["at_request"] is None:
            seen["at_request"] = seen["forwards"]
            (how or (lambda s: s.stop("button")))(signal)

    return on_step, seen, module.register_forward_hook(count)


def test_every_generating_task_stops_between_tokens(case):
    full = stopcock.run(case.pipe, case.item, **case.kwargs)
    assert not full.stopped and full.steps > AT
    signal = stopcock.StopSignal()
    on_step, seen, hook = stop_at(AT, case.stepper, signal)
    try:
        outcome = stopcock.run(case.pipe, case.item, stop=signal, on_step=on_step, **case.kwargs)
    finally:
        hook.remove()
    assert (outcome.stopped, outcome.reason, outcome.steps, outcome.mode) == (True, "button", AT, "finish")
    assert seen["forwards"] == seen["at_request"]  # zero forwards after the request: no token after it
    partial, whole = case.content(outcome.output), case.content(full.output)
    assert partial is not None and len(partial) > 0  # the pipeline's own output, from the tokens so far
    if isinstance(whole, str):  # a character cut between its bytes decodes as U+FFFD
        assert whole.startswith(partial.rstrip("\ufffd")) and partial != whole
    elif isinstance(whole, np.ndarray):
        assert 0 < partial.shape[-1] < whole.shape[-1]
    if outcome.row_reasons is not None:  # not when the pipeline runs beam search (ASR: 5 beams)
        assert outcome.row_reasons == ["button"]
    assert "generate" not in vars(case.pipe.model)  # the binding is gone


def test_every_generating_task_runs_a_list_item_by_item(case):
    """A list (also of chats, or of tables, which the pipelines take in no other form than a
    list) is stopped between items: the finished items are kept, the stopped one is partial."""
    per_item = stopcock.run(case.pipe, case.items[0], **case.kwargs).steps
    torch.manual_seed(0)  # SpeechT5's decoder prenet keeps its dropout on in eval mode
    expected = case.content(case.pipe(case.items[:2], **case.kwargs)[0])  # the pipeline's own list result
    torch.manual_seed(0)
    outcome = stopcock.run(case.pipe, case.items, stop=stopcock.max_steps(per_item + AT), **case.kwargs)
    assert (outcome.stopped, outcome.reason, outcome.steps) == (True, "max_steps", per_item + AT)
    assert outcome.item_reasons == ["completed", "max_steps"] and outcome.extra["items"] == 2
    assert len(outcome.output) == 2  # the third item never started
    first, second = (case.content(out) for out in outcome.output)
    assert (first == expected) if isinstance(first, str) else np.array_equal(first, expected)
    assert len(second) > 0


def test_same_seed_same_partial(case):
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        runs.append(stopcock.run(case.pipe, case.item, stop=stopcock.max_steps(AT), **case.kwargs))
    a, b = (case.content(r.output) for r in runs)
    assert (a == b) if isinstance(a, str) else np.array_equal(a, b)


# -- what the pipelines do with call-time arguments, and their inputs ------------------------------


class Counting(StoppingCriteria):
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        return False


@pytest.mark.parametrize("task", ["document-question-answering", "table-question-answering"])
def test_pipelines_that_drop_call_time_criteria_are_still_stopped(task):
    case = task_case(task)
    native, forwards = Counting(), []
    hook = case.pipe.model.register_forward_hook(lambda m, a, o: forwards.append(1))
    try:
        case.pipe(case.item, stopping_criteria=StoppingCriteriaList([native]), max_new_tokens=3)
        assert native.calls == 0 and len(forwards) == 24  # both dropped: the native route cannot stop it
        forwards.clear()
        outcome = stopcock.run(case.pipe, case.item, stop=stopcock.max_steps(3))
    finally:
        hook.remove()
    assert (outcome.stopped, outcome.steps, outcome.total_steps, len(forwards)) == (True, 3, 24, 3)


def test_speecht5_own_loop_is_ended_by_its_stop_head():
    case = task_case("text-to-audio (SpeechT5)")
    full = stopcock.run(case.pipe, case.item, **case.kwargs)
    assert (full.stopped, full.total_steps) == (False, None) and full.steps > 10  # its own length limit
    stopped = stopcock.run(case.pipe, case.item, stop=stopcock.max_steps(4), **case.kwargs)
    assert (stopped.steps, case.content(stopped.output).shape) == (4, (4 * 2 * 2,))  # 2 mel frames a step, x2
    forward = case.kwargs["forward_params"]
    high = stopcock.run(
        case.pipe, case.item, stop=stopcock.max_steps(4), forward_params={**forward, "threshold": 5.0}
    )
    assert high.steps == full.steps and "threshold=5.0" in high.detail  # it could not end the loop: said so


def test_musicgen_stops_early_without_its_delay_pattern_crash():
    """MusicGen's own ending raises a shape error on an output shorter than planned; stopcock ends
    the codebooks' delay pattern at the length reached: the audio is the full run's, cut."""
    case = task_case("text-to-audio")
    full = case.content(stopcock.run(case.pipe, case.item, **case.kwargs).output)
    native = StoppingCriteriaList(
        [type("AtFive", (StoppingCriteria,), {"__call__": lambda s, ids, sc, **k: ids.shape[-1] > AT})()]
    )
    with pytest.raises(RuntimeError, match="shape"):  # the upstream crash, with a criterion of one's own
        case.pipe(case.item, generate_kwargs={**case.kwargs["generate_kwargs"], "stopping_criteria": native})
    for steps in (AT, 8, NEW - 1):
        audio = case.content(
            stopcock.run(case.pipe, case.item, stop=stopcock.max_steps(steps), **case.kwargs).output
        )
        frames = steps + 1 - 4  # the complete frames: 4 codebooks, each one step later than the last
        assert audio.shape == (frames * 4,) and np.allclose(audio, full[: frames * 4], atol=1e-6)
    early = stopcock.run(case.pipe, case.item, stop=stopcock.max_steps(2), **case.kwargs)
    assert (early.stopped, early.steps, early.mode, early.output) == (True, 2, "abort", [])
    assert "first audio frame" in early.detail


def test_asr_takes_a_bare_array_as_one_input():
    case = task_case("automatic-speech-recognition")
    audio = tiny.sample_audio()  # 8000 samples: one input, not 8000 items
    outcome = stopcock.run(case.pipe, audio, stop=stopcock.max_steps(AT), **case.kwargs)
    assert isinstance(outcome.output, dict) and outcome.output["text"]
    assert (outcome.steps, outcome.total_steps, outcome.item_reasons) == (AT, NEW, None)


@pytest.mark.parametrize(
    "task",
    ["text-generation", "image-text-to-text", "any-to-any", "automatic-speech-recognition", "text-to-audio"],
)
def test_criteria_of_the_user_at_call_time_still_run(task):
    """(Document- and table-QA drop call-time criteria, and SpeechT5's loop runs none.)"""
    case = task_case(task)
    mine = Counting()
    kwargs = dict(case.kwargs)
    if case.task in ("text-generation", "automatic-speech-recognition"):  # generation arguments at the top
        kwargs["stopping_criteria"] = [mine]
    else:  # the others take them in generate_kwargs
        kwargs["generate_kwargs"] = {**kwargs.get("generate_kwargs", {}), "stopping_criteria": [mine]}
    outcome = stopcock.run(case.pipe, case.item, stop=stopcock.max_steps(AT), **kwargs)
    assert outcome.steps == AT and mine.calls == AT


@pytest.mark.parametrize("task", ["text-to-audio", "text-to-audio (SpeechT5)"])
def test_stop_strings_are_refused_where_no_text_is_made(task):
    case = task_case(task)
    with pytest.raises(ValueError, match="makes no text"):
        stopcock.run(case.pipe, case.item, stop=stopcock.stop_strings(["x"]), **case.kwargs)
