"""Every kind of diffusers pipeline stops at a step boundary, cleanly (tiny real pipelines).

One pipeline per survey category: A (SD, SDXL, Flux), B (LCM, InstructPix2Pix), D (Semantic SD,
legacy callback), E (DDPM), a modular pipeline (modular SDXL) and a combined one (Kandinsky 2.2).
Denoiser forwards are counted with hooks to check that no step starts after the stop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import PIL.Image
import pytest
import torch
from diffusers import DiffusionPipeline

import stopcock
from tiny import image as tiny

STEPS = 4


@dataclass
class Kind:
    name: str
    build: Any
    call: dict[str, Any]
    denoisers: tuple[str, ...]  # component names, in stage order
    native: bool  # checks interrupt: finishes through the flag (the others are fast-forwarded)
    stage_steps: tuple[int, ...] = (STEPS,)
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


FLUX_CALL = {"prompt": "a cat", "height": 32, "width": 32, "max_sequence_length": 16}
IMAGE = PIL.Image.fromarray(np.full((32, 32, 3), 128, dtype=np.uint8))
KINDS = [
    Kind("sd", tiny.stable_diffusion_pipeline, {"prompt": "a cat"}, ("unet",), True),
    Kind("sdxl", tiny.sdxl_pipeline, {"prompt": "a cat"}, ("unet",), True),
    Kind("flux", tiny.flux_pipeline, FLUX_CALL,
         ("transformer",), True),
    Kind("lcm", tiny.lcm_pipeline, {"prompt": "a cat"}, ("unet",), False),
    Kind("pix2pix", tiny.instruct_pix2pix_pipeline, {"prompt": "a cat", "image": IMAGE}, ("unet",), False),
    Kind("semantic", tiny.semantic_pipeline, {"prompt": "a cat"}, ("unet",), False),
    Kind("ddpm", tiny.ddpm_pipeline, {}, ("unet",), False),
    Kind("modular-sdxl", tiny.modular_sdxl_pipeline, {"prompt": "a cat", "output": "images"}, ("unet",),
         False),
    Kind("kandinsky-combined", tiny.kandinsky_combined_pipeline,
         {"prompt": "a cat", "height": 64, "width": 64, "prior_num_inference_steps": 3},
         ("prior_prior", "unet"), False, stage_steps=(3, STEPS)),
]


def call_kwargs(kind: Kind) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(kind.seed)
    kwargs = {**kind.call, "num_inference_steps": STEPS, "generator": generator}
    if "output" not in kwargs:
        kwargs["output_type"] = "np"
    return kwargs


def images(output: Any) -> np.ndarray:
    found = output if isinstance(output, list) else output.images
    return np.stack([np.asarray(i, dtype=np.float32) for i in found])


@pytest.fixture(scope="module", params=KINDS, ids=lambda k: k.name)
def kind_pipe(request):
    """(kind, pipeline, reference images of a full run on a fresh pipeline, forwards per step)."""
    kind = request.param
    torch.set_num_threads(1)
    pipe = kind.build(seed=kind.seed)
    models = [pipe.components[name] for name in kind.denoisers]
    counts = {m: 0 for m in models}
    handles = [m.register_forward_hook(lambda m, a, o: counts.__setitem__(m, counts[m] + 1)) for m in models]
    reference = images(pipe(**call_kwargs(kind)))
    for h in handles:
        h.remove()
    per_step = tuple(counts[m] // s for m, s in zip(models, kind.stage_steps, strict=True))
    assert all(counts[m] == p * s for m, p, s in zip(models, per_step, kind.stage_steps, strict=True))
    return kind, pipe, reference, per_step


def assert_clean(pipe: Any) -> None:
    """No hook, no wrapper, no raised flag left behind."""
    assert not getattr(pipe, "_interrupt", False)
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            assert all(not m._forward_pre_hooks for m in component.modules())
        assert "step" not in getattr(component, "__dict__", {})


def test_completed_run_is_the_plain_call(kind_pipe):
    kind, pipe, reference, _ = kind_pipe
    outcome = stopcock.run(pipe, **call_kwargs(kind), stop=stopcock.timeout(3600))
    assert not outcome.stopped and outcome.reason == "completed"
    assert outcome.steps == sum(kind.stage_steps) == outcome.total_steps
    np.testing.assert_array_equal(images(outcome.output), reference)
    assert_clean(pipe)


@pytest.mark.parametrize("mode", ["finish", "abort"])
@pytest.mark.parametrize("at", [1, 3])
def test_stop_at_step(kind_pipe, count_forwards, mode, at):
    kind, pipe, reference, per_step = kind_pipe
    counts = count_forwards(*(pipe.components[n] for n in kind.denoisers))
    seen = []
    stop = stopcock.max_steps(at)
    outcome = stopcock.run(pipe, **call_kwargs(kind), stop=stop, mode=mode, on_step=seen.append)

    assert outcome.stopped and outcome.reason == "max_steps"
    # After the step where the stop is seen, no forward of the stopped stage's denoiser. In finish mode
    # a combined pipeline's next stage then runs in full on what the stopped one produced (stage="next").
    done, later, steps_run, left = at, False, 0, 0
    for name, per, steps in zip(kind.denoisers, per_step, kind.stage_steps, strict=True):
        ran = steps if later and mode == "finish" else 0 if later else min(done, steps)
        assert counts[pipe.components[name]] == per * ran, name
        steps_run += ran
        left = steps - done if not later and done <= steps else left  # the stopped stage's steps left
        later, done = later or done <= steps, max(0, done - steps)
    assert outcome.steps == steps_run == len(seen)
    torch.testing.assert_close(outcome.latents, seen[-1].latents, rtol=0, atol=0)
    assert outcome.partial == "raw"
    if mode == "finish":
        assert outcome.mode == "finish"
        assert images(outcome.output).shape == reference.shape
        forwarded = 0 if kind.native else left
        assert outcome.extra["path"] == ("fast-forward" if forwarded else "interrupt")
        assert outcome.extra["fast_forwarded"] == forwarded
        assert (outcome.detail is None) == (not forwarded)  # a fast-forward says so
    else:
        assert outcome.mode == "abort" and outcome.output is None and outcome.detail is None
    assert_clean(pipe)
    # The next run with the same seed is the same as a fresh pipeline's.
    np.testing.assert_array_equal(images(pipe(**call_kwargs(kind))), reference)


def test_total_steps_known_before_the_first_step(kind_pipe):
    kind, pipe, _, _ = kind_pipe
    states = []
    stopcock.run(pipe, **call_kwargs(kind), stop=stopcock.max_steps(1), on_step=states.append)
    # Single-stage pipelines plan num_inference_steps; a combined one learns its stage's count as it starts.
    assert states[0].total == (STEPS if len(kind.stage_steps) == 1 else kind.stage_steps[0])
    assert states[0].step == 1 and states[0].timestep is not None


def test_a_stop_in_the_second_stage_of_a_combined_pipeline(count_forwards):
    kind = next(k for k in KINDS if k.name == "kandinsky-combined")
    pipe = kind.build()
    prior, unet = pipe.components["prior_prior"], pipe.components["unet"]
    counts = count_forwards(prior, unet)
    states = []
    outcome = stopcock.run(pipe, **call_kwargs(kind), stop=stopcock.max_steps(5), on_step=states.append)
    assert outcome.steps == 5 and outcome.mode == "finish" and images(outcome.output).shape == (1, 64, 64, 3)
    assert outcome.extra["path"] == "fast-forward" and outcome.extra["fast_forwarded"] == 2
    assert counts[prior] == 3 and counts[unet] == 2  # one (guidance-batched) call per step
    # The total is learnt stage by stage: the prior's 3 steps, then 3 + the decoder's 4.
    assert [s.total for s in states] == [3, 3, 3, 7, 7]


def test_sdxl_denoising_end_counts_only_the_steps_it_runs(count_forwards):
    """SDXL's ``denoising_end`` cuts the loop short while the scheduler keeps the full schedule."""
    pipe = tiny.sdxl_pipeline()
    counts = count_forwards(pipe.unet)
    states = []
    outcome = stopcock.run(pipe, "a cat", num_inference_steps=4, denoising_end=0.5, output_type="latent",
                           generator=torch.Generator().manual_seed(0), on_step=states.append)
    assert not outcome.stopped and len(pipe.scheduler.timesteps) == 4
    assert 0 < counts[pipe.unet] == outcome.steps == outcome.total_steps == len(states) < 4
    assert {s.total for s in states} == {outcome.total_steps}


