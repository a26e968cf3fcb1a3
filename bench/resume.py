"""5. Checkpoint and resume: what recording costs, and what resuming saves.

- **Recording overhead**: steps/s (tokens/s) of ``run(..., checkpoint=True)`` vs ``run(...)`` on the same
  model, interleaved, as a ratio per round; and the recording itself timed directly per step.
- **Memory per step** for SD-sized pipelines, computed from the shapes of the denoiser's outputs (what
  replay keeps: one output per denoiser call), checked against the bytes a tiny pipeline's checkpoint
  really holds per step.
- **Resume at step k vs running again**: the time to finish from a checkpoint at step k (its k steps
  replayed or continued from the cache, not computed) against the time of the whole run again; and
  the replay of k steps alone against computing them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import stopcock

from .common import (
    RANDOM_WEIGHTS,
    Section,
    Table,
    image_pipeline,
    interleaved,
    median,
    prompt_ids,
    text_model,
    timed,
)
from .overhead import clocked


@dataclass(frozen=True)
class Config:
    image_steps: int
    text_model: tuple[int, int, int]  # (n_layer, n_embd, n_head)
    new_tokens: int
    fractions: tuple[float, ...]
    reps: int
    calls: int  # for the direct timing of the recording


QUICK = Config(image_steps=4, text_model=(2, 64, 2), new_tokens=8, fractions=(0.5,), reps=2, calls=20)
FULL = Config(
    image_steps=20, text_model=(12, 384, 6), new_tokens=64, fractions=(0.25, 0.5, 0.75), reps=9, calls=500
)

# (pipeline, resolution, the denoiser output's shape per call, calls per step, bytes per value)
SD_SHAPES = [
    ("SD 1.5", "512x512", (2, 4, 64, 64), 1, 2),  # classifier-free guidance batched: one call of batch 2
    ("SDXL", "1024x1024", (2, 4, 128, 128), 1, 2),
    ("SD 3", "1024x1024", (2, 16, 128, 128), 1, 2),
    ("Flux.1-dev", "1024x1024", (1, 4096, 64), 1, 2),  # packed latents, guidance distilled: no second call
    ("Wan 2.1, 81 frames", "832x480", (1, 16, 21, 60, 104), 2, 2),  # cond and uncond as two calls
]


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for side in shape:
        out *= side
    return out


def memory_table(steps: int) -> tuple[Table, list[dict[str, Any]]]:
    table = Table(
        "Memory replay keeps, per denoising step (computed from the shapes; fp16/bf16 outputs)",
        ["pipeline", "size", "denoiser output per call", "calls per step", "per step", f"{steps} steps"],
    )
    rows = []
    for name, size, shape, calls, itemsize in SD_SHAPES:
        per_step = _numel(shape) * calls * itemsize
        rows.append({"pipeline": name, "per_step": per_step})
        table.add(
            name,
            size,
            "x".join(map(str, shape)),
            calls,
            f"{per_step / 2**20:.2f} MiB",
            f"{per_step * steps / 2**20:.1f} MiB",
        )
    return table, rows


def recorded_bytes(checkpoint: stopcock.Checkpoint) -> list[int]:
    """The bytes of the denoiser outputs a checkpoint holds, step by step."""

    def size(value: Any) -> int:
        if isinstance(value, torch.Tensor):
            return value.numel() * value.element_size()
        if isinstance(value, (list, tuple)):
            return sum(map(size, value))
        if isinstance(value, dict):
            return sum(map(size, value.values()))
        return sum(map(size, getattr(value, "attributes", {}).values()))

    return [sum(size(call["output"]) for call in step) for step in checkpoint.state["calls"]]


def _cpu(fn: Callable[[], object]) -> float:
    """CPU seconds of ``fn()`` on this thread: with one torch thread, all its work, and steady while
    other processes compete for the cores (wall-clock time is not, on a shared machine)."""
    return clocked(fn)[1]


def _ratio_rows(table: Table, label: str, unit: str, steps: int, times: dict[str, list[float]]) -> dict:
    plain = times["`run`"]
    recorded = times["`run(..., checkpoint=True)`"]
    ratios = [p / r for p, r in zip(plain, recorded, strict=True)]
    table.add(
        label,
        f"{steps / median(plain):.1f}",
        f"{steps / median(recorded):.1f}",
        f"{median(ratios):.3f}",
        f"{(median(recorded) - median(plain)) / steps * 1000:.3f}",
    )
    return {"ratio": median(ratios), "plain_s": median(plain), "recorded_s": median(recorded), "unit": unit}


def overhead(config: Config, table: Table) -> dict[str, Any]:
    pipe = image_pipeline("ddim")
    steps = config.image_steps

    def image(checkpoint: bool) -> float:
        generator = torch.Generator().manual_seed(0)
        return _cpu(
            lambda: stopcock.run(
                pipe,
                "a red fox",
                num_inference_steps=steps,
                output_type="latent",
                generator=generator,
                checkpoint=checkpoint,
            )
        )

    arms = {
        "`run`": functools.partial(image, False),
        "`run(..., checkpoint=True)`": functools.partial(image, True),
    }
    data = {
        "image": _ratio_rows(table, "tiny SD 64x64, DDIM", "steps", steps, interleaved(arms, config.reps))
    }
    model, tokenizer = text_model(*config.text_model)
    ids = prompt_ids(tokenizer, 16)
    n = config.new_tokens

    def text(checkpoint: bool) -> float:
        return _cpu(
            lambda: stopcock.run(
                model, ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, checkpoint=checkpoint
            )
        )

    arms = {
        "`run`": functools.partial(text, False),
        "`run(..., checkpoint=True)`": functools.partial(text, True),
    }
    label = "GPT-2 {}x{}".format(*config.text_model[:2])
    data["text"] = _ratio_rows(table, label, "tokens", n, interleaved(arms, config.reps))
    return data


# (what, the denoiser output's shape, its dtype)
OUTPUTS = [
    ("tiny SD (the pipeline above)", (2, 4, 32, 32), torch.float32),
    ("SDXL 1024x1024, fp16", (2, 4, 128, 128), torch.float16),
    ("Flux.1 1024x1024, bf16", (1, 4096, 64), torch.bfloat16),
]


def recording_cost(table: Table, calls: int) -> dict[str, float]:
    """What recording adds per denoising step, timed directly: keeping a copy of one denoiser output
    and closing the step (best of 5 batches of ``calls``)."""
    from diffusers.models.unets.unet_2d_condition import UNet2DConditionOutput

    from stopcock.adapters.diffusers_replay import _Replay
    from stopcock.state import StepState

    found = {}
    model = torch.nn.Linear(1, 1)
    for what, shape, dtype in OUTPUTS:
        output = UNet2DConditionOutput(sample=torch.randn(shape).to(dtype))
        args, kwargs = (torch.zeros(shape, dtype=dtype), torch.tensor(981)), {"encoder_hidden_states": None}
        state = StepState(step=1, latents=output.sample)

        def steps(
            source: _Replay,
            args: Any = args,
            kwargs: Any = kwargs,
            output: Any = output,
            state: StepState = state,
        ) -> None:
            for _ in range(calls):
                source.observe(model, args, kwargs, output)
                source.boundary(state)

        found[what] = min(timed(functools.partial(steps, _Replay({"unet": model}))) for _ in range(5)) / calls
        table.add(what, "x".join(map(str, shape)), f"{found[what] * 1e6:.1f}")
    return found


def resume_times(config: Config, table: Table) -> dict[str, Any]:
    """Finish from a checkpoint at step k vs the whole run again; replay k steps vs compute them."""
    pipe = image_pipeline("dpm++")
    steps = config.image_steps
    call = {"num_inference_steps": steps, "output_type": "latent"}
    data: dict[str, Any] = {"image": {}, "text": {}}

    def seeded() -> dict[str, Any]:
        return {**call, "generator": torch.Generator().manual_seed(0)}

    full = pipe("a red fox", **seeded()).images
    for fraction in config.fractions:
        k = max(1, round(steps * fraction))
        checkpoint = stopcock.run(
            pipe, "a red fox", **seeded(), stop=stopcock.max_steps(k), checkpoint=True
        ).checkpoint
        arms: dict[str, Callable[[], float]] = {
            "run again": lambda: _cpu(lambda: stopcock.run(pipe, "a red fox", **seeded())),
            "resume": lambda c=checkpoint: _cpu(lambda: stopcock.resume(pipe, c)),
            "compute k": lambda k=k: _cpu(
                lambda: stopcock.run(pipe, "a red fox", **seeded(), stop=stopcock.max_steps(k))
            ),
            "replay k": lambda c=checkpoint, k=k: _cpu(
                lambda: stopcock.resume(pipe, c, stop=stopcock.max_steps(k))
            ),
        }
        times = {name: median(values) for name, values in interleaved(arms, config.reps).items()}
        exact = torch.equal(stopcock.resume(pipe, checkpoint).output.images, full)
        data["image"][k] = {**times, "exact": exact}
        table.add(
            "tiny SD 64x64, DPM-Solver++",
            f"{k} of {steps}",
            f"{times['run again'] * 1000:.1f}",
            f"{times['resume'] * 1000:.1f}",
            f"{times['resume'] / times['run again']:.2f}",
            f"{(steps - k) / steps:.2f}",
            f"{times['replay k'] / times['compute k']:.2f}",
            exact,
        )

    model, tokenizer = text_model(*config.text_model)
    ids = prompt_ids(tokenizer, 16)
    n = config.new_tokens
    kwargs = {"max_new_tokens": n, "min_new_tokens": n, "do_sample": False}
    reference = model.generate(ids, **kwargs)
    for fraction in config.fractions:
        k = max(1, round(n * fraction))
        checkpoint = stopcock.run(
            model, ids, **kwargs, stop=stopcock.max_steps(k), checkpoint=True
        ).checkpoint
        arms = {
            "run again": lambda: _cpu(lambda: stopcock.run(model, ids, **kwargs)),
            "resume": lambda c=checkpoint: _cpu(lambda: stopcock.resume(model, c)),
        }
        times = {name: median(values) for name, values in interleaved(arms, config.reps).items()}
        exact = torch.equal(stopcock.resume(model, checkpoint).output, reference)
        data["text"][k] = {**times, "exact": exact}
        table.add(
            "GPT-2 {}x{}, greedy".format(*config.text_model[:2]),
            f"{k} of {n}",
            f"{times['run again'] * 1000:.1f}",
            f"{times['resume'] * 1000:.1f}",
            f"{times['resume'] / times['run again']:.2f}",
            f"{(n - k) / n:.2f}",
            "(cache)",
            exact,
        )
    return data


def run(quick: bool = False) -> Section:
    config = QUICK if quick else FULL
    cost = Table(
        "Recording overhead: throughput of `run(..., checkpoint=True)` vs `run(...)`, CPU time (medians)",
        ["model", "run: units/s", "checkpoint=True: units/s", "throughput ratio", "ms added per unit"],
    )
    data: dict[str, Any] = {"overhead": overhead(config, cost)}
    direct = Table(
        "Recording timed directly: a copy of one denoiser output and the step's bookkeeping (best of 5)",
        ["denoiser output", "shape", "µs per step (one call)"],
    )
    data["direct"] = recording_cost(direct, config.calls)
    memory, rows = memory_table(50)
    data["memory"] = rows
    pipe = image_pipeline("ddim")
    tiny = stopcock.run(
        pipe,
        "a red fox",
        num_inference_steps=config.image_steps,
        output_type="latent",
        generator=torch.Generator().manual_seed(0),
        checkpoint=True,
    ).checkpoint
    measured = recorded_bytes(tiny)
    predicted = _numel((2, 4, 32, 32)) * 4  # the tiny UNet's output, fp32, guidance batched
    data["tiny_bytes"] = {"measured": measured, "predicted": predicted}
    times = Table(
        "Resume at step k vs the whole run again (CPU ms, medians); replay of k steps vs computing them",
        [
            "model",
            "checkpoint at",
            "run again",
            "resume",
            "resume / run again",
            "ideal (N-k)/N",
            "replay k / compute k",
            "bit-identical",
        ],
    )
    data["resume"] = resume_times(config, times)
    image, text = data["overhead"]["image"], data["overhead"]["text"]
    half = config.fractions[len(config.fractions) // 2]
    k_image = max(1, round(config.image_steps * half))
    k_text = max(1, round(config.new_tokens * half))
    r_image, r_text = data["resume"]["image"][k_image], data["resume"]["text"][k_text]
    return Section(
        title="5. Checkpoint and resume",
        intro=__doc__.split("\n\n", 1)[1].strip()
        + f"\n\n{RANDOM_WEIGHTS} One torch thread; arms interleaved.",
        tables=[cost, direct, memory, times],
        notes=[
            f"The tiny SD checkpoint holds {measured[0]} bytes per step, as its shapes predict ({predicted}:"
            " one 2x4x32x32 fp32 output per step): the table's figures follow the same formula.",
            "Recording keeps the outputs on the device they were made on; `save()` copies them to the CPU.",
            "Resume times include checking the fingerprint (classes, configs, a sample of the weights,"
            " remembered per model) and, for text, rebuilding the cache.",
        ],
        data=data,
        headline=[
            f"Recording (`checkpoint=True`): throughput ratio {image['ratio']:.3f} on tiny SD (DDIM),"
            f" {text['ratio']:.3f} on GPT-2 {config.text_model[0]}x{config.text_model[1]} (CPU time); timed"
            f" directly {data['direct'][OUTPUTS[1][0]] * 1e6:.0f} µs a step for an SDXL-sized output (CPU);"
            f" replay keeps one denoiser output per call and step: {rows[1]['per_step'] / 2**20:.2f} MiB for"
            " SDXL"
            f" 1024x1024, {rows[4]['per_step'] / 2**20:.1f} MiB for Wan 2.1 81 frames (from shapes).",
            f"Resume at step {k_image} of {config.image_steps} (tiny SD, DPM-Solver++):"
            f" {r_image['resume'] / r_image['run again']:.2f} of the time of running again (ideal"
            f" {(config.image_steps - k_image) / config.image_steps:.2f}); replaying {k_image} steps takes"
            f" {r_image['replay k'] / r_image['compute k']:.2f} of computing them; GPT-2 at token {k_text} of"
            f" {config.new_tokens}: {r_text['resume'] / r_text['run again']:.2f}; bit-identical:"
            f" {r_image['exact'] and r_text['exact']}.",
        ],
    )
