"""Finish mode gives the pipeline's own output on every kind of pipeline (tiny real pipelines).

For each kind: a run stopped at step 2 of 4 returns the pipeline's output class with the shapes of a
full run, no model of the denoising loop computes after the stop step (forwards are counted with
forward hooks, which a fast-forwarded call does not run), and a same-seed rerun is bit-identical.
Kinds: A (Wan video; SkyReels V2 DF, interrupt checked in its inner loop, one scheduler copy per
frame), B (Kandinsky 3, LCM), D (legacy callback: AudioLDM audio, TextToVideoSD video), E (DDPM;
ScoreSdeVe, whose loop steps no scheduler), modular (Flux, SDXL) and combined (Kandinsky 2.2,
Stable Cascade on one shared scheduler).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import DDPMScheduler, DiffusionPipeline

import stopcock
from stopcock.adapters.diffusers import honours_interrupt
from stopcock.adapters.diffusers_parts import StageCall
from stopcock.binding import _PerThread
from stopcock.intercept import intercepted
from tiny import image as tiny

STEPS = 4
AT = 2


def prompt_embeds() -> torch.Tensor:
    return torch.randn(1, 16, 32, generator=torch.Generator().manual_seed(1))


@dataclass
class Kind:
    name: str
    build: Any
    call: dict[str, Any]
    loop: tuple[str, ...]  # the components that run in the denoising loop
    path: str  # how a stop at step AT of STEPS ends the run
    shape: tuple[int, ...]  # of the first output
    extra: dict[str, Any] = field(default_factory=dict)


WAN_CALL = {"height": 16, "width": 16, "num_frames": 9, "output_type": "pt"}
KINDS = [
    Kind("kandinsky3", tiny.kandinsky3_pipeline, {"prompt": "a cat", "height": 16, "width": 16,
         "output_type": "np"}, ("unet",), "fast-forward", (1, 16, 16, 3)),
    Kind("lcm", tiny.lcm_pipeline, {"prompt": "a cat", "output_type": "np"}, ("unet",), "fast-forward",
         (1, 64, 64, 3)),
    Kind("audioldm", tiny.audioldm_pipeline, {"prompt": "a cat", "audio_length_in_s": 0.1,
         "output_type": "np"}, ("unet",), "fast-forward", (1, 1600)),
    Kind("text-to-video", tiny.text_to_video_pipeline, {"prompt": "a cat", "num_frames": 3,
         "output_type": "pt"}, ("unet",), "fast-forward", (1, 3, 3, 32, 32)),
    Kind("ddpm", tiny.ddpm_pipeline, {"output_type": "np"}, ("unet",), "fast-forward", (1, 16, 16, 3)),
    Kind("score-sde", tiny.score_sde_pipeline, {"output_type": "np"}, ("unet",), "fast-forward",
         (1, 16, 16, 3), extra={"saturated": True}),  # random weights: its clamped images are all 0 or 1
    Kind("wan", tiny.wan_pipeline, {"prompt": "a cat", "max_sequence_length": 16, **WAN_CALL},
         ("transformer",), "interrupt", (1, 9, 3, 16, 16)),
    Kind("skyreels-df", tiny.skyreels_df_pipeline, {"prompt": None, **WAN_CALL}, ("transformer",),
         "interrupt", (1, 9, 3, 16, 16), extra={"embeds": True}),
    Kind("modular-flux", tiny.modular_flux_pipeline, {"prompt": "a cat", "height": 32, "width": 32,
         "output": "images"}, ("transformer",), "fast-forward", (32, 32, 3)),
    Kind("kandinsky-combined", tiny.kandinsky_combined_pipeline, {"prompt": "a cat", "height": 64,
         "width": 64, "prior_num_inference_steps": STEPS, "output_type": "np"}, ("prior_prior",),
         "fast-forward", (1, 64, 64, 3), extra={"next_stage": ("unet", STEPS)}),
    Kind("stable-cascade-combined", tiny.stable_cascade_combined_pipeline, {"prompt": "a cat", "height": 128,
         "width": 128, "prior_num_inference_steps": STEPS, "output_type": "np"}, ("prior_prior",),
         "fast-forward", (1, 128, 128, 3), extra={"next_stage": ("decoder", STEPS)}),
]


def call_kwargs(kind: Kind) -> dict[str, Any]:
    kwargs = {**kind.call, "num_inference_steps": STEPS, "generator": torch.Generator().manual_seed(0)}
    if kind.extra.get("embeds"):  # SkyReels' own prompt cleaning needs ftfy, not installed here
        kwargs.update(prompt_embeds=prompt_embeds(), negative_prompt_embeds=prompt_embeds() * 0.5)
    return kwargs


def first(output: Any) -> Any:
    """The pipeline's main output (images, frames, audios) as an array."""
    value = output[0] if isinstance(output, (tuple, list)) else output
    value = next(iter(value.values())) if hasattr(value, "values") else value
    if isinstance(value, list):
        value = value[0]
    return value.numpy() if isinstance(value, torch.Tensor) else np.asarray(value, dtype=np.float32)


