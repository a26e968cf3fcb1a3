"""Batched text jobs: concurrent greedy text jobs on one model run as rows of one padded ``generate``.

The engine takes a batch of jobs that :func:`batchable` accepts from its queue and hands it to the
text lane (``TextLane.execute_batch``), which calls :func:`run_batch`. The prompts are padded on the
left with an attention mask, so each row's greedy tokens are those of the job run alone. One
stopping criterion (:class:`RowStops`) sees every new token and checks each row on its own, in the
order a single run checks its steps: the step reached is recorded first (``Job.reach``, so a stop by
id ends the row at the step it had reached or the one in flight), then the job's stop signal, its
stop conditions (timeout, deadline, max_steps, ...), its stop strings (transformers'
``StopStringCriteria``, as a run alone applies them), end of sequence and its ``max_tokens``. A row
that ends is done for ``generate`` (it is padded from then on and its tokens ignored) and its job gets
its partial text and reason at once; the other rows go on untouched. The batch returns when every
row has ended.

Jobs that sample, have several prompts or resume from a checkpoint run alone: sampling draws from
one generator per job, and a held job's checkpoint is one run's. A job in a batch keeps no
checkpoint, so it cannot be paused or preempted (the engine refuses a pause with a 409 naming the
fix, and never picks it to preempt). transformers' continuous batching (``generate_batch``) is the
route for GPUs; on CPU it is far slower than a padded batch (see the server how-to).
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.stopping_criteria import StopStringCriteria

from ..conditions import (
    AnyOf,
    Condition,
    Repetition,
    SoftDeadline,
    SoftTimeout,
    StopStrings,
    at_boundary,
    from_options,
)
from ..events import TextDecoder
from ..outcome import Outcome
from ..state import StepState
from .contract import JobSpec, JobState, JobStateConflict
from .jobs import INTERRUPTED, Ended, Job
from .schemas import MIN_SAMPLING_TEMPERATURE

__all__ = ["Batching", "Row", "RowStops", "batchable", "run_batch"]

log = logging.getLogger("stopcock.server")


def batchable(spec: JobSpec, checkpoint: Any = None) -> bool:
    """Whether a job can run as a row of a batch: a greedy text job of one prompt, not resuming."""
    return (
        spec.kind == "text"
        and spec.prompts is None
        and checkpoint is None
        and float(spec.params.get("temperature", 1.0)) < MIN_SAMPLING_TEMPERATURE
    )


class Batching:
    """An engine's batching: which queued jobs form a batch (:meth:`take`), running one
    (:meth:`run`), and its occupancy for ``/v1/health`` (:meth:`counts`). ``size`` 1 never batches.

    ``rows`` holds the running jobs that are rows of a batch; the engine changes it under its lock
    (a job joins it in :meth:`take`, and leaves it when its end is told)."""

    def __init__(self, size: int, wait: float) -> None:
        if size < 1 or not 0 <= wait < float("inf"):
            raise ValueError(f"batch_size must be >= 1 and batch_wait seconds >= 0, got {size!r}, {wait!r}")
        self.size = size
        self.wait = wait
        self.rows: set[Any] = set()
        self.rows_now = 0
        self.batches = 0
        self.batched = 0
        self._lock = threading.Lock()

    def batchable(self, job: Job, lanes: Mapping[str, Any]) -> bool:
        return (
            self.size > 1
            and batchable(job.spec, job.checkpoint)
            and hasattr(lanes.get(job.spec.kind), "execute_batch")
        )

    def refuse_pause(self, job: Job) -> None:
        """A :class:`JobStateConflict` for a job running as a row (a row keeps no checkpoint)."""
        if job in self.rows:
            raise JobStateConflict(
                f"job {job.id} runs as a row of a batch, which keeps no checkpoint: stop it instead,"
                " or serve with --batch-size 1 to pause running text jobs"
            )

    def take(self, queue: list[Any], cond: threading.Condition, closing: Callable[[], bool],
             lanes: Mapping[str, Any]) -> list[Any] | None:
        """Under ``cond`` (the engine's lock, notified on each new job): the next job of ``queue``,
        or, when it can be batched, up to ``size`` jobs that can, waiting up to ``wait`` seconds for
        the batch to fill (they join ``rows``); None once ``closing()`` (the engine then holds the
        queued jobs, and ``queue`` may be a list it no longer uses)."""
        while True:
            while not queue and not closing():
                cond.wait()
            if closing():  # the engine has taken (and stopped) every queued job
                return None
            if not self.batchable(queue[0], lanes):
                return [queue.pop(0)]
            deadline = time.monotonic() + self.wait
            while (left := deadline - time.monotonic()) > 0 and not closing():
                if len(self._ready(queue, lanes)) >= self.size:
                    break
                cond.wait(left)
            if closing():
                return None
            ready = self._ready(queue, lanes)
            if ready:  # else another worker took them while this one waited
                for job in ready:
                    queue.remove(job)
                self.rows.update(ready)
                return ready

    def _ready(self, queue: list[Any], lanes: Mapping[str, Any]) -> list[Any]:
        """The jobs of ``queue`` (in priority order) a batch can take: batchable ones, none of a lower
        priority than a job ahead of it that must run alone; at most ``size``."""
        ready: list[Any] = []
        alone: int | None = None  # the priority of the first job that must run alone
        for job in queue:
            if not self.batchable(job, lanes):
                alone = job.spec.priority if alone is None else alone
            elif alone is None or job.spec.priority >= alone:
                ready.append(job)
        return ready[: self.size]

    def run(self, jobs: list[Any], lane: Any, end: Callable[[Any, Ended], None], step_delay: float) -> None:
        """Run ``jobs`` as one batch on ``lane``: ``end(job, ended)`` as each row ends (every job
        ends, as interrupted if the batch did not end it)."""
        ended: set[Any] = set()

        def on_end(job: Any, how: Ended) -> None:
            with self._lock:
                ended.add(job)
                self.rows_now -= 1
            end(job, how)

        with self._lock:
            self.rows_now += len(jobs)
            self.batches += 1
            self.batched += len(jobs)
        try:
            lane.execute_batch(jobs, on_end, step_delay)
        finally:
            for job in jobs:
                if job not in ended:
                    on_end(job, INTERRUPTED)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {
                "batch_size": self.size,
                "batch_wait_ms": round(self.wait * 1000),
                "batch_rows_running": self.rows_now,
                "batches_run": self.batches,
                "batched_jobs": self.batched,
            }


class Row:
    """One job of a batch: its prompt, stop conditions, decoded text and how it ended."""

    def __init__(self, job: Job, prompt: str, prompt_tokens: int, tokenizer: Any,
                 on_end: Callable[[Job, Ended], None]) -> None:
        self.job = job
        self.on_end = on_end
        self.prompt = prompt
        self.prompt_tokens = prompt_tokens
        self.max_tokens = int(job.spec.params["max_tokens"])
        conditions = from_options(job.spec.stop)
        strings = [s for c in conditions if isinstance(c, StopStrings) for s in c.strings]
        others: list[Condition] = [c for c in conditions if not isinstance(c, StopStrings)]
        self.condition: Condition | None = AnyOf(*others) if others else None
        self.strings = StopStringCriteria(tokenizer, strings) if strings else None
        # the row conditions a run alone applies per row (transformers_rows.RowEnds), applied here
        self.repetitions = [c for c in conditions if isinstance(c, Repetition)]
        self.soft = [c for c in conditions if isinstance(c, (SoftTimeout, SoftDeadline))]
        self.emitted = ""  # the text the last token added (held back bytes add none)
        self.decoder = TextDecoder(tokenizer)
        self.pieces: list[str] = []
        self.steps = 0
        self.reason: str | None = None  # set once the row has ended
        self.row_reason = "completed"
        self.stopped = False
        self.started = time.monotonic()
        self.ended_at: float | None = None
        self.skips = job.signal.skips  # a skip after this ends the row (a job of one item)

    @property
    def done(self) -> bool:
        return self.reason is not None

    def loops(self, generated: list[int]) -> bool:
        """Whether the row's ``generated`` tokens loop by one of its ``repetition()`` rules."""
        return any(rule.loops(generated) for rule in self.repetitions)

    def graced(self, state: StepState) -> str | None:
        """The reason of a timeout or deadline with grace if it is up and the row's text has just
        reached its boundary (as a run alone ends such a row), else None."""
        due = [c for c in self.soft if c.due(state.elapsed)]
        if not due or not self.emitted:
            return None
        grace = "sentence" if any(c.grace == "sentence" for c in due) else "line"
        return due[0].reason if at_boundary("".join(self.pieces[-8:]), grace) else None

    def text(self, chunk: str, step: int) -> None:
        self.emitted = chunk
        if chunk:
            self.pieces.append(chunk)
            self.job.emit("text", text=chunk, step=step)

    def end(self, reason: str, stopped: bool, row_reason: str | None = None) -> None:
        self.reason, self.stopped, self.row_reason = reason, stopped, row_reason or reason
        self.ended_at = time.monotonic()
        self.text(self.decoder.flush(), self.steps)
        outcome = self.outcome()
        with self.job.lock:
            self.job.step, self.job.total = outcome.steps, outcome.total_steps
            self.job.outcome = outcome.summary()
            self.job.result = {"text": outcome.output, "prompt_tokens": self.prompt_tokens,
                               "completion_tokens": outcome.steps}
        state: JobState = "stopped" if outcome.stopped else "completed"
        self.on_end(self.job, (state, outcome.reason, outcome.summary(), None))

    def outcome(self) -> Outcome:
        signal = self.job.signal
        asked = signal.stopped_at if self.stopped and signal.stopped else None
        ended = self.ended_at or time.monotonic()
        return Outcome(
            stopped=self.stopped,
            reason=self.reason or "completed",
            steps=self.steps,
            total_steps=self.max_tokens,
            elapsed=ended - self.started,
            stop_latency=None if asked is None else max(0.0, ended - max(asked, self.started)),
            output="".join(self.pieces),
            row_reasons=[self.row_reason],
            detail="ran as one row of a batch",
        )


class RowStops(StoppingCriteria):
    """The batch's stopping criterion: reports each row's new token to its job and ends rows one by
    one (see the module docstring). ``prompt_len`` is the padded prompt length; ``eos`` the end of
    sequence ids; ``step_delay`` the engine's test-only throttle, waited once per token."""

    def __init__(self, rows: Sequence[Row], prompt_len: int, eos: set[int], step_delay: float = 0.0) -> None:
        self.rows = rows
        self.prompt_len = prompt_len
        self.eos = eos
        self.step_delay = step_delay
        self.eos_token_id = None  # generate pads the rows a criterion ends only if one has this attribute
        self._pause = threading.Event()  # never set: the throttle's wait

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        step = input_ids.shape[1] - self.prompt_len
        tokens = input_ids[:, -1].tolist()  # one read of the new tokens for every row
        done = [row.done for row in self.rows]
        for i, row in enumerate(self.rows):
            if row.done:
                continue
            row.steps = step
            state = StepState(
                step=step,
                total=row.max_tokens,
                elapsed=time.monotonic() - row.started,
                input_ids=input_ids[i : i + 1],
                prompt_length=self.prompt_len,
            )
            row.job.reach(state)  # first: a stop requested from now on ends the row at this step or the next
            row.text(row.decoder.push([tokens[i]]), step)
            row.job.emit("progress", step=step, total=row.max_tokens)
            self._check(row, state, tokens[i], input_ids[i : i + 1], scores)
            done[i] = row.done
        if self.step_delay and not all(done):
            self._pause.wait(self.step_delay)
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)  # type: ignore[return-value]

    @staticmethod
    def first(row: Row) -> None:
        """The check before the first token, as a run alone makes it (step 0): a stop or a condition
        already met ends the row with no token."""
        state = StepState(step=0, total=row.max_tokens, elapsed=time.monotonic() - row.started)
        row.job.reach(state)
        RowStops._stopped(row, state)

    @staticmethod
    def _stopped(row: Row, state: StepState) -> bool:
        """End the row if its job's stop, hold or conditions say so; whether they did."""
        job = row.job
        if job.signal.stopped:
            row.end(job.signal.reason or "user", True)
        elif job.interrupt.stopped:
            row.end(job.interrupt.reason or "user", True)
        elif job.signal.skips > row.skips:
            row.end("skipped", True)
        elif row.condition is not None and (reason := row.condition.check(state)) is not None:
            row.end(reason, True)
        return row.done

    def _check(self, row: Row, state: StepState, token: int, ids: torch.Tensor, scores: Any) -> None:
        if self._stopped(row, state):
            return
        if row.strings is not None and bool(row.strings(ids, scores)[0]):
            row.end("stop_string", True)
        elif row.repetitions and row.loops(ids[0, self.prompt_len :].tolist()):
            row.end("repetition", True)
        elif row.soft and (reason := row.graced(state)) is not None:
            row.end(reason, True)
        elif token in self.eos:
            row.end("eos", False)
        elif state.step >= row.max_tokens:
            row.end("length", False)


