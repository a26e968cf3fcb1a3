"""The ``stopcock`` command line: ``demo``, ``text``, ``image`` (and ``serve``, from :mod:`stopcock.server`).

Also ``python -m stopcock`` (and ``python -m stopcock.cli``, which runs this same module's :func:`main`).

Ctrl+C once stops the run gracefully at the next step (the partial result is kept and saved,
reason ``"interrupted"``); Ctrl+C again abandons it at once, inside the step in flight (see
:class:`CtrlC`). Exit codes are listed in :data:`EXIT_CODES`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from . import __version__
from .conditions import Condition, max_steps, stop_strings, timeout
from .outcome import Outcome
from .runner import run
from .signal import StopSignal
from .state import StepState

__all__ = ["main", "build_parser", "EXIT_CODES", "CliError", "UsageError"]

EXIT_COMPLETED = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_STOPPED = 3
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a Ctrl+C

EXIT_CODES = {
    EXIT_COMPLETED: "completed (no stop took effect)",
    EXIT_ERROR: "error (e.g. a model that cannot be loaded)",
    EXIT_USAGE: "bad arguments (also --steps more than the model's scheduler can plan)",
    EXIT_STOPPED: "stopped by a condition (--timeout, --stop, --max-steps, --stop-at-step)",
    EXIT_INTERRUPTED: "interrupted by Ctrl+C (once: graceful, twice: aborted)",
}

INTERRUPTED = "interrupted"

JSON_SCHEMA = """\
--json prints one JSON object on stdout when the run ends (nothing else goes to stdout):
  command        "text" or "image"
  model          the model folder or hub id used
  stopped        true when a stop took effect
  reason         why it ended: "interrupted", "timeout", "stop_string", "max_steps", ... when
                 stopped; "completed", "eos" or "length" otherwise
  steps          tokens generated / denoising steps done
  total_steps    the planned number, or null
  elapsed        seconds; stop_latency: seconds from the stop request to the end, or null
  mode           "finish" or "abort" (the mode actually used; a second Ctrl+C makes it "abort")
  partial        image: "denoised" or "raw" when a stopped image was decoded from a partial state
  row_reasons    text: how each row ended, or null
  detail         a sentence when something needs saying, or null
  exit_code      the process exit code
  text           text: the generated text (without the prompt)
  file           image: the PNG written (null if none), with this object in its "stopcock" text chunk
  image          image: "complete", "partial" (decoded from where it stopped) or "latent preview"
                 (a rough preview of the last latents, no VAE decode: abort mode, second Ctrl+C)
  seed           image: the seed"""


def _epilog() -> str:
    codes = "\n".join(f"  {code:<4} {meaning}" for code, meaning in EXIT_CODES.items())
    return f"exit codes:\n{codes}\n\nCtrl+C once: stop at the next step and keep the partial result;" \
        " twice: abort now."


class CliError(Exception):
    """An error the user can fix; printed as one line, no traceback, exit code :attr:`exit_code`."""

    exit_code = EXIT_ERROR


class UsageError(CliError):
    """An argument that the parser could not judge alone (e.g. more steps than the scheduler plans)."""

    exit_code = EXIT_USAGE


# -- models ------------------------------------------------------------------------------------------

_HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")


def resolve_model(spec: str | None, kind: str) -> str:
    """The folder or hub id to load: the built-in demo model when ``spec`` is None."""
    if spec is None:
        from .tiny.demo import demo_model

        return str(demo_model(kind))
    if Path(spec).expanduser().is_dir():
        return str(Path(spec).expanduser())
    if not _HUB_ID.match(spec) or spec.startswith("."):
        raise CliError(f"model folder not found: {spec}")
    return spec


@contextlib.contextmanager
def _loading(spec: str, *, quiet: bool) -> Iterator[None]:
    """Around a ``from_pretrained``: a failure becomes a one-line :class:`CliError` that names the fix;
    ``quiet`` hides the libraries' loading bars and notices meanwhile (noise for a tiny demo model)."""
    with contextlib.ExitStack() as stack:
        if quiet:
            stack.enter_context(_quiet_libraries())
        try:
            yield
        except (OSError, ValueError) as exc:
            raise CliError(_load_error(spec, exc)) from None


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
    first_line = _first_line(exc)
    if Path(spec).is_dir():
        return f"cannot load the model in {spec}: {first_line}"
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    hint = (
        "HF_HUB_OFFLINE is set, so nothing is downloaded: pass a local folder, or unset HF_HUB_OFFLINE"
        if offline
        else "pass a local folder, or check the id and that this machine reaches the Hugging Face Hub"
    )
    return f"{spec!r} is not a local folder and could not be loaded as a hub id ({hint}): {first_line}"


