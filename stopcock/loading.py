"""Loading models for the CLI, the demo and the server: a folder or hub id in, a ready model out.

Every failure is a one-line :class:`~stopcock.errors.UserError` that names the fix (a missing
folder, an id that cannot be fetched offline), never a traceback.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .errors import UsageError, UserError, first_line

__all__ = [
    "DEMO_THREADS",
    "check_steps",
    "import_loaders",
    "is_demo_model",
    "load_image_pipeline",
    "load_text_model",
    "resolve_model",
    "without_noise",
]

_HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")

#: Torch threads for the built-in demo models (the demo, and the commands' default on them): they are
#: tiny, so a step is a few small matrix products and more threads only add synchronisation (on a busy
#: machine, many times slower).
DEMO_THREADS = 1


def is_demo_model(spec: str) -> bool:
    """Whether ``spec`` (as :func:`resolve_model` returns it) is one of the built-in demo models."""
    from .tiny.demo import KINDS, demo_model

    path = Path(spec).expanduser()
    return path.is_dir() and any(path.resolve() == demo_model(kind).resolve() for kind in KINDS)


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
    ``quiet`` (always for a built-in demo model) hides the libraries' loading bars and notices meanwhile;
    the notices that say nothing to a user of stopcock are dropped in any case (:data:`_NOISE`), for
    this load only."""
    with contextlib.ExitStack() as stack:
        if quiet or is_demo_model(spec):
            stack.enter_context(_quiet_libraries())
        stack.enter_context(without_noise(("transformers.utils.import_utils",)))
        try:
            _check_offline(spec)
            yield
        except (OSError, ValueError) as exc:
            raise UserError(_load_error(spec, exc)) from None


#: Notices the libraries print while loading that a stopcock user cannot act on: transformers' fallback to
#: the PIL image processors where torchvision is not installed (a CLIP or SigLIP processor, which a
#: text-to-image pipeline carries and stopcock never calls), and diffusers' Stable Diffusion licence
#: paragraph for a pipeline loaded without the safety checker its folder does not have.
_NOISE = (
    "requires torchvision (not installed); falling back to",
    "You have disabled the safety checker for",
)


class _DropNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        return not any(part in message for part in _NOISE)


@contextlib.contextmanager
def without_noise(loggers: tuple[str, ...]) -> Iterator[None]:
    """Drop :data:`_NOISE` from ``loggers`` (logger names, e.g. a pipeline class's module) meanwhile:
    a filter on the logger that makes the record (not on a handler), so it holds wherever the record
    would go, and the user's own logging is left alone."""
    noise = _DropNoise()
    targets = [logging.getLogger(name) for name in dict.fromkeys(loggers)]
    for logger in targets:
        logger.addFilter(noise)
    try:
        yield
    finally:
        for logger in targets:
            logger.removeFilter(noise)


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


def _offline() -> str | None:
    """The variable that puts the Hugging Face libraries offline, where one does."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(name, "").lower() in ("1", "true", "yes", "on"):
            return name
    return None


def _check_offline(spec: str) -> None:
    """Offline, a hub id loads only from the local Hugging Face cache: one that is not there is a
    one-line :class:`UserError` naming the id and the fix, before the libraries try (and print)."""
    offline = _offline()
    if Path(spec).expanduser().is_dir() or offline is None:
        return
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        snapshot_download(spec, local_files_only=True)
    except LocalEntryNotFoundError:
        raise UserError(
            f"{spec!r} is not a local folder, and {offline} is set: it is not in the local Hugging Face"
            " cache, and nothing is downloaded. Pass a local folder (the model saved with save_pretrained),"
            f" or unset {offline} to download it"
        ) from None


#: Sentences of the libraries' errors that point at something the one-line error does not show.
_POINTERS = re.compile(r"\s*(Please )?check out the root cause in the stacktrace above\.?", re.IGNORECASE)


def _load_error(spec: str, exc: BaseException) -> str:
    line = _POINTERS.sub("", first_line(exc)).strip()
    if Path(spec).is_dir():
        return f"cannot load the model in {spec}: {line}"
    offline = _offline()
    hint = (
        f"{offline} is set, so nothing is downloaded: pass a local folder, or unset {offline}"
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


def load_text_model(spec: str, *, quiet: bool = False, sharded: bool = False) -> tuple[Any, Any]:
    """A causal LM and its tokenizer, on CPU, in eval mode; ``sharded``: split over the ranks of the
    process group this process has joined (transformers' tensor parallelism, ``tp_plan="auto"``)."""
    with _loading(spec, quiet=quiet):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(spec)
        options: dict[str, Any] = {}
        if sharded:  # over every rank of the group (the tp size is not read from the environment)
            import torch.distributed as dist
            from transformers.distributed import DistributedConfig

            options["distributed_config"] = DistributedConfig(tp_plan="auto", tp_size=dist.get_world_size())
        model = AutoModelForCausalLM.from_pretrained(spec, **options).eval()
    return model, tokenizer


def load_image_pipeline(spec: str, *, quiet: bool = False) -> Any:
    """A diffusers pipeline with its own progress bar off (the CLI and the server draw their own)."""
    with _loading(spec, quiet=quiet):
        from diffusers import DiffusionPipeline

        with without_noise((_pipeline_module(DiffusionPipeline, spec),)):  # where its class logs from
            pipe = DiffusionPipeline.from_pretrained(spec)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _pipeline_module(loader: Any, spec: str) -> str:
    """The module of the pipeline class that ``spec``'s ``model_index.json`` names ("diffusers" if it
    names none that diffusers has)."""
    import diffusers

    name = loader.load_config(spec).get("_class_name")
    cls = getattr(diffusers, name, None) if isinstance(name, str) else None
    return str(getattr(cls, "__module__", "diffusers"))


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
