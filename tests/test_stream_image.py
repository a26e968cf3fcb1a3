"""stopcock.stream on diffusers pipelines: step events, previews, leaving early, errors, the buffer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_stream_text import Pause  # tests/ is on sys.path under pytest

import stopcock
from stopcock.stream import Done, Step, latent_preview

BOUND = 60  # seconds: a hang guard for waits, never a timing assertion


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _seed():
    return torch.Generator().manual_seed(0)


def _clean(pipe) -> bool:
    models = [c for c in pipe.components.values() if isinstance(c, torch.nn.Module)]
    hooks = any(m._forward_pre_hooks or m._forward_hooks for model in models for m in model.modules())
    return not hooks and not getattr(pipe, "_interrupt", False)


def test_steps_then_done(image_pipe):
    events = list(stopcock.stream(image_pipe, "a cat", num_inference_steps=5, generator=_seed()))
    assert [(e.step, e.total) for e in events[:-1]] == [(s, 5) for s in range(1, 6)]
    assert all(isinstance(e, Step) and e.preview is None and e.latents.ndim == 4 for e in events[:-1])
    assert isinstance(events[-1], Done) and events[-1].outcome.reason == "completed"


def test_latent_preview_every_step(image_pipe):
    events = list(
        stopcock.stream(
            image_pipe,
            "a cat",
            num_inference_steps=3,
            num_images_per_prompt=2,
            generator=_seed(),
            preview="latent",
        )
    )
    steps = [e for e in events if isinstance(e, Step)]
    _, _, h, w = steps[0].latents.shape
    assert [e.preview.size for e in steps] == [(2 * w, h)] * 3  # the two images side by side
    assert np.array_equal(np.asarray(steps[-1].preview), np.asarray(latent_preview(steps[-1].latents)))
    assert not np.array_equal(np.asarray(steps[0].preview), np.asarray(steps[-1].preview))


def test_decoded_preview_of_the_last_step_is_the_image(image_pipe):
    events = list(
        stopcock.stream(
            image_pipe, "a cat", num_inference_steps=4, generator=_seed(), preview="decode", preview_every=2
        )
    )
    previews = [e.preview for e in events if isinstance(e, Step)]
    assert [p is not None for p in previews] == [False, True, False, True]
    image = events[-1].outcome.output.images[0]
    assert previews[-1].size == image.size
    assert np.array_equal(np.asarray(previews[-1]), np.asarray(image))


def test_preview_errors_name_the_fix():
    from tiny.image import ddpm_pipeline

    ddpm = ddpm_pipeline()
    with pytest.raises(ValueError, match="preview='latent'"):
        stopcock.stream(ddpm, preview="decode")
    with pytest.raises(ValueError, match="preview must be"):
        stopcock.stream(ddpm, preview="fast")
    with pytest.raises(ValueError, match="4-channel"):  # DDPM denoises 3-channel pixels
        list(stopcock.stream(ddpm, num_inference_steps=3, preview="latent", generator=_seed()))
    assert _clean(ddpm)


@pytest.mark.parametrize("mode", ["finish", "abort"])
def test_break_stops_within_one_step_and_waits(image_pipe, mode):
    pause = Pause(at=3)
    s = stopcock.stream(
        image_pipe, "a cat", num_inference_steps=50, generator=_seed(), mode=mode, on_step=pause
    )
    s.signal.on_stop(pause.release.set)  # the held worker goes on once the stop is requested
    for _event in s:
        assert pause.reached.wait(BOUND)
        del s  # the loop holds the last reference
        break  # the stream goes: its finaliser stops the run and waits for it
    assert not pause.workers[0].is_alive()
    # the stop came while step 3's on_step held the worker: that step is the last, in either mode
    assert pause.steps == [1, 2, 3]
    assert _clean(image_pipe)


def test_close_reports_the_partial_run(image_pipe):
    pause = Pause(at=2)
    s = stopcock.stream(image_pipe, "a cat", num_inference_steps=50, generator=_seed(), on_step=pause)
    s.signal.on_stop(pause.release.set)  # the held worker goes on once the stop is requested
    assert pause.reached.wait(BOUND)
    s.close()
    # the stop came during step 2's on_step: step 2 is the last, then the partial image is decoded
    assert s.outcome.stopped and s.outcome.reason == "cancelled"
    assert s.outcome.steps == 2 and pause.steps == [1, 2]
    assert s.outcome.output is not None and s.outcome.output.images[0].size == (64, 64)
    assert _clean(image_pipe)


def test_exception_reaches_the_consumer(image_pipe):
    def on_step(state):
        if state.step == 2:
            raise RuntimeError("callback failed at step 2")

    seen = []
    with pytest.raises(RuntimeError, match="at step 2"):
        for event in stopcock.stream(
            image_pipe, "a cat", num_inference_steps=10, generator=_seed(), on_step=on_step
        ):
            seen.append(event.step)
    assert seen == [1, 2]  # the events made before the error came first
    assert _clean(image_pipe)


def test_bounded_buffer_holds_the_worker(image_pipe):
    steps = []
    s = stopcock.stream(
        image_pipe,
        "a cat",
        num_inference_steps=8,
        generator=_seed(),
        buffer=2,
        on_step=lambda st: steps.append(st.step),
    )
    assert s._channel.stalled.wait(BOUND)
    # two steps wait in the buffer; the third waits for room, before its on_step
    assert steps == [1, 2] and s.outcome is None
    events = list(s)
    assert [e.step for e in events[:-1]] == list(range(1, 9)) and events[-1].outcome.steps == 8