def load_text_model(spec: str, *, quiet: bool = False) -> tuple[Any, Any]:
    """A causal LM and its tokenizer, on CPU, in eval mode."""
    with _loading(spec, quiet=quiet):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(spec)
        model = AutoModelForCausalLM.from_pretrained(spec).eval()
    return model, tokenizer


def check_steps(pipe: Any, steps: int) -> None:
    """Raise :class:`UsageError` before any work if the pipeline's scheduler cannot plan ``steps`` steps
    (diffusers would raise it from inside the pipeline call). Tried on a copy of the scheduler; one that
    cannot plan even 1 step without more arguments (e.g. ``mu`` for dynamic shifting) is left to the
    pipeline, which passes them."""
    import copy

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
                         f" ({_first_line(error)}): pass a smaller --steps")


def writable(path: Path, option: str = "--out") -> Path:
    """``path``, once it is known that a file can be written there: checked before a run, so that no
    work is lost to a bad path."""
    if path.is_dir():
        raise CliError(f"{option} {path} is a folder: give a file name, e.g. {path / 'stopcock.png'}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CliError(f"cannot write {option} {path}: {_first_line(exc)}") from None
    if not os.access(path.parent, os.W_OK):
        raise CliError(f"cannot write {option} {path}: its folder is not writable")
    return path


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def load_image_pipeline(spec: str, *, quiet: bool = False) -> Any:
    """A diffusers pipeline with its own progress bar off (the CLI draws one)."""
    with _loading(spec, quiet=quiet):
        from diffusers import DiffusionPipeline

        pipe = DiffusionPipeline.from_pretrained(spec)
    pipe.set_progress_bar_config(disable=True)
    return pipe


# -- progress, echo, Ctrl+C --------------------------------------------------------------------------


class Progress:
    """The ``on_step`` hook of a CLI run: remembers the last state and shows progress.

    ``style`` is "bar" (one redrawn line), "lines" (one line per step, for logs and for tests
    that follow a run) or "none". ``echo`` is called first with each state (text streaming).
    """

    def __init__(
        self, style: str, *, unit: str = "step", echo: Callable[[StepState], None] | None = None
    ) -> None:
        self.style = style
        self.unit = unit
        self.echo = echo
        self.stream = sys.stderr
        self.last: StepState | None = None
        self.started = time.monotonic()

    def __call__(self, state: StepState) -> None:
        self.last = state
        if self.echo is not None:
            self.echo(state)
        if self.style == "none":
            return
        total = state.total
        eta = state.elapsed / state.step * (total - state.step) if total and state.step else None
        eta_text = "?" if eta is None else f"{eta:.1f}s"
        if self.style == "lines":
            print(f"{self.unit} {state.step}/{total or '?'} elapsed {state.elapsed:.2f}s eta {eta_text}",
                  file=self.stream, flush=True)
            return
        width = 30
        filled = width * state.step // total if total else 0
        bar = f"[{'#' * filled}{'.' * (width - filled)}]" if total else ""
        self.stream.write(f"\r{self.unit} {state.step}/{total or '?'} {bar} eta {eta_text}   ")
        self.stream.flush()

    def close(self) -> None:
        if self.style == "bar" and self.last is not None:
            self.stream.write("\n")
            self.stream.flush()


class TextEcho:
    """Prints the generated text (batch row 0) to ``out`` as tokens arrive.

    Decoding is :class:`stopcock.stream.TextDecoder`'s: a character split across tokens is
    printed whole once complete.
    """

    def __init__(self, tokenizer: Any, prompt_length: int, out: TextIO) -> None:
        from .stream import TextDecoder

        self.decoder = TextDecoder(tokenizer)
        self.seen = prompt_length
        self.out = out

    def __call__(self, state: StepState) -> None:
        if state.input_ids is not None:
            self._show(self.decoder.push(state.input_ids[0, self.seen:].tolist()))
            self.seen = state.input_ids.shape[1]

    def finish(self) -> None:
        self._show(self.decoder.flush() + "\n")

    def _show(self, text: str) -> None:
        if text:
            self.out.write(text)
            self.out.flush()


class CtrlC:
    """SIGINT handling for one command (main thread only), by the phase it is in.

    ``"loading"`` (before the run): ``KeyboardInterrupt`` at once; there is nothing to keep, and the
    command reports that it was interrupted at step 0 (:func:`not_started`).
    ``"running"``: the first press calls ``stop.stop("interrupted")``. The run is in finish mode, so it
    ends at the next step boundary and the library builds its normal (partial) output, which the CLI
    saves. The second press raises ``KeyboardInterrupt`` from the handler. A run started in finish
    mode has no block hooks to abort through, so the exception itself abandons the step in flight,
    wherever the main thread is (inside the model forward, or in the VAE decode); the adapters'
    cleanup runs on the way out. The CLI then reports mode "abort" with what the last finished step
    produced (:func:`abandoned`).
    ``"ended"`` (saving and reporting the result): a press is acknowledged and otherwise ignored, so
    the saved file and the JSON are never cut off half-written.
    Presses during the run and after it write a line to stderr at once.
    """

    def __init__(self) -> None:
        self.stop = StopSignal()
        self.presses = 0  # during the run
        self.phase = "loading"

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.phase == "loading":
            raise KeyboardInterrupt
        if self.phase == "ended":
            _say("\nstopcock: the run has ended: saving and reporting its result first\n")
            return
        self.presses += 1
        if self.presses == 1:
            self.stop.stop(INTERRUPTED)
            _say("\nstopcock: interrupted: stopping at the next step and keeping the partial result"
                 " (Ctrl+C again to abort now)\n")
            return
        _say("\nstopcock: aborting now\n")
        raise KeyboardInterrupt

    @contextlib.contextmanager
    def installed(self) -> Iterator[CtrlC]:
        """Handle SIGINT while the block runs; a no-op off the main thread (Python delivers signals there)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = signal.signal(signal.SIGINT, self)
        try:
            yield self
        finally:
            signal.signal(signal.SIGINT, previous)


def _say(message: str) -> None:
    """Write to stderr from a signal handler: a raw write, never the (maybe busy) buffered stream."""
    with contextlib.suppress(OSError):
        os.write(2, message.encode())


def run_interruptible(
    target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], *, ctrl_c: CtrlC, conditions: list[Condition],
    mode: str, progress: Progress,
) -> Outcome:
    """``stopcock.run`` with Ctrl+C wired to a stop signal (see :class:`CtrlC`, installed by the caller)."""
    ctrl_c.phase = "running"
    try:
        return run(target, *args, stop=[ctrl_c.stop, *conditions], mode=mode, on_step=progress, **kwargs)
    except KeyboardInterrupt:
        if ctrl_c.presses < 2:
            raise
        return abandoned(progress, ctrl_c.stop)
    finally:
        ctrl_c.phase = "ended"
        progress.close()


def abandoned(progress: Progress, stop: StopSignal) -> Outcome:
    """The Outcome of a run abandoned by a second Ctrl+C: what the last finished step left."""
    last = progress.last or StepState()
    now = time.monotonic()
    return Outcome(
        stopped=True,
        reason=INTERRUPTED,
        steps=last.step,
        total_steps=last.total,
        elapsed=now - progress.started,
        stop_latency=None if stop.stopped_at is None else now - stop.stopped_at,
        output=None,
        mode="abort",
        latents=last.latents,
        detail=f"second Ctrl+C: abandoned inside step {last.step + 1}; the result is what the"
        f" {last.step} finished steps produced",
        extra={"input_ids": last.input_ids},
    )


def not_started(mode: str, started: float) -> Outcome:
    """The Outcome of a command interrupted by Ctrl+C before its run began (loading the model)."""
    return Outcome(stopped=True, reason=INTERRUPTED, steps=0, total_steps=None,
                   elapsed=time.monotonic() - started, stop_latency=None, output=None, mode=mode,
                   detail="Ctrl+C while loading the model: nothing was generated")


# -- reporting ---------------------------------------------------------------------------------------


def exit_code(outcome: Outcome) -> int:
    if not outcome.stopped:
        return EXIT_COMPLETED
    return EXIT_INTERRUPTED if outcome.reason == INTERRUPTED else EXIT_STOPPED


def describe(outcome: Outcome, unit: str = "step") -> str:
    """One readable line about an Outcome."""
    total = f" of {outcome.total_steps}" if outcome.total_steps is not None else ""
    head = "stopped" if outcome.stopped else "completed"
    if outcome.reason != "completed":
        head += f" ({outcome.reason})"
    parts = [f"{head} after {outcome.steps}{total} {unit}s in {outcome.elapsed:.3f} s"]
    if outcome.stop_latency is not None:
        parts.append(f"stop latency {outcome.stop_latency * 1000:.1f} ms")
    parts.append(f"mode {outcome.mode}")
    if outcome.partial and outcome.output is not None:
        parts.append(f"partial image: {outcome.partial}")
    text = ", ".join(parts)
    return f"{text}. {outcome.detail}" if outcome.detail else text


def report(outcome: Outcome, fields: dict[str, Any], *, as_json: bool, unit: str) -> int:
    code = exit_code(outcome)
    if as_json:
        print(json.dumps({"command": fields.pop("command"), "model": fields.pop("model"),
                          **outcome.summary(), "exit_code": code, **fields}))
    else:
        print(f"stopcock: {describe(outcome, unit)}", file=sys.stderr)
    return code


def _conditions(args: argparse.Namespace) -> list[Condition]:
    found: list[Condition] = []
    if args.timeout is not None:
        found.append(timeout(args.timeout))
    if getattr(args, "stop", None):
        found.append(stop_strings(args.stop))
    steps = getattr(args, "max_steps", None)
    if steps is None:
        steps = getattr(args, "stop_at_step", None)
    if steps is not None:
        found.append(max_steps(steps))
    return found


def _progress_style(args: argparse.Namespace, echoing: bool) -> str:
    if args.progress != "auto":
        return str(args.progress)
    return "bar" if sys.stderr.isatty() and not echoing else "none"


# -- commands ----------------------------------------------------------------------------------------


def cmd_text(args: argparse.Namespace) -> int:
    started = time.monotonic()
    model_spec = resolve_model(args.model, "text")
    with CtrlC().installed() as ctrl_c:
        try:
            model, tokenizer = load_text_model(model_spec, quiet=args.model is None)
            inputs = tokenizer(args.prompt, return_tensors="pt")
        except KeyboardInterrupt:
            fields = {"command": "text", "model": model_spec, "text": ""}
            return report(not_started(args.mode, started), fields, as_json=args.json, unit="token")
        prompt_length = inputs["input_ids"].shape[1]
        if prompt_length == 0:
            raise UsageError(f"--prompt {args.prompt!r} is no tokens for this model's tokenizer: give some"
                             " text")
        echo = None if args.json else TextEcho(tokenizer, prompt_length, sys.stdout)
        progress = Progress(_progress_style(args, echoing=echo is not None), unit="token", echo=echo)
        outcome = run_interruptible(
            model, (), {**inputs, "max_new_tokens": args.max_new_tokens, "tokenizer": tokenizer},
            ctrl_c=ctrl_c, conditions=_conditions(args), mode=args.mode, progress=progress,
        )
        if echo is not None:
            echo.finish()
        ids = outcome.output if outcome.output is not None else outcome.extra.get("input_ids")
        text = "" if ids is None else tokenizer.decode(ids[0, prompt_length:], skip_special_tokens=True)
        return report(outcome, {"command": "text", "model": model_spec, "text": text}, as_json=args.json,
                      unit="token")


def save_png(image: Any, path: Path, metadata: dict[str, Any]) -> None:
    """Save a PIL image with ``metadata`` as JSON in the PNG text chunk ``stopcock``."""
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    info.add_text("stopcock", json.dumps(metadata))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        image.save(path, pnginfo=info)
    except OSError as exc:
        raise CliError(f"cannot write {path}: {_first_line(exc)}") from None


def image_of(outcome: Outcome) -> tuple[Any, str | None]:
    """The image to save and what it is: the pipeline's ("complete" or "partial"), or, when the run
    ended before any decode (abort mode, a second Ctrl+C), a rough "latent preview" made from the
    last latents without the VAE (:func:`stopcock.stream.latent_preview`)."""
    images = getattr(outcome.output, "images", None)
    if images:
        return images[0], "partial" if outcome.stopped else "complete"
    if outcome.latents is None:
        return None, None
    from .stream import latent_preview

    try:
        return latent_preview(outcome.latents), "latent preview"
    except ValueError:  # latents the linear map does not cover (not 4-channel SD latents)
        return None, None


def cmd_image(args: argparse.Namespace) -> int:
    import torch

    started = time.monotonic()
    model_spec = resolve_model(args.model, "image")
    out = writable(Path(args.out))
    with CtrlC().installed() as ctrl_c:
        try:
            pipe = load_image_pipeline(model_spec, quiet=args.model is None)
        except KeyboardInterrupt:
            return report(not_started(args.mode, started), {"command": "image", "model": model_spec,
                                                            "file": None, "image": None, "seed": args.seed},
                          as_json=args.json, unit="step")
        check_steps(pipe, args.steps)
        progress = Progress(_progress_style(args, echoing=False))
        kwargs: dict[str, Any] = {
            "num_inference_steps": args.steps,
            "generator": torch.Generator("cpu").manual_seed(args.seed),
            "partial": args.partial,
        }
        outcome = run_interruptible(pipe, (args.prompt,), kwargs, ctrl_c=ctrl_c, conditions=_conditions(args),
                                    mode=args.mode, progress=progress)
        image, kind = image_of(outcome)
        fields = {"command": "image", "model": model_spec, "file": None if image is None else str(out),
                  "image": kind, "seed": args.seed}
        if image is not None:
            save_png(image, out, {**outcome.summary(), "exit_code": exit_code(outcome), "image": kind,
                                  "prompt": args.prompt, "model": model_spec, "seed": args.seed})
        if not args.json:
            saved = f"saved the {kind} image to {out}" if image is not None else "no image to save"
            print(f"stopcock: {saved}", file=sys.stderr)
        return report(outcome, fields, as_json=args.json, unit="step")


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(Path(args.out))


# -- parser ------------------------------------------------------------------------------------------


def _number(kind: Callable[[str], Any], minimum: float, what: str, maximum: float = math.inf
            ) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value

    return parse


_SECONDS = _number(float, 0.0, "a number of seconds >= 0")
_COUNT = _number(int, 1, "an integer >= 1")
_STEP = _number(int, 0, "an integer >= 0")
_SEED = _number(int, 0, "a seed: an integer from 0 to 2**64 - 1", maximum=2**64 - 1)


def _stop_string(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("a stop string cannot be empty")
    return text


def _add_common(p: argparse.ArgumentParser, model_kind: str) -> None:
    p.add_argument("--model", metavar="PATH_OR_ID",
                   help=f"a local folder or a hub id (default: the built-in demo {model_kind} model)")
    p.add_argument("--prompt", required=True, help="the prompt")
    p.add_argument("--timeout", type=_SECONDS, metavar="S", help="stop after S seconds")
    p.add_argument("--mode", choices=("finish", "abort"), default="finish",
                   help="finish: end at the next step with the partial result (default); abort: abandon "
                        "the run inside the model at the next block")
    p.add_argument("--json", action="store_true", help="print the Outcome as one JSON object on stdout")
    p.add_argument("--progress", choices=("auto", "bar", "lines", "none"), default="auto",
                   help="progress on stderr: a bar, one line per step, or none (auto: a bar on a terminal"
                        " when nothing else is drawn)")


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="stopcock", description="Stop Hugging Face pipelines the right way.", epilog=_epilog(),
        formatter_class=fmt,
    )
    parser.add_argument("--version", action="version", version=f"stopcock {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = sub.add_parser("demo", help="show every stop path on tiny offline models", epilog=_epilog(),
                          formatter_class=fmt)
    demo.add_argument("--out", default="stopcock-demo.png",
                      help="the PNG comparing the full and the stopped image (default: %(default)s)")
    demo.set_defaults(func=cmd_demo)

    text = sub.add_parser("text", help="generate text, streamed to stdout",
                          epilog=f"{_epilog()}\n\n{JSON_SCHEMA}", formatter_class=fmt)
    _add_common(text, "text")
    text.add_argument("--max-new-tokens", type=_COUNT, default=100, metavar="N", help="default 100")
    text.add_argument("--stop", nargs="+", type=_stop_string, metavar="STR",
                      help="stop when the text contains one of these")
    text.add_argument("--max-steps", type=_STEP, metavar="N", help="stop after N tokens")
    text.set_defaults(func=cmd_text)

    image = sub.add_parser("image", help="generate an image, saved as PNG with the Outcome in its metadata",
                           epilog=f"{_epilog()}\n\n{JSON_SCHEMA}", formatter_class=fmt)
    _add_common(image, "image")
    image.add_argument("--steps", type=_COUNT, default=30, metavar="N", help="denoising steps (default 30)")
    image.add_argument("--out", default="stopcock.png", metavar="FILE", help="default: %(default)s")
    image.add_argument("--stop-at-step", type=_STEP, metavar="K", help="stop after K steps")
    image.add_argument("--partial", choices=("denoised", "raw"), default="denoised",
                       help="a stopped image shows the model's estimate of the clean image (denoised,"
                            " default) or the noisy latents as they were (raw)")
    image.add_argument("--seed", type=_SEED, default=0, metavar="N", help="default 0")
    image.set_defaults(func=cmd_image)

    from .server.serve import add_parser as add_serve_parser  # owned by the server; cheap to import

    add_serve_parser(sub)

    from .lint.cli import add_parser as add_check_parser  # owned by the linter; cheap to import

    add_check_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return int(args.func(args))
    except CliError as exc:
        print(f"stopcock: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("stopcock: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    # ``python -m stopcock.cli`` runs this file as ``__main__``, a second copy of the module beside the
    # ``stopcock.cli`` that the rest of the package imports (whose CliError the server raises): run the
    # real one's main, so that one set of classes is in play.
    from stopcock.cli import main as package_main

    sys.exit(package_main())
