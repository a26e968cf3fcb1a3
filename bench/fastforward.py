"""6. Fast-forward: what the rest of a stopped loop costs once it is fast-forwarded.

A pipeline whose loop never checks ``interrupt`` (LCM, Kandinsky 3: category B) is stopped at step k
of N in finish mode: its remaining N - k iterations still run, with the loop's models answering from
the stop step without computing and the scheduler holding the sample, then it decodes. Each
iteration's end is timestamped by the pipeline's own ``callback_on_step_end``, which it calls at every
iteration, fast-forwarded or not: the medians of the computed and the fast-forwarded iterations of the
same run give the ms per remaining step and its ratio to a computed step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import stopcock

from .common import Section, Table, median


@dataclass(frozen=True)
class Case:
    label: str
    pipeline: Callable[[], Any]
    call: dict[str, Any]


def _lcm() -> Any:
    from tiny.image import lcm_pipeline

    return lcm_pipeline()


def _kandinsky3() -> Any:
    from tiny.image import kandinsky3_pipeline

    return kandinsky3_pipeline()


LCM = Case("tiny LCM 64x64 (UNet)", _lcm, {})
KANDINSKY3 = Case("tiny Kandinsky 3 32x32 (UNet)", _kandinsky3, {"height": 32, "width": 32})


@dataclass(frozen=True)
class Config:
    cases: tuple[Case, ...]
    steps: int
    stop_at: int
    reps: int


QUICK = Config(cases=(LCM,), steps=6, stop_at=2, reps=1)
FULL = Config(cases=(LCM, KANDINSKY3), steps=50, stop_at=10, reps=3)


def _stamper(ends: list[float]) -> Callable[..., dict[str, Any]]:
    """A ``callback_on_step_end`` that records when each iteration ends."""

    def stamp(pipeline: Any, i: int, t: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        ends.append(time.perf_counter())
        return kwargs

    return stamp


def measure(case: Case, config: Config) -> dict[str, Any]:
    """Per-iteration durations of stopped runs: the computed ones and the fast-forwarded ones."""
    pipe = case.pipeline()
    computed: list[float] = []
    forwarded: list[float] = []
    outcomes = []
    for rep in range(config.reps):
        ends: list[float] = []
        stamp = _stamper(ends)
        start = time.perf_counter()
        outcome = stopcock.run(
            pipe, "a red fox", **case.call, num_inference_steps=config.steps, output_type="np",
            generator=torch.Generator().manual_seed(rep), callback_on_step_end=stamp,
            stop=stopcock.max_steps(config.stop_at),
        )
        total = time.perf_counter() - start
        durations = [b - a for a, b in zip([start, *ends], ends, strict=False)]
        computed += durations[1 : config.stop_at]  # the first includes the prompt encoding
        forwarded += durations[config.stop_at :]
        outcomes.append((outcome, total, time.perf_counter() - ends[-1]))
    return {"computed": computed, "forwarded": forwarded, "outcomes": outcomes}


def run(quick: bool = False) -> Section:
    config = QUICK if quick else FULL
    table = Table(
        f"Stopped at step {config.stop_at} of {config.steps} in finish mode"
        f" (medians over {config.reps} run(s))",
        ["pipeline", "path", "ms per computed step", "ms per fast-forwarded step", "ratio",
         "fast-forwarded steps", "ms for the whole tail", "ms decode and output after the loop"],
    )
    section = Section(
        "6. Fast-forward: the cost of the rest of a stopped loop",
        __doc__.split("\n\n", 1)[1].strip().replace("``", "`"),
        tables=[table],
    )
    for case in config.cases:
        found = measure(case, config)
        outcome, _, after = found["outcomes"][-1]
        step, tail = median(found["computed"]), median(found["forwarded"])
        skipped = outcome.extra["fast_forwarded"]
        table.add(case.label, outcome.extra["path"], f"{step * 1000:.2f}", f"{tail * 1000:.3f}",
                  f"{tail / step:.4f}", skipped, f"{tail * skipped * 1000:.2f}", f"{after * 1000:.2f}")
        section.data[case.label] = {**found, "path": outcome.extra["path"], "fast_forwarded": skipped}
        section.headline.append(
            f"Fast-forwarded tail, {case.label}: {tail * 1000:.3f} ms per remaining step against"
            f" {step * 1000:.2f} ms per computed step (ratio {tail / step:.4f})."
        )
    section.notes.append(
        "The fast-forwarded iterations still run the pipeline's own loop body (guidance arithmetic on"
        " the held model output, the callback, the progress bar); no model computes in them."
    )
    return section
