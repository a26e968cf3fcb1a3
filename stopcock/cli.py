"""The ``stopcock`` command line: ``demo``, ``text``, ``image``, ``resume`` (and ``serve``, from
:mod:`stopcock.server`).

Also ``python -m stopcock`` (and ``python -m stopcock.cli``, which runs this same module's :func:`main`).

Ctrl+C once stops the run gracefully at the next step (the partial result is kept and saved,
reason ``"interrupted"``); Ctrl+C again abandons it at once, inside the step in flight (see
:class:`CtrlC`, installed for the whole command; the ``stopcock`` command catches presses even
earlier, see ``_stopcock_launch``). Exit codes are listed in :data:`EXIT_CODES`; a press at any
moment honours them, and the JSON of ``--json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from . import __version__
from .cli_args import COUNT, SECONDS, SEED, STEP, repetition, stop_string
from .cli_ranks import TextRanks
from .cli_ranks import add_arguments as add_rank_arguments
from .conditions import Condition, from_options
from .console import INTERRUPTED, CtrlC, Progress, TextEcho
from .errors import UsageError, UserError, first_line
from .files import save_png, writable
from .items import run_each
from .loading import (
    DEMO_THREADS,
    check_steps,
    import_loaders,
    is_demo_model,
    load_image_pipeline,
    load_text_model,
    resolve_model,
)
from .outcome import Outcome
from .previews import latent_preview, previewable
from .resume import resume
from .runner import run
from .signal import StopSignal
from .types import MODES, PARTIALS, Mode

__all__ = ["main", "build_parser", "EXIT_CODES", "CliError", "UsageError"]

#: An error the user can fix; printed as one line, no traceback, exit code ``exit_code``.
CliError = UserError

EXIT_COMPLETED = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_STOPPED = 3
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a Ctrl+C

EXIT_CODES = {
    EXIT_COMPLETED: "completed (no stop took effect)",
    EXIT_ERROR: "error (e.g. a model that cannot be loaded)",
    EXIT_USAGE: "bad arguments (also --steps more than the model's scheduler can plan)",
    EXIT_STOPPED: "stopped by a condition (--timeout, --stop, --repetition, --max-steps, --stop-at-step)",
    EXIT_INTERRUPTED: "interrupted by Ctrl+C (once: graceful, twice: aborted)",
}

JSON_SCHEMA = """\
--json prints one JSON object on stdout when the run ends (nothing else goes to stdout):
  command        "text", "image" or "resume"
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
  threads        the torch threads the run used (see --threads)
  text           text: the generated text (without the prompt)
  file           image: the PNG written (null if none), with this object in its "stopcock" text chunk
  image          image: "complete", "partial" (decoded from where it stopped) or "latent preview"
                 (a rough preview of the last latents, no VAE decode: abort mode, second Ctrl+C)
  seed           image: the seed
  checkpoint     image and resume with --checkpoint: the checkpoint file written, or null (completed)
  resumed        resume: from_step, saved_steps (not recomputed), exact (bit-identical), how"""


def _epilog() -> str:
    codes = "\n".join(f"  {code:<4} {meaning}" for code, meaning in EXIT_CODES.items())
    return f"exit codes:\n{codes}\n\nCtrl+C once: stop at the next step and keep the partial result;" \
        " twice: abort now."


def run_interruptible(
    target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], *, ctrl_c: CtrlC, conditions: list[Condition],
    mode: Mode, progress: Progress, call: Callable[..., Outcome] = run,
) -> Outcome:
    """``stopcock.run`` (or ``call``, e.g. a resume) with Ctrl+C wired to a stop signal (see
    :class:`CtrlC`, installed by the caller)."""
    ctrl_c.phase = "running"
    try:
        return call(target, *args, stop=[ctrl_c.stop, *conditions], mode=mode, on_step=progress, **kwargs)
    except KeyboardInterrupt:
        if ctrl_c.presses < 2:
            raise
        return abandoned(progress, ctrl_c.stop)
    finally:
        ctrl_c.phase = "ended"
        progress.close()


def each_prompt(
    prompts: list[str], ctrl_c: CtrlC, one: Callable[[str], tuple[Outcome, dict[str, Any]]]
) -> tuple[Outcome, list[dict[str, Any]]]:
    """``one(prompt)`` for each prompt while the signals allow (:func:`stopcock.items.run_each`): the
    whole sequence's Outcome, and each run's fields for the report."""
    fields: list[dict[str, Any]] = []

    def run_one(prompt: str) -> Outcome:
        outcome, extra = one(prompt)
        fields.append({"prompt": prompt, **outcome.summary(), **extra})
        return outcome

    _, overall = run_each(ctrl_c.stop, prompts, run_one)
    return overall, fields


def abandoned(progress: Progress, stop: StopSignal) -> Outcome:
    """The Outcome of a run abandoned by a second Ctrl+C: what the last finished step left."""
    now = time.monotonic()
    done = progress.last.step if progress.last is not None else 0
    return Outcome.without_output(
        progress.last,
        reason=INTERRUPTED,
        elapsed=now - progress.started,
        stop_latency=None if stop.stopped_at is None else now - stop.stopped_at,
        mode="abort",
        detail=f"second Ctrl+C: abandoned inside step {done + 1}; the result is what the {done} finished"
        " steps produced",
    )


def not_started(mode: Mode, started: float) -> Outcome:
    """The Outcome of a command interrupted by Ctrl+C before its run began (loading the model)."""
    return Outcome.without_output(None, reason=INTERRUPTED, elapsed=time.monotonic() - started, mode=mode,
                                  detail="Ctrl+C while loading the model: nothing was generated")


THREADS_HELP = ("torch threads (default: 1 for the built-in demo models, as `stopcock demo` runs them: a step"
                " of a tiny model is a few small matrix products, and more threads only add synchronisation,"
                " many times slower on a busy machine; for a model you pass, torch's default)")


def set_threads(threads: int | None, spec: str) -> int:
    """Set torch's thread count for the run: ``threads``, else 1 for a built-in demo model, else leave
    torch's default. Returns the count in use."""
    import torch

    if threads is None and is_demo_model(spec):
        threads = DEMO_THREADS
    if threads is not None:
        torch.set_num_threads(threads)
    return int(torch.get_num_threads())