def model_calls(pipe: Any) -> tuple[dict[str, int], list[Any]]:
    """Forwards computed per model component (a fast-forwarded call runs no hook, so is not counted)."""
    counts: dict[str, int] = {}
    handles = []

    def count(name: str) -> Any:
        return lambda module, args, output: counts.__setitem__(name, counts[name] + 1)

    for name, module in pipe.components.items():
        if isinstance(module, torch.nn.Module):
            counts[name] = 0
            handles.append(module.register_forward_hook(count(name)))
    return counts, handles


def assert_clean(pipe: Any) -> None:
    """No flag, wrapper, stage stand-in, intercepting class or hook of stopcock's left behind."""
    assert not getattr(pipe, "_interrupt", False)
    for name, component in pipe.components.items():
        if isinstance(component, torch.nn.Module):
            assert type(component).__call__ is torch.nn.Module.__call__, name
            hooks = [h for m in component.modules() for h in (*m._forward_pre_hooks.values(),
                                                                *m._forward_hooks.values())]
            assert not [h for h in hooks if h.__module__.startswith("stopcock")], name
        assert "step" not in getattr(component, "__dict__", {}), name
    assert not any(isinstance(v, (StageCall, _PerThread)) for v in vars(pipe).values())


@pytest.fixture(scope="module", params=KINDS, ids=lambda k: k.name)
def kind_pipe(request):
    """(kind, pipeline, a full run's Outcome, forwards per model in the full run)."""
    torch.set_num_threads(1)
    kind = request.param
    pipe = kind.build()
    counts, handles = model_calls(pipe)
    full = stopcock.run(pipe, **call_kwargs(kind))
    for handle in handles:
        handle.remove()
    return kind, pipe, full, counts


def test_a_full_run_counts_every_step(kind_pipe):
    kind, _, full, counts = kind_pipe
    stages = 1 + ("next_stage" in kind.extra)
    assert not full.stopped and full.steps == full.total_steps == STEPS * stages
    assert first(full.output).shape == kind.shape
    for name in kind.loop:
        assert counts[name] % STEPS == 0 and counts[name] > 0, name


def test_a_stop_finishes_with_the_output_and_no_loop_forward_after_it(kind_pipe):
    kind, pipe, full, full_counts = kind_pipe
    counts, handles = model_calls(pipe)
    states = []
    try:
        outcome = stopcock.run(pipe, **call_kwargs(kind), stop=stopcock.max_steps(AT), on_step=states.append)
    finally:
        for handle in handles:
            handle.remove()
    assert outcome.stopped and outcome.reason == "max_steps" and outcome.mode == "finish"
    assert type(outcome.output) is type(full.output) and first(outcome.output).shape == kind.shape
    assert outcome.extra["path"] == kind.path
    if honours_interrupt(pipe):  # the survey's list, a test oracle: its pipelines skip on the flag
        assert kind.path == "interrupt"
    assert outcome.extra["fast_forwarded"] == (STEPS - AT if kind.path == "fast-forward" else 0)
    assert (outcome.detail is None) == (kind.path == "interrupt")
    # The loop's models computed the steps up to the stop, none after; every other model (text encoders,
    # the decoders after the loop) ran as in a full run, and a combined pipeline's next stage in full.
    later, later_steps = kind.extra.get("next_stage", (None, 0))
    for name, count in counts.items():
        per_step = full_counts[name] // STEPS
        expected = per_step * AT if name in kind.loop else full_counts[name]
        assert count == expected, name
    assert outcome.steps == AT + later_steps == len(states)
    if later:
        assert counts[later] == full_counts[later] > 0
    assert_clean(pipe)


