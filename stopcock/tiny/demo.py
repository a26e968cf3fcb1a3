"""The built-in demo models: ``demo_model("text")`` and ``demo_model("image")``.

Each returns a folder that ``from_pretrained`` loads offline. The text model is trained and ships
with the package (``demo_text/``, made by :mod:`stopcock.tiny.train`). The image model has random
weights and is built on first use into ``$XDG_CACHE_HOME/stopcock`` (default
``~/.cache/stopcock``); the folder name carries :data:`DEMO_VERSION`, so a changed builder never
reuses an old build. It is built in a temporary folder beside its final place and renamed into
place in one atomic step: an interrupted build leaves no half-written model, and concurrent
builders agree on one result.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["DEMO_VERSION", "DESCRIPTIONS", "KINDS", "TEXT_MODEL", "cache_dir", "demo_model"]

#: Bump when a builder changes what it builds.
DEMO_VERSION = "1"


#: The trained demo text model, shipped with the package.
TEXT_MODEL = Path(__file__).with_name("demo_text")


def _build_image(folder: Path) -> Path:
    from .image import build_image_model

    return build_image_model(folder)


KINDS = ("text", "image")

#: What the demo models are, said plainly wherever they are used.
DESCRIPTIONS = {
    "text": "a tiny GPT-2 (2 layers, 0.2M parameters) trained on the Zen of Python",
    "image": "a tiny Stable Diffusion with random weights (its images are noise)",
}


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/stopcock``, or ``~/.cache/stopcock``."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "stopcock"


def demo_model(kind: str) -> Path:
    """The folder of the demo model ``kind`` ("text" or "image"); the image model is built on first use."""
    if kind not in KINDS:
        raise ValueError(f"demo model kind must be one of {KINDS}, got {kind!r}")
    if kind == "text":
        return TEXT_MODEL
    folder = cache_dir() / f"demo-image-v{DEMO_VERSION}"
    if folder.is_dir():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        _build_image(staging)
        try:
            staging.rename(folder)
        except OSError:
            if not folder.is_dir():  # not a lost race with another builder: a real failure
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder
