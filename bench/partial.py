"""4. Partial quality: how close is the image of a run stopped early to the full run's image?

``stopcock.run(pipe, ..., stop=max_steps(k), partial=...)`` at 25/50/75% of the steps, decoding
either the raw latents x_t (what diffusers' own interrupt decodes) or the scheduler's estimate of
the clean sample at that step (``partial="denoised"``). Distances to the full run with the same
seed: pixel RMSE and PSNR (images in [0, 1]) and latent MSE.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import stopcock

from .common import CPU, Device, Section, Table, image_pipeline


@dataclass(frozen=True)
class Case:
    label: str
    pipeline: Callable[[Device], Any]  # the pipeline, built on a device
    size: int  # height and width


def _flux(device: Device) -> Any:
    from tiny.image import flux_pipeline

    return device.place(flux_pipeline())


def _sd(scheduler: str, device: Device) -> Any:
    return image_pipeline(scheduler, device)


SD = [Case(f"tiny SD, {s}", functools.partial(_sd, s), 64) for s in ("ddim", "euler", "dpm++")]
FLUX = Case("tiny Flux, flow-match Euler", _flux, 32)


@dataclass(frozen=True)
class Config:
    cases: tuple[Case, ...]
    steps: int
    fractions: tuple[float, ...]


QUICK = Config(cases=(SD[0],), steps=4, fractions=(0.5,))
FULL = Config(cases=(*SD, FLUX), steps=20, fractions=(0.25, 0.5, 0.75))


def _rmse(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sqrt(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)))


def _psnr(rmse: float) -> str:
    return "inf" if rmse == 0 else f"{20 * math.log10(1.0 / rmse):.1f}"


def _latent_mse(a: Any, b: Any) -> float:
    if a.shape != b.shape:
        raise ValueError(f"latents of different shapes: {tuple(a.shape)} vs {tuple(b.shape)}")
    return float(torch.mean((a.double().cpu() - b.double().cpu()) ** 2))


def measure_case(
    case: Case, steps: int, fractions: tuple[float, ...], table: Table, device: Device = CPU
) -> dict[str, Any]:
    """Add the rows of one pipeline: the other-seed scale, then raw and denoised at each fraction."""
    pipe = case.pipeline(device)
    def kwargs(seed: int = 0) -> dict[str, Any]:
        return {"num_inference_steps": steps, "height": case.size, "width": case.size,
                "generator": torch.Generator().manual_seed(seed)}

    prompt = "a red fox"
    full = pipe(prompt, output_type="np", **kwargs()).images[0]
    full_latents = pipe(prompt, output_type="latent", **kwargs()).images
    other = pipe(prompt, output_type="np", **kwargs(seed=1)).images[0]
    scale = _rmse(full, other)
    table.add(
        case.label, "full run, another seed (for scale)", steps, "", f"{scale:.4f}", _psnr(scale), "", ""
    )
    data: dict[str, Any] = {"another_seed_rmse": scale, "stops": []}
    for fraction in fractions:
        k = max(1, round(fraction * steps))
        for partial in ("raw", "denoised"):
            outcome = stopcock.run(
                pipe, prompt, stop=stopcock.max_steps(k), partial=partial, output_type="np", **kwargs()
            )
            if not outcome.stopped or outcome.output is None:
                raise RuntimeError(f"{case.label}: the run did not stop with an image: {outcome.summary()}")
            rmse = _rmse(outcome.output.images[0], full)
            latent = _latent_mse(outcome.latents, full_latents)
            data["stops"].append({"fraction": fraction, "asked": partial, "got": outcome.partial,
                                  "steps": outcome.steps, "rmse": rmse, "latent_mse": latent})
            table.add(case.label, f"stopped at {fraction:.0%}, partial={partial}", f"{outcome.steps}",
                      outcome.partial, f"{rmse:.4f}", _psnr(rmse), f"{latent:.4f}", outcome.detail or "")
    return data


def run(quick: bool = False, device: Device = CPU) -> Section:
    c = QUICK if quick else FULL
    table = Table(
        "Distance of the partial result to the full run's (same seed)",
        ["pipeline", "run", "steps", "decoded", "pixel RMSE", "PSNR dB", "latent MSE", "detail"],
    )
    data = {case.label: measure_case(case, c.steps, c.fractions, table, device) for case in c.cases}
    notes = [
        "**The weights are random**, so the full run's image is not a picture of anything and the"
        " denoiser's noise prediction is not a real one: these numbers show that the partial result is"
        " produced and how far it is from the completed run, not how useful a preview a trained model"
        " would give. With trained weights the denoised estimate is the usual preview image. The random"
        " VAE also maps very different latents to similar images (compare the pixel numbers with the"
        " *another seed* row); the latent MSE is the sharper measure here.",
        "*Decoded* is what `Outcome.partial` reports was decoded (the adapter falls back to raw and says so"
        " in *detail* when the scheduler gives no estimate).",
    ]
    return Section(
        title="4. Partial quality",
        intro=(
            f"{c.steps} steps, stopped with `stop=max_steps(k)` at"
            f" {', '.join(f'{f:.0%}' for f in c.fractions)} of them; the partial image (`output_type=\"np\"`)"
            " and `Outcome.latents` are compared with the full run with the same seed. Lower RMSE and"
            " latent MSE, higher PSNR: closer to the full run."
        ),
        tables=[table],
        notes=notes,
        data=data,
        headline=_headline(data),
    )


def _headline(data: dict[str, Any]) -> list[str]:
    """One line: latent MSE to the full run at 50% of the steps, raw vs denoised, per pipeline."""
    parts = []
    for label, d in data.items():
        half = {s["asked"]: s for s in d["stops"] if s["fraction"] == 0.5}
        if {"raw", "denoised"} <= half.keys():
            parts.append(f"{label} {half['raw']['latent_mse']:.3g} vs {half['denoised']['latent_mse']:.3g}")
    what = "Stopped at 50% (random weights), latent MSE to the full run, raw x_t vs denoised"
    return [f"{what}: {'; '.join(parts)}."] if parts else []