def test_a_same_seed_rerun_is_bit_identical(kind_pipe):
    kind, pipe, full, _ = kind_pipe
    runs = [stopcock.run(pipe, **call_kwargs(kind), stop=stopcock.max_steps(AT)) for _ in range(2)]
    np.testing.assert_array_equal(first(runs[0].output), first(runs[1].output))
    if not kind.extra.get("saturated"):
        assert not np.array_equal(first(runs[0].output), first(full.output))  # it did stop early
    np.testing.assert_array_equal(first(stopcock.run(pipe, **call_kwargs(kind)).output), first(full.output))


# -- what a fast-forward decodes ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def lcm():
    torch.set_num_threads(1)
    return tiny.lcm_pipeline()


@pytest.mark.parametrize("partial", ["raw", "denoised"])
@pytest.mark.parametrize("build", [tiny.lcm_pipeline, tiny.kandinsky3_pipeline], ids=["lcm", "kandinsky3"])
def test_a_fast_forward_hands_the_stop_steps_latents_to_the_decoder(build, partial):
    pipe = build()
    states = []
    size = {"height": 16, "width": 16} if "Kandinsky" in type(pipe).__name__ else {}
    outcome = stopcock.run(pipe, "a cat", **size, num_inference_steps=STEPS, output_type="latent",
                           generator=torch.Generator().manual_seed(0), stop=stopcock.max_steps(AT),
                           partial=partial, on_step=states.append)
    assert outcome.extra["path"] == "fast-forward" and outcome.partial == partial
    # LCM decodes its scheduler's own x0 estimate, also at the end of a full run: the stop step's here.
    raw = partial == "raw" and "Kandinsky" in type(pipe).__name__
    expected = states[-1].latents if raw else states[-1].extra["denoised"]
    torch.testing.assert_close(outcome.output.images, expected, rtol=0, atol=0)
    expected = states[-1].latents if partial == "raw" else states[-1].extra["denoised"]
    torch.testing.assert_close(outcome.latents, expected, rtol=0, atol=0)


def test_the_users_callback_still_runs_in_the_fast_forwarded_steps(lcm):
    seen = []

    def mine(pipe, i, t, kw):
        seen.append((i, kw["latents"]))
        return kw

    states = []
    outcome = stopcock.run(lcm, "a cat", num_inference_steps=STEPS, callback_on_step_end=mine,
                           generator=torch.Generator().manual_seed(0), stop=stopcock.max_steps(AT),
                           on_step=states.append)
    assert [i for i, _ in seen] == list(range(STEPS)) and len(states) == AT  # on_step: real steps only
    for _, latents in seen[AT - 1:]:  # from the stop step on, the latents are held
        torch.testing.assert_close(latents, states[-1].latents, rtol=0, atol=0)
    assert outcome.output.images[0].size == (64, 64)


def test_a_fast_forward_with_model_cpu_offload(count_forwards):
    reference_pipe = tiny.lcm_pipeline()
    pipe = tiny.lcm_pipeline()
    pipe.enable_model_cpu_offload(device="cpu")
    kwargs = {"num_inference_steps": STEPS, "output_type": "np"}
    calls = count_forwards(pipe.unet)
    outcome = stopcock.run(pipe, "a cat", **kwargs, generator=torch.Generator().manual_seed(0),
                           stop=stopcock.max_steps(AT))
    assert outcome.extra["path"] == "fast-forward" and calls[pipe.unet] == AT
    assert type(pipe.unet).__call__ is torch.nn.Module.__call__ and pipe._all_hooks
    expected = reference_pipe("a cat", **kwargs, generator=torch.Generator().manual_seed(0)).images
    np.testing.assert_array_equal(pipe("a cat", **kwargs, generator=torch.Generator().manual_seed(0)).images,
                                  expected)