def load_model(ctrl_c: CtrlC, kind: str, spec: str, *, quiet: bool, load: Callable[..., Any] | None = None
               ) -> Any:
    """The ``kind`` model ``spec`` (text: model and tokenizer), loaded by ``load`` (default: the kind's
    loader), with Ctrl+C ending the load at once.

    The libraries are imported first, while a press is only recorded (an import cut short can
    leave a library unusable in this process). ``KeyboardInterrupt`` if Ctrl+C came before or
    during the load.
    """
    if not ctrl_c.stop.stopped:  # pressed already: the command ends without them
        import_loaders(kind, quiet=quiet)
    load = load or (load_text_model if kind == "text" else load_image_pipeline)
    with ctrl_c.interruptible():
        return load(spec, quiet=quiet)


# -- reporting ---------------------------------------------------------------------------------------


def exit_code(outcome: Outcome) -> int:
    if not outcome.stopped:
        return EXIT_COMPLETED
    return EXIT_INTERRUPTED if outcome.reason == INTERRUPTED else EXIT_STOPPED


def report(outcome: Outcome, fields: dict[str, Any], *, as_json: bool, unit: str) -> int:
    code = exit_code(outcome)
    if as_json:
        print(json.dumps({"command": fields.pop("command"), "model": fields.pop("model"),
                          **outcome.summary(), "exit_code": code, **_threads_field(), **fields}))
    else:
        print(f"stopcock: {outcome.describe(unit)}", file=sys.stderr)
    return code


def _threads_field() -> dict[str, int]:
    """The torch threads in use, where torch is loaded (a command ended before loading has none)."""
    torch = sys.modules.get("torch")
    return {} if torch is None else {"threads": int(torch.get_num_threads())}


def _conditions(args: argparse.Namespace) -> list[Condition]:
    try:
        return _from_flags(args)
    except ValueError as exc:  # e.g. --grace without --timeout: the message names the fix
        raise UsageError(str(exc).replace("grace_max", "--grace-max").replace("grace ", "--grace ")) from None


def _from_flags(args: argparse.Namespace) -> list[Condition]:
    steps = getattr(args, "max_steps", None)
    return from_options({
        "timeout": args.timeout,
        "stop_strings": getattr(args, "stop", None),
        "max_steps": getattr(args, "stop_at_step", None) if steps is None else steps,
        "repetition": getattr(args, "repetition", None),
        "grace": getattr(args, "grace", None),
        "grace_max": getattr(args, "grace_max", None),
    })


