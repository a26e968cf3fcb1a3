"""The argument types of the command line: each parses one value or names what it expects."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

__all__ = ["COUNT", "SECONDS", "SEED", "STEP", "number", "repetition", "stop_string"]


def number(kind: Callable[[str], Any], minimum: float, what: str, maximum: float = math.inf
           ) -> Callable[[str], Any]:
    """An argument type: ``kind(text)`` from ``minimum`` to ``maximum``, else an error naming ``what``."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value

    return parse


SECONDS = number(float, 0.0, "a number of seconds >= 0")
COUNT = number(int, 1, "an integer >= 1")
STEP = number(int, 0, "an integer >= 0")
SEED = number(int, 0, "a seed: an integer from 0 to 2**64 - 1", maximum=2**64 - 1)


def stop_string(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("a stop string cannot be empty")
    return text


def repetition(text: str) -> dict[str, int]:
    try:
        ngram, repeats, window = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not NGRAM,REPEATS,WINDOW (e.g. 4,3,64)") from None
    return {"ngram": ngram, "repeats": repeats, "window": window}
