"""A run in a worker thread, and the bounded channel that carries its events to one consumer.

Used by :func:`stopcock.stream`, :func:`stopcock.astream` and :func:`stopcock.arun`; the consumer
side may be a thread or an event loop (woken through :meth:`Channel.add_waker`).
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

from ._callbacks import Callbacks
from .conditions import Condition, StopLike, as_condition
from .events import Done, Event, EventMaker
from .outcome import Outcome
from .runner import RUN_OPTIONS, Bound, bind
from .signal import StopSignal
from .state import StepState

__all__ = ["CONSUMER_POLL", "Channel", "start_worker"]

#: Seconds between two looks, by a worker held by a full buffer, at whether its consumer still
#: exists. A consumer that leaves wakes the worker at once; this is for one freed by the cyclic
#: garbage collector, which tells nobody.
CONSUMER_POLL = 0.05


class Channel:
    """The bounded hand-off from one worker thread to one consumer, sync or async.

    ``signal`` stops the run. ``abandon()`` says the consumer is gone: the run is stopped with
    reason ``"cancelled"`` and the worker no longer waits for room in the buffer. ``stalled`` is
    set once the worker has had to wait for the consumer (back-pressure). :meth:`attach` ties the
    run to the object the consumer holds, so that the run also ends when that object is dropped.
    """

    def __init__(self, size: int) -> None:
        self.signal = StopSignal()
        self.stalled = threading.Event()
        self.finished = False
        self.outcome: Outcome | None = None
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._items: deque[Event] = deque()
        self._size = size
        self._abandoned = False
        self._consumer: weakref.ref[Any] | None = None
        self._wakers = Callbacks(self._cond)

    def attach(self, consumer: object, on_drop: Callable[[], object]) -> weakref.ref[Any]:
        """Tie the run to ``consumer`` (the stream the user holds): once it is gone, the run stops.

        Returns a weak reference that ``consumer`` must keep on itself (drop it to detach). When
        the consumer's last reference goes (a ``break``, a ``del``), its callback runs
        ``on_drop()`` at once. When the cyclic garbage collector frees the consumer instead, that
        reference is garbage too and CPython calls no callback of a garbage weak reference: nothing
        of stopcock runs inside the collection (which may interrupt any code, on any thread, and
        would swallow a ``KeyboardInterrupt`` raised there); the worker notices at its next check
        (:meth:`consumer_gone`) and abandons the channel itself.
        """
        self._consumer = weakref.ref(consumer)
        return weakref.ref(consumer, lambda _: on_drop())

    def consumer_gone(self) -> bool:
        """Whether the attached consumer has been freed (False when none was attached)."""
        return self._consumer is not None and self._consumer() is None

    # worker side
    def put(self, event: Event) -> None:
        """Hand ``event`` over, waiting for room; dropped if the consumer is gone."""
        with self._cond:
            while len(self._items) >= self._size and not self._abandoned and not self.consumer_gone():
                self.stalled.set()
                self._cond.wait(CONSUMER_POLL)
            handed = not self._abandoned and not self.consumer_gone()
            if handed:
                self._items.append(event)
                self._cond.notify_all()
        if handed:
            self._wake()
        elif not self._abandoned:  # the consumer was freed by the cyclic collector
            self.abandon()

    def finish(self, outcome: Outcome | None, error: BaseException | None) -> None:
        with self._cond:
            self.outcome, self._error = outcome, error
            if error is None and outcome is not None and not self._abandoned:
                self._items.append(Done(outcome))  # beyond the bound: the end is never held back
            self.finished = True
            self._cond.notify_all()
        self._wake()

    # consumer side
    def abandon(self) -> None:
        """The consumer is gone: stop the run, drop what it will not read, end the iteration."""
        with self._cond:
            self._abandoned = True
            self._items.clear()
            self._cond.notify_all()
        self.signal.stop("cancelled")

    def raise_error(self) -> None:
        """Raise the run's exception if the consumer has not received it yet."""
        with self._cond:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def get(self) -> Event:
        """The next event, blocking until there is one; StopIteration at the end."""
        with self._cond:
            self._cond.wait_for(self.ready)
            return self._take()

    def ready(self) -> bool:
        """Whether :meth:`get_nowait` has something to return (an event or the end)."""
        return bool(self._items) or self.finished or self._abandoned

    def get_nowait(self) -> Event | None:
        """The next event, or None if there is none yet; StopIteration at the end."""
        with self._cond:
            return self._take() if self.ready() else None

    def _take(self) -> Event:
        if self._items:
            self._cond.notify_all()  # room for the worker
            return self._items.popleft()
        if self._error is not None and not self._abandoned:
            error, self._error = self._error, None
            raise error
        raise StopIteration

    def result(self) -> Outcome:
        """The run's Outcome once finished, or its exception raised."""
        if self._error is not None:
            raise self._error
        assert self.outcome is not None
        return self.outcome

    def add_waker(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Call ``fn()`` (on the worker's thread) after each event and at the end. Returns a remover."""
        return self._wakers.add(fn)

    def _wake(self) -> None:
        for fn in self._wakers.snapshot():
            fn()


class _ConsumerGone(Condition):
    """Stops the run once the channel's consumer is gone (checked at every step and block)."""

    reason = "cancelled"

    def __init__(self, channel: Channel) -> None:
        self.channel = channel

    def check(self, state: StepState) -> str | None:
        if not self.channel.consumer_gone():
            return None
        self.channel.abandon()
        return self.reason

    def __repr__(self) -> str:
        return "consumer_gone()"


def start_worker(
    target: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    stop: StopLike | None = None,
    buffer: int = 64,
    events: Callable[[Bound], EventMaker] | None = None,
    started: bool = True,
) -> tuple[Channel, threading.Thread]:
    """``stopcock.run(target, *args, stop=stop, **kwargs)`` in a worker thread feeding a new channel.

    The run stops when the user's ``stop`` does or when the channel's own signal does. With
    ``events`` (which builds the event maker for the bound call), each step's events go through
    the channel; else only the end does. Bad arguments that can be seen before the run (the target,
    ``stop=``, ``mode=``, streaming options) raise here, in the caller's thread. With
    ``started=False`` the thread is returned not started: the caller starts it, or calls
    ``channel.finish(None, None)`` if it never will.
    """
    if isinstance(buffer, bool) or not isinstance(buffer, int) or buffer < 1:
        raise ValueError(f"buffer must be an int >= 1 (events held for a slow consumer), got {buffer!r}")
    channel = Channel(buffer)
    condition: list[Condition] = [_ConsumerGone(channel), as_condition(channel.signal)]
    if stop is not None:
        condition.append(as_condition(stop))
    options = {name: kwargs.pop(name) for name in RUN_OPTIONS if name in kwargs}
    user_on_step: Callable[[StepState], object] | None = options.pop("on_step", None)
    maker: EventMaker | None = None

    def on_step(state: StepState) -> None:
        if maker is not None:
            for event in maker.on_step(state):
                channel.put(event)
        if user_on_step is not None:
            user_on_step(state)

    bound = bind(target, args, kwargs, stop=condition, on_step=on_step, **options)
    maker = None if events is None else events(bound)

    def work() -> None:
        outcome, error = None, None
        try:
            outcome = bound()
            for event in maker.flush() if maker is not None else ():
                channel.put(event)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, who raises it
            error = exc
        finally:
            channel.finish(outcome, error)

    thread = threading.Thread(target=work, name=f"stopcock-worker-{id(channel):x}", daemon=True)
    if started:
        thread.start()
    return channel, thread
