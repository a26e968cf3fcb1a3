"""Writing results: checked output paths, PNGs that carry their Outcome, base64 PNGs for JSON."""

from __future__ import annotations

import base64
import io
import json
import os
from pathlib import Path
from typing import Any

from .errors import UserError, first_line

__all__ = ["png_base64", "save_png", "writable"]


def writable(path: Path, option: str = "--out") -> Path:
    """``path``, once it is known that a file can be written there: checked before a run, so that no
    work is lost to a bad path."""
    if path.is_dir():
        raise UserError(f"{option} {path} is a folder: give a file name, e.g. {path / 'stopcock.png'}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot write {option} {path}: {first_line(exc)}") from None
    if not os.access(path.parent, os.W_OK):
        raise UserError(f"cannot write {option} {path}: its folder is not writable")
    return path


def save_png(image: Any, path: Path, metadata: dict[str, Any]) -> None:
    """Save a PIL image with ``metadata`` as JSON in the PNG text chunk ``stopcock``."""
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    info.add_text("stopcock", json.dumps(metadata))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        image.save(path, pnginfo=info)
    except OSError as exc:
        raise UserError(f"cannot write {path}: {first_line(exc)}") from None


def png_base64(image: Any) -> str:
    """A PIL image as a base64 PNG (for JSON answers and events)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")
