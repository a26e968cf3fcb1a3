"""The diffusers adapter on a tiny Stable Diffusion: modes, partial results, threads, callbacks,
``attach``, ``step_callback``, ``guard`` and misuse errors."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import torch
from diffusers.callbacks import MultiPipelineCallbacks, PipelineCallback, SDCFGCutoffCallback

import stopcock
import stopcock.adapters.diffusers
from tiny import image as tiny

STEPS = 6


@pytest.fixture(scope="module")
def sd():
    torch.set_num_threads(1)
    return tiny.stable_diffusion_pipeline()


@pytest.fixture(scope="module")
def lcm():
    """Category B: stopped through hooks."""
    return tiny.lcm_pipeline()


def kwargs(**extra):
    return {"prompt": "a cat", "num_inference_steps": STEPS, "generator": torch.Generator().manual_seed(0),
            "output_type": "np", **extra}


def assert_clean(pipe):
    assert getattr(pipe, "_interrupt", False) is False
    assert "step" not in vars(pipe.scheduler)
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            assert all(not m._forward_pre_hooks for m in component.modules())


def test_build_image_model_loads_offline(image_pipe):
    from diffusers import StableDiffusionPipeline

    assert isinstance(image_pipe, StableDiffusionPipeline)
    out = image_pipe("a cat", num_inference_steps=2, output_type="np")
    assert out.images.shape == (1, 64, 64, 3)


def test_outcome_summary_is_json(sd):
    outcome = stopcock.run(sd, **kwargs(), stop=stopcock.max_steps(2))
    summary = json.loads(json.dumps(outcome.summary()))
    assert summary["steps"] == 2 and summary["total_steps"] == STEPS and summary["mode"] == "finish"
    assert summary["partial"] == "raw"


@pytest.mark.parametrize("partial", ["raw", "denoised"])
def test_finish_decodes_the_latents_of_the_stop_step(sd, count_forwards, partial):
    counts = count_forwards(sd.unet)
    states = []
    outcome = stopcock.run(sd, **kwargs(output_type="latent"), stop=stopcock.max_steps(3), partial=partial,
                           on_step=states.append)
    assert outcome.steps == 3 and counts[sd.unet] == 3
    assert outcome.mode == "finish" and outcome.partial == partial
    stop_state = states[-1]
    expected = stop_state.latents if partial == "raw" else stop_state.extra["denoised"]
    # output_type="latent" returns what the pipeline would decode.
    torch.testing.assert_close(outcome.output.images, expected, rtol=0, atol=0)
    torch.testing.assert_close(outcome.latents, expected, rtol=0, atol=0)
    assert not torch.equal(stop_state.latents, stop_state.extra["denoised"])
    assert_clean(sd)


def test_denoised_preview_differs_from_raw_and_both_decode(sd):
    raw = stopcock.run(sd, **kwargs(), stop=stopcock.max_steps(2), partial="raw")
    denoised = stopcock.run(sd, **kwargs(), stop=stopcock.max_steps(2), partial="denoised")
    assert raw.output.images.shape == denoised.output.images.shape == (1, 64, 64, 3)
    assert not np.array_equal(raw.output.images, denoised.output.images)


def test_a_stop_from_another_thread_during_on_step_ends_that_step(sd, count_forwards):
    counts = count_forwards(sd.unet)
    signal = stopcock.StopSignal()
    at_step_two = threading.Event()

    def on_step(state):
        if state.step == 2:
            at_step_two.set()
            assert signal.wait(30)  # the stop arrives while step 3 has not started

    stopper = threading.Thread(target=lambda: at_step_two.wait(30) and signal.stop("button"))
    stopper.start()
    outcome = stopcock.run(sd, **kwargs(), stop=signal, on_step=on_step)
    stopper.join()
    assert outcome.stopped and outcome.reason == "button"
    assert outcome.steps == 2 and counts[sd.unet] == 2  # on_step runs before the check: step 2 ends it
    assert outcome.output.images.shape == (1, 64, 64, 3)


@pytest.mark.parametrize("mode", ["finish", "abort"])
def test_a_stop_inside_a_block(sd, count_forwards, mode):
    """A stop raised while the UNet runs: abort leaves at the next block, finish ends the step."""
    signal = stopcock.StopSignal()
    steps = []
    calls = count_forwards(sd.unet.down_blocks[1], sd.unet.up_blocks[0], sd.vae.decoder)

    def stop_in_third_step(module, args):
        if len(steps) == 2:
            signal.stop("inside")

    handle = sd.unet.down_blocks[0].register_forward_pre_hook(stop_in_third_step)
    try:
        outcome = stopcock.run(sd, **kwargs(), stop=signal, mode=mode, on_step=steps.append)
    finally:
        handle.remove()
    assert outcome.reason == "inside"
    if mode == "abort":
        assert outcome.steps == 2 and outcome.output is None
        assert calls[sd.unet.down_blocks[1]] == 2 and calls[sd.unet.up_blocks[0]] == 2
        assert calls[sd.vae.decoder] == 0  # no decode
        torch.testing.assert_close(outcome.latents, steps[-1].latents, rtol=0, atol=0)
    else:
        assert outcome.steps == 3 and calls[sd.unet.up_blocks[0]] == 3 and calls[sd.vae.decoder] == 1
    assert_clean(sd)


@pytest.mark.parametrize("mode", ["finish", "abort"])
def test_abort_runs_no_decode_and_no_safety_checker(count_forwards, mode):
    pipe = tiny.stable_diffusion_pipeline(with_safety_checker=True)
    calls = count_forwards(pipe.unet, pipe.vae.decoder, pipe.safety_checker)
    outcome = stopcock.run(pipe, **kwargs(), stop=stopcock.max_steps(2), mode=mode)
    assert outcome.steps == 2 and calls[pipe.unet] == 2 and outcome.mode == mode
    after_the_loop = 0 if mode == "abort" else 1
    assert calls[pipe.vae.decoder] == calls[pipe.safety_checker] == after_the_loop
    assert (outcome.output is None) == (mode == "abort")
    assert_clean(pipe)


def test_stopped_before_the_first_step_calls_nothing(sd, count_forwards):
    calls = count_forwards(sd.unet, sd.text_encoder)
    signal = stopcock.StopSignal()
    signal.stop("early")
    outcome = stopcock.run(sd, **kwargs(), stop=signal)
    assert outcome.stopped and outcome.steps == 0 and outcome.output is None
    assert "before the first step" in outcome.detail
    assert calls[sd.unet] == calls[sd.text_encoder] == 0


class RecordSteps(PipelineCallback):
    """A user's ``PipelineCallback`` asking for the latents."""

    tensor_inputs = ["latents"]

    def __init__(self):
        super().__init__()
        self.steps = []

    def callback_fn(self, pipeline, step_index, timestep, callback_kwargs):
        self.steps.append((step_index, sorted(callback_kwargs)))
        return callback_kwargs


