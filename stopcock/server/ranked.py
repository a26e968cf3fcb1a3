"""A text model served as a group of ranks: ``stopcock serve --tp N`` (the local engine).

The model is sharded with transformers' tensor parallelism over ``N`` processes of this machine
(:class:`~stopcock.local_ranks.LocalGroup`). Rank 0 lives in the server process: its shard runs
in the engine's worker (the lane of :class:`RankedTextBackend`), with the job's stop signal and
conditions. Ranks 1..N-1 are worker processes (``python -m stopcock.server.ranked MODEL``): for
each run of a job, rank 0 posts the prompt and the decoding parameters in the group's store, and
each worker makes the same ``stopcock.run`` call on its shard. A stop by id, a timeout, a
disconnect or the server's shutdown stops rank 0's run, and the agreement of :mod:`stopcock.ranks`
stops every rank at the same step (one step after the one where rank 0 decided). After each run,
rank 0 compares each worker's report of its end (reason, steps, text) with its own: a job whose
ranks did not agree fails, as does a job whose ranks cannot go on (a worker died); the model then
refuses new jobs (503) until the server is started again.

What a group run does not have: batching (each job runs alone), checkpoints (a pause or a
preemption ends the job as stopped, its text kept), escalation to abort (``--stop-grace``: a rank
left inside a forward would hold the others in a collective), stop strings (they end rows one by one).
"""

from __future__ import annotations

import secrets
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..conditions import from_options
from ..errors import UserError
from ..events import RowDecoder
from ..loading import load_text_model
from ..local_ranks import LocalGroup, check_shardable, report_of, worker_main
from ..outcome import Outcome
from ..ranks import RanksError, group_of
from ..runner import run
from ..state import StepState
from .backends import TextBackend, TextLane, each_item
from .contract import Backend, InvalidJob, JobSpec, RunContext, Unavailable
from .schemas import MIN_SAMPLING_TEMPERATURE

__all__ = ["RankedTextBackend", "RankedTextLane", "load_ranked_backends", "main"]

OPTION = "--tp"


def _generate(pipe: Any, prompt: str, params: Mapping[str, Any], **options: Any) -> Outcome:
    """The run every rank makes for one prompt of a job: the same on each, but rank 0's ``options``."""
    return run(pipe, prompt, max_new_tokens=params["max_tokens"], return_full_text=False,
               **TextLane.decoding(params), **options)


class RankedTextBackend:
    """A ``text-generation`` pipeline over a model sharded across ``group``'s ranks, this process rank
    0 (see the module docstring). One lane: the ranks make one run at a time."""

    kind = "text"

    def __init__(self, group: LocalGroup, pipe: Any, name: str, description: str = "") -> None:
        self.group = group
        self.pipe = pipe
        self.name = name
        self.description = description
        self.text = TextBackend(pipe, name, description)  # the prompt and its checks are a text model's
        self.broken: str | None = None  # why the ranks cannot run another job
        self._lanes = 0

    @classmethod
    def load(cls, model: str, world: int, *, threads: int = 1, name: str | None = None) -> RankedTextBackend:
        """Start ranks 1..``world``-1 and load this process's shard of ``model`` (a folder or hub id);
        a :class:`~stopcock.errors.UserError` naming the fix if it cannot be sharded."""
        from transformers import pipeline

        check_shardable(model, world, OPTION)
        try:
            group = LocalGroup(world, "stopcock.server.ranked", [model], threads=threads)
        except RanksError as exc:  # a rank that could not start or join
            raise UserError(f"{OPTION} {world}: {exc}") from None
        loaded = False
        try:
            lm, tokenizer = load_text_model(model, sharded=True)
            if group_of(lm) is None:
                raise UserError(f"{OPTION} {world}: the model in {model} was loaded unsharded: serve it"
                                f" without {OPTION}")
            backend = cls(group, pipeline("text-generation", model=lm, tokenizer=tokenizer), name or model)
            loaded = True
        finally:
            if not loaded:
                group.close(abandon=True)
        return backend

    def prompts(self, spec: JobSpec) -> tuple[str, ...]:
        return self.text.prompts(spec)

    def validate(self, spec: JobSpec) -> None:
        if self.broken is not None:
            raise Unavailable(f"the text model's ranks cannot run jobs ({self.broken}): restart the server")
        row = [name for name in ("stop_strings", "repetition", "grace") if spec.stop.get(name)]
        if row:
            raise InvalidJob(f"{row[0]} ends the text row by row, which is not agreed across the ranks of"
                             " this model: leave it out (timeout, deadline and max_steps are agreed)")
        self.text.validate(spec)

    def lane(self) -> RankedTextLane:
        if self._lanes:
            raise ValueError(f"a model served with {OPTION} runs one job at a time: serve it with one worker")
        self._lanes += 1
        return RankedTextLane(self)

    def run_all(self, prompt: str, params: Mapping[str, Any], **options: Any) -> Outcome:
        """Run ``prompt`` on every rank (rank 0 with ``options``: the job's stop and step hook), then
        check that every rank ended as this one did."""
        n = self.group.post({"prompt": prompt, "params": dict(params)})
        ended = False
        try:
            outcome = _generate(self.pipe, prompt, params, **options)
            ended = True
        except RanksError as exc:
            self.broken = str(exc)
            raise
        finally:
            if not ended:
                self.broken = self.broken or "a run did not end on every rank"
        try:
            reports = self.group.results(n)
        except RanksError as exc:
            self.broken = str(exc)
            raise
        mine = report_of(outcome)
        for rank, theirs in enumerate(reports, 1):
            if theirs != mine:
                self.broken = f"rank {rank} ended a run as {theirs}, rank 0 as {mine}"
                raise RanksError(f"the ranks did not agree: {self.broken} (please report it)")
        return outcome

    def close(self) -> None:
        """End the worker processes (terminated if a run did not end on every rank)."""
        self.group.close(abandon=self.broken is not None)


