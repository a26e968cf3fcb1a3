"""A run's time limits: its timeouts and deadlines placed on the run's monotonic clock.

A timeout counts from the run's start; a deadline is an epoch time, placed on the monotonic clock
once, at the start (a later change of the wall clock moves neither). :class:`TimeLimits` computes
the moments from the clock readings its run gives it (the run keeps the one clock its conditions,
its ``elapsed`` and its Outcome read), so every moment here is on that clock.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["TimeLimits"]


class TimeLimits:
    """When a run's timeouts and deadlines expire, from :meth:`start` on.

    ``time_limit``: the first timeout's expiry (monotonic); ``wall_limit``: the first deadline
    (epoch seconds, read against the wall clock); ``due``: the first of all of them (monotonic).
    All three are None when the run has no time condition.
    """

    __slots__ = ("deadlines", "due", "time_limit", "timeouts", "wall_limit")

    def __init__(self, timeouts: tuple[float, ...], deadlines: tuple[float, ...]) -> None:
        self.timeouts = timeouts  # seconds from the start of the run
        self.deadlines = deadlines  # epoch seconds
        self.time_limit: float | None = None
        self.wall_limit: float | None = None
        self.due: float | None = None

    def start(self, started: float, wall_clock: Callable[[], float]) -> None:
        """Place the limits for a run started at ``started`` (monotonic); a deadline is placed by
        one reading of ``wall_clock`` (epoch seconds), taken only when the run has one."""
        if not (self.timeouts or self.deadlines):  # no time condition: the usual case
            return
        timeouts = [started + s for s in self.timeouts]
        wall_now = wall_clock() if self.deadlines else 0.0
        deadlines = [started + (when - wall_now) for when in self.deadlines]
        self.time_limit = min(timeouts, default=None)
        self.wall_limit = min(self.deadlines, default=None)
        self.due = min(timeouts + deadlines)

    def requested(self, stopped_at: float | None) -> float | None:
        """When a stop was (or will be) requested: the token's stop at ``stopped_at``, or the first
        limit's expiry, whichever is first; None while neither is known."""
        due = self.due
        if stopped_at is None or due is None:
            return due if stopped_at is None else stopped_at
        return min(stopped_at, due)

    def requested_by(self, stopped_at: float | None, now: float) -> float:
        """When a stop was requested, by ``now``: the token's stop at ``stopped_at`` or the first
        limit's expiry, whichever came first and has come; ``now`` if neither has."""
        times = [t for t in (stopped_at, self.due) if t is not None and t <= now]
        return min(times, default=now)
