"""Stand-ins for Ray Serve in one process: the registry, model replicas and engine of the Ray engine
run in one event loop without a cluster (``tests/test_ray_local.py``)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

__all__ = ["LocalHandle", "construct"]


async def construct(cls: type[Any], *args: Any, **kwargs: Any) -> Any:
    """An instance of a deployment class with an ``async __init__`` (as Serve makes one), in this process."""
    instance: Any = object.__new__(cls)
    await instance.__init__(*args, **kwargs)
    return instance


class LocalHandle:
    """A stand-in for a Serve handle to ``target`` in this process: ``await handle.method.remote(*args)``
    calls ``target.method(*args)``. With it the registry, model replicas and engine run in one event
    loop without a cluster (the engine's own tests use it)."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def __getattr__(self, method: str) -> Any:
        call = getattr(self.target, method)

        class _Method:
            @staticmethod
            def remote(*args: Any) -> Awaitable[Any]:
                return asyncio.ensure_future(call(*args))

        return _Method
