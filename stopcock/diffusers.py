"""stopcock's helpers for diffusers, for code that calls the pipeline itself.

- ``step_callback(stop)``: a ``callback_on_step_end`` for pipelines that honour their interrupt flag;
- ``attach(pipe, stop)``: a ``with`` block that stops the pipeline's calls made inside it (any pipeline);
- ``guard(pipe)``: the pipeline refuses transformers ``generate()`` arguments with a clear error;
- ``honours_interrupt(pipe)``: whether its ``__call__`` checks the interrupt flag at every step.

The first three are also ``stopcock.step_callback``, ``stopcock.attach`` and ``stopcock.guard``.
``stopcock.run(pipe, ...)`` needs none of this. Importing this module imports diffusers.
"""

from __future__ import annotations

from .adapters.diffusers import Handle, attach, guard, honours_interrupt, step_callback

__all__ = ["Handle", "attach", "guard", "honours_interrupt", "step_callback"]
