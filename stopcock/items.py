"""Runs over several items (a list of prompts, a dataset): the one item loop the adapters share.

Items are run one by one (or ``batch`` at a time), so a run stops between them and keeps the
results of the items done. At each item boundary the run's control decides whether the next item
may start (not after a stop, nor after a ``stop_after_item()``), and records why each item ended
(``Outcome.item_reasons``): a ``skip()`` during an item ends that item only, and the loop goes on.
:func:`run_each` is the same loop over whole runs, one per input (the CLI's and the server's
several prompts).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from itertools import islice
from typing import TypeVar

from .conditions import StopLike
from .control import RunControl
from .outcome import Outcome

__all__ = ["run_each", "run_items"]

T = TypeVar("T")
R = TypeVar("R")


def run_items(
    control: RunControl,
    items: Iterable[T],
    run: Callable[[list[T]], Sequence[R]],
    *,
    into: list[R],
    batch: int = 1,
    step_items: bool = False,
) -> None:
    """``run(chunk)`` for each chunk of ``batch`` items, in order, while the run may go on.

    ``run`` returns one result per item of its chunk; they are appended to ``into`` as each chunk
    ends (a chunk cut short by a stop or a skip gives what ``run`` made of it), so a run abandoned
    by an exception keeps the results done. A chunk is taken from ``items`` just before it would
    run. ``step_items`` makes each finished item a step of the run (for targets with no steps of
    their own).
    """
    source = iter(items)
    while chunk := list(islice(source, batch)):
        if not control.start_item():
            break
        try:
            done = run(chunk)
        finally:
            control.end_item(len(chunk))
        if len(done) != len(chunk):
            raise RuntimeError(f"a chunk of {len(chunk)} items gave {len(done)} results, not one per item")
        for result in done:
            into.append(result)
            if step_items:
                control.step(len(into))


def run_each(
    stop: StopLike | None, inputs: Iterable[T], run_one: Callable[[T], Outcome]
) -> tuple[list[Outcome], Outcome]:
    """``run_one(input)`` (one stopcock run each, with ``stop`` among its conditions) for each input in
    turn, while the signals of ``stop`` allow: a stop ends the sequence, ``stop_after_item()`` lets
    the current run finish and starts no other, ``skip()`` ends the current run (its reason
    ``"skipped"``) and the next one starts. Returns the runs' Outcomes and the sequence's own: its
    output the runs' outputs, its steps theirs added up, its ``item_reasons`` one per run.
    """
    control = RunControl(stop)
    outcomes: list[Outcome] = []
    with control:
        run_items(control, inputs, lambda chunk: [run_one(chunk[0])], into=outcomes)
        if control.token.stopped:  # a signal's stop during the last run ended the sequence too
            control.check()
    control.steps = sum(o.steps for o in outcomes)
    totals = [o.total_steps for o in outcomes]
    control.total = None if None in totals or not totals else sum(t for t in totals if t is not None)
    control.item_reasons = [o.reason if o.stopped else "completed" for o in outcomes]
    return outcomes, control.outcome([o.output for o in outcomes], extra={"items": len(outcomes)})
