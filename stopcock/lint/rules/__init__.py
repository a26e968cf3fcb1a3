"""The rules, one module each, in code order."""

from __future__ import annotations

from ..engine import Rule
from .stc001_generate_args import GenerateArgsToDiffusers
from .stc002_interrupt import InterruptIgnored
from .stc003_callback import CallbackContract
from .stc004_row_zero import RowZeroCriteria
from .stc005_streamer import UnstoppableStreamer
from .stc006_other_engines import OtherEngineArgs
from .stc007_max_time import ReusedMaxTime
from .stc008_swallow import SwallowedStop

__all__ = ["RULES", "rule"]

RULES: tuple[type[Rule], ...] = (
    GenerateArgsToDiffusers,
    InterruptIgnored,
    CallbackContract,
    RowZeroCriteria,
    UnstoppableStreamer,
    OtherEngineArgs,
    ReusedMaxTime,
    SwallowedStop,
)


def rule(code: str) -> type[Rule] | None:
    """The rule with this code (``STC001``), or None."""
    return next((r for r in RULES if r.code == code.upper()), None)
