"""Preview images of diffusion latents: a cheap linear map (no VAE), an exact VAE decode, or the step's
estimate of the clean image (x0) shown by whichever of the two fits its size."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .types import PREVIEWS, choice

__all__ = ["DECODE_MAX_LATENT_PIXELS", "decode_preview", "estimate_preview", "latent_preview", "previewable",
           "previewer"]

#: :func:`estimate_preview` decodes latents of at most this many pixels with the VAE (a 256x256 image for
#: Stable Diffusion, where a decode is cheap); larger ones get the linear map (1/8 of the image size).
DECODE_MAX_LATENT_PIXELS = 32 * 32

# Fixed linear maps from Stable Diffusion latents to RGB (factors and bias, as ComfyUI's latent
# formats publish them): a cheap, rough preview with no VAE call.
_SD_RGB = ([[0.3512, 0.2297, 0.3227], [0.3250, 0.4974, 0.2350], [-0.2829, 0.1762, 0.2721],
            [-0.2120, -0.2616, -0.7177]], [0.0, 0.0, 0.0])  # fmt: skip
_SDXL_RGB = ([[0.3651, 0.4232, 0.4341], [-0.2533, -0.0042, 0.1068], [0.1076, 0.1111, -0.0362],
              [-0.3165, -0.2492, -0.2188]], [0.1084, -0.0175, -0.0011])  # fmt: skip


def previewable(latents: Any) -> bool:
    """Whether :func:`latent_preview` maps these latents: 4-channel image latents (SD 1/2/XL)."""
    return getattr(latents, "ndim", None) == 4 and latents.shape[1] == 4


def _image_4d(latents: Any, what: str) -> Any:
    if getattr(latents, "ndim", None) != 4:
        shape = tuple(getattr(latents, "shape", ()))
        raise ValueError(
            f"{what} needs image latents shaped (batch, channels, height, width); this pipeline's"
            f" latents are {shape or type(latents).__name__} (packed latents, e.g. Flux, are not"
            " supported): stream without preview=, or decode the latents yourself in on_step"
        )
    return latents


def _to_image(rgb: Any) -> Any:
    """(batch, 3, h, w) in [0, 1] -> one PIL image, the batch items side by side."""
    import torch
    from PIL import Image

    b, _, h, w = rgb.shape
    tiled = rgb.permute(2, 0, 3, 1).reshape(h, b * w, 3)
    return Image.fromarray((tiled * 255).round().to(torch.uint8).cpu().numpy())


def latent_preview(latents: Any, *, xl: bool = False) -> Any:
    """A rough RGB preview of 4-channel Stable Diffusion latents by a fixed linear map (no VAE).

    One pixel per latent pixel (1/8 of the image size); a batch is laid out side by side.
    ``xl=True`` uses the SDXL map. Latents that are not :func:`previewable` raise a ValueError.
    """
    import torch

    latents = _image_4d(latents, "latent_preview")
    if not previewable(latents):
        raise ValueError(
            f"latent_preview maps 4-channel (Stable Diffusion 1/2/XL) latents; these have"
            f" {latents.shape[1]} channels: use preview='decode' for this pipeline"
        )
    factors, bias = _SDXL_RGB if xl else _SD_RGB
    x = latents.detach().float().cpu()
    rgb = torch.einsum("bchw,cr->brhw", x, torch.tensor(factors)) + torch.tensor(bias)[:, None, None]
    return _to_image(((rgb + 1) / 2).clamp(0, 1))


def decode_preview(pipe: Any, latents: Any) -> Any:
    """A full VAE decode of ``latents`` (exact, costs one decoder call)."""
    import torch

    vae = pipe.vae
    scaled = _image_4d(latents, "preview='decode'") / vae.config.scaling_factor
    shift = getattr(vae.config, "shift_factor", None)
    if shift is not None:
        scaled = scaled + shift
    with torch.no_grad():
        image = vae.decode(scaled.to(vae.dtype), return_dict=False)[0]
    return _to_image((image.float() / 2 + 0.5).clamp(0, 1))


def previewer(pipe: Any, preview: str | None) -> Callable[[Any], Any] | None:
    """The preview function a stream of ``pipe`` uses for ``preview=`` (None: no previews)."""
    if choice("preview", preview, PREVIEWS, optional=True) is None:
        return None
    if preview == "decode":
        if getattr(pipe, "vae", None) is None:
            raise ValueError("preview='decode' needs a pipeline with a .vae; use preview='latent'")
        return lambda latents: decode_preview(pipe, latents)
    xl = "XL" in type(pipe).__name__
    return lambda latents: latent_preview(latents, xl=xl)


def estimate_preview(pipe: Any, latents: Any, denoised: Any = None) -> Any:
    """A preview of a step that a person recognises: the step's estimate of the clean image (``denoised``,
    the x0 that ``StepState.extra["denoised"]`` holds; else the noisy ``latents``), decoded by the VAE
    where the latents are small (at most :data:`DECODE_MAX_LATENT_PIXELS`), else by the linear map.
    None where neither applies (no VAE and latents the linear map does not cover, packed latents)."""
    x = denoised if getattr(denoised, "ndim", None) == 4 else latents
    if getattr(x, "ndim", None) != 4:
        return None
    if getattr(pipe, "vae", None) is not None and x.shape[-2] * x.shape[-1] <= DECODE_MAX_LATENT_PIXELS:
        return decode_preview(pipe, x)
    if previewable(x):
        return latent_preview(x, xl="XL" in type(pipe).__name__)
    return None
