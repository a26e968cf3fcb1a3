"""``stopcock text --tp N``: the text model sharded over ``N`` processes of this machine.

Rank 0 is the command's own process: it reads the options, loads its shard, prints the text and
the Outcome, and holds every stop (Ctrl+C, ``--timeout``, ``--max-steps``); ranks 1..N-1 are worker
processes (``python -m stopcock.cli_ranks MODEL``, started by :class:`~stopcock.local_ranks.LocalGroup`)
that load their shard and make each run rank 0 makes, with the same arguments. The stop is agreed
(:mod:`stopcock.ranks`): every rank stops at the same token, one token after the one where rank 0
decided. Rank 0 compares each rank's end (reason, tokens) with its own and fails loudly if they
differ. Stops that end rows one by one (``--stop``, ``--repetition``, ``--grace``) are not agreed
across ranks and are refused with ``--tp``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from .cli_args import number
from .errors import UsageError, UserError
from .loading import load_text_model
from .local_ranks import LocalGroup, check_shardable, report_of, worker_main
from .outcome import Outcome
from .ranks import RanksError, group_of
from .types import Mode

__all__ = ["TextRanks", "add_arguments", "main"]

OPTION = "--tp"
_ROW_OPTIONS = {"stop": "--stop", "repetition": "--repetition", "grace": "--grace"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--tp`` to the ``text`` command."""
    parser.add_argument(
        OPTION, type=number(int, 1, "a number of ranks >= 1"), default=1, metavar="N",
        help="shard the model over N processes on this machine (transformers' tensor parallelism, gloo, 1"
             " torch thread each unless --threads); the model needs a tensor-parallel plan (e.g. Llama). A"
             " stop (Ctrl+C, --timeout, --max-steps) ends every rank at the same token, one after the one"
             " where it was decided",
    )


class TextRanks:
    """Rank 0 of a ``--tp`` command: loads its shard (:meth:`load`) and makes each run on every rank
    (:meth:`run`). ``broken`` once a run did not end on every rank: the workers are then terminated."""

    def __init__(self, group: LocalGroup) -> None:
        self.group = group
        self.broken = False

    @classmethod
    @contextmanager
    def started(cls, args: argparse.Namespace, spec: str) -> Iterator[TextRanks | None]:
        """Around a ``text`` command: with ``--tp N`` (N > 1), ranks 1..N-1 started and this process rank 0
        of the group (ended after the block); else None."""
        world = getattr(args, "tp", 1)
        if world <= 1:
            yield None
            return
        given = [flag for name, flag in _ROW_OPTIONS.items() if getattr(args, name, None)]
        if given:
            raise UsageError(f"{given[0]} ends the text row by row, which is not agreed across ranks: drop it"
                             f" with {OPTION} (--timeout, --max-steps and Ctrl+C are agreed)")
        check_shardable(spec, world, OPTION)
        import torch

        threads = args.threads or 1
        torch.set_num_threads(threads)
        try:
            ranks = cls(LocalGroup(world, "stopcock.cli_ranks", [spec], threads=threads))
        except RanksError as exc:  # a rank that could not start or join
            raise UserError(f"{OPTION} {world}: {exc}") from None
        try:
            yield ranks
        finally:
            ranks.group.close(abandon=ranks.broken)
        ranks.tell()

    def tell(self) -> None:
        """Say on stderr where every rank ended each run (the workers' reports, found equal to rank 0's)."""
        ends = enumerate(self.group.reports, 1)
        runs = [f"run {n} at token {r[0]['steps']} ({r[0]['reason']})" for n, r in ends]
        if runs:
            head = f"stopcock: {OPTION} {self.group.world}: every rank ended at the same token"
            print(f"{head}: {', '.join(runs)}", file=sys.stderr)

    def load(self, spec: str, *, quiet: bool = False) -> tuple[Any, Any]:
        """This rank's shard of the model, and the tokenizer."""
        loaded = None
        try:
            loaded = load_text_model(spec, quiet=quiet, sharded=True)
        finally:
            self.broken = self.broken or loaded is None  # e.g. Ctrl+C inside the load: the others are in it
        if group_of(loaded[0]) is None:  # a run would not be agreed: the ranks would part at its first stop
            self.broken = True
            raise UserError(f"{OPTION} {self.group.world}: the model in {spec} was loaded unsharded: run it"
                            f" without {OPTION}")
        return loaded

    def run(self, target: Any, *args: Any, stop: Any, mode: Mode, on_step: Any, **kwargs: Any) -> Outcome:
        """``stopcock.run`` on every rank: the workers get the same arguments (but the stop and the
        step hook, which are rank 0's); then each rank's end is compared with this one's."""
        from .runner import run

        n = self.group.post({"args": [_encode(a) for a in args], "mode": mode,
                             "kwargs": {k: _encode(v) for k, v in kwargs.items() if k != "tokenizer"}})
        ended = False
        try:
            outcome = run(target, *args, stop=stop, mode=mode, on_step=on_step, **kwargs)
            ended = True
        except RanksError as exc:
            raise UserError(f"{OPTION} {self.group.world}: {exc}") from None
        finally:
            self.broken = self.broken or not ended
        try:
            reports = self.group.results(n)
        except RanksError as exc:
            self.broken = True
            raise UserError(f"{OPTION} {self.group.world}: {exc}") from None
        mine = report_of(outcome)
        for rank, theirs in enumerate(reports, 1):
            if theirs != mine:
                self.broken = True
                raise UserError(
                    f"{OPTION} {self.group.world}: rank {rank} ended its run as {_told(theirs)}, rank 0 as"
                    f" {_told(mine)}: the ranks did not agree (please report it)"
                )
        return outcome


def _told(report: dict[str, Any]) -> str:
    return report["error"] if "error" in report else f"{report['reason']} after {report['steps']} tokens"


def _encode(value: Any) -> Any:
    """A run's argument as JSON: a tensor as its values and dtype."""
    if hasattr(value, "tolist") and hasattr(value, "dtype"):
        return {"tensor": value.tolist(), "dtype": str(value.dtype).removeprefix("torch.")}
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"tensor", "dtype"}:
        import torch

        return torch.tensor(value["tensor"], dtype=getattr(torch, value["dtype"]))
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """A worker rank (``python -m stopcock.cli_ranks MODEL``, started by rank 0): join the group, load
    the shard, make each run rank 0 posts."""
    from .runner import run

    def executor(model: Any, tokenizer: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
        def execute(message: dict[str, Any]) -> dict[str, Any]:
            args = [_decode(a) for a in message["args"]]
            kwargs = {k: _decode(v) for k, v in message["kwargs"].items()}
            return report_of(run(model, *args, mode=message["mode"], tokenizer=tokenizer, **kwargs))

        return execute

    return worker_main(argv, "stopcock", executor)


if __name__ == "__main__":
    sys.exit(main())