def _progress_style(args: argparse.Namespace, echoing: bool) -> str:
    if args.progress != "auto":
        return str(args.progress)
    return "bar" if sys.stderr.isatty() and not echoing else "none"


# -- commands ----------------------------------------------------------------------------------------


def read_prompts(args: argparse.Namespace) -> list[str]:
    """The prompts: each ``--prompt``, then the lines of ``--prompts FILE`` (empty lines skipped)."""
    prompts = list(args.prompt or ())
    if args.prompts is not None:
        try:
            text = Path(args.prompts).read_text(encoding="utf-8")
        except (OSError, UnicodeError) as exc:
            raise UsageError(f"--prompts {args.prompts}: cannot read it ({first_line(exc)})") from None
        prompts += [line for line in text.splitlines() if line.strip()]
        if len(prompts) == len(args.prompt or ()):
            raise UsageError(f"--prompts {args.prompts} holds no prompt: write one per line")
    if not prompts:
        raise UsageError("give a prompt: --prompt TEXT (repeatable) or --prompts FILE (one per line)")
    return prompts


def cmd_text(args: argparse.Namespace, ctrl_c: CtrlC) -> int:
    started = time.monotonic()
    prompts = read_prompts(args)
    model_spec = resolve_model(args.model, "text")
    with TextRanks.started(args, model_spec) as ranks:  # --tp N: this process is rank 0 of N
        return _text(args, ctrl_c, started, prompts, model_spec, ranks)


def _text(args: argparse.Namespace, ctrl_c: CtrlC, started: float, prompts: list[str], model_spec: str,
          ranks: TextRanks | None) -> int:
    try:
        model, tokenizer = load_model(ctrl_c, "text", model_spec, quiet=args.model is None,
                                      load=None if ranks is None else ranks.load)
    except KeyboardInterrupt:
        ctrl_c.phase = "ended"
        fields = {"command": "text", "model": model_spec, "text": ""}
        return report(not_started(args.mode, started), fields, as_json=args.json, unit="token")
    set_threads(args.threads, model_spec)
    encoded = [tokenizer(prompt, return_tensors="pt") for prompt in prompts]
    for prompt, inputs in zip(prompts, encoded, strict=True):
        if inputs["input_ids"].shape[1] == 0:
            raise UsageError(f"--prompt {prompt!r} is no tokens for this model's tokenizer: give some"
                             " text")
    tokenized = iter(encoded)

    def one(prompt: str) -> tuple[Outcome, dict[str, Any]]:
        inputs = next(tokenized)
        echo = None if args.json else TextEcho(tokenizer, sys.stdout)
        progress = Progress(_progress_style(args, echoing=echo is not None), unit="token", echo=echo)
        outcome = run_interruptible(
            model, (), {**inputs, "max_new_tokens": args.max_new_tokens, "tokenizer": tokenizer},
            ctrl_c=ctrl_c, conditions=_conditions(args), mode=args.mode, progress=progress,
            call=run if ranks is None else ranks.run,
        )
        if echo is not None:
            echo.finish()
        ids = outcome.output if outcome.output is not None else outcome.extra.get("input_ids")
        prompt_length = inputs["input_ids"].shape[1]
        text = "" if ids is None else tokenizer.decode(ids[0, prompt_length:], skip_special_tokens=True)
        return outcome, {"text": text}

    head = {"command": "text", "model": model_spec}
    if len(prompts) == 1:
        outcome, fields = one(prompts[0])
        return report(outcome, {**head, **fields}, as_json=args.json, unit="token")
    overall, items = each_prompt(prompts, ctrl_c, one)
    return report(overall, {**head, "items": items}, as_json=args.json, unit="token")


def image_of(outcome: Outcome) -> tuple[Any, str | None]:
    """The image to save and what it is: the pipeline's ("complete" or "partial"), or, when the run
    ended before any decode (abort mode, a second Ctrl+C), a rough "latent preview" made from the
    last latents without the VAE (:func:`stopcock.previews.latent_preview`)."""
    images = getattr(outcome.output, "images", None)
    if images:
        return images[0], "partial" if outcome.stopped else "complete"
    if not previewable(outcome.latents):  # none, or latents the linear map does not cover
        return None, None
    return latent_preview(outcome.latents), "latent preview"


