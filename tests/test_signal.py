"""StopSignal: idempotent, first reason wins, thread- and signal-handler-safe, callbacks, children."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import threading

import pytest

from stopcock import StopSignal


def test_first_reason_wins_and_stop_is_idempotent():
    s = StopSignal()
    assert not s.stopped and s.reason is None and s.stopped_at is None
    assert s.stop("first") is True
    assert s.stop("second") is False
    assert s.stopped and s.reason == "first" and s.stopped_at is not None


def test_reason_must_be_a_non_empty_string():
    with pytest.raises(TypeError):
        StopSignal().stop("")
    with pytest.raises(TypeError):
        StopSignal().stop(None)  # type: ignore[arg-type]


def test_exactly_one_of_many_racing_threads_wins():
    s = StopSignal()
    barrier = threading.Barrier(16)
    winners: list[int] = []
    lock = threading.Lock()

    def racer(i: int) -> None:
        barrier.wait()
        if s.stop(f"r{i}"):
            with lock:
                winners.append(i)

    threads = [threading.Thread(target=racer, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(winners) == 1
    assert s.reason == f"r{winners[0]}"


def test_wait_returns_false_on_timeout_and_true_once_stopped_from_another_thread():
    s = StopSignal()
    assert s.wait(timeout=0) is False
    started = threading.Event()

    def stopper() -> None:
        started.wait()
        s.stop("from thread")

    t = threading.Thread(target=stopper)
    t.start()
    started.set()
    assert s.wait() is True
    t.join()
    assert s.reason == "from thread"


def test_on_stop_runs_once_and_immediately_when_registered_late():
    s = StopSignal()
    calls: list[str] = []
    s.on_stop(lambda: calls.append("early"))
    s.stop()
    s.stop()
    s.on_stop(lambda: calls.append("late"))
    assert calls == ["early", "late"]


def test_on_stop_remover_unregisters():
    s = StopSignal()
    calls: list[int] = []
    remove = s.on_stop(lambda: calls.append(1))
    remove()
    s.stop()
    assert calls == []


def test_callback_errors_are_raised_after_all_callbacks_ran():
    s = StopSignal()
    calls: list[str] = []

    def bad() -> None:
        raise RuntimeError("boom")

    s.on_stop(bad)
    s.on_stop(lambda: calls.append("second"))
    with pytest.raises(RuntimeError, match="boom"):
        s.stop("x")
    assert calls == ["second"] and s.reason == "x"


def test_child_follows_parent_but_stops_alone():
    parent = StopSignal()
    a, b = parent.child(), parent.child()
    assert a.stop("own") is True
    assert not parent.stopped
    parent.stop("parent")
    assert a.reason == "own" and b.reason == "parent"
    late = parent.child()
    assert late.stopped and late.reason == "parent"


def test_grandchildren_are_reached():
    root = StopSignal()
    grandchild = root.child().child()
    root.stop("root")
    assert grandchild.reason == "root"


def test_parent_holds_children_weakly():
    parent = StopSignal()
    for _ in range(100):
        parent.child()
    gc.collect()
    assert len(parent._children) == 0


def test_wait_async_wakes_on_stop_from_a_thread():
    async def main() -> str:
        s = StopSignal()
        threading.Thread(target=s.stop, args=("threaded",)).start()
        return await s.wait_async()

    assert asyncio.run(main()) == "threaded"


def test_wait_async_cancelled_leaves_no_callback_behind():
    async def main() -> StopSignal:
        s = StopSignal()
        task = asyncio.ensure_future(s.wait_async())
        await asyncio.sleep(0)  # let the task register its wake-up
        assert len(s._callbacks) == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return s

    s = asyncio.run(main())
    assert len(s._callbacks) == 0


def test_stop_inside_an_event_loop_wakes_waiters_in_that_loop():
    async def main() -> str:
        s = StopSignal()
        waiter = asyncio.ensure_future(s.wait_async())
        await asyncio.sleep(0)
        s.stop("in loop")
        return await waiter

    assert asyncio.run(main()) == "in loop"


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs POSIX signals")
def test_stop_from_a_signal_handler_while_the_lock_is_held():
    """A handler that interrupts code holding the signal's lock must not deadlock (re-entrant)."""
    s = StopSignal()
    old = signal.signal(signal.SIGUSR1, lambda *_: s.stop("signal"))
    try:
        with s._lock:  # the main thread holds the lock, as it would inside on_stop()
            os.kill(os.getpid(), signal.SIGUSR1)
            for _ in range(1000):  # the handler runs between bytecodes of this thread
                if s.stopped:
                    break
        assert s.reason == "signal"
    finally:
        signal.signal(signal.SIGUSR1, old)


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs POSIX signals")
def test_a_handler_interrupting_stop_on_the_same_thread_cannot_overwrite_the_reason():
    """The claim is one atomic step: whichever call makes it wins, the other returns False."""
    s = StopSignal()
    results: dict[str, bool] = {}
    old = signal.signal(signal.SIGUSR1, lambda *_: results.setdefault("handler", s.stop("handler")))
    try:
        # The handler runs at some bytecode boundary after the kill: before or inside stop().
        s.on_stop(lambda: None)
        os.kill(os.getpid(), signal.SIGUSR1)
        results["outer"] = s.stop("outer")
        for _ in range(1000):
            if "handler" in results:
                break
        winner = "outer" if results["outer"] else "handler"
        assert sorted(results.values()) == [False, True]
        assert s.reason == winner
    finally:
        signal.signal(signal.SIGUSR1, old)
