"""Per-thread class swap: a method looked up on the type (a model's call) answered from a source.

``intercepted(obj, method, handler)`` sends the calls of ``obj.method(...)`` made on this thread to
``handler(call, *args, **kwargs)``, where ``call`` is the original bound method: the handler may
call it (and look at the result), change its arguments, or answer without calling it at all.
Interceptions nest: the innermost handler is asked first, and its ``call`` goes through the ones
outside it (a fast-forward answering inside a recording leaves nothing to record).
``answering(modules, source)`` builds on it for loop models: each call of a module asks
``source.answer(module, args, kwargs)`` first, and only a call it does not answer (:data:`COMPUTE`)
runs, its output shown to ``source.observe(...)``. Resuming a diffusion run answers its first
steps' denoiser calls from the checkpoint (replay); recording is a source that answers nothing and
observes everything; a stopped loop's models answering from their last output
(:mod:`stopcock.adapters.diffusers_loop`) intercept the same way.

It works by giving the object, for the duration, a same-named subclass whose ``method`` dispatches
to this thread's handler: a module's ``__call__`` is looked up on its type, so an instance
attribute (:func:`stopcock.binding.bound`, which serves ordinary methods such as ``generate``)
cannot replace it. That puts the handler outside every rewrite of ``forward`` (accelerate's
offload hooks, diffusers' hook registry, so a cache hook never sees an answered call), and nothing
is lost when those rewrites are re-armed mid-call. Other threads' calls
go straight to the original; concurrent runs on shared objects (one model, several pipelines) each
install their own handler, and the original class comes back when the last one leaves.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Hashable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any, Protocol

__all__ = ["COMPUTE", "Source", "answering", "intercepted", "subclass"]

#: What :meth:`Source.answer` returns to let the call run.
COMPUTE: Any = object()

# in the object's __dict__: (original class, {method: {thread: [handlers, innermost last]}})
_STATE = "_stopcock_intercepted"
_lock = threading.Lock()
_subclasses: dict[tuple[type, Hashable], type] = {}
_subclassing = threading.Lock()


def _dispatcher(original: type, method: str) -> Callable[..., Any]:
    def dispatch(self: Any, *args: Any, **kwargs: Any) -> Any:
        call = functools.partial(getattr(original, method), self)
        # read once: another thread may give the object its own class back meanwhile
        state = vars(self).get(_STATE)
        handlers = () if state is None else tuple(state[1].get(method, {}).get(threading.get_ident(), ()))
        for handler in handlers:  # outermost first: each one's call goes through those outside it
            call = functools.partial(handler, call)
        return call(*args, **kwargs)

    dispatch.__name__ = method
    return dispatch


def subclass(original: type, key: Hashable, attrs: Callable[[], dict[str, Any]]) -> type:
    """A subclass of ``original`` with ``attrs()``, made once per ``(original, key)``: of the same
    name, module and qualified name, and built by ``original``'s own metaclass. Every class swap of
    the package makes its classes here (:func:`intercepted`, :func:`stopcock.diffusers.guard`)."""
    with _subclassing:
        found = _subclasses.get((original, key))
        if found is None:
            body = {**attrs(), "__module__": original.__module__, "__qualname__": original.__qualname__}
            found = _subclasses[(original, key)] = type(original)(original.__name__, (original,), body)
        return found


def _intercepting(original: type, methods: frozenset[str]) -> type:
    return subclass(original, methods, lambda: {m: _dispatcher(original, m) for m in methods})


def _retype(obj: Any) -> None:
    """Give ``obj`` the class for the methods intercepted now (its own class when none is)."""
    original, handlers = vars(obj)[_STATE]
    methods = frozenset(m for m, by_thread in handlers.items() if by_thread)
    if methods:
        obj.__class__ = _intercepting(original, methods)
    else:
        obj.__class__ = original
        del vars(obj)[_STATE]


@contextmanager
def intercepted(obj: Any, method: str, handler: Callable[..., Any]) -> Iterator[None]:
    """Send this thread's calls of ``obj.method`` to ``handler(call, *args, **kwargs)`` inside the block."""
    me = threading.get_ident()
    with _lock:
        state = vars(obj).setdefault(_STATE, (type(obj), {}))
        state[1].setdefault(method, {}).setdefault(me, []).append(handler)
        _retype(obj)
    try:
        yield
    finally:
        with _lock:
            by_thread = vars(obj)[_STATE][1][method]
            by_thread[me].remove(handler)
            if not by_thread[me]:
                del by_thread[me]
            _retype(obj)


class Source(Protocol):
    """Where a loop model's calls are answered from (see :func:`answering`)."""

    def answer(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The output to give for this call without running it, or :data:`COMPUTE`."""
        ...

    def observe(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        """A call that ran, with its output."""
        ...


@contextmanager
def answering(modules: Iterable[Any], source: Source) -> Iterator[None]:
    """Inside the block, each call of each module on this thread asks ``source`` first."""

    def handler_for(module: Any) -> Callable[..., Any]:
        def handler(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            answer = source.answer(module, args, kwargs)
            if answer is not COMPUTE:
                return answer
            output = call(*args, **kwargs)
            source.observe(module, args, kwargs, output)
            return output

        return handler

    with ExitStack() as stack:
        for module in dict.fromkeys(modules):  # each module once, order kept
            stack.enter_context(intercepted(module, "__call__", handler_for(module)))
        yield
