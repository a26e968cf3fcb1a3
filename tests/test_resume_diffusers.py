"""Diffusion runs checkpointed and resumed by replay are bit-identical to the run never stopped
(torch.equal on the pipeline's output), for every pipeline kind the tests build, with multistep,
ancestral and second-order schedulers, stateful cache hooks, model CPU offload, a checkpoint saved
to a file, a resume stopped again, and a completed run's checkpoint. Nothing is left behind."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from diffusers import (
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    FirstBlockCacheConfig,
    HeunDiscreteScheduler,
    TaylorSeerCacheConfig,
    UniPCMultistepScheduler,
)
from test_diffusers_kinds import FLUX_CALL, KINDS, STEPS, Kind  # the stop tests' kinds: tests/ is on sys.path

import stopcock
from stopcock.adapters.diffusers_replay import loop_models
from tiny import image as tiny


def call_kwargs(kind: Kind) -> dict[str, Any]:
    return {
        **kind.call,
        "num_inference_steps": STEPS,
        "generator": torch.Generator().manual_seed(0),
        "output_type": "pt",
    }


def stopped_and_reference(pipe: Any, kwargs: dict[str, Any], at: int, seed: int = 0, **options: Any):
    """The Outcome of ``pipe(**kwargs)`` run with ``checkpoint=True`` and stopped at step ``at``, and the
    output of the same call never stopped (both with a generator seeded with ``seed``)."""
    reference = output_tensor(pipe(**kwargs, generator=torch.Generator().manual_seed(seed)))
    stopped = stopcock.run(
        pipe,
        **kwargs,
        generator=torch.Generator().manual_seed(seed),
        stop=stopcock.max_steps(at),
        checkpoint=True,
        **options,
    )
    assert stopped.stopped and stopped.steps == stopped.checkpoint.steps == at
    return stopped, reference


def output_tensor(output: Any) -> torch.Tensor:
    """A pipeline's output as one tensor: its images, or (home-made loops) its tensors flattened."""
    if isinstance(output, tuple) or type(output) is dict:  # a pipeline output is a dict too: not that
        parts = output.values() if isinstance(output, dict) else output
        return torch.cat([p.flatten() for p in parts])
    images = output if isinstance(output, torch.Tensor) else output.images
    return images if isinstance(images, torch.Tensor) else torch.from_numpy(np.asarray(images))


def classes(pipe: Any) -> dict[str, type]:
    return {name: type(c) for name, c in pipe.components.items() if c is not None}


def assert_clean(pipe: Any, before: dict[str, type]) -> None:
    """No hook, wrapper or swapped class left behind, and the pipeline's flag down."""
    assert not getattr(pipe, "_interrupt", False)
    assert classes(pipe) == before
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            assert all(not m._forward_pre_hooks for m in component.modules())
            assert "_stopcock_intercepted" not in vars(component)
        assert "step" not in getattr(component, "__dict__", {})


def finished_stages(kind: Kind, at: int) -> int:
    """The steps of the stages after the one a stop at step ``at`` lands in: a combined pipeline runs
    them in full in finish mode (``stage="next"``), and they are not the checkpoint's (it holds the
    stopped stage's steps, for a resume to continue)."""
    ends = [sum(kind.stage_steps[: i + 1]) for i in range(len(kind.stage_steps))]
    stage = next(i for i, end in enumerate(ends) if at <= end)
    return sum(kind.stage_steps[stage + 1 :])


@pytest.fixture(scope="module", params=KINDS, ids=lambda k: k.name)
def kind_pipe(request):
    torch.set_num_threads(1)
    kind = request.param
    pipe = kind.build()
    reference = output_tensor(pipe(**call_kwargs(kind)))
    return kind, pipe, reference


@pytest.mark.parametrize("mode", ["finish", "abort"])
@pytest.mark.parametrize("at", [1, 3])
def test_every_kind_resumes_bit_identically(kind_pipe, mode, at):
    kind, pipe, reference = kind_pipe
    before = classes(pipe)
    stopped = stopcock.run(pipe, **call_kwargs(kind), stop=stopcock.max_steps(at), mode=mode, checkpoint=True)
    assert stopped.stopped and stopped.checkpoint.steps == at
    assert stopped.steps == at + (finished_stages(kind, at) if mode == "finish" else 0)
    assert_clean(pipe, before)
    resumed = stopcock.resume(pipe, stopped.checkpoint)
    assert not resumed.stopped and resumed.steps == sum(kind.stage_steps)
    assert resumed.resumed == {"from_step": at, "saved_steps": at, "exact": True, "how": "replay"}
    assert torch.equal(output_tensor(resumed.output), reference)
    assert_clean(pipe, before)


