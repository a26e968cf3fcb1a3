"""stopcock.run on transformers pipelines: text-generation, and pipelines over many inputs."""

from __future__ import annotations

import pytest
import torch
from test_transformers_generate import Counting, Recorder, stop_when_armed  # tests/ is on sys.path
from transformers import StoppingCriteriaList, pipeline
from transformers.pipelines.pt_utils import KeyDataset

import stopcock

PROMPTS = ["Hello world", "The quick brown fox", "Stop the pipeline", "Once upon a time"]
TEXTS = [f"sentence number {i} about a fox" for i in range(10)]
NEW = 20


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def classifier(text_model_dir, tokenizer):
    from transformers import GPT2ForSequenceClassification

    model = GPT2ForSequenceClassification.from_pretrained(text_model_dir, num_labels=3).eval()
    return pipeline("text-classification", model=model, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def features(text_model_dir, tokenizer):
    from transformers import GPT2Model

    return pipeline(
        "feature-extraction", model=GPT2Model.from_pretrained(text_model_dir).eval(), tokenizer=tokenizer
    )


def forwards(model):
    calls = []
    return calls, model.register_forward_pre_hook(lambda m, a: calls.append(1))


def test_text_generation_completes_like_the_pipeline(text_pipe):
    expected = text_pipe(PROMPTS[0], max_new_tokens=NEW, do_sample=False)
    outcome = stopcock.run(text_pipe, PROMPTS[0], max_new_tokens=NEW, do_sample=False)
    assert outcome.output == expected
    assert (outcome.stopped, outcome.reason, outcome.steps, outcome.total_steps) == (
        False,
        "length",
        NEW,
        NEW,
    )


def test_text_generation_stop_string_is_kept(text_pipe):
    # the tiny model continues "The quick brown fox" with "xxxxxxxxx do do ..."
    outcome = stopcock.run(
        text_pipe, PROMPTS[1], max_new_tokens=NEW, do_sample=False, stop=stopcock.stop_strings([" do"])
    )
    assert outcome.output == [{"generated_text": "The quick brown foxxxxxxxxxx do"}]
    assert (outcome.stopped, outcome.reason, outcome.row_reasons, outcome.steps) == (
        True,
        "stop_string",
        ["stop_string"],
        10,
    )


@pytest.mark.parametrize(
    "options", [{"do_sample": True}, {"do_sample": False, "num_beams": 3}], ids=["sampling", "beam"]
)
def test_text_generation_sampling_and_beam_stop_at_step(text_pipe, options):
    torch.manual_seed(0)
    full = text_pipe(PROMPTS[0], max_new_tokens=NEW, **options)[0]["generated_text"]
    torch.manual_seed(0)
    outcome = stopcock.run(text_pipe, PROMPTS[0], max_new_tokens=NEW, stop=stopcock.max_steps(6), **options)
    assert (outcome.stopped, outcome.reason, outcome.steps) == (True, "max_steps", 6)
    text = outcome.output[0]["generated_text"]
    assert text.startswith(PROMPTS[0]) and len(text) < len(full)
    if options["do_sample"]:  # the same seed draws the same first tokens
        assert full.startswith(text)


def test_prompt_list_stop_ends_the_whole_run_keeping_finished(text_pipe):
    full = text_pipe(PROMPTS, max_new_tokens=NEW, do_sample=False)
    started = []

    def on_step(state):
        if state.step == NEW + 1:  # the first token of the second prompt
            started.append(state.input_ids.shape[0])

    outcome = stopcock.run(
        text_pipe,
        PROMPTS,
        max_new_tokens=NEW,
        do_sample=False,
        stop=stopcock.max_steps(NEW + 5),
        on_step=on_step,
    )
    assert (outcome.stopped, outcome.reason, outcome.steps, outcome.total_steps) == (
        True,
        "max_steps",
        NEW + 5,
        4 * NEW,
    )
    assert outcome.output[0] == full[0]  # the finished prompt is kept
    second = outcome.output[1][0]["generated_text"]  # the stopped one holds its partial text
    assert full[1][0]["generated_text"].startswith(second) and second != full[1][0]["generated_text"]
    assert len(outcome.output) == 2 and outcome.extra["items"] == 2  # later prompts never started
    assert outcome.row_reasons == ["length", "max_steps"]


def test_prompt_list_batched(text_pipe):
    full = text_pipe(PROMPTS, max_new_tokens=NEW, do_sample=False, batch_size=2)
    outcome = stopcock.run(text_pipe, PROMPTS, max_new_tokens=NEW, do_sample=False, batch_size=2)
    assert outcome.output == full
    assert (outcome.stopped, outcome.reason, outcome.steps, outcome.row_reasons) == (
        False,
        "length",
        2 * NEW,
        ["length"] * 4,
    )


def test_user_criteria_at_init_and_call_kept(text_model, tokenizer):
    at_init, at_call = Counting(), Counting()
    pipe = pipeline(
        "text-generation",
        model=text_model,
        tokenizer=tokenizer,
        stopping_criteria=StoppingCriteriaList([at_init]),
    )
    stopcock.run(pipe, PROMPTS[0], max_new_tokens=NEW, do_sample=False, stop=stopcock.max_steps(4))
    assert at_init.calls == 4
    outcome = stopcock.run(pipe, PROMPTS[0], max_new_tokens=NEW, do_sample=False, stopping_criteria=[at_call])
    assert (
        at_call.calls == NEW and at_init.calls == 4 and outcome.steps == NEW
    )  # the call's list wins, as in transformers


def test_text_generation_abort_and_prestop(text_pipe):
    signal = stopcock.StopSignal()
    armed = []

    def on_step(state):
        if state.step == 3:
            armed.append(True)  # the stop lands in the next token's forward (one from on_step ends step 3)

    hook = text_pipe.model.transformer.h[0].register_forward_pre_hook(stop_when_armed(signal, armed))
    try:
        outcome = stopcock.run(
            text_pipe,
            PROMPTS[:2],
            max_new_tokens=NEW,
            do_sample=False,
            stop=signal,
            mode="abort",
            on_step=on_step,
        )
    finally:
        hook.remove()
    assert (outcome.stopped, outcome.steps, outcome.output) == (True, 3, [])
    assert outcome.extra["partial_ids"].shape[1] == len(text_pipe.tokenizer(PROMPTS[0])["input_ids"]) + 3
    assert [h for m in text_pipe.model.modules() for h in m._forward_pre_hooks.values()] == []
    calls, hook = forwards(text_pipe.model)
    streamer = Recorder()
    try:
        again = stopcock.run(text_pipe, PROMPTS[0], max_new_tokens=NEW, stop=signal, streamer=streamer)
    finally:
        hook.remove()
    assert (again.stopped, again.steps, again.output, calls) == (True, 0, [], [])
    assert streamer.ended and streamer.tokens == []  # no generate ran, so stopcock ends the streamer


@pytest.fixture(scope="module")
def chat_pipe(text_model, text_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(text_model_dir)  # its own copy: the shared one has no template
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    return pipeline("text-generation", model=text_model, tokenizer=tokenizer)


def test_chat_inputs_one_chat_and_a_list_of_chats(chat_pipe):
    chats = [[{"role": "user", "content": p}] for p in PROMPTS[:3]]
    full = chat_pipe(chats, max_new_tokens=NEW, do_sample=False)
    one = stopcock.run(chat_pipe, chats[0], max_new_tokens=NEW, do_sample=False, stop=stopcock.max_steps(4))
    # one chat (a list of messages) is one input, not several: the reply is cut after 4 tokens
    assert (one.stopped, one.steps, one.total_steps, one.row_reasons) == (True, 4, NEW, ["max_steps"])
    [[user, reply]] = [r["generated_text"] for r in one.output]
    assert user == chats[0][0] and reply["role"] == "assistant"
    assert full[0][0]["generated_text"][1]["content"].startswith(reply["content"])
    many = stopcock.run(
        chat_pipe, chats, max_new_tokens=NEW, do_sample=False, stop=stopcock.max_steps(NEW + 3)
    )
    assert (many.stopped, many.steps, many.total_steps) == (True, NEW + 3, 3 * NEW)
    assert len(many.output) == 2 and many.output[0] == full[0]  # the finished chat is kept
    assert many.row_reasons == ["length", "max_steps"]


@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("as_generator", [False, True])
def test_classifier_stops_between_items_keeping_results(classifier, batch_size, as_generator):
    full = classifier(TEXTS, batch_size=batch_size)
    signal = stopcock.StopSignal()
    steps = []

    def on_step(state):
        steps.append(state.step)
        if state.step == 4:
            signal.stop("enough")

    inputs = (t for t in TEXTS) if as_generator else TEXTS
    calls, hook = forwards(classifier.model)
    try:
        outcome = stopcock.run(classifier, inputs, batch_size=batch_size, stop=signal, on_step=on_step)
    finally:
        hook.remove()
    # with batches of 3, the stop after item 4 lets the batch it belongs to (items 4-6) deliver its results
    done = 4 if batch_size == 1 else 6
    assert (outcome.stopped, outcome.reason, outcome.steps) == (True, "enough", done)
    assert outcome.output == full[:done] and steps == list(range(1, done + 1))
    assert len(calls) == -(-done // batch_size)  # no forward for any item after the stop
    assert outcome.total_steps == (None if as_generator else len(TEXTS))


def test_feature_extraction_completes_and_single_input(features):
    outcome = stopcock.run(features, TEXTS[:3], stop=stopcock.max_steps(10))
    assert (outcome.stopped, outcome.reason, outcome.steps) == (False, "completed", 3)
    assert outcome.output == features(TEXTS[:3])
    dataset = KeyDataset([{"text": t} for t in TEXTS[:3]], "text")
    from_dataset = stopcock.run(features, dataset, stop=stopcock.max_steps(2))
    assert (from_dataset.reason, from_dataset.steps, from_dataset.total_steps) == ("max_steps", 2, 3)
    assert from_dataset.output == outcome.output[:2]
    single = stopcock.run(features, TEXTS[0])
    assert (single.steps, single.output) == (1, features(TEXTS[0]))


def test_classifier_abort_inside_forward(classifier):
    signal = stopcock.StopSignal()
    hook = classifier.model.transformer.h[1].register_forward_pre_hook(
        lambda m, a: signal.stop() if calls else calls.append(1)
    )
    calls: list[int] = []
    try:
        outcome = stopcock.run(classifier, TEXTS, stop=signal, mode="abort")
    finally:
        hook.remove()
    # the first item's forward ran through; the second was abandoned at its second block
    assert (outcome.stopped, outcome.steps, outcome.output) == (True, 1, classifier(TEXTS[:1]))
    assert [h for m in classifier.model.modules() for h in m._forward_pre_hooks.values()] == []


def test_pipeline_bad_input(classifier, text_pipe):
    with pytest.raises(ValueError, match="text generation only"):
        stopcock.run(classifier, TEXTS, stop=stopcock.stop_strings(["x"]))
    with pytest.raises(ValueError, match="num_workers"):
        stopcock.run(classifier, TEXTS, num_workers=2)
    with pytest.raises(TypeError, match="stopping_criteria"):
        stopcock.run(text_pipe, PROMPTS[0], stopping_criteria=Counting())
