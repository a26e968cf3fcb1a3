"""``python -m bench.coverage --diffusers-tests PATH``: how stopcock stops every pipeline the libraries'
own test fixtures build offline (``make coverage DIFFUSERS_TESTS=PATH``; not part of ``make test``).

One function per library builds its pipelines, runs each one plainly and stopped in finish mode, and
returns a :class:`Coverage`: one :class:`Row` per pipeline with the checks it passed. ``LIBRARIES``
lists them; a library whose inputs were not given is skipped. The report prints, per category, how
many pipelines were built offline, ran here, and passed each check, then why the others did not;
the exit status is 1 if a pipeline that ran missed a check.

transformers (``transformers_coverage``, :mod:`bench.coverage_transformers`): every generating
pipeline task on a tiny model, stopped from ``on_step``; its categories are the stop paths.

diffusers (``diffusers_coverage``): ``PATH`` is the ``tests`` folder of a diffusers checkout. Each
pipeline test class there (``pipeline_class`` with ``get_dummy_components()``/``get_dummy_inputs()``;
modular ones with ``get_pipeline()``) is built and run with ``num_inference_steps=4``: once plainly,
then twice stopped at step 2 (``max_steps``). Checks: a decoded output (the plain run's output class
and shape), zero loop-model forwards after the stop step (each model's forwards, counted by forward
hooks, equal the plain run's less those it made inside the stopped loop after that step), steps
counted (the plain run's ``steps`` equal its ``total_steps``, > 0) and a bit-identical same-seed rerun.
The two hub fixtures most tests load (``hf-internal-testing/tiny-random-t5``'s tokenizer, config and
encoder, ``hf-internal-testing/tiny-random-clip``'s tokenizer) are stood in for by in-memory ones of
the same sizes (``tiny.image``); any other hub file makes its pipeline "not built offline".
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import math
import os
import sys
import time
import unittest
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

CHECKS = (
    "decoded output",
    "zero loop-model forwards after the stop",
    "steps counted",
    "same-seed rerun identical",
)
STEPS = 4


@dataclass
class Row:
    """One pipeline: its category, how far it got (``stage``), its checks, and why it stopped short."""

    name: str
    category: str
    stage: str = "not built offline"  # then "built", "ran" (its plain run worked; checks are valid),
    # or "no denoising loop" (nothing to stop)
    checks: dict[str, bool | None] = field(default_factory=dict)  # None: does not apply
    path: str | None = None  # how the stopped run ended (diffusers: interrupt, fast-forward, abort)
    reason: str = ""


@dataclass
class Coverage:
    library: str
    checks: tuple[str, ...]
    rows: list[Row] = field(default_factory=list)
    unit: str = "pipelines"  # what a row is
    every_row: bool = False  # list each row with its checks (a short list), not only the missed ones

    def missed(self, row: Row) -> bool:
        """Whether a pipeline that ran failed a check (one that does not apply is not failed)."""
        return any(row.checks.get(c, False) is False for c in self.checks)

    def report(self) -> str:
        """Markdown: counts per category, then each pipeline that missed something, with the reason."""
        head = ["category", self.unit, "built offline", "ran here", *self.checks]
        lines = [f"## {self.library}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        categories = sorted({r.category for r in self.rows})
        for category in [*categories, "all"]:
            rows = [r for r in self.rows if category in ("all", r.category)]
            ran = [r for r in rows if r.stage == "ran"]
            cells: list[object] = [len(rows), sum(r.stage != "not built offline" for r in rows), len(ran)]
            for c in self.checks:
                moot = sum(r.checks.get(c, False) is None for r in ran)
                passed = sum(r.checks.get(c, False) is True for r in ran)
                cells.append(f"{passed} ({moot} n/a)" if moot else passed)
            label = "**all**" if category == "all" else category
            lines.append(f"| {label} | " + " | ".join(map(str, cells)) + " |")
        paths = Counter(r.path for r in self.rows if r.stage == "ran" and r.path)
        lines += ["", "Stopped runs by path: " + ", ".join(f"{p} {n}" for p, n in sorted(paths.items()))]
        if self.every_row:
            head = ["case", "path", *self.checks, "note"]
            lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            for r in self.rows:
                ran = r.stage == "ran"
                marks = [("yes" if r.checks.get(c) else "NO") if ran else "-" for c in self.checks]
                note = r.reason.replace("|", "/").replace("\n", " ")[:160]
                lines.append(f"| {r.name} | {r.category} | " + " | ".join(marks) + f" | {note} |")
        missed = [r for r in self.rows if r.stage != "ran" or self.missed(r)]
        if missed:
            lines += ["", "| pipeline | category | got to | missed | reason |", "|---|---|---|---|---|"]
            for r in sorted(missed, key=lambda r: (r.stage, r.category, r.name)):
                failed = ", ".join(c for c in self.checks if r.stage == "ran" and r.checks.get(c) is False)
                reason = r.reason.replace("|", "/").replace("\n", " ")[:160]
                lines.append(f"| {r.name} | {r.category} | {r.stage} | {failed} | {reason} |")
        return "\n".join(lines)


# -- diffusers -------------------------------------------------------------------------------------
def diffusers_coverage(args: argparse.Namespace) -> Coverage | None:
    """Every pipeline test class of diffusers' ``tests`` folder, built from its own dummy components."""
    if args.diffusers_tests is None:
        return None
    tests = Path(args.diffusers_tests).resolve()
    if not (tests / "pipelines").is_dir():
        raise SystemExit(f"--diffusers-tests must be the tests folder of a diffusers checkout, got {tests}")
    sys.path.insert(0, str(tests.parent))
    coverage = Coverage("diffusers", CHECKS)
    seen: set[str] = set()
    for module_name in _test_modules(tests, args.only):
        try:
            module = importlib.import_module(module_name)
        except Exception as error:  # noqa: BLE001 (a measurement: every failure is reported)
            coverage.rows.append(Row(module_name, "?", reason=f"import failed: {_brief(error)}"))
            continue
        for tester in _testers(module):
            name = _pipeline_name(tester)
            if name in seen:
                continue
            seen.add(name)
            start = time.perf_counter()
            row = _check_diffusers(tester, name)
            coverage.rows.append(row)
            passed = row.stage == "ran" and not coverage.missed(row)
            verdict = "ok" if passed else f"{row.stage}: {row.reason}"
            seconds = time.perf_counter() - start
            print(f"coverage: {name}: {verdict} ({seconds:.1f} s)", file=sys.stderr, flush=True)
    return coverage


