"""2. Stop latency: from ``stop()`` on another thread to the call returning.

Each scenario runs one pipeline four ways, interleaved: without a stop (the rest of the run, for
scale), with the library's native way to stop (diffusers: a ``callback_on_step_end`` that sets
``pipe._interrupt``; transformers: a ``StoppingCriteria`` reading a flag), and with
``stopcock.run`` in finish and abort mode. A forward pre-hook on a chosen block fires a trigger at
a chosen step; a second thread waiting on it calls ``stop()``, so every arm is stopped at the same
point of the same step.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import stopcock

from .common import (
    CPU,
    RANDOM_WEIGHTS,
    Device,
    Probe,
    Section,
    Table,
    blocks,
    image_pipeline,
    interleaved,
    median,
    ms,
    prompt_ids,
    stop_from_thread,
    text_model,
)

# An arm, set up afresh for each repetition: (the call, how to stop it, steps done from its result,
# or None to count the denoiser's / model's forwards instead).
ArmSetup = tuple[Callable[[], Any], Callable[[], object], Callable[[Any], int] | None]


@dataclass
class Scenario:
    """One pipeline, one stop moment: the ``at_call``-th forward of ``trigger``."""

    label: str
    target: Any  # what ``stopcock.run`` is given
    call: Callable[..., Any]  # the plain call: the pipeline itself, or ``model.generate``
    args: tuple[Any, ...]
    kwargs: Callable[[], dict[str, Any]]  # fresh per call (e.g. a new seeded generator)
    total: int  # steps of the run without a stop
    clock: nn.Module  # called once per step
    trigger: nn.Module  # the stop lands just before this module's ``at_call``-th forward
    at_call: int
    where: str  # the trigger, in words
    native_name: str
    native: Callable[[Scenario], ArmSetup]
    n_blocks: int = 0
    device: Device = CPU
    results: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def probe(self) -> Probe:
        return Probe(self.clock, self.trigger, self.at_call)


def plain_arm(s: Scenario) -> ArmSetup:
    return (lambda: s.call(*s.args, **s.kwargs())), (lambda: None), None


def stopcock_arm(s: Scenario, mode: str) -> ArmSetup:
    signal = stopcock.StopSignal()

    def steps_of(outcome: stopcock.Outcome) -> int:
        if not outcome.stopped:
            raise RuntimeError(f"stopcock did not report the stop in {s.label}: {outcome.summary()}")
        return outcome.steps

    def call() -> stopcock.Outcome:
        return stopcock.run(s.target, *s.args, stop=signal, mode=mode, **s.kwargs())

    return call, signal.stop, steps_of


def interrupt_arm(s: Scenario) -> ArmSetup:
    """diffusers' documented way: a step-end callback that sets ``pipe._interrupt`` once asked."""
    asked = threading.Event()
    done = [0]

    def on_step_end(pipe: Any, i: int, t: Any, tensors: dict[str, Any]) -> dict[str, Any]:
        done[0] = i + 1
        if asked.is_set():
            pipe._interrupt = True
        return tensors

    def call() -> Any:
        return s.call(*s.args, callback_on_step_end=on_step_end, **s.kwargs())

    return call, asked.set, lambda _: done[0]


