"""stopcock.run on model.generate: decoding modes, per-row stop strings, composition, abort mode."""

from __future__ import annotations

import pytest
import torch
from transformers import MaxLengthCriteria, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

import stopcock
from tiny.blocks import find_blocks

PROMPTS = ["Hello world", "The quick brown fox"]
NEW = 24


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def batch(tokenizer):
    return tokenizer(PROMPTS, return_tensors="pt", padding=True)


def greedy(model, batch, **kwargs):
    return model.generate(**batch, max_new_tokens=NEW, do_sample=False, **kwargs)


def stop_when_armed(signal, armed):
    """A forward pre-hook that stops ``signal`` once ``armed`` holds something (it keeps the inputs)."""

    def hook(module, args):
        if armed:
            signal.stop()

    return hook


def all_hooks(model):
    return [h for m in [model, *model.modules()] for h in m._forward_pre_hooks.values()]


def test_completes_like_generate(text_model, batch):
    expected = greedy(text_model, batch)
    outcome = stopcock.run(text_model, **batch, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(outcome.output, expected)
    assert (outcome.stopped, outcome.reason, outcome.steps, outcome.total_steps) == (
        False,
        "length",
        NEW,
        NEW,
    )
    assert outcome.row_reasons == ["length", "length"]
    assert outcome.stop_latency is None
    aborting = stopcock.run(text_model, **batch, max_new_tokens=NEW, do_sample=False, mode="abort")
    assert torch.equal(aborting.output, expected) and not aborting.stopped and aborting.detail is None
    assert all_hooks(text_model) == []


@pytest.mark.parametrize(
    "options",
    [{"do_sample": False}, {"do_sample": True}, {"do_sample": False, "num_beams": 3}],
    ids=["greedy", "sampling", "beam"],
)
def test_stops_at_the_step(text_model, batch, options):
    torch.manual_seed(0)
    outcome = stopcock.run(text_model, **batch, max_new_tokens=NEW, stop=stopcock.max_steps(5), **options)
    assert (outcome.stopped, outcome.reason, outcome.steps) == (True, "max_steps", 5)
    prompt_len = batch["input_ids"].shape[1]
    assert outcome.output.shape == (2, prompt_len + 5)
    assert torch.equal(outcome.output[:, :prompt_len], batch["input_ids"])
    assert outcome.row_reasons == ["max_steps", "max_steps"]


def test_signal_from_step_callback_stops_after_that_step(text_model, batch):
    signal = stopcock.StopSignal()
    seen = []

    def on_step(state):
        seen.append(state.step)
        assert state.input_ids.shape[0] == 2
        if state.step == 7:
            signal.stop("button")

    outcome = stopcock.run(
        text_model, **batch, max_new_tokens=NEW, do_sample=False, stop=signal, on_step=on_step
    )
    # on_step runs before the step's check, so the stop ends step 7 itself: no token after it (issue 12)
    assert (outcome.reason, outcome.steps, seen) == ("button", 7, list(range(1, 8)))
    assert torch.equal(outcome.output, greedy(text_model, batch)[:, : batch["input_ids"].shape[1] + 7])


def test_stop_string_ends_its_row_only_padded(text_model, tokenizer, batch):
    prompt_len = batch["input_ids"].shape[1]
    full = greedy(text_model, batch)
    row0, row1 = (tokenizer.decode(r[prompt_len:]) for r in full)
    stop = " do"  # the tiny model's greedy row 1 says "xxxxxxxxx do do ...", row 0 never does
    assert stop in row1 and stop not in row0
    outcome = stopcock.run(
        text_model,
        **batch,
        max_new_tokens=NEW,
        do_sample=False,
        stop=stopcock.stop_strings([stop]),
        tokenizer=tokenizer,
    )
    assert (outcome.stopped, outcome.reason, outcome.row_reasons) == (
        True,
        "stop_string",
        ["length", "stop_string"],
    )
    assert outcome.steps == NEW
    out = outcome.output
    assert torch.equal(out[0], full[0])  # the other row went on to the end
    text1 = tokenizer.decode(out[1, prompt_len:], skip_special_tokens=True)
    assert text1 == row1[: row1.index(stop) + len(stop)]  # the stop string is kept, nothing after it
    n = len(tokenizer(text1)["input_ids"])
    assert (out[1, prompt_len + n :] == tokenizer.pad_token_id).all()  # padded, not silently continued


def test_stop_string_in_beam_search_ends_the_item(text_model, tokenizer, batch):
    prompt_len = batch["input_ids"].shape[1]
    beams = {"num_beams": 3, "num_return_sequences": 2}
    full = greedy(text_model, batch, **beams)
    texts = [tokenizer.decode(r[prompt_len:]) for r in full]
    # "Hello world" + "ld" + "ld": the match may start in the prompt, as with transformers' own stop_strings
    stop = "ldldld"
    assert all(stop not in t for t in texts)  # without the stop string, item 0's beams say "veve..."
    outcome = stopcock.run(
        text_model,
        **batch,
        max_new_tokens=NEW,
        do_sample=False,
        stop=stopcock.stop_strings([stop]),
        tokenizer=tokenizer,
        **beams,
    )
    assert outcome.reason == "stop_string"
    # the best candidate hit the stop string at step 2: every candidate row of item 0 ended there
    assert outcome.row_reasons == ["stop_string", "stop_string", "length", "length"]
    assert tokenizer.decode(outcome.output[0, prompt_len:], skip_special_tokens=True) == "ldld"
    assert (outcome.output[:2, prompt_len + 2 :] == tokenizer.pad_token_id).all()
    assert torch.equal(outcome.output[2:], full[2:])  # the other item went on unchanged


def test_eos_reason(text_model, batch):
    # make the first greedy token of each row the end-of-sequence token
    first = greedy(text_model, batch)[:, batch["input_ids"].shape[1]]
    outcome = stopcock.run(
        text_model, **batch, max_new_tokens=NEW, do_sample=False, eos_token_id=first.tolist()
    )
    assert (outcome.stopped, outcome.reason, outcome.row_reasons) == (False, "eos", ["eos", "eos"])
    assert outcome.steps == 1


class Counting(StoppingCriteria):
    def __init__(self):
        self.calls = 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


class Recorder(BaseStreamer):
    def __init__(self):
        self.tokens, self.ended = [], False

    def put(self, value):
        self.tokens.append(value)

    def end(self):
        self.ended = True


def test_user_criteria_and_streamer_keep_working(text_model, tokenizer):
    ids = tokenizer(PROMPTS[:1], return_tensors="pt")
    mine, streamer = Counting(), Recorder()
    # an exact built-in type replaces generate's own; ours is appended, never replaced
    users = StoppingCriteriaList([mine, MaxLengthCriteria(ids["input_ids"].shape[1] + 10)])
    outcome = stopcock.run(
        text_model,
        **ids,
        max_new_tokens=NEW,
        do_sample=False,
        stopping_criteria=users,
        streamer=streamer,
        stop=stopcock.max_steps(6),
    )
    assert (outcome.reason, outcome.steps, mine.calls) == ("max_steps", 6, 6)
    assert streamer.ended and torch.equal(
        torch.cat([t.flatten() for t in streamer.tokens]), outcome.output[0]
    )
    assert len(users) == 2  # the user's list is not modified
    limited = stopcock.run(
        text_model, **ids, max_new_tokens=NEW, do_sample=False, stopping_criteria=users[1:]
    )
    # ended by the user's own criterion, which stopcock cannot name
    assert (limited.stopped, limited.reason, limited.steps) == (False, "completed", 10)


def test_steps_count_tokens_when_a_step_adds_several(text_model, tokenizer):
    ids = tokenizer(PROMPTS[1:], return_tensors="pt")
    prompt_len, lookup = ids["input_ids"].shape[1], {"prompt_lookup_num_tokens": 3}
    states = []
    done = stopcock.run(
        text_model, **ids, max_new_tokens=NEW, do_sample=False, on_step=states.append, **lookup
    )
    seen = [state.step for state in states]
    # prompt-lookup decoding accepts several tokens per step on this repetitive text: fewer steps
    # than tokens, and each step reports the tokens generated so far
    assert len(seen) < NEW and seen[-1] == done.steps == NEW == done.output.shape[1] - prompt_len
    stopped = stopcock.run(
        text_model, **ids, max_new_tokens=NEW, do_sample=False, stop=stopcock.max_steps(5), **lookup
    )
    assert stopped.stopped and stopped.steps >= 5
    assert stopped.steps == stopped.output.shape[1] - prompt_len and stopped.steps in seen


def test_user_max_time_and_stop_strings_keep_working(text_model, tokenizer, batch):
    timed = stopcock.run(
        text_model, **batch, max_new_tokens=NEW, do_sample=False, max_time=0.0, stop=stopcock.max_steps(9)
    )
    assert (timed.stopped, timed.steps, timed.row_reasons) == (False, 1, ["completed", "completed"])
    prompt_len = batch["input_ids"].shape[1]
    own = stopcock.run(
        text_model,
        **batch,
        max_new_tokens=NEW,
        do_sample=False,
        stop_strings=[" do"],
        tokenizer=tokenizer,
        stop=stopcock.stop_strings(["never-generated"]),
    )
    assert tokenizer.decode(own.output[1, prompt_len:], skip_special_tokens=True) == "xxxxxxxxx do"
    assert own.steps == NEW and not own.stopped  # transformers' own stop string ended row 1, not ours


def test_abort_mid_generation_keeps_tokens_and_removes_hooks(text_model, batch):
    signal, streamer = stopcock.StopSignal(), Recorder()
    armed = []

    def on_step(state):
        if state.step == 4:
            armed.append(True)  # the stop lands in the next token's forward (one from on_step ends step 4)

    hook = find_blocks(text_model)[0].register_forward_pre_hook(stop_when_armed(signal, armed))
    try:
        outcome = stopcock.run(
            text_model,
            **batch,
            max_new_tokens=NEW,
            do_sample=False,
            mode="abort",
            stop=signal,
            on_step=on_step,
            streamer=streamer,
        )
    finally:
        hook.remove()
    assert (outcome.stopped, outcome.reason, outcome.steps, outcome.mode) == (True, "user", 4, "abort")
    assert "aborted" in outcome.detail
    assert (
        streamer.ended and len(streamer.tokens) == 1 + 4
    )  # the prompt, then each token; ended for its reader
    assert torch.equal(outcome.output, greedy(text_model, batch)[:, : batch["input_ids"].shape[1] + 4])
    assert all_hooks(text_model) == []


def test_abort_during_prefill_within_one_block(text_model, tokenizer):
    ids = tokenizer(["Stop the pipeline when the user presses the button. " * 20], return_tensors="pt")
    blocks = find_blocks(text_model)
    signal, ran = stopcock.StopSignal(), []
    stop_in_first = blocks[0].register_forward_pre_hook(lambda m, a: signal.stop("prefill"))
    count = [b.register_forward_pre_hook(lambda m, a, i=i: ran.append(i)) for i, b in enumerate(blocks)]
    try:
        outcome = stopcock.run(text_model, **ids, max_new_tokens=NEW, mode="abort", stop=signal)
    finally:
        for h in [stop_in_first, *count]:
            h.remove()
    assert (outcome.stopped, outcome.reason, outcome.steps) == (True, "prefill", 0)
    assert ran == [0]  # the first block never ran its forward, the second was never reached
    assert torch.equal(outcome.output, ids["input_ids"])
    assert all_hooks(text_model) == []


def test_stopped_before_run_no_forward(text_model, batch):
    signal = stopcock.StopSignal()
    signal.stop("early")
    calls = []
    hook = text_model.register_forward_pre_hook(lambda m, a: calls.append(1))
    try:
        for mode in ("finish", "abort"):
            streamer = Recorder()
            outcome = stopcock.run(
                text_model, **batch, max_new_tokens=NEW, stop=signal, mode=mode, streamer=streamer
            )
            assert (outcome.stopped, outcome.reason, outcome.steps) == (True, "early", 0)
            assert torch.equal(outcome.output, batch["input_ids"])
            assert streamer.ended and streamer.tokens == []  # its reader is not left waiting
    finally:
        hook.remove()
    assert calls == []


def test_stop_after_completion_is_a_noop(text_model, batch):
    signal = stopcock.StopSignal()
    outcome = stopcock.run(text_model, **batch, max_new_tokens=5, do_sample=False, stop=signal)
    signal.stop()
    assert (outcome.stopped, outcome.reason) == (False, "length")
    again = stopcock.run(text_model, **batch, max_new_tokens=5, do_sample=False)
    assert torch.equal(again.output, outcome.output)


class Boom(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        if input_ids.shape[1] > 12:
            raise RuntimeError("boom")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def test_user_exception_propagates_and_hooks_go(text_model, batch):
    with pytest.raises(RuntimeError, match="boom"):
        stopcock.run(text_model, **batch, max_new_tokens=NEW, mode="abort", stopping_criteria=[Boom()])
    assert all_hooks(text_model) == []


def test_bad_input_errors(text_model, batch, tokenizer):
    with pytest.raises(ValueError, match="tokenizer="):
        stopcock.run(text_model, **batch, max_new_tokens=3, stop=stopcock.stop_strings(["x"]))
    with pytest.raises(ValueError, match=r"\|"):
        stopcock.run(
            text_model,
            **batch,
            tokenizer=tokenizer,
            stop=stopcock.stop_strings(["x"]) & stopcock.max_steps(2),
        )
    with pytest.raises(TypeError, match="StopSignal"):
        stopcock.run(text_model, **batch, stop=3)
    with pytest.raises(ValueError, match="timeout"):
        stopcock.run(text_model, **batch, stop=stopcock.timeout(-1))
    with pytest.raises(TypeError, match="diffusers"):
        stopcock.run(text_model, **batch, partial="raw")
    with pytest.raises(stopcock.UnsupportedTarget, match="transformers"):
        stopcock.run(object())


def test_diy_stopping_criteria(text_model, tokenizer, batch):
    signal = stopcock.StopSignal()
    signal.stop()
    out = text_model.generate(
        **batch, max_new_tokens=NEW, stopping_criteria=stopcock.stopping_criteria(signal)
    )
    assert out.shape[1] == batch["input_ids"].shape[1] + 1  # a criterion runs after the first token
    prompt_len = batch["input_ids"].shape[1]
    criteria = stopcock.stopping_criteria(stopcock.stop_strings([" do"]) | stopcock.max_steps(100), tokenizer)
    out = greedy(text_model, batch, stopping_criteria=criteria)
    assert tokenizer.decode(out[1, prompt_len:], skip_special_tokens=True) == "xxxxxxxxx do"
    assert torch.equal(out[0], greedy(text_model, batch)[0])


@pytest.fixture(scope="module")
def seq2seq(tokenizer):
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    sizes = {"d_model": 16, "encoder_ffn_dim": 16, "decoder_ffn_dim": 16}
    layers = {
        "encoder_layers": 2,
        "decoder_layers": 2,
        "encoder_attention_heads": 2,
        "decoder_attention_heads": 2,
    }
    ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "decoder_start_token_id": tokenizer.eos_token_id,
        "forced_eos_token_id": None,
    }
    config = BartConfig(vocab_size=len(tokenizer), **sizes, **layers, **ids)
    return BartForConditionalGeneration(config).eval()


def test_encoder_decoder(seq2seq, batch):
    full = seq2seq.generate(**batch, max_new_tokens=10, do_sample=False)
    outcome = stopcock.run(seq2seq, **batch, max_new_tokens=10, do_sample=False, stop=stopcock.max_steps(3))
    assert (outcome.reason, outcome.steps, outcome.total_steps) == ("max_steps", 3, 10)
    assert torch.equal(outcome.output, full[:, :4])  # the decoder start token, then 3 tokens
    signal = stopcock.StopSignal()
    signal.stop()
    early = stopcock.run(seq2seq, **batch, max_new_tokens=10, stop=signal, mode="abort")
    assert (early.stopped, early.steps, early.output.shape) == (True, 0, (2, 0))  # nothing decoded yet
