"""Forward pre-hooks: the fallback that reaches inside a model forward.

Used for abort mode (a check before every block, so a long prefill or denoiser call is abandoned
within one block) and for libraries with no step hook (a check before each denoiser call). Hooks
act only on the thread that installed them, so a concurrent run on the same model in another
thread is not touched, and they are always removed when the ``with`` block exits. The same holds
for :func:`input_hooks` (before a forward, with its arguments), :func:`output_hooks` (after a
forward: diffusers' fast-forward records the loop models' outputs) and :func:`bound` (a method
replaced for this thread).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

__all__ = ["bound", "find_blocks", "input_hooks", "output_hooks", "pre_hooks"]


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
    with _thread_hooks(modules, "register_forward_pre_hook", lambda module, _args: fn(module)):
        yield


@contextmanager
def input_hooks(
    modules: Iterable[nn.Module], fn: Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], Any]
) -> Iterator[None]:
    """Call ``fn(module, args, kwargs)`` before each forward of each module, on this thread only."""
    with _thread_hooks(modules, "register_forward_pre_hook", fn, with_kwargs=True):
        yield


@contextmanager
def _thread_hooks(
    modules: Iterable[nn.Module], register: str, fn: Callable[..., Any], **options: Any
) -> Iterator[None]:
    """``fn``, hooked on each module by its ``register`` method, called on this thread only (what it
    returns is the hook's result: None, or a forward hook's replacement output)."""
    owner = threading.get_ident()

    def hook(*args: Any) -> Any:
        return fn(*args) if threading.get_ident() == owner else None

    handles = []
    try:
        for m in dict.fromkeys(modules):  # each module once, order kept
            handles.append(getattr(m, register)(hook, **options))
        yield
    finally:
        for h in handles:
            h.remove()


class _PerThread:
    """Stands in for ``obj.<name>`` while runs have bound wrappers to it: a call made on a thread
    with a binding goes to that thread's wrapper, any other call to the attribute as it was."""

    def __init__(self, obj: Any, name: str) -> None:
        self.obj, self.name = obj, name
        self.own = obj.__dict__.get(name)  # an instance attribute it replaces, put back at the end
        self.by_thread: dict[int, Callable[..., Any]] = {}
        functools.update_wrapper(self, self.original())  # signature and docs of the original

    def original(self) -> Callable[..., Any]:
        if self.own is not None:
            return self.own  # type: ignore[no-any-return]
        return getattr(type(self.obj), self.name).__get__(self.obj)  # type: ignore[no-any-return]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fn = self.by_thread.get(threading.get_ident())
        return (fn or self.original())(*args, **kwargs)


_BINDING = threading.Lock()


@contextmanager
def bound(obj: Any, name: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
    """For the ``with`` block, calls of ``obj.<name>(...)`` made on this thread go to
    ``wrap(original)``; calls from other threads are not touched, and concurrent bindings on other
    threads each get their own. The attribute is as it was once the last binding ends."""
    owner = threading.get_ident()
    with _BINDING:
        patch = obj.__dict__.get(name)
        if not isinstance(patch, _PerThread):
            patch = _PerThread(obj, name)
            object.__setattr__(obj, name, patch)
        previous = patch.by_thread.get(owner)
        patch.by_thread[owner] = wrap(previous or patch.original())
    try:
        yield
    finally:
        with _BINDING:
            if previous is not None:
                patch.by_thread[owner] = previous
            else:
                del patch.by_thread[owner]
                if not patch.by_thread:
                    if patch.own is None:
                        del obj.__dict__[name]
                    else:
                        object.__setattr__(obj, name, patch.own)


@contextmanager
def output_hooks(modules: Iterable[nn.Module], fn: Callable[[nn.Module, Any], Any]) -> Iterator[None]:
    """Call ``fn(module, output)`` after each forward of each module, on this thread only; a value
    it returns other than None replaces the output."""
    with _thread_hooks(modules, "register_forward_hook", lambda module, _args, output: fn(module, output)):
        yield
