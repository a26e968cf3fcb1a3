"""After a stopped or aborted run, the next run with the same seed is bit-identical to a fresh
pipeline's: with a stateful cache hook (TaylorSeer) and with model CPU offload."""

from __future__ import annotations

import pytest
import torch
from diffusers import TaylorSeerCacheConfig

import stopcock
from tiny import image as tiny


def flux_kwargs():
    return {"prompt": "a cat", "height": 32, "width": 32, "max_sequence_length": 16, "num_inference_steps": 8,
            "generator": torch.Generator().manual_seed(0), "output_type": "latent"}


def cached_flux():
    pipe = tiny.flux_pipeline()
    config = TaylorSeerCacheConfig(
        cache_interval=2, disable_cache_before_step=1, taylor_factors_dtype=torch.float32
    )
    pipe.transformer.enable_cache(config)
    return pipe


@pytest.fixture(scope="module")
def flux_reference():
    torch.set_num_threads(1)
    return cached_flux()(**flux_kwargs()).images


def test_the_hazard_is_real(flux_reference):
    """Without clean-up, an exception mid-run leaves the cache stale and the next run differs."""
    pipe = cached_flux()

    def interrupt(pipe, i, t, kw):
        if i == 3:
            raise KeyboardInterrupt
        return kw

    with pytest.raises(KeyboardInterrupt):
        pipe(**flux_kwargs(), callback_on_step_end=interrupt)
    assert not torch.equal(pipe(**flux_kwargs()).images, flux_reference)


@pytest.mark.parametrize("mode", ["finish", "abort"])
def test_cache_hook_is_reset_after_a_stop(flux_reference, mode):
    pipe = cached_flux()
    outcome = stopcock.run(pipe, **flux_kwargs(), stop=stopcock.max_steps(3), mode=mode)
    assert outcome.stopped and outcome.steps == 3 and outcome.mode == mode
    assert torch.equal(pipe(**flux_kwargs()).images, flux_reference)


def test_cache_hook_is_reset_after_a_stop_inside_a_block(flux_reference):
    pipe = cached_flux()
    signal = stopcock.StopSignal()
    steps = []
    block = pipe.transformer.single_transformer_blocks[0]

    def stop_in_fifth_step(module, args):
        if len(steps) == 4:
            signal.stop("inside")

    handle = block.register_forward_pre_hook(stop_in_fifth_step)
    try:
        outcome = stopcock.run(pipe, **flux_kwargs(), stop=signal, mode="abort", on_step=steps.append)
    finally:
        handle.remove()
    assert outcome.reason == "inside" and outcome.steps == 4 and outcome.output is None
    assert torch.equal(pipe(**flux_kwargs()).images, flux_reference)


def offloaded_sd():
    pipe = tiny.stable_diffusion_pipeline()
    pipe.enable_model_cpu_offload(device="cpu")
    return pipe


def sd_kwargs():
    return {"prompt": "a cat", "num_inference_steps": 6, "generator": torch.Generator().manual_seed(0),
            "output_type": "np"}


@pytest.mark.parametrize("mode", ["finish", "abort"])
def test_model_cpu_offload_survives_a_stop(mode, count_forwards):
    reference = offloaded_sd()(**sd_kwargs()).images
    pipe = offloaded_sd()
    calls = count_forwards(pipe.unet)
    armed = list(pipe._all_hooks)
    outcome = stopcock.run(pipe, **sd_kwargs(), stop=stopcock.max_steps(2), mode=mode)
    assert outcome.steps == 2 and calls[pipe.unet] == 2 and outcome.mode == mode
    assert (outcome.output is None) == (mode == "abort")
    # Offload was re-armed (maybe_free_model_hooks: fresh hooks), as after a plain call: on "cpu" the
    # images cannot show it, on an accelerator the last model would otherwise stay on the device.
    assert pipe._all_hooks and not any(h in armed for h in pipe._all_hooks)
    assert (pipe(**sd_kwargs()).images == reference).all()
