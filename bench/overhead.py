"""1. Overhead: throughput of ``stopcock.run(..., stop=StopSignal())`` vs the plain call, same model.

A stop signal that never fires costs one condition check per step (and, in abort mode, one check
per block). The arms are interleaved in rotating order; the ratio is the median of the per-round
ratios to the plain call, so drift in machine load cancels.
"""

from __future__ import annotations

import functools
import time
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
    blocks,
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
FULL = Config(
    text_models=((2, 64, 2), (12, 384, 6)), new_tokens=64, image_steps=20, reps=15, check_calls=5000
)


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


Arms = dict[str, Callable[[], tuple[float, float]]]  # name -> a call timed: (wall, CPU) seconds


def clocked(fn: Callable[[], object]) -> tuple[float, float]:
    """Wall-clock and CPU seconds of ``fn()`` on this thread (with one torch thread, all its work).

    CPU time leaves out the time other processes held the core, so it stays steady on a busy machine.
    """
    wall, cpu = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - wall, time.thread_time() - cpu


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[round(q * (len(ordered) - 1))]


def compare(table: Table, label: str, steps: int, timers: Arms, reps: int) -> dict:
    """Time the arms (the first is the plain call), add one row per arm, return the raw numbers."""
    times = interleaved(timers, reps)
    plain = times[next(iter(times))]
    out: dict[str, Any] = {}
    for name, values in times.items():
        # throughput ratios per round, from wall-clock and from CPU time
        ratios = [p[0] / v[0] for p, v in zip(plain, values, strict=True)]
        cpu_ratios = [p[1] / v[1] for p, v in zip(plain, values, strict=True)]
        seconds = median([v[0] for v in values])
        out[name] = {"ratio": median(ratios), "cpu_ratio": median(cpu_ratios), "seconds": seconds}
        table.add(
            label,
            name,
            f"{steps / seconds:.1f}",
            f"{median(ratios):.3f}",
            f"{_quantile(ratios, 0.25):.3f} to {_quantile(ratios, 0.75):.3f}",
            f"{median(cpu_ratios):.3f}",
        )
    return out


def arms(name: str, plain: Callable[..., Any], target: Any, args: tuple[Any, ...],
         kwargs: Callable[[], dict[str, Any]]) -> Arms:
    """The plain call and ``stopcock.run`` in both modes with a signal that never fires, each timed.

    ``kwargs`` is called afresh for every call (e.g. a new seeded generator).
    """
    def with_stopcock(mode: str) -> tuple[float, float]:
        return clocked(lambda: stopcock.run(target, *args, stop=stopcock.StopSignal(), mode=mode, **kwargs()))

    found: Arms = {f"plain `{name}`": lambda: clocked(lambda: plain(*args, **kwargs()))}
    for mode in ("finish", "abort"):
        found[f"`run`, mode={mode}"] = functools.partial(with_stopcock, mode)
    return found


def run(quick: bool = False) -> Section:
    config = QUICK if quick else FULL
    columns = ["model", "call", "{unit}/s (median)", "ratio to plain", "middle half", "CPU-time ratio"]
    text = Table("Text generation: tokens/s, greedy, batch 1", [c.format(unit="tokens") for c in columns])
    image = Table("Denoising: steps/s of the whole call", [c.format(unit="steps") for c in columns])
    data: dict[str, Any] = {"text": {}, "image": {}, "implied": {}}
    n = config.new_tokens
    checks = Table("Cost of one check, timed directly (best of 5 batches)", ["check", "µs per call", "paid"])
    costs = data["checks"] = check_costs(checks, config.check_calls)
    implied = Table(
        "Per-token overhead implied by the direct timings (generate)",
        ["model", "plain ms per token", "hooked blocks", "finish: criterion", "abort: criterion + hooks"],
    )

    def generate_kwargs() -> dict[str, Any]:
        return {"max_new_tokens": n, "min_new_tokens": n, "do_sample": False}

    for i, (n_layer, n_embd, n_head) in enumerate(config.text_models):
        model, tokenizer = text_model(n_layer, n_embd, n_head)
        ids = prompt_ids(tokenizer, 16)
        label = f"GPT-2 {n_layer}x{n_embd}"
        found = arms("model.generate", model.generate, model, (ids,), generate_kwargs)
        data["text"][label] = compare(text, label, n, found, config.reps)
        per_token = data["text"][label][next(iter(found))]["seconds"] / n
        hooked = len(blocks(model)) + 1  # abort mode hooks the blocks and the model itself
        finish = costs["criterion"] / per_token
        abort = (costs["criterion"] + hooked * costs["block_hook"]) / per_token
        data["implied"][label] = {"finish": finish, "abort": abort}
        implied.add(label, f"{per_token * 1e3:.2f}", hooked, f"{finish:.2%}", f"{abort:.2%}")
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
    return Section(
        title="1. Overhead of a stop signal that never fires",
        intro=(
            f"Same model, same inputs, {config.reps} interleaved rounds per arm (rotating order) after"
            f" a warm-up. Text: {config.new_tokens} new tokens from a 16-token prompt. Images:"
            f" {config.image_steps} steps, whole call (text encoding and VAE decode included)."
            " *Ratio* is the throughput of the arm divided by the plain call's in the same round"
            " (median; >1 is faster; *middle half*: the 25th to 75th percentile of the per-round"
            " ratios). The *CPU-time ratio* is the same from the CPU time of the calling thread (with"
            " one torch thread it does all the work), which leaves out the time other processes held"
            " the core. The target is a ratio within 1% of 1; on a shared machine the rounds scatter by"
            " more than that (see the middle half), so the last two tables time the checks a run adds"
            " directly and divide them by the model's own step time."
        ),
        tables=[text, image, checks, implied],
        notes=[
            "The tiny models make a step as short as possible, so they show the worst case: a fixed"
            " cost per step is the largest fraction of it there.",
            "The implied overhead covers what a run adds at every token (the criterion, and in abort"
            " mode a pre-hook per block and on the model); *plain ms per token* is the plain call's"
            " median time divided by its tokens. Setting up a run (criteria, hooks) is a fixed cost per"
            " call on top. The diffusers path adds a wrapped `scheduler.step` per step (with the x0"
            " estimate), which is not timed separately: see the denoising table.",
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
                f"{a['ratio']:.3f} {name.split('=')[-1]} (CPU time {a['cpu_ratio']:.3f})"
                for name, a in arms.items()
                if "=" in name
            ]
            lines.append(f"Overhead, {label}: {unit} of `run` / plain call = {', '.join(ratios)}.")
    checks = data["checks"]
    implied = "; ".join(
        f"{label} {d['finish']:.2%} finish, {d['abort']:.2%} abort" for label, d in data["implied"].items()
    )
    lines.append(
        f"Timed directly: {checks['criterion'] * 1e6:.1f} µs per token for stopcock's stopping criterion,"
        f" {checks['block_hook'] * 1e6:.1f} µs per block for abort mode's pre-hook; per token: {implied}."
    )
    return lines