def _left_padding(tokenizer: Any) -> Any:
    """A copy of ``tokenizer`` that pads on the left (with its end-of-sequence token if it has no pad)."""
    padded = copy.deepcopy(tokenizer)
    padded.padding_side = "left"
    if padded.pad_token is None:
        padded.pad_token = padded.eos_token
    return padded


def run_batch(model: Any, tokenizer: Any, jobs: Sequence[Job], prompts: Sequence[str],
              on_end: Callable[[Job, Ended], None], step_delay: float = 0.0) -> None:
    """Run ``jobs`` (with their ``prompts``) as the rows of one greedy ``generate`` on ``model``. Each
    job gets its text and progress events as the tokens come, and once its row ends, its result and
    ``on_end(job, ended)`` (its final state, reason, Outcome summary and error), while the other rows
    go on. If ``generate`` fails, every row still running ends as failed.

    The jobs must be marked started by the caller. A job stopped before the batch starts ends at
    step 0 with its reason."""
    padded = _left_padding(tokenizer)
    rows = [Row(job, p, len(tokenizer(p)["input_ids"]), tokenizer, on_end)
            for job, p in zip(jobs, prompts, strict=True)]
    for row in rows:
        row.job.emit("started")
    try:
        encoded = padded(list(prompts), return_tensors="pt", padding=True).to(model.device)
        prompt_len = int(encoded["input_ids"].shape[1])
        eos = model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        stops = RowStops(rows, prompt_len, eos_ids, step_delay)
        for row in rows:
            stops.first(row)
        if not all(row.done for row in rows):
            with torch.inference_mode():
                model.generate(
                    **encoded,
                    max_new_tokens=max(row.max_tokens for row in rows),
                    do_sample=False,
                    pad_token_id=padded.pad_token_id,
                    stopping_criteria=StoppingCriteriaList([stops]),
                )
    except Exception as exc:  # the rows still running report it as failed; the worker lives on
        log.exception("a batch of %d jobs failed", len(rows))
        failed: Ended = ("failed", "error", None, f"{type(exc).__name__}: {exc}")
        for row in rows:
            if not row.done:
                row.reason = "error"
                on_end(row.job, failed)
        return
    for row in rows:
        if not row.done:  # generate returned without the criterion ending the row
            row.end("length", False)
