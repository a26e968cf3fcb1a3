"""Stops that judge the output: repetition() per row, timeouts and deadlines with grace."""

from __future__ import annotations

import time

import pytest
import torch

import stopcock
from stopcock.adapters.transformers_rows import _looping
from stopcock.conditions import Repetition, SoftDeadline, SoftTimeout, at_boundary
from stopcock.loading import load_text_model, resolve_model
from stopcock.state import StepState

NEW = 40
PROMPTS = ["Hello world", "The quick brown fox"]
ZEN = ["Beautiful is", "Errors should", "There should be", "If the"]


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def batch(tokenizer):
    return tokenizer(PROMPTS, return_tensors="pt", padding=True)


@pytest.fixture(scope="module")
def demo():
    """The demo text model (trained on the Zen of Python: it writes sentences, one a line)."""
    model, tokenizer = load_text_model(resolve_model(None, "text"), quiet=True)
    tokenizer.padding_side = "left"
    return model, tokenizer, tokenizer(ZEN, return_tensors="pt", padding=True)


def _greedy(model, batch, tokenizer, new=NEW):
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return model.generate(**batch, max_new_tokens=new, do_sample=False, pad_token_id=pad)


# -- the rules on their own -----------------------------------------------------------------------
def test_repetition_rule_counts_the_last_ngram_in_the_window():
    rule = Repetition(ngram=2, repeats=3, window=8)
    assert rule.loops([1, 2, 1, 2, 1, 2])
    assert not rule.loops([1, 2, 1, 2, 3, 1, 2, 4])  # the last 2-gram (2, 4) occurs once
    assert not rule.loops([1, 2, 9, 9, 9, 9, 1, 2, 7, 1, 2])  # (1, 2) three times, but not in the last 8
    assert rule.loops([1, 2, 5, 1, 2, 6, 1, 2])  # not back to back: three times in the window
    assert not rule.loops([1, 2, 1, 2])  # too short to hold three


def test_repetition_on_tensors_matches_the_rule():
    gen = torch.Generator().manual_seed(0)
    rule = Repetition(ngram=2, repeats=3, window=10)
    rows = torch.randint(0, 3, (64, 14), generator=gen)
    got = _looping(rows, rule).tolist()
    assert got == [rule.loops(row) for row in rows.tolist()]
    assert any(got) and not all(got)  # both kinds of row were exercised


def test_boundaries():
    assert at_boundary("It is done.", "sentence")
    assert at_boundary('He said "stop!" ', "sentence")
    assert at_boundary("a list\n", "sentence")
    assert not at_boundary("e.g", "sentence")
    assert not at_boundary("half a sent", "sentence")
    assert at_boundary("one line\n", "line")
    assert not at_boundary("It is done.", "line")


def test_bad_options_name_the_fix():
    with pytest.raises(ValueError, match="window >= ngram"):
        stopcock.repetition(ngram=8, repeats=4, window=16)
    with pytest.raises(ValueError, match="repeats"):
        stopcock.repetition(repeats=1)
    with pytest.raises(ValueError, match="sentence"):
        stopcock.timeout(5, grace="word")
    with pytest.raises(ValueError, match="grace_max"):
        stopcock.deadline(time.time(), grace="line", grace_max=-1)
    with pytest.raises(ValueError, match=r"\|"):
        stopcock.conditions.row_conditions_of(stopcock.repetition() & stopcock.max_steps(3))
    with pytest.raises(ValueError, match="text generation only"):
        stopcock.conditions.refuse_row_conditions(stopcock.timeout(1, grace="line"), "a diffusers pipeline")


