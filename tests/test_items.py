"""Runs over several items: skip() ends the current item and the run goes on; stop_after_item() lets
the current item finish and starts no new one; Outcome.item_reasons says how each item ended."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import pipeline

import stopcock
from stopcock.control import RunControl
from stopcock.items import run_items

PROMPTS = ["Hello world", "The quick brown fox", "Stop the pipeline"]
NEW = 10


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def at(step, action):
    """An on_step doing ``action()`` once, at run step ``step``."""
    done = []

    def on_step(state):
        if state.step == step and not done:
            done.append(True)
            action()

    return on_step


def test_skip_ends_the_current_item_only(text_pipe):
    full = text_pipe(PROMPTS, max_new_tokens=NEW, do_sample=False)
    signal = stopcock.StopSignal()
    outcome = stopcock.run(
        text_pipe, PROMPTS, max_new_tokens=NEW, do_sample=False, stop=signal, on_step=at(NEW + 3, signal.skip)
    )
    assert (outcome.stopped, outcome.steps, outcome.total_steps) == (False, NEW + 3 + NEW, 3 * NEW)
    assert outcome.item_reasons == ["completed", "skipped", "completed"]
    assert outcome.row_reasons == ["length", "skipped", "length"]
    assert outcome.output[0] == full[0] and outcome.output[2] == full[2]  # the others are untouched
    skipped, whole = outcome.output[1][0]["generated_text"], full[1][0]["generated_text"]
    assert whole.startswith(skipped) and skipped != whole  # its partial text: 3 tokens, none after the skip
    assert (
        len(text_pipe.tokenizer(skipped)["input_ids"])
        == len(text_pipe.tokenizer(PROMPTS[1])["input_ids"]) + 3
    )
    assert "skip" in outcome.summary()["item_reasons"][1]


def test_stop_after_item_lets_the_current_one_finish(text_pipe):
    full = text_pipe(PROMPTS, max_new_tokens=NEW, do_sample=False)
    signal = stopcock.StopSignal()
    outcome = stopcock.run(
        text_pipe,
        PROMPTS,
        max_new_tokens=NEW,
        do_sample=False,
        stop=signal,
        on_step=at(NEW + 3, lambda: signal.stop_after_item("enough")),
    )
    assert (outcome.stopped, outcome.reason, outcome.steps) == (True, "enough", 2 * NEW)
    assert outcome.item_reasons == ["completed", "completed"] and outcome.output == full[:2]
    assert not signal.stopped and signal.after_item == "enough"  # the signal itself is not stopped


def test_a_stop_after_stop_after_item_still_stops_now(text_pipe):
    signal = stopcock.StopSignal()

    def escalate(state):
        if state.step == 2:
            signal.stop_after_item()
        if state.step == 4:
            signal.stop("now")

    outcome = stopcock.run(
        text_pipe, PROMPTS, max_new_tokens=NEW, do_sample=False, stop=signal, on_step=escalate
    )
    assert (outcome.reason, outcome.steps, outcome.item_reasons) == ("now", 4, ["now"])


def test_stop_after_item_on_the_last_item_changes_nothing(text_pipe):
    signal = stopcock.StopSignal()
    outcome = stopcock.run(
        text_pipe,
        PROMPTS[:2],
        max_new_tokens=NEW,
        do_sample=False,
        stop=signal,
        on_step=at(NEW + 1, signal.stop_after_item),
    )
    assert (outcome.stopped, outcome.reason, outcome.item_reasons) == (False, "length", ["completed"] * 2)


def test_skip_on_a_single_input_ends_the_run(text_pipe, text_model, tokenizer):
    signal = stopcock.StopSignal()
    outcome = stopcock.run(
        text_pipe, PROMPTS[0], max_new_tokens=NEW, do_sample=False, stop=signal, on_step=at(4, signal.skip)
    )
    assert (outcome.stopped, outcome.reason, outcome.steps, outcome.item_reasons) == (
        True,
        "skipped",
        4,
        None,
    )
    batch = tokenizer(PROMPTS[:1], return_tensors="pt")
    model = stopcock.run(
        text_model, **batch, max_new_tokens=NEW, do_sample=False, stop=signal, on_step=at(2, signal.skip)
    )
    assert (model.reason, model.steps, model.output.shape[1]) == (
        "skipped",
        2,
        batch["input_ids"].shape[1] + 2,
    )


def test_skips_before_the_run_do_not_count(text_pipe):
    signal = stopcock.StopSignal()
    signal.skip()
    outcome = stopcock.run(text_pipe, PROMPTS[:2], max_new_tokens=NEW, do_sample=False, stop=signal)
    assert outcome.item_reasons == ["completed", "completed"] and outcome.steps == 2 * NEW


def test_items_without_steps_stop_after_the_item(text_model_dir, tokenizer):
    from transformers import GPT2ForSequenceClassification

    model = GPT2ForSequenceClassification.from_pretrained(text_model_dir, num_labels=2).eval()
    classifier = pipeline("text-classification", model=model, tokenizer=tokenizer)
    texts = [f"text {i}" for i in range(6)]
    signal = stopcock.StopSignal()
    outcome = stopcock.run(classifier, texts, stop=signal, on_step=at(2, signal.stop_after_item))
    assert (outcome.stopped, outcome.steps, outcome.item_reasons) == (True, 2, ["completed"] * 2)
    assert outcome.output == classifier(texts[:2])


def test_the_loop_reads_a_generator_only_as_far_as_it_runs():
    read = []

    def items():
        for i in range(10):
            read.append(i)
            yield i

    with RunControl(stopcock.max_steps(3)) as control:
        results: list[int] = []
        run_items(
            control, items(), lambda chunk: [x * 10 for x in chunk], into=results, batch=2, step_items=True
        )
    # chunks [0, 1] and [2, 3] ran; the stop at step 3 is seen within the second; [4, 5] was taken, not run
    assert results == [0, 10, 20, 30] and read == [0, 1, 2, 3, 4, 5]
    assert control.item_reasons == ["completed"] * 4


def test_signal_skip_and_stop_after_item_reach_children():
    parent = stopcock.StopSignal()
    child = parent.child()
    parent.skip()
    parent.skip()
    assert (parent.skips, child.skips) == (2, 2)
    assert parent.stop_after_item("first") and not parent.stop_after_item("second")
    assert (parent.after_item, child.after_item, parent.stopped) == ("first", "first", False)
    assert parent.child().after_item == "first"  # a child made later follows too
    with pytest.raises(TypeError, match="reason"):
        parent.stop_after_item("")


def test_a_binding_touches_no_other_thread(text_model, tokenizer):
    """Two runs on the same model at once, in two threads: each stops by its own conditions only,
    and the model's generate is itself again when both have ended."""
    mine = pipeline("text-generation", model=text_model, tokenizer=tokenizer)
    theirs = pipeline("text-generation", model=text_model, tokenizer=tokenizer)
    expected = theirs(PROMPTS[1], max_new_tokens=NEW, do_sample=False)
    inside, other_done, results = threading.Event(), threading.Event(), {}

    def hold(state):
        if state.step == 2:
            inside.set()  # my binding is on: the other run goes now
            assert other_done.wait(30)

    def other():
        assert inside.wait(30)
        results["theirs"] = stopcock.run(theirs, PROMPTS[1], max_new_tokens=NEW, do_sample=False)
        other_done.set()

    thread = threading.Thread(target=other)
    thread.start()
    results["mine"] = stopcock.run(
        mine, PROMPTS[0], max_new_tokens=NEW, do_sample=False, stop=stopcock.max_steps(4), on_step=hold
    )
    thread.join(30)
    assert (results["mine"].steps, results["mine"].reason) == (4, "max_steps")
    assert (results["theirs"].steps, results["theirs"].output) == (NEW, expected)
    assert "generate" not in vars(text_model)
