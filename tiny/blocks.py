"""A model's repeated blocks, and checks before their forwards: helpers of the tests and benchmarks
(stopcock's own checks are :class:`stopcock.hooks.Tripwire`s)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from stopcock.hooks import Tripwire

__all__ = ["find_blocks", "pre_hooks"]


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a model: the items of its outermost ``nn.ModuleList``s.

    For a decoder this is its transformer layers, for a UNet its down and up blocks, for a DiT its
    transformer blocks. Returns an empty list for a model with no ModuleList.
    """
    blocks: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(child, nn.ModuleList):
                blocks.extend(child)
            else:
                visit(child)

    visit(model)
    return blocks


@contextmanager
def pre_hooks(modules: Iterable[nn.Module], fn: Callable[[nn.Module], Any]) -> Iterator[None]:
    """Call ``fn(module)`` before each forward of each module, on this thread only (armed at once)."""
    with Tripwire(modules, fn) as wire:
        wire.arm()
        yield
