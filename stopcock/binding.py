"""Per-thread method binding: one attribute of one object replaced for the calls of one thread.

``with bound(obj, name, wrap):`` sends the calls of ``obj.<name>(...)`` made on this thread to
``wrap(original)``; calls from other threads reach the attribute as it was, and concurrent bindings
on other threads each get their own. Bindings on one thread nest (the inner ``wrap`` gets the outer
one's wrapper as its original). While any binding is in place the object holds a stand-in as an
instance attribute; the last binding to leave puts back what was there (an instance attribute of
its own, or nothing, so the class attribute shows again).

It serves every adapter's replacement of a method for a run (generate, ``_get_stopping_criteria``,
a module's ``_call_impl``, a scheduler's ``step``) and of a callable attribute (a combined
pipeline's stages: attribute reads go through to the thread's value). A stand-in copied with its
object by :func:`copy.deepcopy` binds the copy for the same threads, each wrapper deep-copied in
turn, so a wrapper decides what its copy is (diffusers' schedulers copied during a call); such a
copy keeps its stand-in until :func:`unbind` takes it off.

Its per-thread counterpart for methods looked up on the type (a module's ``__call__``) is
:func:`stopcock.intercept.intercepted`, which swaps the object's class instead.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["bound", "unbind"]

Wrap = Callable[[Callable[..., Any]], Callable[..., Any]]

_lock = threading.Lock()


class _PerThread:
    """Stands in for ``obj.<name>`` while bindings are in place: a call made on a thread with a
    binding goes to that thread's wrapper, any other call to the attribute as it was."""

    __slots__ = ("_by_thread", "_name", "_obj", "_own")

    def __init__(self, obj: Any, name: str) -> None:
        self._obj, self._name = obj, name
        self._own = vars(obj).get(name)  # an instance attribute it replaces, put back at the end
        self._by_thread: dict[int, Callable[..., Any]] = {}

    @property
    def __wrapped__(self) -> Callable[..., Any]:
        """The original, so ``inspect.signature`` reads its signature (diffusers reads the step's)."""
        return self.original()

    def original(self) -> Callable[..., Any]:
        if self._own is not None:
            return self._own  # type: ignore[no-any-return]
        return getattr(type(self._obj), self._name).__get__(self._obj)  # type: ignore[no-any-return]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fn = self._by_thread.get(threading.get_ident())
        return (fn or self.original())(*args, **kwargs)

    def __getattr__(self, attr: str) -> Any:
        """An attribute of the thread's value (a stage pipeline's config, say)."""
        if attr in _PerThread.__slots__:  # not set yet (a copy being built)
            raise AttributeError(attr)
        fn = self._by_thread.get(threading.get_ident())
        return getattr(fn or self.original(), attr)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        twin = memo.get(id(self._obj))
        if twin is None:  # the stand-in alone is copied, not with its object
            return self
        stand_in = _PerThread(twin, self._name)  # the twin is being built: its class gives the original
        stand_in._by_thread = {thread: copy.deepcopy(fn, memo) for thread, fn in self._by_thread.items()}
        return stand_in


class _MethodBinding:
    """:func:`bound`'s ``with`` block."""

    __slots__ = ("_name", "_obj", "_owner", "_patch", "_previous", "_wrap")

    def __init__(self, obj: Any, name: str, wrap: Wrap) -> None:
        self._obj, self._name, self._wrap = obj, name, wrap

    def __enter__(self) -> None:
        obj, name = self._obj, self._name
        self._owner = owner = threading.get_ident()
        with _lock:
            patch = vars(obj).get(name)
            if not isinstance(patch, _PerThread):
                patch = _PerThread(obj, name)
                object.__setattr__(obj, name, patch)
            self._patch = patch
            self._previous = previous = patch._by_thread.get(owner)
            patch._by_thread[owner] = self._wrap(previous or patch.original())

    def __exit__(self, *exc: object) -> None:
        obj, name, patch, owner, previous = self._obj, self._name, self._patch, self._owner, self._previous
        with _lock:
            if previous is not None:
                patch._by_thread[owner] = previous
                return
            del patch._by_thread[owner]
            if not patch._by_thread:
                if patch._own is None:
                    del vars(obj)[name]
                else:
                    object.__setattr__(obj, name, patch._own)


def bound(obj: Any, name: str, wrap: Wrap) -> _MethodBinding:
    """For the ``with`` block, calls of ``obj.<name>(...)`` made on this thread go to
    ``wrap(original)``; calls from other threads are not touched, and concurrent bindings on other
    threads each get their own. The attribute is as it was once the last binding ends."""
    return _MethodBinding(obj, name, wrap)


def unbind(obj: Any, name: str) -> None:
    """Take off a stand-in that a deep copy carried over to ``obj`` (no binding of it ever ends)."""
    with _lock:
        patch = vars(obj).get(name)
        if isinstance(patch, _PerThread):
            if patch._own is None:
                del vars(obj)[name]
            else:
                object.__setattr__(obj, name, patch._own)