def test_user_callbacks_compose(sd):
    seen = []

    def mine(pipe, i, t, kw):
        seen.append((i, sorted(kw)))
        return kw

    outcome = stopcock.run(sd, **kwargs(callback_on_step_end=mine,
                                        callback_on_step_end_tensor_inputs=["latents", "prompt_embeds"]),
                           stop=stopcock.max_steps(3))
    assert outcome.steps == 3 and [i for i, _ in seen] == [0, 1, 2]
    assert all(keys == ["latents", "prompt_embeds"] for _, keys in seen)

    record = RecordSteps()
    outcome = stopcock.run(sd, **kwargs(callback_on_step_end=record), stop=stopcock.max_steps(2))
    assert outcome.steps == 2 and record.steps == [(0, ["latents"]), (1, ["latents"])]

    cutoff = SDCFGCutoffCallback(cutoff_step_ratio=None, cutoff_step_index=1)
    record = RecordSteps()
    outcome = stopcock.run(sd, **kwargs(callback_on_step_end=MultiPipelineCallbacks([cutoff, record])),
                           stop=stopcock.max_steps(2))
    assert outcome.steps == 2 and outcome.output is not None and sd.guidance_scale == 0.0
    assert [i for i, _ in record.steps] == [0, 1]


@pytest.mark.parametrize("mode", ["finish", "abort"])
@pytest.mark.parametrize("name", ["sd", "lcm"])
def test_a_user_exception_propagates_and_leaves_the_pipeline_clean(request, name, mode):
    pipe = request.getfixturevalue(name)
    reference = pipe(**kwargs()).images

    def boom(pipe, i, t, kw):
        if i == 1:
            raise ValueError("user bug")
        return kw

    with pytest.raises(ValueError, match="user bug"):
        stopcock.run(pipe, **kwargs(callback_on_step_end=boom), stop=stopcock.max_steps(5), mode=mode)
    assert_clean(pipe)
    np.testing.assert_array_equal(pipe(**kwargs()).images, reference)


def test_total_counts_the_steps_img2img_actually_runs(sd):
    from diffusers import StableDiffusionImg2ImgPipeline

    img2img = StableDiffusionImg2ImgPipeline(**sd.components)
    img2img.set_progress_bar_config(disable=True)
    states = []
    image = torch.zeros(1, 3, 64, 64)
    outcome = stopcock.run(img2img, **kwargs(image=image, strength=0.5, num_inference_steps=10),
                           on_step=states.append)
    assert outcome.steps == outcome.total_steps == 5 and states[0].total == 5