class TwoStreams(DiffusionPipeline):
    """An unknown, home-made pipeline: two schedulers step side by side in one loop, no callbacks."""

    def __init__(self, unet, scheduler, scheduler_2):
        super().__init__()
        self.register_modules(unet=unet, scheduler=scheduler, scheduler_2=scheduler_2)

    @torch.no_grad()
    def __call__(self, num_inference_steps=4, generator=None):
        shape = (1, 3, 16, 16)
        a, b = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
        self.scheduler.set_timesteps(num_inference_steps)
        self.scheduler_2.set_timesteps(num_inference_steps)
        for t in self.scheduler.timesteps:
            a = self.scheduler.step(self.unet(a, t).sample, t, a, generator=generator).prev_sample
            b = self.scheduler_2.step(self.unet(b, t).sample, t, b, generator=generator).prev_sample
        return a, b


@pytest.mark.parametrize("mode", ["finish", "abort"])
def test_an_unknown_pipeline_with_two_schedulers_in_one_loop(count_forwards, mode):
    from diffusers import DDPMScheduler

    pipe = TwoStreams(tiny.ddpm_pipeline().unet, DDPMScheduler(), DDPMScheduler())
    generator = torch.Generator().manual_seed(0)
    full = stopcock.run(pipe, num_inference_steps=4, generator=generator)
    assert full.steps == full.total_steps == 4 and not full.stopped
    calls = count_forwards(pipe.unet)
    stop = stopcock.max_steps(2)
    outcome = stopcock.run(pipe, num_inference_steps=4, generator=generator, stop=stop, mode=mode)
    assert outcome.steps == 2 and outcome.mode == mode
    assert calls[pipe.unet] == 3  # both streams' first step, then the first stream's second one
    if mode == "finish":  # fast-forwarded: both streams come back, the first at its stop step
        a, b = outcome.output
        torch.testing.assert_close(a, outcome.latents, rtol=0, atol=0)
        assert b.shape == a.shape and outcome.extra["path"] == "fast-forward"
    else:
        assert outcome.output is None