def test_replayed_steps_call_no_loop_model(kind_pipe, count_forwards):
    kind, pipe, reference = kind_pipe
    models = list(loop_models(pipe).values())
    counts = count_forwards(*models)
    full = sum(counts.values())
    pipe(**call_kwargs(kind))
    per_run = sum(counts.values()) - full
    stopped = stopcock.run(pipe, **call_kwargs(kind), stop=stopcock.max_steps(2), checkpoint=True)
    before = sum(counts.values())
    seen = []
    resumed = stopcock.resume(pipe, stopped.checkpoint, on_step=seen.append)
    recorded = sum(len(step) for step in stopped.checkpoint.state["calls"])
    assert sum(counts.values()) - before == per_run - recorded  # the first two steps answered, not run
    assert [s.step for s in seen] == list(range(3, resumed.steps + 1))  # on_step not called again for them
    assert torch.equal(output_tensor(resumed.output), reference)


@pytest.mark.parametrize(
    "scheduler",
    [
        DPMSolverMultistepScheduler,
        EulerAncestralDiscreteScheduler,
        HeunDiscreteScheduler,
        UniPCMultistepScheduler,
    ],
    ids=lambda s: s.__name__,
)
def test_schedulers_with_history_and_noise(scheduler):
    pipe = tiny.stable_diffusion_pipeline()
    pipe.scheduler = scheduler.from_config(pipe.scheduler.config)
    stopped, reference = stopped_and_reference(
        pipe, {"prompt": "a cat", "num_inference_steps": 6, "output_type": "pt"}, 3, seed=3
    )
    assert torch.equal(stopcock.resume(pipe, stopped.checkpoint).output.images, reference)


def cached_flux(config: Any) -> Any:
    pipe = tiny.flux_pipeline()
    pipe.transformer.enable_cache(config)
    return pipe


@pytest.mark.parametrize(
    "config",
    [
        TaylorSeerCacheConfig(
            cache_interval=2, disable_cache_before_step=1, taylor_factors_dtype=torch.float32
        ),
        FirstBlockCacheConfig(threshold=0.2),
    ],
    ids=["taylorseer", "first-block-cache"],
)
def test_stateful_cache_hooks_resume_exactly(config, tmp_path):
    pipe = cached_flux(config)
    kwargs = {**FLUX_CALL, "num_inference_steps": 8, "output_type": "latent"}
    stopped, reference = stopped_and_reference(pipe, kwargs, 3)
    assert stopped.checkpoint.state["hooks"]  # the cache's state at the stop is part of the checkpoint
    assert torch.equal(stopcock.resume(pipe, stopped.checkpoint).output.images, reference)
    loaded = stopcock.Checkpoint.load(stopped.checkpoint.save(tmp_path / "cache.safetensors"))
    assert torch.equal(stopcock.resume(cached_flux(config), loaded).output.images, reference)


def test_resume_without_the_cache_state_would_differ():
    """The hazard the hook state guards against: replay alone, with a fresh cache state, is not exact."""
    pipe = cached_flux(
        TaylorSeerCacheConfig(
            cache_interval=2, disable_cache_before_step=1, taylor_factors_dtype=torch.float32
        )
    )
    stopped, reference = stopped_and_reference(
        pipe, {**FLUX_CALL, "num_inference_steps": 8, "output_type": "latent"}, 3
    )
    stopped.checkpoint.state["hooks"] = {}
    assert not torch.equal(stopcock.resume(pipe, stopped.checkpoint).output.images, reference)


def test_model_cpu_offload():
    pipe = tiny.stable_diffusion_pipeline()
    pipe.enable_model_cpu_offload(device="cpu")
    before = classes(pipe)
    stopped, reference = stopped_and_reference(
        pipe, {"prompt": "a cat", "num_inference_steps": 6, "output_type": "pt"}, 2
    )
    armed = list(pipe._all_hooks)
    assert torch.equal(stopcock.resume(pipe, stopped.checkpoint).output.images, reference)
    assert pipe._all_hooks and not any(h in armed for h in pipe._all_hooks)  # re-armed, as after a plain call
    assert_clean(pipe, before)


@pytest.mark.parametrize("partial", ["raw", "denoised"])
def test_the_partial_output_is_unaffected_by_recording(partial):
    pipe = tiny.stable_diffusion_pipeline()
    kwargs = {"prompt": "a cat", "num_inference_steps": 6, "output_type": "pt"}
    recorded, reference = stopped_and_reference(pipe, kwargs, 3, partial=partial)
    plain = stopcock.run(
        pipe,
        **kwargs,
        generator=torch.Generator().manual_seed(0),
        stop=stopcock.max_steps(3),
        partial=partial,
    )
    assert recorded.partial == plain.partial == partial
    assert torch.equal(recorded.output.images, plain.output.images)
    assert torch.equal(stopcock.resume(pipe, recorded.checkpoint).output.images, reference)