def numbered(out: Path, index: int, count: int) -> Path:
    """The PNG of prompt ``index`` (from 1): ``out`` itself for one prompt, else ``out-<index>``."""
    return out if count == 1 else out.with_name(f"{out.stem}-{index}{out.suffix}")


def save_image(outcome: Outcome, out: Path, run: dict[str, Any], *, quiet: bool,
               checkpoint: Path | None = None, notes: dict[str, Any] | None = None) -> dict[str, Any]:
    """Save the run's image, with the Outcome and ``run`` (prompt, model, seed) in its metadata, and,
    when it stopped, its checkpoint to ``checkpoint`` (with ``notes`` for ``stopcock resume``).
    Returns what the report adds: the file, what the image is, and the checkpoint's file."""
    image, kind = image_of(outcome)
    fields: dict[str, Any] = {"file": None if image is None else str(out), "image": kind}
    if checkpoint is not None:
        fields["checkpoint"] = save_checkpoint(outcome, checkpoint, {**run, **(notes or {}), "out": str(out)},
                                               quiet=quiet)
    if image is not None:
        save_png(image, out, {**outcome.summary(), "exit_code": exit_code(outcome), "image": kind, **run})
    if not quiet:
        saved = f"saved the {kind} image to {out}" if image is not None else "no image to save"
        print(f"stopcock: {saved}", file=sys.stderr)
    return fields


def cmd_image(args: argparse.Namespace, ctrl_c: CtrlC) -> int:
    import torch

    started = time.monotonic()
    prompts = read_prompts(args)
    model_spec = resolve_model(args.model, "image")
    outs = [writable(numbered(Path(args.out), i, len(prompts))) for i in range(1, len(prompts) + 1)]
    checkpoint = None if args.checkpoint is None else writable(Path(args.checkpoint), "--checkpoint")
    if checkpoint is not None and len(prompts) > 1:
        raise UsageError("--checkpoint saves the checkpoint of one run: give one prompt")
    try:
        pipe = load_model(ctrl_c, "image", model_spec, quiet=args.model is None)
    except KeyboardInterrupt:
        ctrl_c.phase = "ended"
        return report(not_started(args.mode, started), {"command": "image", "model": model_spec,
                                                        "file": None, "image": None, "seed": args.seed},
                      as_json=args.json, unit="step")
    set_threads(args.threads, model_spec)
    check_steps(pipe, args.steps)
    files = iter(outs)

    def one(prompt: str) -> tuple[Outcome, dict[str, Any]]:
        out = next(files)
        kwargs: dict[str, Any] = {
            "num_inference_steps": args.steps,
            "generator": torch.Generator("cpu").manual_seed(args.seed),  # the same seed for each prompt
            "partial": args.partial,
            "checkpoint": checkpoint is not None,
        }
        progress = Progress(_progress_style(args, echoing=False))
        outcome = run_interruptible(pipe, (prompt,), kwargs, ctrl_c=ctrl_c, conditions=_conditions(args),
                                    mode=args.mode, progress=progress)
        run_info = {"prompt": prompt, "model": model_spec, "seed": args.seed}
        return outcome, save_image(outcome, out, run_info, quiet=args.json, checkpoint=checkpoint,
                                   notes={"partial": args.partial})

    head = {"command": "image", "model": model_spec}
    if len(prompts) == 1:
        outcome, fields = one(prompts[0])
        return report(outcome, {**head, **fields, "seed": args.seed}, as_json=args.json, unit="step")
    overall, items = each_prompt(prompts, ctrl_c, one)
    return report(overall, {**head, "items": items, "seed": args.seed}, as_json=args.json, unit="step")


def save_checkpoint(outcome: Outcome, path: Path, run: dict[str, Any], *, quiet: bool) -> str | None:
    """Save a stopped run's checkpoint with what ``stopcock resume`` needs (``run``: model, prompt,
    seed, output file); returns the path, or None when there is nothing to resume."""
    checkpoint = outcome.checkpoint
    if not outcome.stopped or checkpoint is None:
        if not quiet and outcome.stopped:
            print("stopcock: no checkpoint: the run was abandoned inside a step", file=sys.stderr)
        return None
    checkpoint.notes["cli"] = {"command": "image", **run}
    checkpoint.save(path)
    if not quiet:
        print(f"stopcock: saved a checkpoint at step {checkpoint.steps} to {path}: `stopcock resume {path}`"
              " finishes it", file=sys.stderr)
    return str(path)