class FlagOnly(DiffusionPipeline):
    """The loop of category C (LongCatImagePipeline, HunyuanVideo15Pipeline), on a tiny UNet: it resets
    and checks ``interrupt`` but takes no callback. The real ones need a Qwen2.5-VL text encoder."""

    def __init__(self, unet, scheduler):
        super().__init__()
        self.register_modules(unet=unet, scheduler=scheduler)

    @property
    def interrupt(self):
        return self._interrupt

    @torch.no_grad()
    def __call__(self, num_inference_steps=4, generator=None):
        self._interrupt = False
        sample = torch.randn((1, 3, 16, 16), generator=generator)
        self.scheduler.set_timesteps(num_inference_steps)
        self._num_timesteps = len(self.scheduler.timesteps)
        for t in self.scheduler.timesteps:
            if self.interrupt:
                continue
            noise = self.unet(sample, t).sample
            sample = self.scheduler.step(noise, t, sample, generator=generator, return_dict=False)[0]
        decoded = sample.clamp(-1, 1)  # stands for the VAE decode
        self.maybe_free_model_hooks()
        return {"decoded": decoded}


def test_a_flag_only_pipeline_finishes_natively_without_a_callback(count_forwards):
    from diffusers import DDPMScheduler

    from stopcock.pipeline_facts import pipeline_class

    category_c = {"LongCatImagePipeline", "LongCatImageEditPipeline", "HunyuanVideo15Pipeline",
                  "HunyuanVideo15ImageToVideoPipeline"}
    assert all(pipeline_class(name).honours_interrupt for name in category_c)  # the real ones take this path
    pipe = FlagOnly(tiny.ddpm_pipeline().unet, DDPMScheduler())
    calls = count_forwards(pipe.unet)
    states = []
    outcome = stopcock.run(pipe, num_inference_steps=4, generator=torch.Generator().manual_seed(0),
                           stop=stopcock.max_steps(2), partial="denoised", on_step=states.append)
    assert outcome.mode == "finish" and outcome.extra["path"] == "interrupt" and calls[pipe.unet] == 2
    assert outcome.steps == 2 and outcome.total_steps == 4 and outcome.partial == "denoised"
    torch.testing.assert_close(outcome.output["decoded"], states[-1].extra["denoised"].clamp(-1, 1))
    assert not pipe._interrupt


class CogVideoXStyle(DiffusionPipeline):
    """Steps ``CogVideoXDPMScheduler`` exactly as CogVideoX's pipelines do: its ``step`` takes the previous
    x0 estimate and timestep before the sample, so step arguments must be read by name."""

    def __init__(self, unet, scheduler):
        super().__init__()
        self.register_modules(unet=unet, scheduler=scheduler)

    @torch.no_grad()
    def __call__(self, num_inference_steps=4, generator=None):
        latents = torch.randn((1, 3, 16, 16), generator=generator)
        self.scheduler.set_timesteps(num_inference_steps)
        timesteps, old_pred_original_sample = self.scheduler.timesteps, None
        for i, t in enumerate(timesteps):
            noise_pred = self.unet(latents, t).sample
            latents, old_pred_original_sample = self.scheduler.step(
                noise_pred, old_pred_original_sample, t, timesteps[i - 1] if i > 0 else None, latents,
                generator=generator, return_dict=False,
            )
        return latents


def test_a_scheduler_whose_step_takes_other_arguments_first(count_forwards):
    from diffusers import CogVideoXDPMScheduler

    pipe = CogVideoXStyle(tiny.ddpm_pipeline().unet, CogVideoXDPMScheduler())
    calls = count_forwards(pipe.unet)
    states = []
    outcome = stopcock.run(pipe, num_inference_steps=4, generator=torch.Generator().manual_seed(0),
                           stop=stopcock.max_steps(2), mode="abort", on_step=states.append)
    assert outcome.steps == 2 and outcome.total_steps == 4 and calls[pipe.unet] == 2
    assert [s.timestep for s in states] == list(pipe.scheduler.timesteps[:2])
    torch.testing.assert_close(outcome.latents, states[-1].latents, rtol=0, atol=0)
    assert states[-1].extra["denoised"].shape == outcome.latents.shape
