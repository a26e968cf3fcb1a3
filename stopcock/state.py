"""What a stop condition sees at each check."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["StepState"]


@dataclass
class StepState:
    """The state of a run at a check.

    ``step`` counts completed steps (tokens generated, denoising steps done, items processed);
    ``total`` is the planned number when known. ``block`` is True for checks made inside a model
    forward (abort mode), where only conditions that can change between steps are evaluated.
    The tensor fields hold the library's tensors for the step, or None where they do not apply.
    """

    step: int = 0
    total: int | None = None
    elapsed: float = 0.0
    input_ids: Any = None
    scores: Any = None
    latents: Any = None
    timestep: Any = None
    block: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
