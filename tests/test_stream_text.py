"""stopcock.stream on transformers targets: text chunks, leaving early, errors, the bounded buffer."""

from __future__ import annotations

import gc
import random
import threading
import weakref

import pytest
import torch

import stopcock
from stopcock.events import TextDecoder
from stopcock.stream import Done, TextChunk

BOUND = 60  # seconds: a hang guard for waits on events, never a timing assertion


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _prompt(tokenizer, texts):
    return tokenizer(texts, return_tensors="pt", padding=True)


def _text_by_row(events):
    rows: dict[int, str] = {}
    for e in events:
        if isinstance(e, TextChunk):
            rows[e.row] = rows.get(e.row, "") + e.text
    return rows


class Pause:
    """An on_step that records steps and worker threads, and holds the worker at step ``at``.

    ``reached`` (a StopSignal, so a thread can wait for it and a coroutine await it) says the
    worker is held; the worker goes on when ``release`` is set.
    """

    def __init__(self, at: int) -> None:
        self.at = at
        self.steps: list[int] = []
        self.workers: list[threading.Thread] = []
        self.reached = stopcock.StopSignal()
        self.release = threading.Event()

    def __call__(self, state) -> None:
        self.steps.append(state.step)
        self.workers.append(threading.current_thread())
        if state.step == self.at:
            self.reached.stop("reached")
            assert self.release.wait(BOUND)

    def worker_ended(self) -> bool:
        self.workers[0].join(BOUND)
        return not self.workers[0].is_alive()


def _byte_tokens(tokenizer, text):
    """One byte-level token per UTF-8 byte of ``text``: every multi-byte character is split."""
    pieces = tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)
    symbols = [symbol for piece, _ in pieces for symbol in piece]  # one symbol per byte
    assert len(symbols) == len(text.encode())
    return tokenizer.convert_tokens_to_ids(symbols)


def test_decoder_holds_back_split_characters(tokenizer):
    text = "Zürich 東京 😀!"
    ids = _byte_tokens(tokenizer, text)
    assert tokenizer.decode(ids) == text
    decoder = TextDecoder(tokenizer)
    chunks = [decoder.push([i]) for i in ids] + [decoder.flush()]
    assert "".join(chunks) == text
    assert not any("\ufffd" in c for c in chunks)
    emoji = len("Zürich 東京 ".encode())
    assert chunks[emoji : emoji + 4] == ["", "", "", "😀"]  # whole, once its fourth byte is there


def test_decoder_flush_gives_an_incomplete_tail_as_decoded(tokenizer):
    ids = _byte_tokens(tokenizer, "ok é")[:-1]
    decoder = TextDecoder(tokenizer)
    assert "".join(decoder.push([i]) for i in ids) == "ok "
    assert decoder.flush() == tokenizer.decode(ids)[len("ok ") :] != ""


