"""Forward pre-hooks that reach inside a model forward, and cost nothing until they are armed.

Used for abort mode (a check before every module call, so a long prefill or denoiser call is
abandoned at the next module call), for a finish-mode stop that escalates, and for checks on chosen
modules. A :class:`Tripwire` installs nothing
when it is entered: a model with no hook takes torch's fast path, so a run pays nothing per module
until :meth:`Tripwire.arm` is called, from any thread, at the moment a stop becomes possible. A
tripwire on chosen modules hooks each of them; one on *every* module (``modules=None``) puts one
hook in torch's global pre-hook dict, so arming it costs the same for a model of ten modules or
ten thousand. Checks act only on the thread that made the tripwire, so a concurrent run in another
thread is not touched (its module calls take torch's hook path while a
global hook is armed); everything is removed when the ``with`` block exits. Inside a compiled graph
(torch traces the hooks of a module compiled in place into it) the check does nothing: no thread
can be told apart there, and no Python would run; the next module call outside a graph checks.

**Arming while the run's thread is inside a forward.** torch's ``Module._call_impl`` reads
``module._forward_pre_hooks`` and the global ``_global_forward_pre_hooks`` afresh at every call and
runs a snapshot of them. Arming never mutates a dict that torch may be iterating: it publishes a
*copy* of the hook dict with one stopcock hook added (a single attribute store, atomic with or
without the GIL). A forward already past its pre-hooks keeps its snapshot; the next module call
sees the hook. Disarming puts the original dict object back (the one users' ``RemovableHandle``s
refer to), so hooks registered and removed around the run keep working. Only if a hook was
registered *while* armed (it then lives in the copy) is the copy kept and the stopcock entry
deleted from it, on the run's own thread once its forward is over. One stopcock hook serves every
tripwire armed on a dict (a registry keyed by dict), so tripwires of concurrent runs never publish
over each other.

:func:`input_hooks` (before a module call, with its arguments) and :func:`output_hooks` (after
it: diffusers' fast-forward records the loop models' outputs) are installed at once, act only on
the thread that installed them and are removed when the ``with`` block exits. They are not torch
hooks but wrappers of the module's call for this thread (:func:`stopcock.binding.bound`), so the
module keeps torch's fast path and a module compiled in place keeps its graph.
"""

from __future__ import annotations

import collections
import functools
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, ExitStack
from typing import Any

from torch import compiler, nn
from torch.nn.modules import module as torch_module
from torch.utils.hooks import RemovableHandle

from .binding import bound

__all__ = ["Tripwire", "input_hooks", "output_hooks"]

_is_compiling = compiler.is_compiling  # True while torch traces a call into a graph

#: The key of stopcock's hook in every module's ``_forward_pre_hooks``: an id taken from torch's
#: own counter, so it never collides with a hook registered the usual way.
_KEY = RemovableHandle(OrderedDict()).id

# Arming and removing are serialised by one lock. A stop can re-enter them on the very thread that is
# half-way through one (a signal handler, or a stream's finaliser run by the garbage collector, calls
# stop(), whose callbacks arm): the lock is re-entrant, and an operation that comes in while another
# is under way is queued and run as soon as that one is done, before the lock is let go.
_lock = threading.RLock()
_busy = False
_queued: collections.deque[Callable[[], None]] = collections.deque()


def _serialised(operation: Callable[[], None]) -> None:
    global _busy
    with _lock:
        if _busy:
            _queued.append(operation)
            return
        _busy = True
        try:
            operation()
            while _queued:
                _queued.popleft()()
        finally:
            _busy = False
        if _queued:  # one that came in between the last check and the line above
            _serialised(_queued.popleft())


class _Published:
    """stopcock's hook in one hook dict (a module's, or torch's global one): the original dict,
    the published copy, and the tripwires it serves."""

    def __init__(self, attrs: dict[str, Any], name: str) -> None:
        self.attrs, self.name = attrs, name
        self.original: OrderedDict[int, Any] = attrs[name]
        self.keys = set(self.original)
        self.wires: tuple[Tripwire, ...] = ()  # replaced, never mutated: the hook reads it unlocked
        self.copy: OrderedDict[int, Any] = type(self.original)(self.original)
        self.copy[_KEY] = self.hook
        attrs[name] = self.copy

    def hook(self, module: nn.Module, args: Any) -> None:
        if _is_compiling():
            # torch traces the hook into a compiled call (a module compiled in place), where a thread
            # cannot be told apart: no check there, the next call outside the graph checks.
            return
        me = threading.get_ident()
        for wire in self.wires:
            if wire.owner == me:
                wire.check(module)

    def withdraw(self) -> None:
        """Take the hook out (see the module docstring)."""
        current = self.attrs[self.name]
        if current is self.copy and set(self.copy) <= self.keys | {_KEY}:
            self.attrs[self.name] = self.original  # also reflects hooks removed meanwhile
            return
        for key in [_KEY, *(self.keys - set(self.original))]:  # ours, and those removed meanwhile
            current.pop(key, None)


