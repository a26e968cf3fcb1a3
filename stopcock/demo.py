"""``stopcock demo``: every stop path, shown on the tiny offline demo models.

Each run prints what it did and a readable summary of its Outcome, and is checked against what it
must show: the demo exits 1 if a run ends differently, so ``make demo`` is also a smoke test.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .conditions import StopLike, max_steps, stop_strings, timeout
from .files import save_png, writable
from .loading import DEMO_THREADS, load_image_pipeline, load_text_model, resolve_model
from .outcome import Outcome
from .runner import run
from .signal import StopSignal
from .state import StepState
from .tiny.demo import DESCRIPTIONS

IMAGE_STEPS = 20
STOP_AT = 8
SEED = 0
PROMPT_IMAGE = "7"  # the demo image model draws the digit it is asked for


class Demo:
    """Runs the demo's examples, printing each and recording whether it ended as it must."""

    def __init__(self) -> None:
        self.failures: list[str] = []

    def show(self, title: str, outcome: Outcome, expected: str, unit: str, output: str | None = None) -> None:
        print(f"\n{title}")
        if output is not None:
            print(f"  output: {output}")
        print(f"  outcome: {outcome.describe(unit)}")
        if outcome.reason != expected:
            self.failures.append(f"{title}: expected reason {expected!r}, got {outcome.reason!r}")
            print(f"  UNEXPECTED: the reason should be {expected!r}")

    # -- text ------------------------------------------------------------------------------------
    def text(self) -> None:
        model, tokenizer = load_text_model(resolve_model(None, "text"), quiet=True)

        def generate(prompt: str, stop: StopLike, max_new_tokens: int,
                     on_step: Callable[[StepState], object] | None = None) -> tuple[Outcome, str]:
            inputs = tokenizer(prompt, return_tensors="pt")
            outcome = run(model, **inputs, max_new_tokens=max_new_tokens, tokenizer=tokenizer, stop=stop,
                          on_step=on_step)
            new = outcome.output[0, inputs["input_ids"].shape[1]:]
            return outcome, repr(prompt + tokenizer.decode(new, skip_special_tokens=True))

        outcome, text = generate("Beautiful is", stop_strings(["."]), 100)
        self.show('1. Text, stopped by a stop string: stop=stopcock.stop_strings(["."])', outcome,
                  "stop_string", "token", text)

        outcome, text = generate("The Zen of Python", timeout(0.05), 1000)
        self.show("2. Text, stopped by a timeout: stop=stopcock.timeout(0.05), max_new_tokens=1000", outcome,
                  "timeout", "token", text)

        button = StopSignal()
        eight_tokens_out = threading.Event()

        def press() -> None:
            eight_tokens_out.wait()
            button.stop("user")

        def watch(state: StepState) -> None:
            if state.step == 8:
                eight_tokens_out.set()

        presser = threading.Thread(target=press)
        presser.start()
        try:
            outcome, text = generate("Errors should", button, 1000, on_step=watch)
        finally:
            eight_tokens_out.set()  # the presser never waits past the run, however it ended
            presser.join()
        self.show("3. Text, stopped from another thread (a Stop button) once 8 tokens were out:"
                  " stop=signal, signal.stop() in the other thread", outcome, "user", "token", text)

    # -- image -----------------------------------------------------------------------------------
    def image(self, out: Path) -> None:
        import torch

        pipe = load_image_pipeline(resolve_model(None, "image"), quiet=True)

        def generate(**options: Any) -> Outcome:
            generator = torch.Generator("cpu").manual_seed(SEED)
            return run(pipe, PROMPT_IMAGE, num_inference_steps=IMAGE_STEPS, generator=generator, **options)

        full = generate()
        self.show(f"4. Image of {PROMPT_IMAGE!r}, the full run ({IMAGE_STEPS} steps)", full, "completed",
                  "step")
        raw = generate(stop=max_steps(STOP_AT), partial="raw")
        self.show(f"5. Image, stopped at step {STOP_AT}: stop=stopcock.max_steps({STOP_AT}), partial='raw'"
                  " (the noisy latents as they were)", raw, "max_steps", "step")
        denoised = generate(stop=max_steps(STOP_AT), partial="denoised")
        self.show(f"6. Image, stopped at step {STOP_AT}, partial='denoised' (the model's estimate of the"
                  " clean image at that step)", denoised, "max_steps", "step")
        aborted = generate(stop=max_steps(STOP_AT), mode="abort")
        self.show(f"7. Image, aborted at step {STOP_AT}: mode='abort' (no VAE decode; latents only)", aborted,
                  "max_steps", "step", f"output={aborted.output!r}, latents of shape"
                  f" {tuple(aborted.latents.shape) if aborted.latents is not None else None}")

        panels = [("full run", full), (f"stopped at {STOP_AT}: raw", raw),
                  (f"stopped at {STOP_AT}: denoised", denoised)]
        save_png(side_by_side([(label, o.output.images[0]) for label, o in panels]), out,
                 {label: o.summary() for label, o in panels})
        print(f"\n   The full run and the two stopped images, side by side: {out}")


def side_by_side(panels: list[tuple[str, Any]], scale: int = 8) -> Any:
    """One image: the panels enlarged ``scale`` times, left to right, each with its label above."""
    from PIL import Image, ImageDraw

    w, h = panels[0][1].size
    label_height, gap = 16, 8
    sheet = Image.new("RGB", (len(panels) * (w * scale + gap) - gap, h * scale + label_height), "white")
    draw = ImageDraw.Draw(sheet)
    for i, (label, image) in enumerate(panels):
        x = i * (w * scale + gap)
        draw.text((x + 2, 2), label, fill="black")
        sheet.paste(image.resize((w * scale, h * scale), Image.Resampling.NEAREST), (x, label_height))
    return sheet


def run_demo(out: Path, threads: int = DEMO_THREADS) -> int:
    """Run the whole demo on ``threads`` torch threads; 0 if every run ended as it must, else 1."""
    import torch

    writable(out)  # a bad --out fails now, not after the runs
    torch.set_num_threads(threads)
    print(f"stopcock demo: every stop path, offline, on tiny models (torch threads: {threads})")
    for kind, description in DESCRIPTIONS.items():
        print(f"  {kind} model: {description}")
    demo = Demo()
    demo.text()
    demo.image(out)
    if demo.failures:
        print("\nThe demo did not go as it must:\n  " + "\n  ".join(demo.failures))
        return 1
    print("\nEvery run ended for the reason it should. Now try Ctrl+C on a long run (once: stop at the next"
          " step\nand save the partial image; twice: abort now):  stopcock image --prompt 3 --steps 1000")
    return 0