def _test_modules(tests: Path, only: str | None) -> Iterator[str]:
    for folder in ("pipelines", "modular_pipelines"):
        for path in sorted((tests / folder).rglob("test_*.py")):
            name = ".".join(path.relative_to(tests.parent).with_suffix("").parts)
            if only is None or only in name:
                yield name


def _testers(module: Any) -> Iterator[Any]:
    """Instances of the module's own pipeline test classes that can build a pipeline."""
    for cls in vars(module).values():
        if not (inspect.isclass(cls) and cls.__module__ == module.__name__ and not inspect.isabstract(cls)):
            continue
        if not isinstance(inspect.getattr_static(cls, "pipeline_class", None), type):
            continue
        if not (hasattr(cls, "get_dummy_components") or hasattr(cls, "get_pipeline")):
            continue
        if getattr(cls, "__unittest_skip__", False):
            continue
        tester = cls.__new__(cls)
        if isinstance(tester, unittest.TestCase):
            method = next((n for n in dir(cls) if n.startswith("test")), "__init__")
            unittest.TestCase.__init__(tester, methodName=method)
        yield tester


def _pipeline_name(tester: Any) -> str:
    return tester.pipeline_class.__name__


def _category(pipe: Any) -> str:
    """The survey's category of the ``__call__`` a pipeline runs, read from its signature and source."""
    from diffusers import DiffusionPipeline, ModularPipeline

    if isinstance(pipe, ModularPipeline):
        return "modular"
    if any(isinstance(v, DiffusionPipeline) for v in vars(pipe).values()):
        return "combined"
    call = type(pipe).__call__
    source = inspect.getsource(call)
    if "self.interrupt" in source or "self._interrupt" in source:
        return "A/C: checks interrupt" if "callback_on_step_end" in source else "C: interrupt, no callback"
    if "callback_on_step_end" in inspect.signature(call).parameters:
        return "B: callback_on_step_end only"
    if "callback" in inspect.signature(call).parameters:
        return "D: legacy callback only"
    return "E: no step hook"


