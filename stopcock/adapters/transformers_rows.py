"""The row conditions of a generate call, applied per row: stop strings, repetition, soft deadlines.

:class:`RowEnds` is called by the run's criterion at each token with the rows so far and says which
rows end now; :meth:`RowEnds.why` reads afterwards why a returned row ended, from the row itself.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.generation.stopping_criteria import StopStringCriteria

from ..conditions import Condition, Repetition, SoftDeadline, SoftTimeout, StopStrings, at_boundary
from ..control import RunControl

__all__ = ["RowEnds", "row_ends"]

#: how many of a row's last tokens are decoded to find a boundary (enough for a closing quote)
_TAIL_TOKENS = 4


class RowEnds:
    """The row conditions of a run: which rows end at each token, and why a row ended.

    ``strings``: transformers' criterion for the stop strings; ``repetitions``: the ``repetition()``
    conditions; ``soft``: the timeouts and deadlines with grace, whose boundaries are found on the
    rows' text decoded with ``tokenizer``.
    """

    def __init__(
        self,
        control: RunControl,
        strings: StopStringCriteria | None,
        repetitions: list[Repetition],
        soft: list[SoftTimeout | SoftDeadline],
        tokenizer: Any,
    ) -> None:
        self.control = control
        self.strings = strings
        self.repetitions = repetitions
        self.soft = soft
        self.tokenizer = tokenizer
        self.soft_from: int | None = None  # the new-token count at which the current call's grace began

    def start(self) -> None:
        """A new generate call begins."""
        self.soft_from = None

    def __call__(self, input_ids: torch.Tensor, scores: Any, prompt_len: int) -> torch.Tensor:
        """The rows that end at this token (a bool per row)."""
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        if self.strings is not None:
            done |= self.strings(input_ids, scores)
        for rule in self.repetitions:
            done |= _looping(input_ids[:, prompt_len:], rule)
        if self.soft:
            new = input_ids.shape[1] - prompt_len
            if self.soft_from is None and any(c.due(self.control.elapsed) for c in self.soft):
                self.soft_from = new
            if self.soft_from is not None and new > 0:
                tail = input_ids[:, max(prompt_len, input_ids.shape[1] - _TAIL_TOKENS) :]
                tails = self.tokenizer.batch_decode(tail, skip_special_tokens=True)
                grace = self._grace()
                ends = [at_boundary(text, grace) for text in tails]
                done |= torch.tensor(ends, dtype=torch.bool, device=input_ids.device)
        return done

    def _grace(self) -> str:
        """The grace of the soft conditions that are due: a line is also a sentence's end."""
        due = [c.grace for c in self.soft if c.due(self.control.elapsed)]
        return "sentence" if "sentence" in due else "line"

    def why(self, row: torch.Tensor, new: list[int]) -> str | None:
        """Why a returned row ended by a row condition (None if it did not): ``row`` is the row up to
        its last real token, ``new`` its generated tokens up to there."""
        if self.strings is not None and new and bool(self.strings(row, None)):
            return "stop_string"
        if new and any(rule.loops(new) for rule in self.repetitions):
            return "repetition"
        if self.soft_from is not None and len(new) >= self.soft_from:
            text = self.tokenizer.decode(new[-_TAIL_TOKENS:], skip_special_tokens=True)
            if at_boundary(text, self._grace()):
                return next(c.reason for c in self.soft if c.due(self.control.elapsed))
        return None


def _looping(generated: torch.Tensor, rule: Repetition) -> torch.Tensor:
    """The rows whose ``generated`` tokens loop by ``rule`` (see :meth:`Repetition.loops`)."""
    n, rows = rule.ngram, generated.shape[0]
    tail = generated[:, -rule.window :]
    if tail.shape[1] < n * rule.repeats:
        return torch.zeros(rows, dtype=torch.bool, device=generated.device)
    grams = tail.unfold(1, n, 1)  # (rows, windows, n)
    count = (grams == tail[:, -n:].unsqueeze(1)).all(dim=2).sum(dim=1)
    return count >= rule.repeats


def row_ends(control: RunControl, conditions: list[Condition], tokenizer: Any) -> RowEnds | None:
    """The :class:`RowEnds` of a run's top-level row ``conditions`` (None when there are none)."""
    if not conditions:
        return None
    strings = [s for c in conditions if isinstance(c, StopStrings) for s in c.strings]
    soft = [c for c in conditions if isinstance(c, (SoftTimeout, SoftDeadline))]
    if (strings or soft) and tokenizer is None:
        what = "stop_strings(...)" if strings else "timeout/deadline(grace=...)"
        raise ValueError(
            f"{what} needs the model's tokenizer: pass tokenizer=... (to stopcock.run with a model,"
            " or to stopcock.stopping_criteria), or run a text-generation pipeline, which has one"
        )
    return RowEnds(
        control,
        StopStringCriteria(tokenizer, strings) if strings else None,
        [c for c in conditions if isinstance(c, Repetition)],
        soft,
        tokenizer,
    )
