"""Loading models for the CLI, the demo and the server: a folder or hub id in, a ready model out.

Every failure is a one-line :class:`~stopcock.errors.UserError` that names the fix (a missing
folder, an id that cannot be fetched offline), never a traceback.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .errors import UsageError, UserError, first_line

__all__ = ["check_steps", "import_loaders", "load_image_pipeline", "load_text_model", "resolve_model"]

_HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")


def resolve_model(spec: str | None, kind: str) -> str:
    """The folder or hub id to load: the built-in demo model of ``kind`` when ``spec`` is None."""
    if spec is None:
        from .tiny.demo import demo_model

        return str(demo_model(kind))
    if Path(spec).expanduser().is_dir():
        return str(Path(spec).expanduser())
    if not _HUB_ID.match(spec) or spec.startswith("."):
        raise UserError(f"model folder not found: {spec}")
    return spec


@contextlib.contextmanager
def _loading(spec: str, *, quiet: bool) -> Iterator[None]:
    """Around a ``from_pretrained``: a failure becomes a one-line :class:`UserError` that names the fix;
    ``quiet`` hides the libraries' loading bars and notices meanwhile (noise for a tiny demo model)."""
    with contextlib.ExitStack() as stack:
        if quiet:
            stack.enter_context(_quiet_libraries())
        try:
            yield
        except (OSError, ValueError) as exc:
            raise UserError(_load_error(spec, exc)) from None


@contextlib.contextmanager
def _quiet_libraries() -> Iterator[None]:
    import diffusers.utils.logging
    import transformers.utils.logging

    saved = [(m, m.get_verbosity(), m.is_progress_bar_enabled())
             for m in (transformers.utils.logging, diffusers.utils.logging)]
    for module, _, _ in saved:
        module.set_verbosity_error()
        module.disable_progress_bar()
    try:
        yield
    finally:
        for module, verbosity, bars in saved:
            module.set_verbosity(verbosity)
            if bars:
                module.enable_progress_bar()


def _load_error(spec: str, exc: BaseException) -> str:
    line = first_line(exc)
    if Path(spec).is_dir():
        return f"cannot load the model in {spec}: {line}"
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    hint = (
        "HF_HUB_OFFLINE is set, so nothing is downloaded: pass a local folder, or unset HF_HUB_OFFLINE"
        if offline
        else "pass a local folder, or check the id and that this machine reaches the Hugging Face Hub"
    )
    return f"{spec!r} is not a local folder and could not be loaded as a hub id ({hint}): {line}"


def import_loaders(kind: str, *, quiet: bool = False) -> None:
    """Import what loading a ``kind`` ("text" or "image") model imports, without loading one: the CLI
    does it while Ctrl+C is only recorded, and loads while Ctrl+C ends the load at once."""
    if quiet:
        import diffusers.utils.logging  # noqa: F401 - the libraries _quiet_libraries silences
        import transformers.utils.logging  # noqa: F401
    if kind == "text":
        from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401
    else:
        from diffusers import DiffusionPipeline  # noqa: F401


def load_text_model(spec: str, *, quiet: bool = False) -> tuple[Any, Any]:
    """A causal LM and its tokenizer, on CPU, in eval mode."""
    with _loading(spec, quiet=quiet):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(spec)
        model = AutoModelForCausalLM.from_pretrained(spec).eval()
    return model, tokenizer


def load_image_pipeline(spec: str, *, quiet: bool = False) -> Any:
    """A diffusers pipeline with its own progress bar off (the CLI and the server draw their own)."""
    with _loading(spec, quiet=quiet):
        from diffusers import DiffusionPipeline

        pipe = DiffusionPipeline.from_pretrained(spec)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def check_steps(pipe: Any, steps: int) -> None:
    """Raise :class:`UsageError` before any work if the pipeline's scheduler cannot plan ``steps`` steps
    (diffusers would raise it from inside the pipeline call). Tried on a copy of the scheduler; one that
    cannot plan even 1 step without more arguments (e.g. ``mu`` for dynamic shifting) is left to the
    pipeline, which passes them."""
    scheduler = getattr(pipe, "scheduler", None)
    if scheduler is None:
        return

    def refusal(n: int) -> ValueError | None:
        try:
            copy.deepcopy(scheduler).set_timesteps(n)
        except ValueError as exc:
            return exc
        return None

    error = refusal(steps)
    if error is not None and refusal(1) is None:
        raise UsageError(f"--steps {steps}: this model's {type(scheduler).__name__} cannot plan {steps} steps"
                         f" ({first_line(error)}): pass a smaller --steps")