def _check_diffusers(tester: Any, name: str) -> Row:
    import stopcock

    row = Row(name, "?")
    try:
        pipe = _build(tester)
    except Exception as error:  # noqa: BLE001
        row.reason = _brief(error)
        return row
    row.category = _category(pipe)
    empty = [n for n, c in dict(pipe.components).items() if hasattr(c, "all_special_tokens") and len(c) < 10]
    if empty:  # transformers builds a tokenizer it cannot find offline empty, without an error
        row.reason = f"its tokenizer ({', '.join(empty)}) is on the hub only (offline: built empty)"
        return row
    row.stage = "built"
    try:
        full, full_calls = _run(pipe, _inputs(tester, pipe))
    except Exception as error:  # noqa: BLE001
        row.reason = f"its plain run fails here: {_brief(error)}"
        return row
    if full.steps == 0 and not _schedulers(pipe):
        row.stage, row.reason = "no denoising loop", "no scheduler and no step: nothing to stop"
        return row
    row.stage = "ran"
    states = full_calls.states
    at = 2 if states and (states[0].total or STEPS) > 2 else 1
    end = full_calls.stage_end(at, full.steps)
    if row.category == "combined" and states[at - 1].total:  # its next stage runs in full (stage="next")
        end = min(end, states[at - 1].total)
    try:
        stopped, calls = _run(pipe, _inputs(tester, pipe), stop=stopcock.max_steps(at))
        again, _ = _run(pipe, _inputs(tester, pipe), stop=stopcock.max_steps(at))
    except Exception as error:  # noqa: BLE001
        row.reason = f"the stopped run raised: {_brief(error)}"
        row.checks = dict.fromkeys(CHECKS, False)
        return row
    row.path = stopped.extra.get("path")
    # The models that computed inside the stopped loop: each must compute only the steps before the stop
    # (and what it does outside that loop, as in the plain run).
    looping = [m for m in full_calls.calls if full_calls.count(m, since=1, until=end)]
    expected = {m: full_calls.count(m) - full_calls.count(m, since=at, until=end) for m in looping}
    row.checks = {
        "decoded output": stopped.stopped and stopped.output is not None and stopped.mode == "finish"
        and type(stopped.output) is type(full.output) and _shape(stopped.output) == _shape(full.output),
        "zero loop-model forwards after the stop": all(calls.count(m) == expected[m] for m in expected),
        "steps counted": full.steps > 0 and full.steps == (full.total_steps or full.steps),
        "same-seed rerun identical": _same(stopped.output, again.output),
    }
    if not row.checks["same-seed rerun identical"]:
        plain, _ = _run(pipe, _inputs(tester, pipe))
        if not _same(plain.output, full.output):
            row.checks["same-seed rerun identical"] = None
            row.reason = "its plain runs with one seed differ too (the pipeline is not deterministic here); "
    missed = [c for c, ok in row.checks.items() if ok is False]
    if missed:
        forwards = {m: (calls.count(m), expected[m]) for m in expected if calls.count(m) != expected[m]}
        row.reason += (f"steps {full.steps}/{full.total_steps}, stopped at {stopped.steps}, path {row.path},"
                      f" forwards (got, expected) {forwards}; {stopped.detail or ''}")
    return row


def _schedulers(pipe: Any) -> list[Any]:
    from diffusers.schedulers.scheduling_utils import SchedulerMixin

    return [c for c in dict(pipe.components).values() if isinstance(c, SchedulerMixin)]


