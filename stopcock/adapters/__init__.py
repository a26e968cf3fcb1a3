"""Bridges from the stop machinery into each library's own mechanisms: the adapter registry.

Each entry is loaded (imported) on first use only; see :mod:`stopcock.adapters.base` for the
interface and how to add one.
"""

from __future__ import annotations

from functools import cache

from .base import Adapter, Registered, UnsupportedTarget, resolve

__all__ = ["REGISTRY", "Adapter", "Registered", "UnsupportedTarget", "resolve"]


@cache  # loaded once: detection runs on every run() call
def _transformers() -> Adapter:
    from .transformers_resume import ADAPTER  # the transformers adapter, resumable

    return ADAPTER


@cache
def _diffusers() -> Adapter:
    from .diffusers_replay import ADAPTER  # the diffusers adapter, resumable by replay

    return ADAPTER


#: The adapters, in the order detection tries them.
REGISTRY: tuple[Registered, ...] = (
    Registered(
        name="transformers",
        library="transformers",
        kind="transformers (a model with .generate, a text-generation pipeline, any other transformers"
        " Pipeline)",
        options=frozenset(),
        load=_transformers,
    ),
    Registered(
        name="diffusers",
        library="diffusers",
        kind="diffusers pipelines (DiffusionPipeline, ModularPipeline)",
        options=frozenset({"partial", "stage"}),
        load=_diffusers,
    ),
)
