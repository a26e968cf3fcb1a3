"""Stop, Skip and Stop-after-this buttons for a Gradio app that keep the partial result on the page.

Gradio's own ``cancels=`` cancels the generating event's task: its generator never yields again,
so what the run made so far never reaches the page, and an event chained after it with ``.then()``
never runs (gradio#10432). Here the buttons act on a :class:`~stopcock.StopSignal` of the browser
session instead: the run ends at its next step, the event's generator goes on to the end, and its
last update carries the partial result and how the run ended::

    session = gr.State(stopcock.gradio.Session)          # one per browser session
    stop.click(stopcock.gradio.Session.stop, session, notice)

    async def generate(prompt, session):
        async for view in session.stream(pipe, prompt, preview="decode"):
            yield view.image, view.status

:meth:`Session.stream` runs the target with :func:`stopcock.astream` (in a worker thread, the event
loop stays free), once, or once per item of ``each=`` (several prompts: Skip ends the current one,
Stop after this lets it finish and starts no other), and yields a :class:`View` after every event:
the text so far, the latest preview or image (enlarged with crisp pixels when small), the finished
items' results, a status line, and at the end the Outcome. If the event itself is cancelled (the
browser tab closed), the run is stopped and waited for, as :func:`stopcock.astream` does. Nothing
here imports Gradio: a :class:`Session` works in any async web framework.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from .aio import astream
from .events import Done, Step, TextChunk
from .outcome import Outcome
from .signal import StopSignal

__all__ = ["AFTER_ITEM", "CLOSED", "Session", "View", "enlarge"]

#: The reason of a sequence ended by "Stop after this", and of a run stopped as its session closed.
AFTER_ITEM = "after_item"
CLOSED = "closed"


def enlarge(image: Any, size: int = 256) -> Any:
    """``image`` (PIL) enlarged by a whole factor to about ``size`` pixels on its longer side, with
    crisp pixels (nearest neighbour); an image that large already is returned as it is."""
    longest = max(image.size)
    factor = size // longest if longest else 0
    if factor <= 1:
        return image
    from PIL import Image

    return image.resize((image.size[0] * factor, image.size[1] * factor), Image.Resampling.NEAREST)


@dataclass(frozen=True)
class View:
    """What a page shows at one moment of :meth:`Session.stream`.

    ``text``: the current item's generated text so far (its first row); ``image``: the current
    item's latest preview, or its result once done (partial when stopped); ``texts``/``images``:
    the finished items' results; ``status``: one line for a person; ``running``: False on the last
    view only, whose ``outcome`` is the last run's (``outcomes``: every run's, one per item started).
    """

    text: str = ""
    image: Any = None
    texts: tuple[str, ...] = ()
    images: tuple[Any, ...] = ()
    step: int = 0
    total: int | None = None
    item: int = 0
    items: int = 1
    status: str = "Starting..."
    running: bool = True
    outcome: Outcome | None = None
    outcomes: tuple[Outcome, ...] = field(default=())


class Session:
    """One browser session's runs and their buttons; keep it in ``gr.State(Session)``.

    Each :meth:`stream` call gets a new signal (a stopped signal stays stopped), made before its
    first view: enable the buttons from that view on, and a click always reaches the run it shows.
    The buttons act on every run of the session that is going (two events of one page streaming at
    once); each returns a line to show (a click when nothing runs does nothing).
    """

    def __init__(self) -> None:
        self.signal = StopSignal()  # the latest run's
        self._going: list[StopSignal] = []  # the signals of the runs going now

    @property
    def running(self) -> bool:
        """Whether a run of this session is going."""
        return bool(self._going)

    def __deepcopy__(self, memo: dict[int, Any]) -> Session:
        # gr.State deep-copies the initial value for each session: a copy is a new, idle session
        return type(self)()

    def stop(self) -> str:
        """Stop the run at its next step; the page keeps what it made."""
        going = list(self._going)
        for signal in going:
            signal.stop("user")
        if not going:
            return "Nothing is running."
        return "Stopping at the next step: the partial result will be kept."

    def skip(self) -> str:
        """End the current item and go on with the next (with one item: end the run)."""
        going = list(self._going)
        for signal in going:
            signal.skip()
        if not going:
            return "Nothing is running."
        return "Skipping the current item."

    def stop_after_item(self) -> str:
        """Let the current item finish, then start no other."""
        going = list(self._going)
        for signal in going:
            signal.stop_after_item(AFTER_ITEM)
        if not going:
            return "Nothing is running."
        return "Stopping once the current item is done."

    def close(self) -> None:
        """Stop whatever runs (``gr.State(Session, delete_callback=Session.close)``: a closed tab)."""
        for signal in [*self._going, self.signal]:
            signal.stop(CLOSED)

    async def stream(
        self,
        target: Any,
        *args: Any,
        each: Sequence[Any] | None = None,
        tokenizer: Any = None,
        preview: str | None = None,
        preview_every: int = 1,
        size: int = 256,
        **kwargs: Any,
    ) -> AsyncIterator[View]:
        """Run ``target(*args, **kwargs)`` under this session's buttons, yielding a :class:`View`
        after each event. ``each=[a, b, ...]``: one run per item, the item passed first
        (``target(a, *args, **kwargs)``). ``tokenizer``, ``preview`` and ``preview_every`` are
        :func:`stopcock.stream`'s; ``size``: images smaller than this are enlarged (:func:`enlarge`).
        Other keyword arguments go to :func:`stopcock.astream` (``buffer=``), to
        :func:`stopcock.run` (``mode=``, ``partial=``, ``on_step=``; a ``stop=`` given is joined with
        this session's signal) and to the target.
        """
        items = [None] if each is None else list(each)
        signal = self.signal = StopSignal()
        stop = kwargs.pop("stop", None)
        condition: Any = signal if stop is None else [signal, *(stop if isinstance(stop, list) else [stop])]
        view = View(items=len(items))
        self._going.append(signal)
        try:
            yield view
            for index, item in enumerate(items):
                if signal.stopped or signal.after_item is not None:
                    break
                view = replace(view, item=index, text="", image=None, step=0, total=None)
                call_args = args if each is None else (item, *args)
                async with astream(target, *call_args, stop=condition, tokenizer=tokenizer, preview=preview,
                                   preview_every=preview_every, **kwargs) as events:
                    async for event in events:
                        view = self._next(view, event, size)
                        yield view
        finally:
            self._going.remove(signal)
        yield replace(view, running=False, status=self._ended(view, signal))

    def _next(self, view: View, event: Any, size: int) -> View:
        where = f"Item {view.item + 1} of {view.items}: " if view.items > 1 else ""
        if isinstance(event, TextChunk):
            if event.row != 0:  # several rows: the page shows the first
                return view
            text = view.text + event.text
            return replace(view, text=text, step=event.step, status=f"{where}token {event.step}")
        if isinstance(event, Step):
            image = view.image if event.preview is None else enlarge(event.preview, size)
            of = f"/{event.total}" if event.total else ""
            return replace(view, image=image, step=event.step, total=event.total,
                           status=f"{where}step {event.step}{of}")
        assert isinstance(event, Done)
        outcome = event.outcome
        text, image = view.text, view.image
        found = _image_of(outcome.output)
        if found is not None:
            image = enlarge(found, size)
        elif isinstance(outcome.output, list) and outcome.output and isinstance(outcome.output[0], dict):
            text = str(outcome.output[0].get("generated_text", text))  # a text pipeline's own result
        unit = "token" if view.text else "step"
        return replace(
            view, text=text, image=image, texts=(*view.texts, text), images=(*view.images, image),
            step=outcome.steps, total=outcome.total_steps, outcome=outcome,
            outcomes=(*view.outcomes, outcome), status=where + _sentence(outcome, unit),
        )

    @staticmethod
    def _ended(view: View, signal: StopSignal) -> str:
        if view.outcome is None:
            return "Stopped before the run started." if signal.stopped else "Nothing ran."
        status = view.status
        if view.items > 1:
            done = len(view.outcomes)
            if signal.after_item is not None and done < view.items:
                status += f" Stopped after this item: {view.items - done} not started."
            elif signal.stopped and done < view.items:
                status += f" {view.items - done} not started."
        return status


def _image_of(output: Any) -> Any:
    """The first image of a diffusers output (None for anything else)."""
    images = getattr(output, "images", None)
    if isinstance(images, list) and images and hasattr(images[0], "size"):
        return images[0]
    return None


def _sentence(outcome: Outcome, unit: str) -> str:
    """How a run ended, for a person: a stopped one says its partial result is kept."""
    total = f" of {outcome.total_steps}" if outcome.total_steps is not None else ""
    if outcome.stopped and outcome.reason == "skipped":
        return f"Skipped after {outcome.steps}{total} {unit}s."
    if outcome.stopped:
        return f"Stopped ({outcome.reason}) after {outcome.steps}{total} {unit}s: the partial result is kept."
    return f"Done: {outcome.steps}{total} {unit}s in {outcome.elapsed:.1f} s."