def test_stop_and_resume_again_and_a_completed_checkpoint(tmp_path):
    pipe = tiny.stable_diffusion_pipeline()
    pipe.scheduler = DPMSolverMultistepScheduler.from_config(pipe.scheduler.config)
    first, reference = stopped_and_reference(
        pipe, {"prompt": "a cat", "num_inference_steps": 8, "output_type": "pt"}, 2
    )
    second = stopcock.resume(pipe, first.checkpoint, stop=stopcock.max_steps(5), record=True)
    assert second.stopped and second.steps == 5 and second.resumed["saved_steps"] == 2
    path = second.checkpoint.save(tmp_path / "twice.safetensors")
    third = stopcock.resume(pipe, stopcock.Checkpoint.load(path), record=True)
    assert not third.stopped and third.steps == 8 and third.resumed["saved_steps"] == 5
    assert torch.equal(third.output.images, reference)
    # A completed run's checkpoint resumes to the same output with every step answered.
    again = stopcock.resume(pipe, third.checkpoint)
    assert again.resumed["saved_steps"] == 8 and torch.equal(again.output.images, reference)
    # A resume stopped before the checkpoint's step keeps the (further) checkpoint it came from.
    early = stopcock.resume(pipe, second.checkpoint, stop=stopcock.max_steps(3), record=True)
    assert early.steps == 3 and early.checkpoint is second.checkpoint


def test_without_a_generator_the_global_rng_is_replayed():
    pipe = tiny.stable_diffusion_pipeline()
    pipe.scheduler = EulerAncestralDiscreteScheduler.from_config(pipe.scheduler.config)
    kwargs = {"prompt": "a cat", "num_inference_steps": 5, "output_type": "pt"}
    torch.manual_seed(7)
    reference = pipe(**kwargs).images
    torch.manual_seed(7)
    stopped = stopcock.run(pipe, **kwargs, stop=stopcock.max_steps(2), checkpoint=True)
    torch.manual_seed(8)  # the program's RNG has moved on
    assert torch.equal(stopcock.resume(pipe, stopped.checkpoint).output.images, reference)


def test_a_callback_is_given_again_after_a_file(tmp_path):
    pipe = tiny.stable_diffusion_pipeline()
    before = classes(pipe)

    def halve(pipeline, i, t, kw):
        return {"latents": kw["latents"] * 0.5} if i == 1 else kw

    kwargs = {"prompt": "a cat", "num_inference_steps": 5, "output_type": "pt", "callback_on_step_end": halve}
    stopped, reference = stopped_and_reference(pipe, kwargs, 3)
    assert torch.equal(stopcock.resume(pipe, stopped.checkpoint).output.images, reference)  # in memory: kept
    loaded = stopcock.Checkpoint.load(stopped.checkpoint.save(tmp_path / "cb.safetensors"))
    assert loaded.live == ["callback_on_step_end"]
    with pytest.raises(stopcock.CheckpointError, match=r"callback_on_step_end=.*pass it again"):
        stopcock.resume(pipe, loaded)
    assert torch.equal(stopcock.resume(pipe, loaded, callback_on_step_end=halve).output.images, reference)
    assert_clean(pipe, before)


def _home_made() -> dict[str, Any]:
    from diffusers import CogVideoXDPMScheduler, DDPMScheduler
    from test_diffusers_kinds import CogVideoXStyle, FlagOnly, TwoStreams  # tests/ is on sys.path

    unet = tiny.ddpm_pipeline().unet
    return {
        "two-streams": lambda: TwoStreams(unet, DDPMScheduler(), DDPMScheduler()),
        "flag-only": lambda: FlagOnly(unet, DDPMScheduler()),
        "cogvideox-dpm": lambda: CogVideoXStyle(unet, CogVideoXDPMScheduler()),
    }


@pytest.mark.parametrize("name", ["two-streams", "flag-only", "cogvideox-dpm"])
def test_home_made_loops_resume_bit_identically(name):
    """The loops of the home-made pipelines the stop tests build: two schedulers stepped in one loop
    (ancestral noise from one generator), category C's flag-only loop, CogVideoX's DPM stepping."""
    pipe = _home_made()[name]()
    stopped, reference = stopped_and_reference(pipe, {"num_inference_steps": 6}, 3)
    resumed = stopcock.resume(pipe, stopped.checkpoint)
    assert resumed.resumed["saved_steps"] == 3 and torch.equal(output_tensor(resumed.output), reference)
