"""Forward pre-hooks: the fallback that reaches inside a model forward.

Used for abort mode (a check before every block, so a long prefill or denoiser call is abandoned
within one block) and for libraries with no step hook (a check before each denoiser call). Hooks
act only on the thread that installed them, so a concurrent run on the same model in another
thread is not touched, and they are always removed when the ``with`` block exits.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

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
    """Call ``fn(module)`` before each forward of each module, on this thread only."""
    owner = threading.get_ident()

    def hook(module: nn.Module, args: Any) -> None:
        if threading.get_ident() == owner:
            fn(module)

    handles = []
    try:
        for m in dict.fromkeys(modules):  # each module once, order kept
            handles.append(m.register_forward_pre_hook(hook))
        yield
    finally:
        for h in handles:
            h.remove()