def test_a_model_shared_with_another_thread_computes_there(lcm):
    """A fast-forward answers the run's own thread only: a pipeline on the same UNet in another thread,
    running while this one is held, gets its own results."""
    scheduler = type(lcm.scheduler).from_config(lcm.scheduler.config)
    other = type(lcm)(**{**lcm.components, "scheduler": scheduler})
    other.set_progress_bar_config(disable=True)
    kwargs = {"num_inference_steps": STEPS, "output_type": "np"}
    reference = other("a dog", **kwargs, generator=torch.Generator().manual_seed(3)).images
    held, other_done, results = threading.Event(), threading.Event(), {}

    def wait_in_fast_forward(pipe, i, t, kw):
        if i == AT:  # the first fast-forwarded step: the UNet is held for this thread now
            held.set()
            assert other_done.wait(60)
        return kw

    def run_other():
        assert held.wait(60)
        results["other"] = other("a dog", **kwargs, generator=torch.Generator().manual_seed(3)).images
        other_done.set()

    thread = threading.Thread(target=run_other)
    thread.start()
    outcome = stopcock.run(lcm, "a cat", **kwargs, callback_on_step_end=wait_in_fast_forward,
                           generator=torch.Generator().manual_seed(0), stop=stopcock.max_steps(AT))
    thread.join()
    assert outcome.extra["path"] == "fast-forward" and outcome.extra["answered"] == STEPS - AT
    np.testing.assert_array_equal(results["other"], reference)


def test_nested_interceptions_unwind_to_the_plain_class():
    unet = tiny.ddpm_pipeline().unet
    with intercepted(unet, "__call__", lambda call, *a, **k: "outer"):
        with intercepted(unet, "__call__", lambda call, *a, **k: "inner"):
            assert unet() == "inner"
        assert unet() == "outer"
    assert type(unet).__call__ is torch.nn.Module.__call__


# -- combined pipelines: the stage option -------------------------------------------------------------
@pytest.fixture(scope="module")
def kandinsky():
    torch.set_num_threads(1)
    return tiny.kandinsky_combined_pipeline()


def kandinsky_kwargs():
    return {"prompt": "a cat", "height": 64, "width": 64, "prior_num_inference_steps": 3,
            "num_inference_steps": 4, "output_type": "np", "generator": torch.Generator().manual_seed(0)}


@pytest.mark.parametrize("stage", [None, "next", "current"])
def test_a_stop_in_the_prior_and_the_stage_option(kandinsky, count_forwards, stage):
    prior, unet = kandinsky.components["prior_prior"], kandinsky.components["unet"]
    calls = count_forwards(prior, unet)
    options = {} if stage is None else {"stage": stage}
    outcome = stopcock.run(kandinsky, **kandinsky_kwargs(), stop=stopcock.max_steps(1), **options)
    assert outcome.stopped and outcome.mode == "finish" and calls[prior] == 1
    if stage == "current":  # the run ends with the prior: its own output, no decoder step
        assert calls[unet] == 0 and outcome.steps == 1
        image_embeds, negative_image_embeds = outcome.output
        assert image_embeds.shape == negative_image_embeds.shape == (1, 32)
        assert "stage='current'" in outcome.detail
    else:  # the decoder runs in full on what the prior produced
        assert calls[unet] == 4 and outcome.steps == 5 == outcome.total_steps
        assert outcome.output.images.shape == (1, 64, 64, 3)
    assert_clean(kandinsky)


def test_the_stage_option_is_checked(kandinsky):
    with pytest.raises(ValueError, match="stage must be 'next' or 'current'"):
        stopcock.run(kandinsky, **kandinsky_kwargs(), stage="prior")


