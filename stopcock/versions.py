"""The versions of the installed libraries that decide a target's numbers (a checkpoint's
fingerprint names them: :func:`versions`)."""

from __future__ import annotations

import functools
import importlib.metadata
import re
import sys
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["versions"]


# The dependencies of a target's library that decide its numbers (how it computes, loads, tokenizes
# or converts); the others (downloads, progress bars, command lines) do not enter a fingerprint.
_NUMERIC_DEPENDENCIES = frozenset(
    {
        "torch",
        "numpy",
        "tokenizers",
        "safetensors",
        "accelerate",
        "kernels",
        "pillow",
        "transformers",
        "diffusers",
    }
)


def versions(*objects: Any) -> dict[str, str]:
    """The versions of the libraries that decide a target's numbers: torch, stopcock, the library of
    each object's class (``objects``: the target and its parts), and those libraries' installed
    dependencies that compute or load numbers. Read from the installed packages, not from what the
    process happens to have imported: a process that also imported another library, or has not yet
    imported a dependency, computes the same versions."""
    libraries = sorted({name for obj in objects if (name := _library_of(obj)) is not None})
    found = {"torch": str(torch.__version__)}
    found["stopcock"] = str(getattr(sys.modules.get("stopcock"), "__version__", "?"))
    found.update(_installed(tuple(libraries)))
    return found


def _library_of(obj: Any) -> str | None:
    """The installed distribution that defines ``obj``'s class (None for the user's own code)."""
    top = type(obj).__module__.split(".")[0]
    if top in ("builtins", "__main__", "torch", "stopcock"):
        return None
    named = _named_after(top)
    if named is not None:
        return named
    names = _distributions().get(top)
    return _canonical(names[0]) if names else None


@functools.lru_cache(maxsize=64)
def _named_after(top: str) -> str | None:
    """The distribution named as the module ``top`` is, if it installed that module: read from that
    one distribution's file list, where mapping every installed distribution to its modules
    (:func:`_distributions`) reads them all, which costs a stop in a fresh process far more."""
    try:
        record = importlib.metadata.distribution(top).read_text("RECORD") or ""
    except importlib.metadata.PackageNotFoundError:
        return None
    provides = any(line.startswith((f"{top}/", f"{top}.py,")) for line in record.splitlines())
    return _canonical(top) if provides else None


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@functools.lru_cache(maxsize=1)
def _distributions() -> Mapping[str, list[str]]:
    return importlib.metadata.packages_distributions()


@functools.lru_cache(maxsize=64)
def _installed(libraries: tuple[str, ...]) -> dict[str, str]:
    """Each library's installed version and those of its numeric dependencies (required ones, not extras)."""
    found: dict[str, str] = {}
    for library in libraries:
        try:
            found[library] = importlib.metadata.version(library)
            requires = importlib.metadata.requires(library) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for requirement in requires:
            if "extra ==" in requirement:
                continue
            match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement)
            name = _canonical(match.group(0)) if match else ""
            if name in _NUMERIC_DEPENDENCIES and name != "torch":
                try:
                    found[name] = importlib.metadata.version(name)
                except importlib.metadata.PackageNotFoundError:
                    continue
    return found