def _build(tester: Any) -> Any:
    with _stand_ins():
        if hasattr(tester, "get_dummy_components"):
            pipe = tester.pipeline_class(**tester.get_dummy_components())
        else:
            pipe = tester.get_pipeline()
    for component in dict(pipe.components).values():
        if hasattr(component, "eval"):  # as from_pretrained leaves them: a model built from a config
            component.eval()  # is in training mode, and some fixtures leave T5's dropout on
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _inputs(tester: Any, pipe: Any) -> dict[str, Any]:
    """The test's own dummy inputs (seeded on CPU), with ``STEPS`` denoising steps per stage."""
    parameters = inspect.signature(tester.get_dummy_inputs).parameters
    inputs = tester.get_dummy_inputs("cpu") if "device" in parameters else tester.get_dummy_inputs()
    accepted = set(inspect.signature(type(pipe).__call__).parameters)
    accepted |= set(getattr(getattr(pipe, "blocks", None), "input_names", ()))
    strength = inputs.get("strength")
    steps = STEPS  # an img2img pipeline runs only strength * num_inference_steps of them
    if isinstance(strength, (int, float)) and 0 < strength < 1:
        steps = math.ceil(STEPS / strength)
    for key in ("num_inference_steps", "prior_num_inference_steps", "decoder_num_inference_steps"):
        if key in accepted and "timesteps" not in inputs and "sigmas" not in inputs:
            inputs[key] = max(steps, inputs.get(key) or 0) if key == "num_inference_steps" else STEPS
    return inputs


class _Calls:
    """Each model component's forwards, with the steps done when each one was made."""

    def __init__(self) -> None:
        self.calls: dict[str, list[int]] = {}
        self.states: list[Any] = []

    def count(self, model: str, since: int = 0, until: float = float("inf")) -> int:
        return sum(since <= done < until for done in self.calls.get(model, []))

    def stage_end(self, at: int, steps: int) -> int:
        """The steps done when the loop running at step ``at`` ends: when a model that had not run
        before starts (the decoder after the loop, a next loop's models), else at the last step (a
        loop run again on the same models, chunk by chunk, is the same loop)."""
        later = [min(d) for d in self.calls.values() if d and min(d) >= at]
        return min([*later, steps])


def _run(pipe: Any, inputs: dict[str, Any], **options: Any) -> tuple[Any, _Calls]:
    import torch

    import stopcock

    record = _Calls()
    handles = []
    for name, module in dict(pipe.components).items():
        if isinstance(module, torch.nn.Module):
            record.calls[name] = []
            handles.append(module.register_forward_hook(_counter(record, name)))
    try:
        outcome = stopcock.run(pipe, on_step=record.states.append, kwargs=inputs, **options)
    finally:
        for handle in handles:
            handle.remove()
    return outcome, record


def _counter(record: _Calls, name: str) -> Callable[..., None]:
    def hook(module: Any, args: Any, output: Any) -> None:
        record.calls[name].append(record.states[-1].step if record.states else 0)

    return hook


def _leaf(output: Any) -> Any:
    """The first array of an output (images, frames, audios; a tuple's first element)."""
    while isinstance(output, (tuple, list)) and output:
        output = output[0]
    if hasattr(output, "detach"):  # a tensor
        return output.detach().float().cpu().numpy()
    if isinstance(output, dict):  # diffusers' output classes are ordered dicts
        return _leaf(next(iter(output.values()), None))
    return np.asarray(output, dtype=np.float32) if output is not None else None


def _shape(output: Any) -> tuple[int, ...] | None:
    leaf = _leaf(output)
    return None if leaf is None else tuple(leaf.shape)


def _same(a: Any, b: Any) -> bool:
    x, y = _leaf(a), _leaf(b)
    return x is not None and y is not None and x.shape == y.shape and np.array_equal(x, y, equal_nan=True)