def test_soft_hard_limit_on_a_given_clock():
    soft = stopcock.timeout(2, grace="sentence", grace_max=3)
    assert isinstance(soft, SoftTimeout) and soft.per_row
    assert not soft.due(1.9) and soft.due(2.0)
    assert soft.check(StepState(step=5, elapsed=4.9)) is None  # in the grace: the rows decide
    assert soft.check(StepState(step=5, elapsed=5.0)) == "timeout"  # the hard limit
    assert soft.check(StepState(step=5, elapsed=9.0, block="h.0")) is None  # step boundaries only
    late = stopcock.deadline(time.time() - 20, grace="line", grace_max=10)
    assert isinstance(late, SoftDeadline) and late.due(0.0)
    assert late.check(StepState(step=1)) == "deadline"
    assert type(stopcock.timeout(2)) is stopcock.conditions.Timeout  # no grace: the plain timeout


# -- repetition in runs ---------------------------------------------------------------------------
def _cut(row: list[int], prompt_len: int, ends) -> int | None:
    """The length of ``row`` at the first new token where ``ends(new tokens so far)`` holds."""
    for n in range(1, len(row) - prompt_len + 1):
        if ends(row[prompt_len : prompt_len + n]):
            return prompt_len + n
    return None


@pytest.mark.timeout(120)
def test_repetition_ends_each_looping_row_where_it_loops(text_model, tokenizer, batch):
    rule = stopcock.repetition()  # the defaults: a 4-gram seen 3 times in the last 64 tokens
    full = _greedy(text_model, batch, tokenizer)
    prompt_len = batch["input_ids"].shape[1]
    outcome = stopcock.run(
        text_model, **batch, max_new_tokens=NEW, do_sample=False, stop=rule, tokenizer=tokenizer
    )
    assert (outcome.stopped, outcome.reason, outcome.row_reasons) == (True, "repetition", ["repetition"] * 2)
    cuts = [_cut(row, prompt_len, rule.loops) for row in full.tolist()]
    assert None not in cuts and cuts[0] != cuts[1]  # the rows loop from different steps
    for i, cut in enumerate(cuts):
        assert torch.equal(outcome.output[i, :cut], full[i, :cut])  # the row as it was, up to its loop
        assert (outcome.output[i, cut:] == tokenizer.pad_token_id).all()  # then padding
    assert outcome.steps == max(cuts) - prompt_len < NEW  # the run ended with its last row


@pytest.mark.timeout(120)
def test_repetition_changes_nothing_on_text_that_does_not_loop(demo):
    model, tokenizer, zen = demo
    full = _greedy(model, zen, tokenizer, 80)
    outcome = stopcock.run(
        model, **zen, max_new_tokens=80, do_sample=False, stop=stopcock.repetition(), tokenizer=tokenizer
    )
    assert (outcome.stopped, outcome.row_reasons) == (False, ["length"] * len(ZEN))
    assert torch.equal(outcome.output, full)


@pytest.mark.timeout(120)
def test_repetition_in_a_text_generation_pipeline(text_pipe):
    outcome = stopcock.run(
        text_pipe, PROMPTS, max_new_tokens=NEW, do_sample=False, stop=stopcock.repetition(ngram=2, repeats=3)
    )
    assert outcome.reason == "repetition" and outcome.row_reasons == ["repetition"] * 2
    assert outcome.steps < 2 * NEW


# -- soft deadlines in runs -----------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("grace", ["sentence", "line"])
def test_grace_ends_each_row_at_its_next_boundary(demo, grace):
    model, tokenizer, zen = demo
    full = _greedy(model, zen, tokenizer, 80)
    prompt_len = zen["input_ids"].shape[1]
    # the time is up at the first token: each row ends at its first boundary
    stop = stopcock.timeout(0, grace=grace, grace_max=600)
    outcome = stopcock.run(model, **zen, max_new_tokens=80, do_sample=False, stop=stop, tokenizer=tokenizer)
    assert (outcome.stopped, outcome.reason, outcome.row_reasons) == (True, "timeout", ["timeout"] * len(ZEN))

    def ends(new):
        return at_boundary(tokenizer.decode(new[-4:], skip_special_tokens=True), grace)

    for i, row in enumerate(full.tolist()):
        cut = _cut(row, prompt_len, ends)
        assert cut is not None
        text = tokenizer.decode(outcome.output[i, prompt_len:], skip_special_tokens=True)
        assert text == tokenizer.decode(full[i, prompt_len:cut], skip_special_tokens=True)
        assert at_boundary(text, grace) and len(text) > 1