# -- attach ---------------------------------------------------------------------------------------
def test_attach_stops_the_users_own_call(sd, count_forwards):
    calls = count_forwards(sd.unet)
    with stopcock.attach(sd, stopcock.max_steps(2), partial="denoised") as handle:
        out = sd(**kwargs())
    assert out.images.shape == (1, 64, 64, 3) and calls[sd.unet] == 2
    assert handle.outcome.stopped and handle.outcome.steps == 2 and handle.outcome.partial == "denoised"
    assert handle.outcome.mode == "finish"
    assert_clean(sd)


def test_attach_abort_ends_the_block_quietly(lcm):
    after_call = []
    with stopcock.attach(lcm, stopcock.max_steps(2), mode="abort") as handle:
        lcm(**kwargs())
        after_call.append(True)
    assert after_call == []
    assert handle.outcome.mode == "abort" and handle.outcome.steps == 2 and handle.outcome.output is None
    assert handle.outcome.latents is not None
    assert_clean(lcm)


def test_attach_aborts_a_call_made_after_the_stop(sd, count_forwards):
    """Several calls in one block: the one after a finish-mode stop is aborted, and the detail says so."""
    calls = count_forwards(sd.unet)
    outputs = []
    with stopcock.attach(sd, stopcock.max_steps(2)) as handle:
        for _ in range(2):
            outputs.append(sd(**kwargs()))
    assert len(outputs) == 1 and calls[sd.unet] == 2
    assert handle.outcome.mode == "abort" and handle.outcome.steps == 2
    assert handle.outcome.detail == "a call made after the stop was aborted before its first step"
    assert_clean(sd)


def test_one_run_per_pipeline_at_a_time(sd):
    with stopcock.attach(sd, stopcock.max_steps(2)):
        with pytest.raises(RuntimeError, match="one call per pipeline at a time"):
            stopcock.run(sd, **kwargs())
    assert_clean(sd)
    assert stopcock.run(sd, **kwargs(), stop=stopcock.max_steps(1)).steps == 1


# -- step_callback --------------------------------------------------------------------------------
def test_step_callback_stops_a_pipeline_that_honours_interrupt(sd, count_forwards):
    calls = count_forwards(sd.unet)
    seen = []

    def mine(pipe, i, t, kw):
        seen.append(sorted(kw))
        return kw

    states = []
    callback = stopcock.step_callback(stopcock.max_steps(3), mine, on_step=states.append)
    out = sd(**kwargs(callback_on_step_end=callback,
                      callback_on_step_end_tensor_inputs=["latents", "prompt_embeds"]))
    assert [(s.step, s.total) for s in states] == [(1, STEPS), (2, STEPS), (3, STEPS)]
    assert states[-1].latents is not None
    assert out.images.shape == (1, 64, 64, 3) and calls[sd.unet] == 3
    assert seen == [["latents", "prompt_embeds"]] * 3
    # As with diffusers' own interrupt, the flag stays up until the pipeline's next call resets it.
    assert sd.interrupt
    sd(**kwargs())
    assert calls[sd.unet] == 3 + STEPS and not sd.interrupt


@pytest.mark.parametrize("form", ["PipelineCallback", "MultiPipelineCallbacks"])
def test_step_callback_wraps_pipeline_callbacks(sd, count_forwards, form):
    calls = count_forwards(sd.unet)
    signal = stopcock.StopSignal()
    cutoff = SDCFGCutoffCallback(cutoff_step_ratio=None, cutoff_step_index=1)  # guidance off from step 2
    record = RecordSteps()
    theirs = cutoff if form == "PipelineCallback" else MultiPipelineCallbacks([cutoff, record])
    combined = stopcock.step_callback(signal, theirs, on_step=lambda s: s.step == 2 and signal.stop())
    assert isinstance(combined, MultiPipelineCallbacks)
    assert set(combined.tensor_inputs) == set(theirs.tensor_inputs)
    sd(**kwargs(callback_on_step_end=combined))
    assert calls[sd.unet] == 2  # stopped by on_step at step 2: on_step runs before the check
    assert signal.reason == "user" and sd.interrupt
    assert sd.guidance_scale == 0.0  # their cutoff ran
    if form == "MultiPipelineCallbacks":
        assert record.steps == [(i, ["latents", "prompt_embeds"]) for i in range(2)]


