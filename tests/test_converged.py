"""stopcock.converged(): a diffusion run stops once its x0 estimate stops changing, keeping it."""

from __future__ import annotations

import pytest
import torch

import stopcock
from stopcock.conditions import Converged
from stopcock.loading import load_image_pipeline, resolve_model
from stopcock.state import StepState

STEPS = 30


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def digits():
    """The demo digits pipeline (DDIM; its latents are the 8x8 digit images)."""
    return load_image_pipeline(resolve_model(None, "image"), quiet=True)


def test_rule_on_given_changes():
    rule = stopcock.converged(tol=0.05, patience=2)
    assert isinstance(rule, Converged)
    assert rule.check(StepState(step=3, extra={"denoised_changes": (0.2, 0.04)})) is None  # one step under
    assert rule.check(StepState(step=4, extra={"denoised_changes": (0.2, 0.04, 0.01)})) == "converged"
    assert rule.check(StepState(step=4, extra={"denoised_changes": (0.01, 0.01, 0.06)})) is None
    assert rule.check(StepState(step=4)) is None  # no x0 estimate: never converges
    with pytest.raises(ValueError, match="tol"):
        stopcock.converged(tol=0)
    with pytest.raises(ValueError, match="patience"):
        stopcock.converged(patience=0)


@pytest.mark.timeout(120)
def test_stops_when_x0_settles_and_keeps_it(digits):
    seen: list[StepState] = []
    rule = stopcock.converged(tol=0.05, patience=2)
    outcome = stopcock.run(
        digits, "3", num_inference_steps=STEPS, generator=torch.Generator().manual_seed(0),
        output_type="latent", stop=rule, on_step=seen.append,
    )
    assert (outcome.stopped, outcome.reason, outcome.partial) == (True, "converged", "denoised")
    assert outcome.steps < STEPS and outcome.steps == len(seen)
    changes = seen[-1].extra["denoised_changes"]
    assert len(changes) == outcome.steps - 1  # one change per step after the first
    assert max(changes[-2:]) < 0.05
    # the first step at which two changes in a row were under tol, not later
    assert not any(max(changes[i - 1 : i + 1]) < 0.05 for i in range(1, len(changes) - 1))
    assert torch.equal(outcome.output.images, seen[-1].extra["denoised"])  # the x0 estimate it watched


@pytest.mark.timeout(120)
def test_partial_raw_and_a_run_that_never_settles(digits):
    generator = torch.Generator().manual_seed(0)
    outcome = stopcock.run(
        digits, "3", num_inference_steps=STEPS, generator=generator, output_type="latent",
        stop=stopcock.converged(tol=0.05), partial="raw",
    )
    assert (outcome.reason, outcome.partial) == ("converged", "raw")
    full = stopcock.run(
        digits, "3", num_inference_steps=STEPS, generator=torch.Generator().manual_seed(0),
        output_type="latent", stop=stopcock.converged(tol=1e-9),
    )
    assert (full.stopped, full.steps, full.reason) == (False, STEPS, "completed")


@pytest.mark.timeout(120)
def test_decoded_x0_from_a_pipeline_that_decodes(image_pipe):
    outcome = stopcock.run(
        image_pipe, "a cat", num_inference_steps=STEPS, generator=torch.Generator().manual_seed(0),
        output_type="np", stop=stopcock.converged(tol=0.5, patience=1),
    )
    assert (outcome.reason, outcome.partial) == ("converged", "denoised")
    assert outcome.steps < STEPS and outcome.output.images.shape == (1, 64, 64, 3)


def test_where_there_is_no_x0_it_is_refused(text_model, digits):
    with pytest.raises(ValueError, match="repetition"):
        stopcock.run(text_model, torch.tensor([[1, 2]]), max_new_tokens=2, stop=stopcock.converged())
    with pytest.raises(ValueError, match="attach"):
        stopcock.step_callback(stopcock.converged())


@pytest.mark.timeout(120)
def test_attach_and_abort_mode_keep_x0_too(digits):
    def call():
        generator = torch.Generator().manual_seed(0)
        return digits("3", num_inference_steps=STEPS, generator=generator, output_type="latent")

    alone = stopcock.run(
        digits, "3", num_inference_steps=STEPS, generator=torch.Generator().manual_seed(0),
        output_type="latent", stop=stopcock.converged(tol=0.05),
    )
    with stopcock.attach(digits, stopcock.converged(tol=0.05)) as handle:
        attached = call()
    assert (handle.outcome.reason, handle.outcome.partial, handle.outcome.steps) == (
        "converged", "denoised", alone.steps
    )
    assert torch.equal(attached.images, alone.output.images)
    aborted = stopcock.run(
        digits, "3", num_inference_steps=STEPS, generator=torch.Generator().manual_seed(0),
        output_type="latent", stop=stopcock.converged(tol=0.05), mode="abort",
    )
    assert (aborted.reason, aborted.partial, aborted.steps) == ("converged", "denoised", alone.steps)
    # abandoned inside the pipeline: no output, the x0 estimate kept aside
    assert aborted.output is None and torch.equal(aborted.latents, alone.output.images)