class RankedTextLane:
    """The one lane of a :class:`RankedTextBackend`: each prompt of a job run on every rank."""

    def __init__(self, backend: RankedTextBackend) -> None:
        self.backend = backend

    def execute(self, spec: JobSpec, ctx: RunContext) -> Outcome:
        backend = self.backend
        params = dict(spec.params)
        if params["temperature"] >= MIN_SAMPLING_TEMPERATURE and params.get("seed") is None:
            params["seed"] = secrets.randbits(63)  # every rank draws its tokens with the same generator

        def one(prompt: str, checkpoint: Any) -> tuple[Outcome, dict[str, Any]]:
            rows = RowDecoder(backend.pipe.tokenizer)
            pieces: list[str] = []

            def publish(chunks: list[Any], step: int) -> None:
                for chunk in chunks:
                    if chunk.text:
                        pieces.append(chunk.text)
                        ctx.text(chunk.text, step)

            report: Callable[[StepState], None] = lambda state: publish(rows.chunks(state), state.step)  # noqa: E731
            outcome = backend.run_all(prompt, params, stop=ctx.stop(from_options(spec.stop)),
                                      on_step=ctx.on_step(report))
            publish(rows.flush(), outcome.steps)
            prompt_tokens = len(backend.pipe.tokenizer(prompt)["input_ids"])
            return outcome, {"text": "".join(pieces), "prompt_tokens": prompt_tokens,
                             "completion_tokens": outcome.steps}

        return each_item(spec, ctx, backend.prompts(spec), one)


def load_ranked_backends(
    text_model: str | None, image_model: str | None, world: int, *, threads: int | None, concurrency: int,
) -> dict[str, Backend]:
    """``stopcock serve --tp N``: the text model sharded over ``world`` local ranks, and the image model
    (if given) as usual; a :class:`~stopcock.errors.UserError` naming the fix for what cannot be."""
    from .backends import load_backends

    if text_model is None:
        raise UserError(f"{OPTION} {world} shards the text model: give --text-model (a model with a"
                        " tensor-parallel plan, e.g. a Llama)")
    if concurrency != 1:
        raise UserError(f"{OPTION} {world}: the ranks run one job at a time: drop --concurrency")
    import torch

    torch.set_num_threads(threads or 1)
    backends: dict[str, Backend] = {}
    if image_model is not None:
        backends.update(load_backends(None, image_model))
    backends["text"] = RankedTextBackend.load(text_model, world, threads=threads or 1)
    return backends


def main(argv: Sequence[str] | None = None) -> int:
    """A worker rank (``python -m stopcock.server.ranked MODEL``, started by the server): join the
    group, load the shard, make each run rank 0 posts."""
    from transformers import pipeline

    def executor(lm: Any, tokenizer: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
        pipe = pipeline("text-generation", model=lm, tokenizer=tokenizer)
        return lambda message: report_of(_generate(pipe, message["prompt"], message["params"]))

    return worker_main(argv, "stopcock serve", executor)


if __name__ == "__main__":
    sys.exit(main())