def test_step_callback_refuses_a_pipeline_that_ignores_interrupt(lcm, count_forwards):
    """At its first step, not at the first stop: a stop button must not be found broken when pressed."""
    calls = count_forwards(lcm.unet)
    never = stopcock.StopSignal()
    with pytest.raises(TypeError, match=r"ignores the interrupt flag.*stopcock\.attach"):
        lcm(**kwargs(callback_on_step_end=stopcock.step_callback(never)))
    assert calls[lcm.unet] == 1 and not never.stopped


def test_a_callback_that_returns_none_gets_a_clear_error(sd):
    with pytest.raises(TypeError, match="must return the callback_kwargs dict"):
        sd(**kwargs(callback_on_step_end=stopcock.step_callback(stopcock.max_steps(9), lambda *a: None)))


# -- misuse ---------------------------------------------------------------------------------------
def test_run_rejects_generate_only_arguments(sd):
    with pytest.raises(TypeError, match=r"stopping_criteria.*stop="):
        stopcock.run(sd, **kwargs(stopping_criteria=[]))
    with pytest.raises(ValueError, match="text generation only"):
        stopcock.run(sd, **kwargs(), stop=stopcock.stop_strings(["x"]))
    with pytest.raises(ValueError, match="partial"):
        stopcock.run(sd, **kwargs(), partial="clean")


def test_guard_makes_a_bare_pipeline_reject_generate_arguments():
    from diffusers import StableDiffusionPipeline

    pipe = tiny.stable_diffusion_pipeline()
    pipe(**kwargs(num_inference_steps=1, stopping_criteria=[]))  # diffusers silently ignores it
    assert stopcock.guard(pipe) is pipe and stopcock.guard(pipe) is pipe
    with pytest.raises(TypeError, match="stopping_criteria"):
        pipe(**kwargs(stopping_criteria=[]))
    assert isinstance(pipe, StableDiffusionPipeline) and type(pipe).__name__ == "StableDiffusionPipeline"
    outcome = stopcock.run(pipe, **kwargs(), stop=stopcock.max_steps(2))
    assert outcome.mode == "finish" and outcome.extra["path"] == "interrupt"


# -- which path ------------------------------------------------------------------------------------
def test_a_subclass_that_overrides_call_is_decided_at_run_time(count_forwards):
    from diffusers import StableDiffusionPipeline

    class Custom(StableDiffusionPipeline):
        def __call__(self, *args, **kwargs):
            return super().__call__(*args, **kwargs)

    pipe = Custom(**tiny.stable_diffusion_pipeline().components)
    pipe.set_progress_bar_config(disable=True)
    assert stopcock.adapters.diffusers.honours_interrupt(tiny.stable_diffusion_pipeline())
    assert not stopcock.adapters.diffusers.honours_interrupt(pipe)
    calls = count_forwards(pipe.unet)
    outcome = stopcock.run(pipe, **kwargs(), stop=stopcock.max_steps(2))
    # The static answer is no, yet its loop (SD's own) checks the flag: the run finishes through it.
    assert outcome.extra["path"] == "interrupt" and outcome.mode == "finish" and calls[pipe.unet] == 2
    assert outcome.output.images.shape == (1, 64, 64, 3)


def test_a_pipeline_that_ignores_the_flag_is_fast_forwarded(lcm, count_forwards):
    """LCM's loop goes on after the flag: its denoiser answers from the stop step, nothing computes."""
    calls = count_forwards(lcm.unet, lcm.vae.decoder)
    outcome = stopcock.run(lcm, **kwargs(), stop=stopcock.max_steps(2))
    assert outcome.extra["path"] == "fast-forward" and calls[lcm.unet] == 2 and calls[lcm.vae.decoder] == 1
    assert outcome.mode == "finish" and outcome.output.images.shape == (1, 64, 64, 3)
    assert outcome.extra["fast_forwarded"] == STEPS - 2 and "fast-forward" in outcome.detail
    assert_clean(lcm)


def test_a_copy_of_a_wrapped_scheduler_steps_itself(sd):
    """Pipelines such as LTX-2 deep-copy their scheduler inside the call: the copy is not observed."""
    import copy

    with stopcock.attach(sd, stopcock.max_steps(99)):
        copied = copy.deepcopy(sd.scheduler)
        assert "step" in vars(sd.scheduler)
    assert copied.step.__self__ is copied
    assert_clean(sd)


def test_the_guard_lets_a_pipeline_take_its_own_generate_named_arguments():
    from diffusers import AudioLDM2Pipeline

    from stopcock.adapters.diffusers import _reject_generate_args

    audioldm2 = object.__new__(AudioLDM2Pipeline)  # the class is what matters: it declares max_new_tokens
    _reject_generate_args(audioldm2, {"max_new_tokens": 8})
    with pytest.raises(TypeError, match="stopping_criteria"):
        _reject_generate_args(audioldm2, {"stopping_criteria": []})
