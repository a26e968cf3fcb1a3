"""Audio models called directly (not through a pipeline) stop within one step of the request.

MusicGen's ``generate`` (the conditional model and its decoder alone) ends with its delay pattern,
which raises on an output shorter than planned, with any criterion; stopcock pads the pattern at
the length reached. SpeechT5's ``generate`` runs a loop of its own, ended by a stop-probability
head that ``minlenratio=`` makes it ignore at first; stopcock keeps the minimum itself, so a stop
ends the loop at once. Each partial is the model's normal output: codes, audio, mel frames.
"""

from __future__ import annotations

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

import stopcock
from tiny import text as tiny

NEW = 12  # the tokens a full MusicGen run makes
AT = 6  # the step whose on_step asks for the stop
CODEBOOKS = 4  # the tiny MusicGen's codebooks: the first frame is complete after 4 steps


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def musicgen():
    pipe = tiny.musicgen_pipeline()
    return pipe.model, dict(pipe.tokenizer(["a calm tune"], return_tensors="pt"))


def _stop_at(step: int, module: torch.nn.Module, signal: stopcock.StopSignal):
    """An on_step that stops ``signal`` at ``step``; a record of ``module``'s forwards (all, and
    those done when the stop was requested)."""
    seen: dict[str, int | None] = {"forwards": 0, "at_request": None}

    def count(m, args, out):
        seen["forwards"] += 1  # type: ignore[operator]

    def on_step(state):
        if state.step == step and seen["at_request"] is None:
            seen["at_request"] = seen["forwards"]
            signal.stop("button")

    return on_step, seen, module.register_forward_hook(count)


def _musicgen_cases(musicgen):
    model, text = musicgen
    codes = {"input_ids": torch.full((CODEBOOKS, 1), 64), "num_return_sequences": 1}  # the pad code starts
    return {"conditional": (model, text, model.decoder), "decoder": (model.decoder, codes, model.decoder)}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("which", ["conditional", "decoder"])
def test_musicgen_called_directly_stops_at_the_step_and_keeps_the_frames(musicgen, which):
    target, inputs, decoder = _musicgen_cases(musicgen)[which]
    kwargs = {**inputs, "max_new_tokens": NEW, "do_sample": False}
    native = StoppingCriteriaList(
        [type("AtSix", (StoppingCriteria,), {"__call__": lambda s, ids, sc, **k: ids.shape[-1] > AT})()]
    )
    with pytest.raises(RuntimeError, match="shape"):  # upstream's crash, with a criterion of one's own
        target.generate(**kwargs, stopping_criteria=native)
    full = target.generate(**kwargs)
    signal = stopcock.StopSignal()
    on_step, seen, hook = _stop_at(AT, decoder, signal)
    try:
        outcome = stopcock.run(target, kwargs=kwargs, stop=signal, on_step=on_step)
    finally:
        hook.remove()
    assert (outcome.stopped, outcome.reason, outcome.steps, outcome.mode) == (True, "button", AT, "finish")
    assert seen["forwards"] == seen["at_request"]  # no forward of the decoder after the request
    assert outcome.row_reasons == ["button"] and outcome.detail is None
    frames = AT + 1 - CODEBOOKS  # the frames complete in every codebook
    out = outcome.output
    assert out.dtype == full.dtype and out.shape[:-1] == full.shape[:-1]  # the normal output, shorter
    if which == "decoder":  # the codes: (batch, codebooks, frames)
        assert out.shape[-1] == frames and torch.equal(out, full[..., :frames])
    else:  # the audio: EnCodec makes 4 samples a frame here
        assert out.shape[-1] == frames * 4 and torch.allclose(out, full[..., : frames * 4], atol=1e-6)
    assert "generate" not in vars(target) and "build_delay_pattern_mask" not in vars(decoder)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("which", ["conditional", "decoder"])
def test_musicgen_stopped_before_its_first_frame_aborts_with_the_codes(musicgen, which):
    target, inputs, _ = _musicgen_cases(musicgen)[which]
    outcome = stopcock.run(
        target, kwargs={**inputs, "max_new_tokens": NEW, "do_sample": False}, stop=stopcock.max_steps(2)
    )
    assert (outcome.stopped, outcome.steps, outcome.mode) == (True, 2, "abort")
    assert "first audio frame" in outcome.detail
    assert outcome.output.shape == (CODEBOOKS, 3)  # the delayed codes so far: the start and two steps


@pytest.mark.timeout(60)
def test_musicgen_refuses_stop_strings(musicgen):
    model, text = musicgen
    with pytest.raises(ValueError, match="makes no text"):
        stopcock.run(model, kwargs={**text, "max_new_tokens": NEW}, stop=stopcock.stop_strings(["x"]))


# -- SpeechT5 ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def speecht5():
    pipe, speaker = tiny.speecht5_pipeline()
    ids = pipe.tokenizer(["hello world"], return_tensors="pt")["input_ids"]
    return pipe.model, pipe.vocoder, ids, speaker