@contextmanager
def _stand_ins() -> Iterator[None]:
    """In-memory stand-ins for the two hub fixtures most of diffusers' pipeline tests load."""
    import torch
    import transformers
    from transformers import T5Config

    from tiny.image import clip_tokenizer, t5_tokenizer

    t5, clip = "hf-internal-testing/tiny-random-t5", "hf-internal-testing/tiny-random-clip"

    def t5_config() -> Any:
        return T5Config(
            vocab_size=1103, d_model=32, d_ff=37, d_kv=8, num_layers=5, num_heads=4,
            relative_attention_num_buckets=8, decoder_start_token_id=0, eos_token_id=1, pad_token_id=0,
        )

    def t5_encoder() -> Any:
        torch.manual_seed(0)
        return transformers.T5EncoderModel(t5_config()).eval()

    stand_ins: dict[tuple[str, str], Callable[[], Any]] = {
        ("AutoTokenizer", t5): t5_tokenizer,
        ("T5Tokenizer", t5): t5_tokenizer,
        ("T5TokenizerFast", t5): t5_tokenizer,
        ("AutoConfig", t5): t5_config,
        ("T5EncoderModel", t5): t5_encoder,
        ("CLIPTokenizer", clip): clip_tokenizer,
        ("AutoTokenizer", clip): clip_tokenizer,
    }
    with ExitStack() as stack:
        for cls_name in {c for c, _ in stand_ins}:
            cls = getattr(transformers, cls_name)
            stack.enter_context(_patched_from_pretrained(cls, cls_name, stand_ins))
        yield


@contextmanager
def _patched_from_pretrained(
    cls: type, cls_name: str, stand_ins: dict[tuple[str, str], Callable[[], Any]]
) -> Iterator[None]:
    original = cls.__dict__.get("from_pretrained")
    bound = cls.from_pretrained  # type: ignore[attr-defined]

    def from_pretrained(_cls: type, name: Any, *args: Any, **kwargs: Any) -> Any:
        make = stand_ins.get((cls_name, str(name)))
        return make() if make is not None else bound(name, *args, **kwargs)

    cls.from_pretrained = classmethod(from_pretrained)  # type: ignore[attr-defined]
    try:
        yield
    finally:
        if original is None:
            del cls.from_pretrained  # type: ignore[attr-defined]
        else:
            cls.from_pretrained = original  # type: ignore[attr-defined]


def _brief(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:200] if text else ''}"


# -- the report ------------------------------------------------------------------------------------
# -- transformers ----------------------------------------------------------------------------------
def transformers_coverage(args: argparse.Namespace) -> Coverage:
    """Every generating transformers pipeline task on its tiny models (:mod:`bench.coverage_transformers`)."""
    from . import coverage_transformers as half

    checks = ("stopped at the step", "zero tokens after the request", "non-empty partial output")
    coverage = Coverage("transformers", checks, unit="cases", every_row=True)
    for r in half.coverage():
        coverage.rows.append(
            Row(r.case, r.path, stage="ran" if r.built else "not built offline",
                checks=dict(zip(checks, (r.stopped, r.zero_after, r.non_empty), strict=True)),
                path=r.path, reason=r.note)
        )
    return coverage


#: Each library's coverage: a function of the command-line arguments (None when its inputs were not given).
LIBRARIES: dict[str, Callable[[argparse.Namespace], Coverage | None]] = {
    "diffusers": diffusers_coverage,
    "transformers": transformers_coverage,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.coverage", description=__doc__.split("\n\n")[0])
    parser.add_argument("--diffusers-tests", type=Path, help="the tests folder of a diffusers checkout")
    parser.add_argument("--only", help="only test modules whose dotted name contains this")
    parser.add_argument("--out", type=Path, help="also write the report here (markdown)")
    parser.add_argument("--library", nargs="+", choices=list(LIBRARIES), help="only these libraries")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a fixture that needs the hub is "not built offline"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore")
    names = args.library or list(LIBRARIES)
    reports = [c for c in (LIBRARIES[name](args) for name in names) if c is not None]
    if not reports:
        parser.error("nothing to measure: give --diffusers-tests PATH")
    text = "\n\n".join(c.report() for c in reports)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return int(any(r.stage == "ran" and c.missed(r) for c in reports for r in c.rows))


if __name__ == "__main__":
    sys.exit(main())
