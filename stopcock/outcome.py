"""The result of a run: what happened, honestly."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Outcome"]


@dataclass
class Outcome:
    """How a run ended.

    ``reason`` is the stop reason when ``stopped`` (``"user"`` or the reason given to ``stop()``,
    ``"timeout"``, ``"deadline"``, ``"max_steps"``, ``"stop_string"``, a ``when`` reason), and
    otherwise how it completed (``"completed"``, ``"eos"``, ``"length"``). ``stopped`` is True only
    when the stop took effect, i.e. a check saw it before the run ended; a stop that arrives after
    the last check changes nothing. ``stop_latency`` is measured from the stop request (or from the
    start of the run, if the request came earlier) to the return. ``mode`` is the mode actually
    used, which can differ from the one asked for (``detail`` then says why).
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

    def summary(self) -> dict[str, Any]:
        """The JSON-serialisable fields (everything but ``output``, ``latents`` and ``extra``)."""
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
            "detail": self.detail,
        }
