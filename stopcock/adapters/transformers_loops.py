"""Generate calls that need more than the criterion: SpeechT5's own loop, ended through its
stop-probability head (:class:`_OwnLoop`), and MusicGen's codebook delay pattern, whose rows a stop
must pad as its loop would (:func:`_padding_codebooks`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from types import TracebackType
from typing import Any

import torch

from ..binding import bound
from ..control import Abort, RunControl
from ..hooks import output_hooks
from .transformers_criteria import _RunCriteria, _Settings

__all__: list[str] = []

_ABORTED_FRAMES = (
    "aborted inside the model forward; output holds the mel frames generated so far, before the postnet"
    " and the vocoder"
)
_ABORTED_NO_FRAMES = "aborted inside the model forward, before the first mel frame; no output"


def _submodule(module: Any, name: str) -> torch.nn.Module | None:
    """``module.<name>`` if it is a submodule, else None, read from ``_modules`` (where a module keeps
    every module assigned to it): through torch's ``__getattr__``, a miss raises and catches an
    AttributeError on every run of a model that lacks it."""
    return module._modules.get(name) if isinstance(module, torch.nn.Module) else None


def _stop_head(model: Any) -> torch.nn.Module | None:
    """The stop-probability head that ends a ``generate`` running its own loop (SpeechT5's ``prob_out``)."""
    return _submodule(_submodule(model, "speech_decoder_postnet"), "prob_out")


class _OwnLoop:
    """For one call of a ``generate`` with its own loop that ends when a stop-probability head says
    so (SpeechT5): each call of the head is a step; to stop, the head says stop for every row.

    ``minlenratio=`` makes that loop skip its head until a minimum length, so a stop would wait for
    it: the minimum is kept here instead (the call runs with ``minlenratio=0``, ``kwargs`` changed in
    place, and the head says "go on" for every row until the minimum), and a stop ends the loop at
    once. The minimum is the loop's own: the encoder's output length times the ratio, over the
    reduction factor, read from the call's encoder output.
    """

    def __init__(
        self,
        model: Any,
        head: torch.nn.Module,
        criteria: _RunCriteria,
        settings: _Settings,
        kwargs: dict[str, Any],
        note: Callable[[str], None],
    ) -> None:
        self.head, self.criteria = head, criteria
        self.factor = getattr(model.config, "reduction_factor", 1)
        threshold = settings.get("threshold")
        threshold = 0.5 if threshold is None else float(threshold)  # the loop's default
        if threshold > self.factor:
            note(f"threshold={threshold} is more than the stop head can reach ({self.factor}): it cannot end"
                 " the loop, so a stop waits for the loop's own end")
        ratio = float(settings.get("minlenratio") or 0.0)
        most = settings.get("maxlenratio")
        self.encoder = _submodule(_submodule(model, "speecht5"), "encoder")
        # the head's "go on" is below any positive threshold; a minimum past the maximum is the loop's
        self.ratio = ratio if threshold > 0 and (most is None or ratio <= float(most)) else 0.0
        if ratio and not self.ratio:
            note(f"minlenratio={ratio} with this threshold or maxlenratio: a stop waits for the minimum")
        elif self.ratio:
            kwargs["minlenratio"] = 0.0
        self.least = 0  # the minimum length in steps, once the encoder has run
        self.bindings: list[AbstractContextManager[None]] = []
        self.frames: torch.Tensor | None = None  # after an abort: the mel frames made so far

    def aborted(self, tb: TracebackType | None, model: Any) -> None:
        """After an abort inside the loop: the mel frames so far, read from the loop's own list
        (``spectrogram`` in SpeechT5's ``_generate_speech``), one tensor per step."""
        while tb is not None:
            frame = tb.tb_frame
            steps = frame.f_locals.get("spectrogram") if frame.f_code.co_name == "_generate_speech" else None
            if isinstance(steps, list) and steps and all(isinstance(t, torch.Tensor) for t in steps):
                frames = torch.cat(steps, dim=1)  # (batch, steps x reduction factor, mel bins)
                self.frames = frames[0] if frames.shape[0] == 1 else frames
            tb = tb.tb_next

    def __enter__(self) -> None:
        criteria = self.criteria
        criteria.prompt_len = criteria.new = 0
        self.least = 0

        def each_step(module: torch.nn.Module, output: torch.Tensor) -> torch.Tensor | None:
            criteria.new += 1
            if criteria.step():
                return torch.full_like(output, 1e4)
            return torch.full_like(output, -1e4) if criteria.new < self.least else None

        def encoded(module: torch.nn.Module, output: Any) -> None:
            hidden = output[0] if isinstance(output, (tuple, list)) else output.last_hidden_state
            self.least = int(hidden.shape[1] * self.ratio / self.factor)

        self.bindings = [output_hooks([self.head], each_step)]
        if self.ratio and self.encoder is not None:
            self.bindings.append(output_hooks([self.encoder], encoded))
        for binding in self.bindings:
            binding.__enter__()

    def __exit__(self, *exc: object) -> None:
        try:
            for binding in reversed(self.bindings):
                binding.__exit__(None, None, None)
        finally:
            self.criteria.last_ids = torch.zeros(1, self.criteria.new)  # the steps made, for the next count


def _delaying(model: Any) -> Any:
    """The model (or its decoder) that builds MusicGen's delay pattern (see :func:`_padding_codebooks`)."""
    for candidate in (model, _submodule(model, "decoder")):
        if hasattr(type(candidate), "build_delay_pattern_mask"):
            return candidate
    return None


@contextmanager
def _padding_codebooks(
    decoder: Any, criteria: _RunCriteria, control: RunControl, note: Callable[[str], None]
) -> Iterator[None]:
    """MusicGen's delay pattern offsets codebook k by k steps, and its mask, built for the full
    length, pads each codebook's tail there; its own ending raises on a shorter output. When a
    stop ends it early, the mask MusicGen keeps for that call gets the same tail padding at the
    length reached, so the output holds the frames that are complete in every codebook."""
    kept: list[tuple[torch.Tensor, Any]] = []  # the call's mask, and the pad id it uses

    def keep(build: Callable[..., Any]) -> Callable[..., Any]:
        def build_and_keep(input_ids: torch.Tensor, pad_token_id: Any, max_length: Any = None) -> Any:
            ids, mask = build(input_ids, pad_token_id, max_length=max_length)
            if not kept:
                kept.append((mask, pad_token_id))
            return ids, mask

        return build_and_keep

    def end_at(input_ids: torch.Tensor) -> None:
        if not kept:
            return
        mask, pad = kept[0]
        length, codebooks = input_ids.shape[-1], decoder.num_codebooks
        stereo = getattr(decoder.config, "audio_channels", 1) == 2
        delays = codebooks // 2 if stereo else codebooks
        if length <= delays:  # MusicGen's decoder raises on zero frames: end here, with no audio
            note(f"stopped before the first audio frame was complete in all {delays} codebooks"
                 f" ({delays} steps): aborted, no audio")
            raise Abort(control)
        by_codebook = mask.view(-1, codebooks, mask.shape[-1])
        for codebook in range(codebooks):
            delay = codebook // 2 if stereo else codebook
            by_codebook[:, codebook, max(0, length - (delays - 1 - delay)) : length] = pad

    with bound(decoder, "build_delay_pattern_mask", keep):
        criteria.ended_early = end_at
        try:
            yield
        finally:
            criteria.ended_early = None