class TwoLoops(DiffusionPipeline):
    """Two loops in one ``__call__`` (as UnCLIP's prior, then decoder), each with its scheduler."""

    def __init__(self, unet, scheduler, scheduler_2):
        super().__init__()
        self.register_modules(unet=unet, scheduler=scheduler, scheduler_2=scheduler_2)

    @torch.no_grad()
    def __call__(self, num_inference_steps=3, generator=None):
        sample = torch.randn((1, 3, 16, 16), generator=generator)
        for scheduler in (self.scheduler, self.scheduler_2):
            scheduler.set_timesteps(num_inference_steps)
            for t in scheduler.timesteps:
                noise = self.unet(sample, t).sample
                sample = scheduler.step(noise, t, sample, generator=generator).prev_sample
        return {"sample": sample}


class SharedStages(DiffusionPipeline):
    """A combined pipeline whose two stages share one denoiser and one scheduler (as VisualCloze's)."""

    def __init__(self, unet, scheduler):
        super().__init__()
        self.register_modules(unet=unet, scheduler=scheduler)
        self.first_pipe = type(tiny.ddpm_pipeline())(unet=unet, scheduler=scheduler)
        self.second_pipe = type(tiny.ddpm_pipeline())(unet=unet, scheduler=scheduler)
        for stage in (self.first_pipe, self.second_pipe):
            stage.set_progress_bar_config(disable=True)

    @torch.no_grad()
    def __call__(self, num_inference_steps=3, generator=None):
        kwargs = {"generator": generator, "output_type": "np"}  # the second starts at another timestep
        first = self.first_pipe(num_inference_steps=num_inference_steps, **kwargs)
        second = self.second_pipe(num_inference_steps=num_inference_steps - 1, **kwargs)
        return {"images": np.concatenate([first.images, second.images])}


def test_the_stages_of_a_combined_pipeline_on_one_denoiser_and_scheduler(count_forwards):
    unet = tiny.ddpm_pipeline().unet
    pipe = SharedStages(unet, DDPMScheduler())
    calls = count_forwards(unet)
    states = []
    full = stopcock.run(pipe, generator=torch.Generator().manual_seed(0), on_step=states.append)
    assert full.steps == full.total_steps == 5 and calls[unet] == 5
    assert [s.total for s in states] == [3, 3, 3, 5, 5]  # learnt stage by stage
    outcome = stopcock.run(pipe, generator=torch.Generator().manual_seed(0), stop=stopcock.max_steps(1))
    assert outcome.steps == 1 + 2 and calls[unet] == 5 + 1 + 2  # the second stage runs in full
    assert outcome.output["images"].shape == (2, 16, 16, 3) and outcome.extra["fast_forwarded"] == 2


@pytest.mark.parametrize("stage", ["next", "current"])
def test_a_stop_in_the_first_of_two_loops_in_one_call(count_forwards, stage):
    unet = tiny.ddpm_pipeline().unet
    pipe = TwoLoops(unet, DDPMScheduler(), DDPMScheduler())
    calls = count_forwards(unet)
    outcome = stopcock.run(pipe, generator=torch.Generator().manual_seed(0), stop=stopcock.max_steps(1),
                           stage=stage)
    assert outcome.stopped and outcome.extra["fast_forwarded"] == 2
    if stage == "next":  # the first loop fast-forwarded, the second one runs in full
        assert calls[unet] == 1 + 3 and outcome.steps == 4
        assert outcome.output["sample"].shape == (1, 3, 16, 16)
    else:  # ended as the second loop began, before it computed: this pipeline builds its output at the end
        assert calls[unet] == 1 and outcome.output is None and "stage='current'" in outcome.detail


# -- steps on every loop --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def skyreels():
    torch.set_num_threads(1)
    return tiny.skyreels_df_pipeline()


def skyreels_kwargs(**extra):
    return {"prompt": None, "prompt_embeds": prompt_embeds(), "negative_prompt_embeds": prompt_embeds() * 0.5,
            "num_inference_steps": STEPS, "generator": torch.Generator().manual_seed(0), **WAN_CALL, **extra}


