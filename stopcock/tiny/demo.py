"""The built-in demo models: ``demo_model("text")`` and ``demo_model("image")``.

Both are tiny, trained briefly on CPU on data that ships with Python or scikit-learn, and committed
with the package (``demo_text/``, ``demo_image/``; :mod:`tiny.train`, in the repository, made them), so the
demo's output is recognisable and nothing is downloaded or built at run time. Each is a folder that
``from_pretrained`` loads offline.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["DESCRIPTIONS", "KINDS", "demo_model"]

KINDS = ("text", "image")

#: What the demo models are, said plainly wherever they are used.
DESCRIPTIONS = {
    "text": "a tiny GPT-2 (2 layers, 0.2M parameters) trained on the Zen of Python",
    "image": "a tiny Stable Diffusion (0.3M parameters) trained on scikit-learn's 8x8 handwritten digits:"
    " prompts '0' to '9', 16x16 images",
}


def demo_model(kind: str) -> Path:
    """The folder of the demo model ``kind`` ("text" or "image")."""
    if kind not in KINDS:
        raise ValueError(f"demo model kind must be one of {KINDS}, got {kind!r}")
    return Path(__file__).with_name(f"demo_{kind}")