def cmd_resume(args: argparse.Namespace, ctrl_c: CtrlC) -> int:
    """Finish the image of a checkpoint saved by ``stopcock image --checkpoint FILE``, by replay: the
    same image as an uninterrupted run. Stopped again (Ctrl+C once), it saves a new checkpoint."""
    from .checkpoint import Checkpoint, CheckpointError

    started = time.monotonic()
    try:
        checkpoint = Checkpoint.load(args.file)
    except (CheckpointError, OSError) as exc:
        raise UserError(f"cannot resume {args.file}: {exc}") from None
    if checkpoint.kind != "diffusers":
        raise UsageError(f"{args.file} is a {checkpoint.describe()}: stopcock resume finishes images;"
                         " resume it in Python: stopcock.resume(model, stopcock.Checkpoint.load(path))")
    saved = dict(checkpoint.notes.get("cli") or {})
    if args.model is None and "model" not in saved:
        raise UsageError(f"{args.file} was not saved by `stopcock image`: name its model with --model")
    model_spec = resolve_model(args.model or saved["model"], "image")
    out = writable(Path(args.out or saved.get("out") or "stopcock.png"))
    again = writable(Path(args.checkpoint or args.file), "--checkpoint")
    run_info = {"prompt": saved.get("prompt"), "model": model_spec, "seed": saved.get("seed")}
    head = {"command": "resume", "model": model_spec}
    try:
        pipe = load_model(ctrl_c, "image", model_spec, quiet=args.model is None)
    except KeyboardInterrupt:
        ctrl_c.phase = "ended"
        return report(not_started(args.mode, started), {**head, "file": None, "image": None,
                                                        "seed": run_info["seed"]},
                      as_json=args.json, unit="step")
    set_threads(args.threads, model_spec)
    progress = Progress(_progress_style(args, echoing=False))

    def resumed(target: Any, **options: Any) -> Outcome:
        return resume(target, checkpoint, record=True, **options)

    partial = args.partial or saved.get("partial")
    try:
        outcome = run_interruptible(pipe, (), {"partial": partial}, ctrl_c=ctrl_c,
                                    conditions=_conditions(args), mode=args.mode, progress=progress,
                                    call=resumed)
    except CheckpointError as exc:
        raise UserError(f"cannot resume {args.file} with {model_spec}: {exc}") from None
    fields = save_image(outcome, out, run_info, quiet=args.json, checkpoint=again,
                        notes={"partial": partial})
    return report(outcome, {**head, **fields, "seed": run_info["seed"]}, as_json=args.json, unit="step")


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(Path(args.out), threads=args.threads)


# -- parser ------------------------------------------------------------------------------------------


