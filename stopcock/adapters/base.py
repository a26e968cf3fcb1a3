"""The adapter interface: what ``run()`` and the streams need from the code that drives one library.

An adapter turns a call of a library's target (a model's ``generate``, a pipeline call) into a run
bound to a :class:`~stopcock.control.RunControl`: it counts steps where the library makes them,
stops at the boundary the run's mode asks for and builds the Outcome. Each adapter is described by
a :class:`Registered` entry in :data:`stopcock.adapters.REGISTRY` (its name, the library its targets
come from, what it drives, the ``run()`` options it owns) and loaded on first use.

To add an adapter: write a module with a class implementing :class:`Adapter` and add an entry to
the registry; ``run(target, ..., adapter=...)`` also takes an :class:`Adapter` object directly.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ..control import RunControl
from ..events import EventMaker
from ..outcome import Outcome

if TYPE_CHECKING:
    from ..checkpoint import Checkpoint

__all__ = ["Adapter", "Registered", "Resumable", "UnsupportedTarget", "resolve"]


class UnsupportedTarget(TypeError):
    """``run()`` was given something no adapter drives."""


class Adapter(Protocol):
    """Drives the targets of one library. ``options`` are the ``run()`` options it takes (e.g.
    ``partial=``): ``run()`` hands exactly these to :meth:`run`, never to the target."""

    name: str
    options: frozenset[str]

    def accepts(self, target: object) -> bool:
        """Whether this adapter drives ``target``."""
        ...

    def run(
        self,
        target: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        control: RunControl,
        **options: Any,
    ) -> Outcome:
        """``target(*args, **kwargs)`` (or its library's equivalent) bound to ``control``."""
        ...

    def stream_events(
        self, target: Any, kwargs: dict[str, Any], *, tokenizer: Any, preview: str | None, preview_every: int
    ) -> EventMaker:
        """How a stream of ``target`` turns each step into events; streaming options it cannot
        honour raise here, before the run (``kwargs`` may gain what the run needs, e.g. the tokenizer)."""
        ...


@runtime_checkable
class Resumable(Protocol):
    """A capability of an adapter: checkpoint a run and resume one, bit-identically where it can
    (``run(..., checkpoint=True)``, ``stopcock.resume``). The checkpoint's ``kind`` is the adapter's name."""

    def record(
        self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], control: RunControl, **options: Any
    ) -> Outcome:
        """:meth:`Adapter.run`, recording what a resume needs: the Outcome's ``checkpoint``."""
        ...

    def resume(
        self,
        target: Any,
        checkpoint: Checkpoint,
        control: RunControl,
        given: dict[str, Any],
        *,
        record: bool = False,
        **options: Any,
    ) -> Outcome:
        """Continue ``checkpoint``'s run on ``target`` (refused, with the differences named, if it does
        not match the checkpoint's fingerprint). ``given`` holds the call's arguments that the checkpoint
        could not keep; ``record`` makes the Outcome carry a new checkpoint. The Outcome says how it
        resumed (``resumed``)."""
        ...


@dataclass(frozen=True)
class Registered:
    """A registry entry: the facts about an adapter that are known without importing it."""

    name: str
    library: str  #: the top-level module its targets come from (no target exists until it is imported)
    kind: str  #: what it drives, for error messages
    options: frozenset[str]
    load: Callable[[], Adapter]


def resolve(
    target: object, registry: tuple[Registered, ...], adapter: str | Adapter | None = None
) -> tuple[Adapter, frozenset[str]]:
    """The adapter that drives ``target``, and the ``run()`` options of every other adapter.

    ``adapter`` names a registered adapter (or is one) instead of detecting it; it must still
    accept the target. Detection tries the registered adapters whose library is imported: a
    target of a library that was never imported cannot exist, so nothing heavy is imported here.
    """
    if isinstance(adapter, str):
        by_name: Mapping[str, Registered] = {entry.name: entry for entry in registry}
        if adapter not in by_name:
            raise ValueError(
                f"adapter must be one of {sorted(by_name)} or an Adapter object, got {adapter!r}"
            )
        candidates = [by_name[adapter]]
    elif adapter is not None:
        others = frozenset().union(*(e.options for e in registry)) - adapter.options
        if not adapter.accepts(target):
            raise UnsupportedTarget(
                f"the adapter {adapter.name!r} does not drive a {type(target).__name__!r}"
            )
        return adapter, others
    else:
        candidates = [entry for entry in registry if entry.library in sys.modules]
    for entry in candidates:
        found = entry.load()
        if found.accepts(target):
            others = frozenset().union(*(e.options for e in registry if e is not entry))
            return found, others - found.options
    if adapter is not None:
        raise UnsupportedTarget(f"the {adapter} adapter does not drive a {type(target).__name__!r}")
    kinds = "; ".join(
        e.kind if importlib.util.find_spec(e.library) else f"{e.kind}: install stopcock[{e.name}]"
        for e in registry
    )
    raise UnsupportedTarget(f"stopcock cannot run a {type(target).__name__!r}. Supported targets: {kinds}.")