class _Clock:
    """The run's clock, moved by hand: ``time.monotonic`` for stopcock.control, real wall-clock time."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    time = staticmethod(time.time)


@pytest.mark.timeout(120)
def test_grace_max_is_a_hard_limit(text_model, tokenizer, batch, monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(stopcock.control, "time", clock)

    def on_step(state):
        if state.step == 5:
            clock.now += 10  # step 5 took 10 s: the time is up (4 s) and so is the grace (4 + 3 s)

    # this model's rows never reach a sentence's end: only the hard limit can end them
    stop = stopcock.timeout(4, grace="sentence", grace_max=3)
    outcome = stopcock.run(
        text_model, **batch, max_new_tokens=NEW, do_sample=False, stop=stop, tokenizer=tokenizer,
        on_step=on_step,
    )
    # on_step runs after step 5's checks: the next token's check sees the time
    assert (outcome.stopped, outcome.reason, outcome.steps) == (True, "timeout", 6)
    assert outcome.row_reasons == ["timeout", "timeout"]
    assert outcome.elapsed == 10


@pytest.mark.timeout(120)
def test_grace_keeps_a_row_going_to_its_boundary_past_the_time(demo, monkeypatch):
    model, tokenizer, zen = demo
    clock = _Clock()
    monkeypatch.setattr(stopcock.control, "time", clock)

    def on_step(state):
        if state.step == 3:
            clock.now += 10

    stop = stopcock.timeout(4, grace="line", grace_max=60)
    outcome = stopcock.run(
        model, **zen, max_new_tokens=80, do_sample=False, stop=stop, tokenizer=tokenizer, on_step=on_step
    )
    assert outcome.reason == "timeout" and outcome.row_reasons == ["timeout"] * len(ZEN)
    prompt_len = zen["input_ids"].shape[1]
    for row in outcome.output:
        text = tokenizer.decode(row[prompt_len:], skip_special_tokens=True)
        assert text.endswith("\n") and "\n" not in text[:-1]  # the first line, whole
        assert len(tokenizer(text)["input_ids"]) > 3  # past the step where the time was up


@pytest.mark.timeout(120)
def test_grace_needs_the_tokenizer_and_deadline_reports_deadline(text_model, demo, batch):
    with pytest.raises(ValueError, match="tokenizer="):
        stopcock.run(text_model, **batch, max_new_tokens=3, stop=stopcock.timeout(1, grace="line"))
    model, tokenizer, zen = demo
    stop = stopcock.deadline(time.time() - 1, grace="line", grace_max=600)
    outcome = stopcock.run(model, **zen, max_new_tokens=80, do_sample=False, stop=stop, tokenizer=tokenizer)
    assert outcome.reason == "deadline" and outcome.row_reasons == ["deadline"] * len(ZEN)


@pytest.mark.timeout(120)
def test_abort_mode_and_own_generate_call(text_model, tokenizer, batch):
    from stopcock.control import Watch

    watch = Watch.of(stopcock.repetition() | stopcock.timeout(9, grace="line"))
    assert watch.per_row and not watch.in_forward  # no check inside each forward for them
    outcome = stopcock.run(
        text_model, **batch, max_new_tokens=NEW, do_sample=False, stop=stopcock.repetition(),
        tokenizer=tokenizer, mode="abort",
    )
    assert outcome.row_reasons == ["repetition"] * 2
    own = text_model.generate(
        **batch, max_new_tokens=NEW, do_sample=False, pad_token_id=tokenizer.pad_token_id,
        stopping_criteria=stopcock.stopping_criteria(stopcock.repetition(), tokenizer),
    )
    assert torch.equal(own, outcome.output)
