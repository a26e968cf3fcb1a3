"""stopcock: stop Hugging Face pipelines the right way.

One stop signal for transformers and diffusers: stop from any thread, for any reason, within one
step (or at the next module call when aborting), with the reason, the step reached and the partial result.
"""

from __future__ import annotations

from ._lazy import lazy_names
from .conditions import (
    AllOf,
    AnyOf,
    Condition,
    converged,
    deadline,
    max_steps,
    repetition,
    stop_strings,
    timeout,
    when,
)
from .control import Abort
from .events import Done, Event, Step, TextChunk
from .interrupt import interrupted
from .outcome import Outcome
from .pause import PauseSignal

# Eager (they import no heavy library): a lazy name would be shadowed by the submodule once imported.
from .resume import resume
from .runner import UnsupportedTarget, run
from .signal import StopSignal
from .state import StepState
from .stream import Stream, stream

__version__ = "0.1.0"

# Names that need a heavy library (torch, transformers, diffusers): imported on first use.
_LAZY = {
    "stopping_criteria": "stopcock.transformers",
    "step_callback": "stopcock.adapters.diffusers",
    "attach": "stopcock.adapters.diffusers",
    "guard": "stopcock.adapters.diffusers",
    "arun": "stopcock.aio",
    "astream": "stopcock.aio",
    "AsyncStream": "stopcock.aio",
    "Checkpoint": "stopcock.checkpoint",
    "CheckpointError": "stopcock.checkpoint",
    "CheckpointMismatch": "stopcock.checkpoint",
}

__getattr__ = lazy_names(__name__, _LAZY)


__all__ = [
    "Abort",
    "AllOf",
    "AnyOf",
    "Condition",
    "Done",
    "converged",
    "Event",
    "Outcome",
    "PauseSignal",
    "Step",
    "StepState",
    "StopSignal",
    "Stream",
    "TextChunk",
    "UnsupportedTarget",
    "deadline",
    "interrupted",
    "max_steps",
    "repetition",
    "resume",
    "run",
    "stop_strings",
    "stream",
    "timeout",
    "when",
    *_LAZY,
]
