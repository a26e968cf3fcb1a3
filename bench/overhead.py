"""1. Overhead: throughput of ``stopcock.run(..., stop=StopSignal())`` vs the plain call, same model.

A stop signal that never fires costs one condition check per step (and, in abort mode, one check
per block). The arms are interleaved in rotating order; the ratio is the median of the per-round
ratios to the plain call, so drift in machine load cancels.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import pipeline

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


@dataclass(frozen=True)
class Config:
    text_models: tuple[tuple[int, int, int], ...]  # (n_layer, n_embd, n_head)
    new_tokens: int
    image_steps: int
    reps: int
    check_calls: int


QUICK = Config(text_models=((2, 64, 2),), new_tokens=8, image_steps=3, reps=2, check_calls=200)
FULL = Config(text_models=((2, 64, 2), (12, 384, 6)), new_tokens=64, image_steps=20, reps=9, check_calls=5000)


def per_call(fn: Callable[[], object], calls: int) -> float:
    """Seconds per call of ``fn``: the best of 5 batches (noise only ever adds time)."""
    return min(timed(lambda: [fn() for _ in range(calls)]) for _ in range(5)) / calls


def check_costs(table: Table, calls: int) -> dict[str, float]:
    """What a run adds per step and per block, timed in isolation on this machine."""
    from stopcock.control import RunControl
    from stopcock.hooks import pre_hooks

    ids = torch.zeros((1, 32), dtype=torch.long)
    criteria = stopcock.stopping_criteria(stopcock.StopSignal())
    block, x = torch.nn.Identity(), torch.zeros(1)
    costs: dict[str, float] = {}
    with RunControl(stopcock.StopSignal() | stopcock.timeout(3600)) as control:
        costs["step"] = per_call(control.step, calls)
        costs["criterion"] = per_call(lambda: criteria(ids, None), calls)
        bare = per_call(lambda: block(x), calls)
        with pre_hooks([block], lambda _m: control.poll()):
            costs["block_hook"] = per_call(lambda: block(x), calls) - bare
    rows = [
        ("`RunControl.step`: one step boundary (a signal and a timeout)", "step", "every step, every target"),
        ("`stopcock.stopping_criteria(signal)`, called as generate calls it", "criterion",
         "every token (`run` on generate and text pipelines)"),
        ("a forward pre-hook that polls (abort mode)", "block_hook", "each block of each forward, abort"),
    ]
    for what, key, paid in rows:
        table.add(what, f"{costs[key] * 1e6:.1f}", paid)
    return costs


Arms = dict[str, Callable[[], float]]  # name -> a timed call (seconds)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[round(q * (len(ordered) - 1))]


def compare(table: Table, label: str, steps: int, timers: Arms, reps: int) -> dict:
    """Time the arms (the first is the plain call), add one row per arm, return the raw numbers."""
    times = interleaved(timers, reps)
    plain = next(iter(times))
    out: dict[str, Any] = {}
    for name, values in times.items():
        ratios = [p / v for p, v in zip(times[plain], values, strict=True)]  # throughput ratio per round
        best = min(times[plain]) / min(values)
        out[name] = {"seconds": values, "ratio": median(ratios), "best_ratio": best}
        table.add(
            label,
            name,
            f"{steps / median(values):.1f}",
            f"{median(ratios):.3f}",
            f"{_quantile(ratios, 0.25):.3f} to {_quantile(ratios, 0.75):.3f}",
            f"{best:.3f}",
        )
    return out


def arms(name: str, plain: Callable[..., Any], target: Any, args: tuple[Any, ...],
         kwargs: Callable[[], dict[str, Any]]) -> Arms:
    """The plain call and ``stopcock.run`` in both modes with a signal that never fires, each timed.

    ``kwargs`` is called afresh for every call (e.g. a new seeded generator).
    """
    def with_stopcock(mode: str) -> float:
        return timed(lambda: stopcock.run(target, *args, stop=stopcock.StopSignal(), mode=mode, **kwargs()))

    found: Arms = {f"plain `{name}`": lambda: timed(lambda: plain(*args, **kwargs()))}
    for mode in ("finish", "abort"):
        found[f"`run`, mode={mode}"] = functools.partial(with_stopcock, mode)
    return found


def run(quick: bool = False) -> Section:
    config = QUICK if quick else FULL
    columns = ["model", "call", "{unit}/s (median)", "ratio to plain", "middle half", "ratio, best runs"]
    text = Table("Text generation: tokens/s, greedy, batch 1", [c.format(unit="tokens") for c in columns])
    image = Table("Denoising: steps/s of the whole call", [c.format(unit="steps") for c in columns])
    data: dict[str, Any] = {"text": {}, "image": {}}
    n = config.new_tokens

    def generate_kwargs() -> dict[str, Any]:
        return {"max_new_tokens": n, "min_new_tokens": n, "do_sample": False}

    for i, (n_layer, n_embd, n_head) in enumerate(config.text_models):
        model, tokenizer = text_model(n_layer, n_embd, n_head)
        ids = prompt_ids(tokenizer, 16)
        label = f"GPT-2 {n_layer}x{n_embd}"
        found = arms("model.generate", model.generate, model, (ids,), generate_kwargs)
        data["text"][label] = compare(text, label, n, found, config.reps)
        if i == 0:  # the pipeline adds a fixed cost per call, not per step: the smallest model shows it
            pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
            label += ", text-generation pipeline"
            found = arms("pipe(...)", pipe, pipe, (tokenizer.decode(ids[0]),), generate_kwargs)
            data["text"][label] = compare(text, label, n, found, config.reps)

    def image_kwargs() -> dict[str, Any]:
        return {"num_inference_steps": config.image_steps, "generator": torch.Generator().manual_seed(0)}

    pipe = image_pipeline()
    label = "tiny SD 64x64, DDIM"
    found = arms("pipe(...)", pipe, pipe, ("a red fox",), image_kwargs)
    data["image"][label] = compare(image, label, config.image_steps, found, config.reps)
    checks = Table("Cost of one check, timed directly (best of 5 batches)", ["check", "µs per call", "paid"])
    data["checks"] = check_costs(checks, config.check_calls)
    return Section(
        title="1. Overhead of a stop signal that never fires",
        intro=(
            f"Same model, same inputs, {config.reps} interleaved rounds per arm (rotating order) after"
            f" a warm-up. Text: {config.new_tokens} new tokens from a 16-token prompt. Images:"
            f" {config.image_steps} steps, whole call (text encoding and VAE decode included)."
            " *Ratio* is the throughput of the arm divided by the plain call's in the same round"
            " (median; >1 is faster; *middle half*: the 25th to 75th percentile of the per-round"
            " ratios); *best runs* compares the fastest call of each arm, the least disturbed by"
            " other processes. The target is a ratio within 1% of 1."
        ),
        tables=[text, image, checks],
        notes=[
            "The tiny models make a step as short as possible, so they show the worst case: a fixed"
            " cost per step is the largest fraction of it there. On a shared or busy machine the"
            " end-to-end ratios carry a few percent of noise (see the middle half); the direct"
            " timings of the checks carry much less: divided by a model's step time they give the"
            " per-step overhead of the text path (criterion, plus blocks x hook in abort mode). The"
            " diffusers path also wraps `scheduler.step` (and computes the x0 estimate at each step),"
            " which is not timed separately here.",
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
            ratios = [
                f"{a['ratio']:.3f} {name.split('=')[-1]} (best runs {a['best_ratio']:.3f})"
                for name, a in arms.items()
                if "=" in name
            ]
            lines.append(f"Overhead, {label}: {unit} of `run` / plain call = {', '.join(ratios)}.")
    checks = data["checks"]
    lines.append(
        f"Timed directly: {checks['criterion'] * 1e6:.1f} µs per token for stopcock's stopping criterion,"
        f" {checks['block_hook'] * 1e6:.1f} µs per block for abort mode's pre-hook."
    )
    return lines