def criterion_arm(s: Scenario) -> ArmSetup:
    """transformers' documented way: a ``StoppingCriteria`` that reads a flag after each token."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    asked = threading.Event()

    class Asked(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
            rows = input_ids.shape[0]
            return torch.full((rows,), asked.is_set(), dtype=torch.bool, device=input_ids.device)

    prompt = s.args[0].shape[1]

    def call() -> Any:
        return s.call(*s.args, stopping_criteria=StoppingCriteriaList([Asked()]), **s.kwargs())

    return call, asked.set, lambda out: out.shape[1] - prompt


ARMS = ("no stop (rest of the run)", "native", "stopcock finish", "stopcock abort")


def measure(s: Scenario, reps: int) -> dict[str, list[dict[str, Any]]]:
    """Run every arm ``reps`` times, interleaved (:func:`interleaved`, no warm-up); the raw
    measurements per arm."""
    setups: dict[str, Callable[[], ArmSetup]] = {ARMS[0]: lambda: plain_arm(s)}
    setups[ARMS[1]] = lambda: s.native(s)
    setups[ARMS[2]] = lambda: stopcock_arm(s, "finish")
    setups[ARMS[3]] = lambda: stopcock_arm(s, "abort")

    def once(setup: Callable[[], ArmSetup]) -> dict[str, Any]:
        call, stop, steps_of = setup()
        timing = stop_from_thread(call, stop, s.probe(), s.device)
        return {
            "latency": timing.latency,
            "steps": len(timing.probe.step_starts) if steps_of is None else steps_of(timing.result),
            "reported": getattr(timing.result, "stop_latency", None),  # stopcock's own account
            "forwards_after_stop": timing.steps_started_after_stop(),
            "step_durations": timing.probe.step_durations(),
        }

    arms = {name: functools.partial(once, setup) for name, setup in setups.items()}
    s.results = interleaved(arms, reps, warmup=0)
    return s.results


def unit_seconds(s: Scenario, first: bool) -> float:
    """From the runs without a stop: the first step (``first``, e.g. a prefill) or a later step."""
    runs = s.results[ARMS[0]]
    return median([r["step_durations"][0] if first else median(r["step_durations"][1:]) for r in runs])


def add_rows(table: Table, s: Scenario, unit: float) -> dict[str, Any]:
    """One row per arm: latency in ms, in units, in blocks (unit / blocks), steps done."""
    summary: dict[str, Any] = {"unit_s": unit, "n_blocks": s.n_blocks, "total": s.total}
    for name, runs in s.results.items():
        lat = [r["latency"] for r in runs]
        reported = [r["reported"] for r in runs if r["reported"] is not None]
        row = {
            "latency_s": median(lat),
            "in_units": median(lat) / unit,
            "in_blocks": median(lat) / (unit / s.n_blocks) if s.n_blocks else None,
            "steps": median([r["steps"] for r in runs]),
            "forwards_after_stop": max(r["forwards_after_stop"] for r in runs),
            "reported_s": median(reported) if reported else None,
        }
        summary[name] = row
        display = s.native_name if name == ARMS[1] else name
        table.add(
            s.label,
            display,
            ms(row["latency_s"]),
            f"{ms(min(lat))} to {ms(max(lat))}",
            f"{row['in_units']:.2f}",
            "" if row["in_blocks"] is None else f"{row['in_blocks']:.1f}",
            f"{row['steps']:g} / {s.total}",
            row["forwards_after_stop"],
            "" if row["reported_s"] is None else ms(row["reported_s"]),
        )
    return summary


COLUMNS = ["scenario", "stopped by", "latency ms (median)", "range ms", "in {unit}", "in blocks (≈)"]
COLUMNS += ["steps done", "forwards started after stop()", "`Outcome.stop_latency` ms"]


@dataclass(frozen=True)
class Config:
    image_steps: int
    image_stop_step: int
    text_model: tuple[int, int, int]
    prompt_tokens: int
    reps: int


QUICK = Config(image_steps=4, image_stop_step=2, text_model=(2, 64, 2), prompt_tokens=64, reps=1)
FULL = Config(image_steps=20, image_stop_step=10, text_model=(12, 384, 6), prompt_tokens=900, reps=7)


def image_scenario(label: str, pipe: Any, denoiser: nn.Module, trigger: str, steps: int, stop_step: int,
                   device: Device = CPU, **options: Any) -> Scenario:
    """A pipeline stopped just before ``denoiser``'s submodule ``trigger`` (name it inside a block,
    so the stop lands mid-block) during step ``stop_step + 1``; ``options`` go to every call."""

    def kwargs() -> dict[str, Any]:
        return {"num_inference_steps": steps, "generator": torch.Generator().manual_seed(0), **options}

    return Scenario(
        label=label,
        target=pipe,
        call=pipe,
        args=("a red fox",),
        kwargs=kwargs,
        total=steps,
        clock=denoiser,
        trigger=denoiser.get_submodule(trigger),
        at_call=stop_step,
        where=f"`{trigger}` of the {type(denoiser).__name__}",
        native_name="native `_interrupt` callback",
        native=interrupt_arm,
        n_blocks=len(blocks(denoiser)),
        device=device,
    )


def text_scenario(model_shape: tuple[int, int, int], prompt: int, new_tokens: int, at_call: int,
                  block_fraction: float, label: str | None = None, device: Device = CPU) -> Scenario:
    """Generation stopped before the MLP of a block (after its attention: mid-block), the block at
    ``block_fraction`` of the depth from the first (0) to the last (1), during forward number
    ``at_call`` (0 is the prefill). The label defaults to where the stop lands."""
    model, tokenizer = text_model(*model_shape, device=device)
    layers = blocks(model)
    index = round(block_fraction * (len(layers) - 1))
    where = f"the MLP of block {index + 1} of {len(layers)}"
    return Scenario(
        label=label or f"before {where}",
        target=model,
        call=model.generate,
        args=(prompt_ids(tokenizer, prompt, device),),
        kwargs=lambda: {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False},
        total=new_tokens,
        clock=model,
        trigger=layers[index].get_submodule("mlp"),
        at_call=at_call,
        where=where,
        native_name="native `StoppingCriteria`",
        native=criterion_arm,
        n_blocks=len(layers),
        device=device,
    )


def run(quick: bool = False, device: Device = CPU) -> Section:
    c = QUICK if quick else FULL
    pipe = image_pipeline(device=device)
    image = image_scenario(  # the cross-attention of the UNet's mid block: the middle of its forward
        f"tiny SD 64x64, DDIM, {c.image_steps} steps", pipe, pipe.unet,
        "mid_block.attentions.0.transformer_blocks.0.attn2",
        c.image_steps, c.image_stop_step, device,
    )
    n_layer, n_embd, _ = c.text_model
    prefill = text_scenario(
        c.text_model, c.prompt_tokens, new_tokens=8, at_call=0, block_fraction=0.5,
        label=f"GPT-2 {n_layer}x{n_embd}, {c.prompt_tokens}-token prompt, stop mid-prefill", device=device,
    )
    measure(image, c.reps)
    measure(prefill, c.reps)
    image_table = Table("Diffusers: stop requested in the middle of a denoising step",
                        [col.format(unit="steps") for col in COLUMNS])
    text_table = Table("Transformers: stop requested in the middle of the prefill",
                       [col.format(unit="prefills") for col in COLUMNS])
    data = {
        "image": add_rows(image_table, image, unit_seconds(image, first=False)),
        "prefill": add_rows(text_table, prefill, unit_seconds(prefill, first=True)),
    }
    headline = _headline(data)
    return Section(
        title="2. Stop latency",
        intro=(
            f"From `stop()` on another thread to the call returning; median of {c.reps} runs per arm,"
            " interleaved. A forward pre-hook holds the run until a second thread has called"
            f" `stop()`: diffusers before {image.where} during step {c.image_stop_step + 1} of"
            f" {c.image_steps}; transformers before {prefill.where} in the prefill forward. Both land"
            " mid-block, where abort mode leaves at the next module call. *In steps*"
            " divides by the median step (start to start of the denoiser's forwards) of the runs"
            " without a stop, *in prefills* by their prefill forward; *in blocks* divides that"
            " unit by the number of blocks stopcock hooks (an average block, an approximation)."
            " *Steps done* counts denoising steps or generated tokens. The last column is the latency"
            " stopcock itself reports (median), to compare with the measured one."
        ),
        tables=[image_table, text_table],
        notes=[
            "The native interrupt skips the remaining steps but still runs the VAE decode, and so"
            " does stopcock's finish mode (it returns the pipeline's own output); abort mode returns"
            " at the next module call without decoding (`Outcome.latents` holds the latents).",
            "No stopping criterion runs inside the prefill: the native criterion and finish mode end"
            " after the prefill and one token; abort mode leaves the forward at the next module call.",
            RANDOM_WEIGHTS,
        ],
        data=data,
        headline=headline,
    )


def _headline(data: dict[str, Any]) -> list[str]:
    lines = []
    scenarios = (("image", "a denoising step", "steps"), ("prefill", "a long prefill", "prefills"))
    for key, what, unit in scenarios:
        d = data[key]
        if ARMS[3] not in d:
            continue
        native, finish, abort = d["native"], d[ARMS[2]], d[ARMS[3]]
        lines.append(
            f"Stop latency during {what}: native {ms(native['latency_s'])} ms"
            f" ({native['in_units']:.2f} {unit}), stopcock finish {ms(finish['latency_s'])} ms,"
            f" abort {ms(abort['latency_s'])} ms ({abort['in_units']:.2f} {unit})."
        )
    return lines
