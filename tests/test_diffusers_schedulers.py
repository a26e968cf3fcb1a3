"""``partial="denoised"`` across schedulers: the x0 estimate each one gives at the stop step.

At the last step these schedulers land exactly on their clean-sample estimate (final sigma 0, or
alpha 1), so a stop there with ``partial="denoised"`` must reproduce the full run's result: a check of
the estimate that does not restate the adapter's formulas.
"""

from __future__ import annotations

import pytest
import torch
from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
    HeunDiscreteScheduler,
    PNDMScheduler,
    UniPCMultistepScheduler,
)

import stopcock
from tiny import image as tiny
from tiny.image import SD_BETAS

STEPS = 5
SCHEDULERS = {
    "ddim": lambda: DDIMScheduler(**SD_BETAS, set_alpha_to_one=True, clip_sample=False),
    "euler": lambda: EulerDiscreteScheduler(**SD_BETAS),
    "euler-ancestral": lambda: EulerAncestralDiscreteScheduler(**SD_BETAS),
    "dpm-solver++": lambda: DPMSolverMultistepScheduler(**SD_BETAS),
    "unipc": lambda: UniPCMultistepScheduler(**SD_BETAS),
}


def run_latents(pipe, **options):
    generator = torch.Generator().manual_seed(0)
    kwargs = {"num_inference_steps": STEPS, "generator": generator, "output_type": "latent"}
    if type(pipe).__name__ == "FluxPipeline":
        kwargs.update(height=32, width=32, max_sequence_length=16)
    return stopcock.run(pipe, "a cat", **kwargs, **options)


def sd_with(name):
    return tiny.stable_diffusion_pipeline(scheduler=SCHEDULERS[name]())


@pytest.fixture(scope="module")
def flux():
    torch.set_num_threads(1)
    return tiny.flux_pipeline()


@pytest.mark.parametrize("name", [*SCHEDULERS, "flow-match-euler"])
def test_denoised_at_the_last_step_is_the_final_sample(name, flux):
    pipe = flux if name == "flow-match-euler" else sd_with(name)
    full = run_latents(pipe)
    stopped = run_latents(pipe, stop=stopcock.max_steps(STEPS), partial="denoised")
    assert stopped.stopped and stopped.partial == "denoised" and stopped.detail is None
    torch.testing.assert_close(stopped.output.images, full.output.images, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", [*SCHEDULERS, "flow-match-euler"])
def test_denoised_midway_is_handed_to_the_decoder(name, flux):
    pipe = flux if name == "flow-match-euler" else sd_with(name)
    states = []
    raw = run_latents(pipe, stop=stopcock.max_steps(2), partial="raw", on_step=states.append)
    denoised = run_latents(pipe, stop=stopcock.max_steps(2), partial="denoised")
    assert raw.partial == "raw" and denoised.partial == "denoised"
    torch.testing.assert_close(raw.output.images, states[-1].latents, rtol=0, atol=0)
    torch.testing.assert_close(denoised.output.images, states[-1].extra["denoised"], rtol=0, atol=0)
    assert not torch.allclose(raw.output.images, denoised.output.images)


def test_a_scheduler_with_no_estimate_falls_back_to_raw_and_says_so():
    pipe = tiny.stable_diffusion_pipeline(scheduler=PNDMScheduler(**SD_BETAS, skip_prk_steps=True))
    states = []
    outcome = run_latents(pipe, stop=stopcock.max_steps(2), partial="denoised", on_step=states.append)
    assert outcome.partial == "raw" and "no denoised estimate from PNDMScheduler" in outcome.detail
    assert "denoised" not in states[-1].extra
    torch.testing.assert_close(outcome.output.images, states[-1].latents, rtol=0, atol=0)


@pytest.mark.parametrize(
    "scheduler", [PNDMScheduler(**SD_BETAS, skip_prk_steps=True), HeunDiscreteScheduler(**SD_BETAS)],
    ids=["pndm", "heun"],
)
def test_steps_are_the_loop_iterations_and_total_matches(scheduler):
    """Heun steps twice per inference step: steps and total both count the loop's iterations."""
    pipe = tiny.stable_diffusion_pipeline(scheduler=scheduler)
    states = []
    outcome = run_latents(pipe, on_step=states.append)
    assert outcome.steps == outcome.total_steps == len(pipe.scheduler.timesteps) == len(states)
    assert [s.step for s in states] == list(range(1, outcome.steps + 1))
