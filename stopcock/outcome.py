"""The result of a run: what happened, honestly."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .state import StepState

__all__ = ["Outcome"]


@dataclass
class Outcome:
    """How a run ended.

    ``reason`` is the stop reason when ``stopped`` (``"user"`` or the reason given to ``stop()``,
    ``"timeout"``, ``"deadline"``, ``"max_steps"``, ``"stop_string"``, ``"repetition"``,
    ``"converged"``, a ``when`` reason), and
    otherwise how it completed (``"completed"``, ``"eos"``, ``"length"``). ``stopped`` is True only
    when the stop took effect, i.e. a check saw it before the run ended; a stop that arrives after
    the last check changes nothing. ``stop_latency`` is measured from the stop request (or from the
    start of the run, if the request came earlier) to the return, on this process's monotonic
    clock. In a run agreed across ranks (``run(..., group=)``) every rank measures it on its own
    clock, from when that rank first knew of the stop: the rank that decided, from its own request;
    any other rank, from the moment it read the announcement of the stop step (not from the agreed
    step, nor from the other rank's request, whose clock it does not share). ``mode`` is the mode actually
    used, which can differ from the one asked for (``detail`` then says why). ``item_reasons``
    (runs over several inputs) says how each item that started ended: ``"completed"``,
    ``"skipped"`` or the stop reason; items that never started are not listed.

    ``checkpoint`` is set by ``run(..., checkpoint=True)``: what ``stopcock.resume`` needs to continue
    the run. ``resumed`` is set on the Outcome of a resumed run: ``from_step`` (the checkpoint's step),
    ``saved_steps`` (steps not recomputed), ``exact`` (whether the output is guaranteed bit-identical
    to the run never stopped) and ``how`` (``"replay"``, ``"cache"`` or ``"recompute"``).
    """

    stopped: bool
    reason: str
    steps: int
    total_steps: int | None
    elapsed: float
    stop_latency: float | None
    output: Any
    mode: str = "finish"
    latents: Any = None
    partial: str | None = None
    row_reasons: list[str] | None = None
    detail: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    item_reasons: list[str] | None = None
    checkpoint: Any = None
    resumed: dict[str, Any] | None = None

    @classmethod
    def without_output(
        cls,
        last: StepState | None,
        *,
        reason: str,
        stopped: bool = True,
        elapsed: float = 0.0,
        stop_latency: float | None = None,
        mode: str = "finish",
        detail: str | None = None,
    ) -> Outcome:
        """The Outcome of a run that returned nothing from the library: it never started, was
        abandoned inside a step, or failed. Its progress is that of ``last``, the last step seen
        (none: step 0); its latents and token ids are that step's."""
        last = last or StepState()
        return cls(
            stopped=stopped,
            reason=reason,
            steps=last.step,
            total_steps=last.total,
            elapsed=elapsed,
            stop_latency=stop_latency,
            output=None,
            mode=mode,
            latents=last.latents,
            detail=detail,
            extra={} if last.input_ids is None else {"input_ids": last.input_ids},
        )

    def describe(self, unit: str = "step") -> str:
        """One readable line: how it ended, after how many ``unit``s, how fast, and ``detail``."""
        total = f" of {self.total_steps}" if self.total_steps is not None else ""
        head = "stopped" if self.stopped else "completed"
        if self.reason != "completed":
            head += f" ({self.reason})"
        parts = [f"{head} after {self.steps}{total} {unit}s in {self.elapsed:.3f} s"]
        if self.stop_latency is not None:
            parts.append(f"stop latency {self.stop_latency * 1000:.1f} ms")
        parts.append(f"mode {self.mode}")
        if self.partial and self.output is not None:
            parts.append(f"partial image: {self.partial}")
        text = ", ".join(parts)
        return f"{text}. {self.detail}" if self.detail else text

    def summary(self) -> dict[str, Any]:
        """The JSON-serialisable fields (all but ``output``, ``latents``, ``extra`` and ``checkpoint``)."""
        return {
            "stopped": self.stopped,
            "reason": self.reason,
            "steps": self.steps,
            "total_steps": self.total_steps,
            "elapsed": round(self.elapsed, 6),
            "stop_latency": None if self.stop_latency is None else round(self.stop_latency, 6),
            "mode": self.mode,
            "partial": self.partial,
            "row_reasons": self.row_reasons,
            "item_reasons": self.item_reasons,
            "detail": self.detail,
            "resumed": self.resumed,
        }
