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

    For text, ``input_ids`` holds every row so far, prompt included: its first ``prompt_length``
    tokens are the prompt of the current ``generate`` call, and ``generation`` counts those calls
    within the run (a pipeline given several prompts makes one per prompt), so a consumer decodes
    exactly the new tokens without guessing where generation started.
    """

    step: int = 0
    total: int | None = None
    elapsed: float = 0.0
    input_ids: Any = None
    scores: Any = None
    latents: Any = None
    timestep: Any = None
    block: bool = False
    prompt_length: int | None = None
    generation: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
