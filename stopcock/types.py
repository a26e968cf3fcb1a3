"""The vocabularies that ``run()``, the streams, the CLI and the server share: one definition each."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, TypeVar, get_args

from .conditions import StopLike

__all__ = ["MODES", "Mode", "PARTIALS", "PREVIEWS", "Partial", "Preview", "StopLike", "choice"]

#: ``"finish"``: end at the next step with the output the library builds; ``"abort"``: abandon the
#: run inside the model forward at the next module call.
Mode = Literal["finish", "abort"]
#: What a stopped diffusion run decodes: the latents as they were, or the x0 estimate of that step.
Partial = Literal["raw", "denoised"]
#: A stream's preview image of each diffusion step: a linear map of the latents, or a VAE decode.
Preview = Literal["latent", "decode"]

MODES: tuple[Mode, ...] = get_args(Mode)
PARTIALS: tuple[Partial, ...] = get_args(Partial)
PREVIEWS: tuple[Preview, ...] = get_args(Preview)

T = TypeVar("T")


def choice(name: str, value: object, choices: Sequence[T], *, optional: bool = False, hint: str = "") -> T:
    """``value`` if it is one of ``choices`` (or None, when ``optional``); else a ValueError naming
    them (and ``hint``)."""
    if (optional and value is None) or value in choices:
        return value  # type: ignore[return-value]
    allowed = " or ".join(map(repr, [*choices, *([None] if optional else [])]))
    raise ValueError(f"{name} must be {allowed}, got {value!r}{hint}")
