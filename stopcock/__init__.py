"""stopcock: stop Hugging Face pipelines the right way.

One stop signal for transformers and diffusers: stop from any thread, for any reason, within one
step (or at the next module call when aborting), with the reason, the step reached and the partial result.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_names
from ._version import __version__ as __version__
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

if TYPE_CHECKING:  # the lazy names' real types for type checkers; at run time they stay lazy (above)
    # ``X as X``: an explicit re-export (the lazy names reach ``__all__`` through ``_LAZY``).
    from .adapters.diffusers import attach as attach
    from .adapters.diffusers import guard as guard
    from .adapters.diffusers import step_callback as step_callback
    from .aio import AsyncStream as AsyncStream
    from .aio import arun as arun
    from .aio import astream as astream
    from .checkpoint import Checkpoint as Checkpoint
    from .checkpoint import CheckpointError as CheckpointError
    from .checkpoint import CheckpointMismatch as CheckpointMismatch
    from .transformers import stopping_criteria as stopping_criteria


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