def _head_says(model, value: float):
    """The stop head's bias set to ``value`` (restored on exit): +1e4, the loop may end at once."""
    bias = model.speech_decoder_postnet.prob_out.bias

    class Biased:
        def __enter__(self):
            self.kept = bias.detach().clone()
            with torch.no_grad():
                bias.fill_(value)

        def __exit__(self, *exc):
            with torch.no_grad():
                bias.copy_(self.kept)

    return Biased()


RATIO = 6.0  # minlenratio: 6 encoder positions x 6 / reduction factor 2 = a minimum of 18 steps
LEAST = 18
STOP = 4  # the step whose on_step asks for the stop, well before the minimum


@pytest.mark.timeout(120)
@pytest.mark.parametrize("vocoded", [False, True])
def test_speecht5_stop_ends_its_loop_at_the_step_despite_minlenratio(speecht5, vocoded):
    model, vocoder, ids, speaker = speecht5
    assert ids.shape == (1, 6)
    kwargs = {"speaker_embeddings": speaker, "minlenratio": RATIO}
    if vocoded:
        kwargs["vocoder"] = vocoder
    torch.manual_seed(0)  # the decoder prenet keeps its dropout on in eval mode
    full = model.generate(ids, **kwargs)
    signal = stopcock.StopSignal()
    on_step, seen, hook = _stop_at(STOP, model.speech_decoder_postnet.prob_out, signal)
    try:
        torch.manual_seed(0)
        outcome = stopcock.run(model, ids, kwargs=kwargs, stop=signal, on_step=on_step)
    finally:
        hook.remove()
    assert (outcome.stopped, outcome.reason, outcome.steps, outcome.mode) == (True, "button", STOP, "finish")
    assert seen["forwards"] == seen["at_request"]  # the loop ended at the step of the request
    out = outcome.output
    assert isinstance(out, torch.Tensor) and out.dtype == full.dtype
    mel = STOP * 2  # 2 mel frames a step
    if vocoded:  # the waveform: the tiny vocoder makes 2 samples a mel frame
        assert out.shape == (mel * 2,)
    else:  # the spectrogram: (frames, mel bins)
        assert out.shape == (mel, 8)
    assert "speech_decoder_postnet" not in vars(model) and not outcome.detail


@pytest.mark.timeout(120)
def test_speecht5_minimum_length_is_kept_without_a_stop(speecht5):
    """With a head that would end the loop at once, the loop still runs to minlenratio's minimum,
    as it does without stopcock, and makes the same spectrogram."""
    model, _, ids, speaker = speecht5
    kwargs = {"speaker_embeddings": speaker, "minlenratio": RATIO}
    with _head_says(model, 1e4):
        torch.manual_seed(0)
        native = model.generate(ids, **kwargs)
        torch.manual_seed(0)
        outcome = stopcock.run(model, ids, kwargs=kwargs, stop=stopcock.StopSignal())
        torch.manual_seed(0)
        at_once = stopcock.run(model, ids, kwargs={"speaker_embeddings": speaker})
    assert native.shape == (LEAST * 2, 8)  # the loop's own minimum
    assert (outcome.stopped, outcome.steps) == (False, LEAST) and torch.allclose(outcome.output, native)
    assert at_once.steps == 1  # without the minimum the head ends the loop at its first step


@pytest.mark.timeout(120)
def test_speecht5_pipeline_stop_despite_minlenratio():
    case = tiny.task_case("text-to-audio (SpeechT5)")
    forward = {**case.kwargs["forward_params"], "minlenratio": RATIO}
    torch.manual_seed(0)
    outcome = stopcock.run(case.pipe, case.item, stop=stopcock.max_steps(STOP), forward_params=forward)
    assert (outcome.stopped, outcome.steps) == (True, STOP) and not outcome.detail
    assert case.content(outcome.output).shape == (STOP * 2 * 2,)


@pytest.mark.timeout(120)
def test_speecht5_abort_keeps_the_mel_frames_so_far(speecht5):
    model, vocoder, ids, speaker = speecht5
    signal = stopcock.StopSignal()
    on_step, seen, hook = _stop_at(STOP, model.speech_decoder_postnet.prob_out, signal)
    kwargs = {"speaker_embeddings": speaker, "minlenratio": RATIO, "vocoder": vocoder}
    try:
        outcome = stopcock.run(model, ids, kwargs=kwargs, stop=signal, on_step=on_step, mode="abort")
    finally:
        hook.remove()
    assert (outcome.stopped, outcome.steps, outcome.mode) == (True, STOP, "abort")
    assert seen["forwards"] == seen["at_request"]
    assert outcome.output.shape == (STOP * 2, 8)  # the loop's frames, before the postnet and vocoder
    assert "mel frames generated so far" in outcome.detail
