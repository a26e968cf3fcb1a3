"""Coverage, transformers half: every generating pipeline task, stopped between tokens.

The tasks are read from transformers itself (every pipeline class whose ``_pipeline_calls_generate``
flag is set), so a task added by a new release shows up here as "no tiny build" until one exists.
For each tiny case (``tiny.text.task_case``): a full run, then a run stopped from ``on_step`` at
step 5; it counts when the stop took effect (``steps`` = 5), when the model made zero forwards
after the request (no token after it), and when the partial output is non-empty.

The models whose ``generate`` needs more than a criterion are also run directly (not through a
pipeline), with the same three checks: MusicGen (the conditional model and its decoder alone), whose
delay pattern raises on an early end, and SpeechT5, whose own loop skips its stop head until
``minlenratio=``'s minimum.

``python -m bench.coverage_transformers`` prints one line per case and a summary line, and exits 1
if a case that builds misses one of the three.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from typing import Any

AT = 5  # the step whose on_step asks for the stop


@dataclass
class Row:
    case: str
    path: str  # how the run was stopped between tokens
    built: bool
    stopped: bool = False
    zero_after: bool = False
    non_empty: bool = False
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.built and self.stopped and self.zero_after and self.non_empty


def generating_tasks() -> list[str]:
    """The pipeline tasks of the installed transformers whose pipeline calls ``generate``."""
    from transformers.pipelines import SUPPORTED_TASKS

    found = []
    for task, entry in SUPPORTED_TASKS.items():
        impl = entry["impl"]
        if isinstance(impl, str):
            module, _, name = impl.rpartition(".")
            impl = getattr(importlib.import_module(module), name)
        if getattr(impl, "_pipeline_calls_generate", False):
            found.append(task)
    return found


def _path(pipe: Any) -> str:
    from stopcock.adapters.transformers_loops import _stop_head

    if _stop_head(pipe.model) is not None:
        return "stop-probability head of its own loop"
    if hasattr(getattr(pipe.model, "decoder", None), "build_delay_pattern_mask"):
        return "criterion bound to generate; delay pattern ended at the stop"
    return "criterion bound to generate"


def _stopped_at_step(row: Row, stepper: Any, run: Any) -> Any:
    """``run(stop=..., on_step=...)`` stopped by a button at step ``AT``, counting ``stepper``'s
    forwards: records on ``row`` whether it stopped there in finish mode with no forward after."""
    import stopcock

    signal, seen = stopcock.StopSignal(), {"forwards": 0, "at_request": None}

    def count(module: Any, args: Any, out: Any) -> None:
        seen["forwards"] += 1

    def on_step(state: Any) -> None:
        if state.step == AT and seen["at_request"] is None:
            seen["at_request"] = seen["forwards"]
            signal.stop("button")

    hook = stepper.register_forward_hook(count)
    try:
        outcome = run(stop=signal, on_step=on_step)
    finally:
        hook.remove()
    row.stopped = outcome.stopped and outcome.steps == AT and outcome.mode == "finish"
    row.zero_after = seen["at_request"] is not None and seen["forwards"] == seen["at_request"]
    return outcome


def measure(name: str) -> Row:
    import torch

    import stopcock
    from tiny.text import task_case

    torch.manual_seed(0)
    case = task_case(name)
    row = Row(name, _path(case.pipe), built=True)
    outcome = _stopped_at_step(row, case.stepper, lambda **run: stopcock.run(case.pipe, case.item, **run,
                                                                               **case.kwargs))
    partial = case.content(outcome.output)
    row.non_empty = partial is not None and len(partial) > 0
    row.note = outcome.detail or ""
    return row


@dataclass
class Direct:
    """A model's ``generate`` called directly: the model, its arguments, and the module that makes
    one forward a step."""

    model: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    stepper: Any


def _direct(name: str) -> Direct:
    import torch

    from tiny import text

    if name.startswith("Musicgen"):
        pipe = text.musicgen_pipeline()
        model = pipe.model
        settings = {"max_new_tokens": text.CASE_TOKENS, "do_sample": False}
        if name.startswith("MusicgenForCausalLM"):  # the decoder alone: its 4 codebooks start at the pad code
            codes = {"input_ids": torch.full((4, 1), 64), "num_return_sequences": 1}
            return Direct(model.decoder, (), {**codes, **settings}, model.decoder)
        return Direct(model, (), {**dict(pipe.tokenizer(["a calm tune"], return_tensors="pt")), **settings},
                      model.decoder)
    pipe, speaker = text.speecht5_pipeline()
    ids = pipe.tokenizer(["hello world"], return_tensors="pt")["input_ids"]
    kwargs = {"speaker_embeddings": speaker, "vocoder": pipe.vocoder, "minlenratio": 6.0}
    return Direct(pipe.model, (ids,), kwargs, pipe.model.speech_decoder_postnet.prob_out)


#: Models run directly: their paths differ from a pipeline's (see the module docstring).
DIRECT_CASES = (
    "MusicgenForConditionalGeneration.generate",
    "MusicgenForCausalLM.generate",
    "SpeechT5ForTextToSpeech.generate (minlenratio=6)",
)


def measure_direct(name: str) -> Row:
    import torch

    import stopcock

    torch.manual_seed(0)
    case = _direct(name)
    path = "stop-probability head of its own loop" if name.startswith("SpeechT5") else (
        "criterion in generate's list; delay pattern ended at the stop"
    )
    row = Row(name, path, built=True)
    outcome = _stopped_at_step(row, case.stepper, lambda **run: stopcock.run(case.model, *case.args,
                                                                               kwargs=case.kwargs, **run))
    output = outcome.output
    row.non_empty = isinstance(output, torch.Tensor) and output.numel() > 0 and output.shape[-1] > 0
    row.note = outcome.detail or ""
    return row


def coverage() -> list[Row]:
    """One row per tiny case and per model run directly, and one per generating task of
    transformers that has no tiny case."""
    from tiny.text import TASK_CASES

    rows = [measure(name) for name in TASK_CASES]
    rows += [measure_direct(name) for name in DIRECT_CASES]
    covered = {name.split(" ")[0] for name in TASK_CASES}
    rows += [
        Row(task, "-", built=False, note="no tiny build")
        for task in generating_tasks()
        if task not in covered
    ]
    return rows


def report(rows: list[Row]) -> str:
    lines = [
        "| transformers task | path | stopped at the step | zero tokens after | non-empty partial |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        marks = [("yes" if v else "NO") if r.built else "-" for v in (r.stopped, r.zero_after, r.non_empty)]
        lines.append(f"| {r.case} | {r.path} | {' | '.join(marks)} |" + (f" {r.note}" if r.note else ""))
    built = [r for r in rows if r.built]
    ok = sum(r.ok for r in built)
    tasks = len({r.case.split(" ")[0] for r in rows if r.case not in DIRECT_CASES})
    lines.append(
        f"transformers: {ok}/{len(built)} tiny cases ({tasks} generating tasks, {len(DIRECT_CASES)} models"
        f" called directly) stop with zero tokens after the request and a non-empty partial output"
        f" ({len(rows) - len(built)} tasks without a tiny build)"
    )
    return "\n".join(lines)


def main() -> int:
    rows = coverage()
    print(report(rows))
    return 0 if all(r.ok for r in rows if r.built) else 1


if __name__ == "__main__":
    sys.exit(main())