def _add_common(p: argparse.ArgumentParser, model_kind: str) -> None:
    p.add_argument("--model", metavar="PATH_OR_ID",
                   help=f"a local folder or a hub id (default: the built-in demo {model_kind} model)")
    p.add_argument("--prompt", action="append", metavar="TEXT",
                   help="the prompt; repeat it for several, run one after the other")
    p.add_argument("--prompts", metavar="FILE", help="more prompts, one per line")
    p.add_argument("--timeout", type=SECONDS, metavar="S", help="stop after S seconds")
    p.add_argument("--mode", choices=MODES, default="finish",
                   help="finish: end at the next step with the partial result (default); abort: abandon "
                        "the run inside the model at its next module call")
    p.add_argument("--json", action="store_true", help="print the Outcome as one JSON object on stdout")
    p.add_argument("--threads", type=COUNT, metavar="N", help=THREADS_HELP)
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
    demo.add_argument("--threads", type=COUNT, default=DEMO_THREADS, metavar="N",
                      help="torch threads (default: %(default)s: the demo models are tiny, and more threads"
                           " only add synchronisation, many times slower on a busy machine)")
    demo.set_defaults(func=cmd_demo)

    text = sub.add_parser("text", help="generate text, streamed to stdout",
                          epilog=f"{_epilog()}\n\n{JSON_SCHEMA}", formatter_class=fmt)
    _add_common(text, "text")
    text.add_argument("--max-new-tokens", type=COUNT, default=100, metavar="N", help="default 100")
    text.add_argument("--stop", nargs="+", type=stop_string, metavar="STR",
                      help="stop when the text contains one of these")
    text.add_argument("--max-steps", type=STEP, metavar="N", help="stop after N tokens")
    text.add_argument("--repetition", nargs="?", const=True, type=repetition, metavar="NGRAM,REPEATS,WINDOW",
                      help="end the text when it loops: its last NGRAM tokens seen REPEATS times in its last"
                           " WINDOW tokens (default 4,3,64)")
    text.add_argument("--grace", choices=("sentence", "line"),
                      help="once --timeout is up, end the text at its next sentence or line boundary")
    text.add_argument("--grace-max", type=SECONDS, metavar="S",
                      help="with --grace: stop S seconds after the timeout at the latest (default 10)")
    add_rank_arguments(text)
    text.set_defaults(func=cmd_text)

    image = sub.add_parser("image", help="generate an image, saved as PNG with the Outcome in its metadata",
                           epilog=f"{_epilog()}\n\n{JSON_SCHEMA}", formatter_class=fmt)
    _add_common(image, "image")
    image.add_argument("--steps", type=COUNT, default=30, metavar="N", help="denoising steps (default 30)")
    image.add_argument("--out", default="stopcock.png", metavar="FILE", help="default: %(default)s")
    image.add_argument("--stop-at-step", type=STEP, metavar="K", help="stop after K steps")
    image.add_argument("--partial", choices=PARTIALS, default="denoised",
                       help="a stopped image shows the model's estimate of the clean image (denoised,"
                            " default) or the noisy latents as they were (raw)")
    image.add_argument("--seed", type=SEED, default=0, metavar="N", help="default 0")
    image.add_argument("--checkpoint", metavar="FILE",
                       help="when the run is stopped (Ctrl+C once, --timeout, --stop-at-step), save a"
                            " checkpoint there: `stopcock resume FILE` finishes the image exactly")
    image.set_defaults(func=cmd_image)

    resumed = sub.add_parser("resume", help="finish an image from the checkpoint of `stopcock image"
                             " --checkpoint`", epilog=f"{_epilog()}\n\n{JSON_SCHEMA}", formatter_class=fmt)
    resumed.add_argument("file", metavar="FILE", help="the checkpoint")
    resumed.add_argument("--model", metavar="PATH_OR_ID", help="the model (default: the checkpoint's)")
    resumed.add_argument("--out", metavar="FILE", help="the PNG (default: the stopped run's --out)")
    resumed.add_argument("--checkpoint", metavar="FILE",
                         help="where a resume stopped again saves its checkpoint (default: FILE)")
    resumed.add_argument("--timeout", type=SECONDS, metavar="S", help="stop after S seconds")
    resumed.add_argument("--stop-at-step", type=STEP, metavar="K", help="stop after step K of the run")
    resumed.add_argument("--partial", choices=PARTIALS, help="what a stopped image shows")
    resumed.add_argument("--mode", choices=MODES, default="finish", help="finish (default) or abort")
    resumed.add_argument("--json", action="store_true", help="print the Outcome as one JSON object")
    resumed.add_argument("--threads", type=COUNT, metavar="N", help=THREADS_HELP)
    resumed.add_argument("--progress", choices=("auto", "bar", "lines", "none"), default="auto",
                         help="progress on stderr (auto: a bar on a terminal)")
    resumed.set_defaults(func=cmd_resume)

    from .server.serve import add_parser as add_serve_parser  # owned by the server; cheap to import

    add_serve_parser(sub)

    from .lint.cli import add_parser as add_check_parser  # owned by the linter; cheap to import

    add_check_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; Ctrl+C is handled from here to the return (see :class:`CtrlC`)."""
    ctrl_c = CtrlC()
    with ctrl_c.installed():
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help(sys.stderr)
            return EXIT_USAGE
        try:
            if args.func in (cmd_text, cmd_image, cmd_resume):  # they handle Ctrl+C by phase (see CtrlC)
                return int(args.func(args, ctrl_c))
            with ctrl_c.interruptible():  # demo, serve, check: Ctrl+C ends them at once
                return int(args.func(args))
        except UserError as exc:
            print(f"stopcock: error: {exc}", file=sys.stderr)
            return exc.exit_code
        except KeyboardInterrupt:
            print("stopcock: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED


if __name__ == "__main__":
    # ``python -m stopcock.cli`` runs this file as ``__main__``, a second copy of the module beside the
    # ``stopcock.cli`` that the rest of the package imports: run the real one's main (through the
    # command's entry point, as ``stopcock`` does), so that one copy of its state is in play.
    from _stopcock_launch import main as launch

    sys.exit(launch())