_published: dict[int, _Published] = {}  # id of the hook dict's holder -> its entry (holders stay alive)


def _slots(modules: Iterable[nn.Module] | None) -> Iterator[tuple[dict[str, Any], str]]:
    """Where the hooks go: each module's own hook dict, or torch's global one for every module."""
    if modules is None:
        yield vars(torch_module), "_global_forward_pre_hooks"
        return
    for module in dict.fromkeys(modules):  # each module once, order kept
        if "_forward_pre_hooks" in vars(module):  # else not initialised by nn.Module: no hooks run
            yield vars(module), "_forward_pre_hooks"


class Tripwire:
    """``check(module)`` before each forward of each of ``modules`` (None: of every module) on this
    thread, once armed.

    Entering installs nothing; :meth:`arm` (from any thread, idempotent) installs the checks, and
    leaving the ``with`` block removes them. ``modules`` is read when armed, not before.
    """

    def __init__(self, modules: Iterable[nn.Module] | None, check: Callable[[nn.Module], Any]) -> None:
        self.check = check
        self.owner = threading.get_ident()
        self.armed = False
        self._modules = modules
        self._on: list[_Published] = []
        self._closed = False

    def __enter__(self) -> Tripwire:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def arm(self) -> None:
        """Install the checks (no-op when armed already or closed)."""
        _serialised(self._arm)

    def _arm(self) -> None:
        if self.armed or self._closed:
            return
        self.armed = True
        modules, self._modules = self._modules, ()
        for attrs, name in _slots(modules):
            entry = _published.get(id(attrs))
            if entry is None:
                entry = _published[id(attrs)] = _Published(attrs, name)
            entry.wires = (*entry.wires, self)
            self._on.append(entry)

    def close(self) -> None:
        """Remove the checks (idempotent); a later :meth:`arm` does nothing."""
        self._closed = True  # at once, even if the removal itself has to wait for the lock
        _serialised(self._close)

    def _close(self) -> None:
        on, self._on = self._on, []
        for entry in on:
            entry.wires = tuple(w for w in entry.wires if w is not self)
            if not entry.wires:
                del _published[id(entry.attrs)]
                entry.withdraw()


def input_hooks(
    modules: Iterable[nn.Module], fn: Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], Any]
) -> AbstractContextManager[None]:
    """Call ``fn(module, args, kwargs)`` before each forward of each module, on this thread only
    (what it returns is ignored)."""
    return _ThreadHooks(modules, fn, before=True)


class _ThreadHooks:
    """``fn`` around each module's call, on this thread only: before it (``before``), as
    ``fn(module, args, kwargs)``, its result ignored; or after it, as ``fn(module, output)``, a
    result other than None replacing the output.

    Not a torch hook: a module with any hook takes torch's slow call path, and a module compiled in
    place (``module.compile()``) runs its hooks inside the compiled call, where torch would trace ``fn``
    into its graph (the thread check cannot be traced: an error with ``fullgraph=True``, else a graph
    break and recompiled hook frames). The call itself is wrapped for this thread (:func:`bound`):
    ``_call_impl`` (the module's hooks and forward), or the compiled call of a module compiled in place,
    whose graph is not touched."""

    __slots__ = ("_before", "_fn", "_modules", "_stack")

    def __init__(self, modules: Iterable[nn.Module], fn: Callable[..., Any], *, before: bool) -> None:
        self._modules, self._fn, self._before = modules, fn, before

    def __enter__(self) -> None:
        self._stack = stack = ExitStack()
        try:
            for m in dict.fromkeys(self._modules):  # each module once, order kept
                compiled = vars(m).get("_compiled_call_impl") is not None
                call = "_compiled_call_impl" if compiled else "_call_impl"
                stack.enter_context(bound(m, call, functools.partial(_around, m, self._fn, self._before)))
        except BaseException:  # the bindings made so far come off, and the error goes on
            stack.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self._stack.close()


def _around(
    module: nn.Module, fn: Callable[..., Any], before: bool, call: Callable[..., Any]
) -> Callable[..., Any]:
    """``module``'s ``call`` with ``fn`` before or after it, as :class:`_ThreadHooks` calls it."""

    if before:
        def called_before(*args: Any, **kwargs: Any) -> Any:
            fn(module, args, kwargs)
            return call(*args, **kwargs)

        return called_before

    def called_after(*args: Any, **kwargs: Any) -> Any:
        output = call(*args, **kwargs)
        changed = fn(module, output)
        return output if changed is None else changed

    return called_after


def output_hooks(
    modules: Iterable[nn.Module], fn: Callable[[nn.Module, Any], Any]
) -> AbstractContextManager[None]:
    """Call ``fn(module, output)`` after each forward of each module, on this thread only; a value
    it returns other than None replaces the output."""
    return _ThreadHooks(modules, fn, before=False)