def _metaspace_tokenizer():
    """A SentencePiece-style tokenizer (Metaspace spaces, byte fallback), built in memory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    special = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    corpus = ["Hello world, spaces come first here.", "Zürich 東京 café naïve 😀 emoji"] * 10
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=special))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize("kind", ["byte-level", "metaspace"])
def test_decoder_chunks_always_join_to_the_decoded_text(tokenizer, kind):
    tok = tokenizer if kind == "byte-level" else _metaspace_tokenizer()
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 30))]
        decoder = TextDecoder(tok)
        chunks = [decoder.push([i]) for i in ids]
        assert not any(c.endswith("\ufffd") for c in chunks)  # incomplete characters are held back
        assert "".join(chunks) + decoder.flush() == tok.decode(ids, skip_special_tokens=True)


def test_model_stream_rows_match_the_output(text_model, tokenizer):
    inputs = _prompt(tokenizer, ["Hello world", "Unicode: caf"])
    events = list(
        stopcock.stream(text_model, **inputs, tokenizer=tokenizer, max_new_tokens=24, do_sample=False)
    )
    assert isinstance(events[-1], Done) and not any(isinstance(e, Done) for e in events[:-1])
    outcome = events[-1].outcome
    assert outcome.steps == 24 and outcome.reason == "length"
    steps = [e.step for e in events if isinstance(e, TextChunk)]
    assert steps == sorted(steps) and steps[-1] <= 24
    new = outcome.output[:, inputs["input_ids"].shape[1] :]
    assert _text_by_row(events) == {r: tokenizer.decode(new[r], skip_special_tokens=True) for r in range(2)}


def test_pipeline_stream_numbers_rows_across_prompts(text_pipe):
    prompts = ["Hello", "The quick brown"]
    events = list(stopcock.stream(text_pipe, prompts, max_new_tokens=12, do_sample=False))
    outcome = events[-1].outcome
    texts = _text_by_row(events)
    assert sorted(texts) == [0, 1]
    for row, prompt in enumerate(prompts):
        assert outcome.output[row][0]["generated_text"] == prompt + texts[row]


def test_stop_keeps_streaming_to_done(text_model, tokenizer):
    inputs = _prompt(tokenizer, ["Hello"])
    s = stopcock.stream(text_model, **inputs, tokenizer=tokenizer, max_new_tokens=200, do_sample=False)
    first = next(s)
    assert s.stop("enough")
    events = [first, *s]
    outcome = events[-1].outcome
    assert outcome.stopped and outcome.reason == "enough" and outcome.steps < 200
    assert s.outcome is outcome
    new = outcome.output[0, inputs["input_ids"].shape[1] :]
    assert _text_by_row(events)[0] == tokenizer.decode(new, skip_special_tokens=True)


def test_user_stop_and_conditions_compose(text_model, tokenizer):
    inputs = _prompt(tokenizer, ["Hello"])
    events = list(
        stopcock.stream(
            text_model, **inputs, tokenizer=tokenizer, stop=stopcock.max_steps(5), max_new_tokens=50
        )
    )
    assert events[-1].outcome.reason == "max_steps" and events[-1].outcome.steps == 5


def released_on_stop(stream, release: threading.Event):
    """``stream``, with ``release`` set when its run is asked to stop."""
    stream.signal.on_stop(release.set)
    return stream


@pytest.mark.parametrize("mode", ["finish", "abort"])
def test_break_stops_the_run_and_waits_for_it(text_model, tokenizer, mode):
    pause = Pause(at=4)
    inputs = _prompt(tokenizer, ["Hello"])
    for _event in released_on_stop(
        stopcock.stream(
            text_model, **inputs, tokenizer=tokenizer, max_new_tokens=200, mode=mode, on_step=pause
        ),
        pause.release,
    ):
        assert pause.reached.wait(BOUND)
        break  # the stream's last reference goes: its finaliser stops the run and waits for it
    assert not pause.workers[0].is_alive()
    # finish: the step under way when the stream was left (5) is the last; abort: it is abandoned
    assert pause.steps == [1, 2, 3, 4]  # on_step runs before the check: the paused step is the last
    assert not any(m._forward_pre_hooks for m in text_model.modules())


def test_close_stops_waits_and_reports_cancelled(text_model, tokenizer):
    pause = Pause(at=3)
    s = stopcock.stream(
        text_model, **_prompt(tokenizer, ["Hello"]), tokenizer=tokenizer, max_new_tokens=200, on_step=pause
    )
    s.signal.on_stop(pause.release.set)  # the worker goes on once the stop is requested
    assert pause.reached.wait(BOUND)
    s.close()
    assert not pause.workers[0].is_alive()
    assert s.outcome is not None and s.outcome.stopped and s.outcome.reason == "cancelled"
    assert s.outcome.steps == 3 and pause.steps == [1, 2, 3]
    assert list(s) == []  # closed: the events not read are dropped


def test_garbage_collected_stream_stops_the_run(text_model, tokenizer):
    pause = Pause(at=2)
    s = stopcock.stream(
        text_model, **_prompt(tokenizer, ["Hello"]), tokenizer=tokenizer, max_new_tokens=200, on_step=pause
    )
    s.cycle = s  # only the cyclic garbage collector can free it
    alive = weakref.ref(s)
    assert pause.reached.wait(BOUND)
    del s
    gc.collect()
    assert alive() is None  # the worker holds no reference to the stream
    pause.release.set()
    assert pause.worker_ended() and pause.steps == [1, 2]


class Boom(Exception):
    pass


def test_exception_in_the_run_reaches_the_consumer(text_model, tokenizer):
    def on_step(state):
        if state.step == 3:
            raise Boom("at step 3")

    s = stopcock.stream(
        text_model, **_prompt(tokenizer, ["Hello"]), tokenizer=tokenizer, max_new_tokens=50, on_step=on_step
    )
    seen = []
    with pytest.raises(Boom, match="at step 3"):
        for event in s:
            seen.append(event)
    assert all(isinstance(e, TextChunk) and e.step <= 3 for e in seen)
    assert s.outcome is None
    assert not any(m._forward_pre_hooks for m in text_model.modules())
    assert list(s) == []


def test_buffer_is_bounded_and_holds_the_worker(text_model, tokenizer):
    s = stopcock.stream(
        text_model, **_prompt(tokenizer, ["Hello"]), tokenizer=tokenizer, max_new_tokens=60, buffer=2
    )
    channel = s._channel
    assert channel.stalled.wait(BOUND)  # the worker waits for the consumer, who read nothing yet
    assert len(channel._items) == 2 and s.outcome is None
    events = list(s)
    assert events[-1].outcome.steps == 60 and events[-1].outcome.reason == "length"


def test_bad_arguments_raise_before_the_run(text_model, tokenizer, text_pipe):
    inputs = _prompt(tokenizer, ["Hello"])
    with pytest.raises(ValueError, match="tokenizer="):
        stopcock.stream(text_model, **inputs, max_new_tokens=5)
    with pytest.raises(ValueError, match="beam search"):
        stopcock.stream(text_model, **inputs, tokenizer=tokenizer, num_beams=2, max_new_tokens=5)
    with pytest.raises(ValueError, match="beam search"):
        stopcock.stream(text_pipe, "Hello", num_beams=3, max_new_tokens=5)
    with pytest.raises(ValueError, match="buffer"):
        stopcock.stream(text_model, **inputs, tokenizer=tokenizer, buffer=0)
    with pytest.raises(TypeError, match="stop= accepts"):
        stopcock.stream(text_model, **inputs, tokenizer=tokenizer, stop="soon")
    with pytest.raises(stopcock.UnsupportedTarget):
        stopcock.stream(object())
    assert not [t for t in threading.enumerate() if t.name.startswith("stopcock-worker")]


def test_close_from_another_thread_ends_a_waiting_consumer(text_model, tokenizer):
    pause = Pause(at=2)
    s = stopcock.stream(
        text_model, **_prompt(tokenizer, ["Hello"]), tokenizer=tokenizer, max_new_tokens=200, on_step=pause
    )
    s.signal.on_stop(pause.release.set)
    received: list = []
    consumer = threading.Thread(target=lambda: received.extend(s))
    consumer.start()
    assert pause.reached.wait(BOUND)
    s.close()
    consumer.join(BOUND)
    assert not consumer.is_alive() and not pause.workers[0].is_alive()
    assert not any(isinstance(e, Done) for e in received) and s.outcome.reason == "cancelled"
    assert pause.steps == [1, 2] and s.outcome.steps == 2


def test_stopcock_stream_stays_the_function_once_its_module_is_imported():
    import importlib

    importlib.import_module("stopcock.aio")  # imports the stopcock.stream module
    assert stopcock.stream is importlib.import_module("stopcock.stream").stream
