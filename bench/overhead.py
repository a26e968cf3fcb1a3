"""1. Overhead: throughput of ``stopcock.run(..., stop=StopSignal())`` vs the plain call, same model.

A stop signal that never fires costs one condition check per step (and, in abort mode, one check
per block). The arms are interleaved in rotating order; the ratio is the median of the per-round
ratios to the plain call, so drift in machine load cancels.
"""

from __future__ import annotations

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
    supported,
    text_model,
    timed,
)


@dataclass(frozen=True)
class Config:
    text_models: tuple[tuple[int, int, int], ...]  # (n_layer, n_embd, n_head)
    new_tokens: int
    image_steps: int
    reps: int


QUICK = Config(text_models=((2, 64, 2),), new_tokens=8, image_steps=3, reps=2)
FULL = Config(text_models=((2, 64, 2), (12, 384, 6)), new_tokens=64, image_steps=20, reps=9)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[round(q * (len(ordered) - 1))]


def compare(table: Table, label: str, steps: int, arms: dict[str, Callable[[], float]], reps: int) -> dict:
    """Time the arms (the first is the plain call), add one row per arm, return the raw numbers."""
    times = interleaved(arms, reps)
    plain = next(iter(times))
    out: dict[str, Any] = {}
    for name, values in times.items():
        ratios = [p / v for p, v in zip(times[plain], values, strict=True)]  # throughput ratio per round
        per_step_us = (median(values) - median(times[plain])) / steps * 1e6
        out[name] = {"seconds": values, "ratio": median(ratios), "per_step_us": per_step_us}
        table.add(
            label,
            name,
            f"{steps / median(values):.1f}",
            f"{median(ratios):.3f}",
            f"{_quantile(ratios, 0.25):.3f} to {_quantile(ratios, 0.75):.3f}",
            "" if name == plain else f"{per_step_us:+.0f}",
        )
    return out


def _text_arms(model: Any, ids: torch.Tensor, new_tokens: int) -> dict[str, Callable[[], float]]:
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    arms: dict[str, Callable[[], float]] = {
        "plain `model.generate`": lambda: timed(lambda: model.generate(ids, **kwargs))
    }
    if supported(model):
        for mode in ("finish", "abort"):
            arms[f"`run`, mode={mode}"] = lambda mode=mode: timed(
                lambda: stopcock.run(model, ids, stop=stopcock.StopSignal(), mode=mode, **kwargs)
            )
    return arms


def _image_arms(pipe: Any, steps: int) -> dict[str, Callable[[], float]]:
    def call(fn: Callable[..., Any], **options: Any) -> float:
        generator = torch.Generator().manual_seed(0)
        return timed(lambda: fn("a red fox", num_inference_steps=steps, generator=generator, **options))

    arms: dict[str, Callable[[], float]] = {"plain `pipe(...)`": lambda: call(pipe)}
    if supported(pipe):
        for mode in ("finish", "abort"):
            arms[f"`run`, mode={mode}"] = lambda mode=mode: call(
                lambda *a, **k: stopcock.run(pipe, *a, stop=stopcock.StopSignal(), mode=mode, **k)
            )
    return arms


def run(quick: bool = False) -> Section:
    config = QUICK if quick else FULL
    columns = ["model", "call", "{unit}/s (median)", "ratio to plain", "ratio, middle half", "µs per step"]
    text = Table("Text generation: tokens/s, greedy, batch 1", [c.format(unit="tokens") for c in columns])
    image = Table("Denoising: steps/s of the whole call", [c.format(unit="steps") for c in columns])
    data: dict[str, Any] = {"text": {}, "image": {}}
    for n_layer, n_embd, n_head in config.text_models:
        model, tokenizer = text_model(n_layer, n_embd, n_head)
        label = f"GPT-2 {n_layer}x{n_embd}"
        arms = _text_arms(model, prompt_ids(tokenizer, 16), config.new_tokens)
        data["text"][label] = compare(text, label, config.new_tokens, arms, config.reps)
    label = "tiny SD 64x64, DDIM"
    arms = _image_arms(image_pipeline(), config.image_steps)
    data["image"][label] = compare(image, label, config.image_steps, arms, config.reps)
    return Section(
        title="1. Overhead of a stop signal that never fires",
        intro=(
            f"Same model, same inputs, {config.reps} interleaved rounds per arm (rotating order) after"
            f" a warm-up. Text: {config.new_tokens} new tokens from a 16-token prompt. Images:"
            f" {config.image_steps} steps, whole call (text encoding and VAE decode included)."
            " *Ratio* is the throughput of the arm divided by the plain call's in the same round"
            " (median; >1 is faster); *µs per step* is the difference of the median call times"
            " divided by the steps. The target is a ratio within 1% of 1."
        ),
        tables=[text, image],
        notes=[
            "The tiny models make a step as short as possible, so they show the worst case: a fixed"
            " cost per step is the largest fraction of it there.",
            "Abort mode adds a forward pre-hook on every block (a check per block), so its cost scales"
            " with depth; finish mode adds one check per step.",
            RANDOM_WEIGHTS,
        ],
        data=data,
        headline=_headline(data),
    )


def _headline(data: dict[str, Any]) -> list[str]:
    """One line per model: the throughput ratios of finish and abort mode to the plain call."""
    lines = []
    for kind, unit in (("text", "tokens/s"), ("image", "steps/s")):
        for label, arms in data[kind].items():
            ratios = [f"{a['ratio']:.3f} ({name.split('=')[-1]})" for name, a in arms.items() if "=" in name]
            if ratios:
                lines.append(f"Overhead, {label}: {unit} of `run` / plain call = {', '.join(ratios)}.")
    return lines