def test_the_scheduler_copies_of_diffusion_forcing_count_one_step_per_iteration(skyreels, count_forwards):
    """SkyReels V2 DF steps a copy of its scheduler per latent frame: each loop iteration is one step."""
    calls = count_forwards(skyreels.transformer)
    states = []
    full = stopcock.run(skyreels, **skyreels_kwargs(), on_step=states.append)
    assert full.steps == full.total_steps == STEPS and [s.step for s in states] == [1, 2, 3, 4]
    assert calls[skyreels.transformer] == 2 * STEPS  # guidance: two calls per iteration
    at_step = stopcock.when(lambda s: s.step == AT, reason="b")
    outcome = stopcock.run(skyreels, **skyreels_kwargs(), stop=at_step)
    assert outcome.reason == "b" and outcome.steps == AT and calls[skyreels.transformer] == 2 * (STEPS + AT)
    assert outcome.output.frames.shape == (1, 9, 3, 16, 16)
    assert_clean(skyreels)


class CopiesPerChunk(DiffusionPipeline):
    """A loop that steps a fresh copy of its scheduler per chunk of the sample and never checks
    ``interrupt`` (the pattern of diffusion forcing, without the flag)."""

    def __init__(self, unet, scheduler):
        super().__init__()
        self.register_modules(unet=unet, scheduler=scheduler)

    @torch.no_grad()
    def __call__(self, num_inference_steps=4, generator=None):
        import copy

        sample = torch.randn((2, 3, 16, 16), generator=generator)
        self.scheduler.set_timesteps(num_inference_steps)
        chunks = [copy.deepcopy(self.scheduler) for _ in range(2)]
        for t in self.scheduler.timesteps:
            noise = self.unet(sample, t).sample
            for i, chunk in enumerate(chunks):
                sample[i : i + 1] = chunk.step(noise[i : i + 1], t, sample[i : i + 1]).prev_sample
        return {"sample": sample}


def test_scheduler_copies_are_counted_and_fast_forwarded(count_forwards):
    unet = tiny.ddpm_pipeline().unet
    pipe = CopiesPerChunk(unet, DDPMScheduler())
    calls = count_forwards(unet)
    full = stopcock.run(pipe, generator=torch.Generator().manual_seed(0))
    assert full.steps == full.total_steps == STEPS and calls[unet] == STEPS
    states = []
    outcome = stopcock.run(pipe, generator=torch.Generator().manual_seed(0), stop=stopcock.max_steps(AT),
                           on_step=states.append)
    assert outcome.steps == AT and calls[unet] == STEPS + AT and outcome.extra["fast_forwarded"] == STEPS - AT
    # Both chunks stepped for real at the stop step (the second after the stop was seen), then were held.
    stop_state = states[-1]
    torch.testing.assert_close(outcome.output["sample"][:1], stop_state.latents, rtol=0, atol=0)
    assert not torch.equal(outcome.output["sample"][1:], full.output["sample"][1:])


def test_a_loop_with_no_scheduler_step_is_counted_by_the_denoisers_timestep(count_forwards):
    torch.set_num_threads(1)
    pipe = tiny.score_sde_pipeline()
    calls = count_forwards(pipe.unet)
    states = []
    kwargs = {"num_inference_steps": STEPS, "output_type": "np"}
    full = stopcock.run(pipe, **kwargs, generator=torch.Generator().manual_seed(0), on_step=states.append)
    per_step = calls[pipe.unet] // STEPS  # a corrector and a predictor call at each timestep
    assert full.steps == full.total_steps == STEPS == len(states) and per_step == 2
    outcome = stopcock.run(pipe, **kwargs, generator=torch.Generator().manual_seed(0),
                           stop=stopcock.max_steps(AT), mode="abort")
    assert outcome.steps == AT and calls[pipe.unet] == per_step * (STEPS + AT) and outcome.output is None


def test_attach_aborts_a_second_call_of_a_fast_forwarded_pipeline(lcm, count_forwards):
    calls = count_forwards(lcm.unet)
    outputs = []
    with stopcock.attach(lcm, stopcock.max_steps(AT)) as handle:
        for _ in range(2):
            outputs.append(lcm("a cat", num_inference_steps=STEPS, output_type="np"))
    # LCM has no flag to tell a new call: its loop starting again on the stopped scheduler tells it.
    assert len(outputs) == 1 and calls[lcm.unet] == AT
    assert handle.outcome.mode == "abort" and "a call made after the stop" in handle.outcome.detail
    assert_clean(lcm)
