"""Ctrl+C keeps the partial result: a long image run that a press stops, and saves what it made.

    python examples/ctrl_c.py            # press Ctrl+C once during the run
    python examples/ctrl_c.py --steps 50 --prompt 3 --out three.png

``stop=stopcock.interrupted()`` handles Ctrl+C for the span of the run only: the first press stops
it at the next step with reason ``"interrupted"`` and ``run()`` returns the Outcome with the partial
image; a second press raises ``KeyboardInterrupt`` at once. It uses the demo image model that ships
with stopcock (16x16 handwritten digits, prompts "0" to "9"), so it runs offline.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import stopcock
from stopcock.loading import load_image_pipeline, resolve_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompt", default="7", help="the digit to draw, '0' to '9' (default: 7)")
    parser.add_argument("--steps", type=int, default=1000, help="denoising steps (default: 1000)")
    parser.add_argument("--out", default="ctrl_c.png", help="where to save the image (default: ctrl_c.png)")
    parser.add_argument("--json", action="store_true", help="print the Outcome's summary as JSON")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)  # a tiny model: more threads only add synchronisation
    pipe = load_image_pipeline(resolve_model(None, "image"), quiet=True)

    def progress(state: stopcock.StepState) -> None:
        print(f"\rstep {state.step}/{state.total}", end="", file=sys.stderr, flush=True)

    print("Press Ctrl+C to stop and keep the partial image (twice to abort at once).", file=sys.stderr)
    outcome = stopcock.run(
        pipe, args.prompt, num_inference_steps=args.steps, generator=torch.Generator().manual_seed(0),
        partial="denoised", stop=stopcock.interrupted(), on_step=progress,
    )
    print(file=sys.stderr)
    outcome.output.images[0].resize((256, 256), 0).save(args.out)  # 0: nearest, crisp pixels
    print(json.dumps(outcome.summary()) if args.json else f"{outcome.describe()}; saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
