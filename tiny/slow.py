"""A slow step on demand: a real layer inside a model that keeps its forward busy.

``slow_down(model, "mid_block.resnets.0.conv1")`` puts a :class:`SlowLayer` in front of that
submodule (an ``nn.Sequential`` of the two, so the model's output is unchanged). While it holds,
the layer calls its own small inner module over and over, as a long forward of many module calls
does, until ``release`` is set or ``seconds`` have passed; a stop that is armed inside the forward
lands at one of those calls. Tests hold one chosen call (``hold_at``) and release it through the
events; the server's load check makes every call take ``seconds``.
"""

from __future__ import annotations

import threading
import time

import torch
from torch import nn

__all__ = ["SlowLayer", "slow_down"]

#: A hold never lasts longer than this (a test that forgets to release fails instead of hanging).
LIMIT = 120.0


class SlowLayer(nn.Module):
    """Passes its input through; the calls it holds stay busy (see the module docstring).

    ``hold_at``: the 0-based call to hold until ``release`` (None: none); ``seconds``: how long
    every call takes (None: no time). ``entered`` is set when a hold begins; ``calls`` counts calls.
    """

    def __init__(self, *, hold_at: int | None = None, seconds: float | None = None) -> None:
        super().__init__()
        self.inner = nn.Identity()
        self.hold_at = hold_at
        self.seconds = seconds
        self.entered = threading.Event()
        self.release = threading.Event()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        call, self.calls = self.calls, self.calls + 1
        holding = call == self.hold_at
        if not holding and self.seconds is None:
            return x
        start = time.monotonic()
        if holding:
            self.entered.set()
        while not (holding and self.release.is_set()):
            if self.seconds is not None and not holding and time.monotonic() - start >= self.seconds:
                break
            if time.monotonic() - start > LIMIT:
                raise RuntimeError(f"SlowLayer held call {call} for {LIMIT:g} s: nobody released it")
            self.inner(x)
        return x


def slow_down(model: nn.Module, name: str, layer: SlowLayer) -> SlowLayer:
    """Put ``layer`` in front of ``model``'s submodule ``name``; returns ``layer``."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, nn.Sequential(layer, getattr(parent, child)))
    return layer
