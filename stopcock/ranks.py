"""Stop agreement across ranks: a run sharded over a process group stops on every rank at one step.

A model sharded over several processes (transformers' ``tp_plan="auto"`` under ``torchrun``,
diffusers' ``enable_parallelism``) runs the same loop on every rank, and the ranks meet in a
collective inside every step. A stop that reaches one rank only (the one serving a UI) would end
that rank's loop while the others wait in their next collective, forever. With ``group=`` (or a
model whose sharding names its group, see :func:`group_of`), ``stopcock.run`` replaces the run's
stop with an :class:`Agreement`: what can stop the run (signals, timeouts, deadlines, conditions)
is still decided on each rank, on that rank's clock, but a rank that decides does not stop; it
*announces* a stop step, and every rank stops at that step, with the announcer's reason.

**The mechanism.** Each run of a group gets a key in the process group's store (the TCP store
``init_process_group`` made; ``stopcock/ranks/<group>/<n>/stop``, ``n`` counting the group's runs on
each rank, so every rank names the same key without talking). On each rank a watcher thread waits
for the key (``store.wait`` on a connection of its own); when it appears, the watcher keeps the
announcement in the run's :class:`Agreement` and acknowledges it in the store. A rank whose own stop
fires at the boundary after step ``s`` writes ``T = s + 1`` and its reason with ``compare_set``,
which writes only if nobody has (when two ranks decide at once, both read back the one that won),
then waits until every other rank has acknowledged. Every rank (the announcer too) stops at its
first boundary at step ``>= T``; in finish mode the library then builds its result from the steps
done, in abort mode the run leaves at that boundary (the next module call raises before any
collective of step ``T + 1``). When the run ends on a rank with no stop announced, that rank writes
"end" into the key, which ends every watcher and keeps a late announcement from taking effect.

**Why no rank passes T before it knows it.** Call the announcer A and any other rank B. Every step
contains a collective that completes on a rank only once every rank has entered it (the premise of
sharding: the ranks exchange activations inside each step). A writes the key at its boundary after
step ``s`` and enters step ``s + 1`` only after B's watcher has acknowledged, which it does after it
has stored the announcement on B and armed B's step check. B completes step ``s + 1`` only after A
entered it, so B's boundary after step ``s + 1`` (the step ``T``) checks, reads the announcement and
stops there. And B cannot be late for it: A completed step ``s``, so B entered step ``s``, and B's
boundaries from then on are ``s``, then ``s + 1 = T``. A margin of one step is enough; a stop costs
one step more than on one process. The watcher runs while B's run thread waits in a collective
(collectives release the GIL). On a GPU, where NCCL launches collectives without waiting, the
premise needs the host of each rank to wait for each step's result, as ``generate``'s per-token
check of finished rows does.

**Cost (measured by ``python -m bench --only ranks``; figures in ``bench/RESULTS.md``).** A design
that read the key at every step boundary (``store.check``) pays a store round trip per step, and
inside a lockstep loop of ranks that wait is paid again whenever the store's thread must be
scheduled. The watcher moves that wait off the run's thread, and the run's control
sees only what can stop it (:meth:`Agreement.parts`: the run's own signals, time limits and
``max_steps``, and a signal the watcher stops before it acknowledges), so until a stop is possible
on this rank or announced by another, a step costs what it costs in one process: nothing of this
module, and transformers' criterion stays out of generate's loop. A stop costs the announcement
and one acknowledgement per rank; a run, a store connection for its watcher, a thread, and one
write at its end.

**Never a hang.** Store calls time out (the store's timeout, ``init_process_group(timeout=)``) and a
rank whose store or peer is gone raises :class:`RankLost` naming what happened, as does a collective
of the run that fails because a peer died (gloo reports the closed connection at once). An
announcer whose acknowledgements do not come (a rank not running the agreement: run without the
same ``group=``) raises :class:`RankLost` after :data:`ACK_TIMEOUT` (or the store's timeout), and
a rank that sees an announcement for a step it has already passed (a rank not stepping in
lockstep) raises :class:`RanksError`, instead of going on alone. A rank that hangs without dying
is waited for as long as the group's own timeout.

**What the Outcome measures.** Every rank returns the same ``stopped``, ``reason``, ``steps`` and
``mode``. Its ``stop_latency`` is its own, on its own clock, from :attr:`Agreement.known_at`: on the
rank that decided, its stop request (as on one process: the signal's stop, or the check at which its
condition fired); on any other rank, the moment its watcher read the announcement. So on every rank
it includes the step the agreement adds; on the other ranks it leaves out how long the announcement
took to reach them (the ranks' clocks are not compared).

Every rank makes the same runs of a group in the same order, one at a time (as its collectives
require anyway): a run's key is named by that order. The user's signals are read, not followed:
``skip()`` and ``stop_after_item()`` do not apply to a group run, and ``escalate_after=`` is refused
(it would abort one rank inside a forward while the others wait in a collective).
"""

from __future__ import annotations

import datetime
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from .conditions import Condition, Signalled, StopLike, as_condition, top_level
from .signal import StopSignal
from .state import StepState

__all__ = ["Agreement", "RankLost", "RanksError", "agreement", "group_of"]

_R = TypeVar("_R")

#: Where a run's keys live in the group's store.
PREFIX = "stopcock/ranks"
_END = b"end"  # the run's key once the run has ended on some rank with no stop announced
#: The longest an announcer waits for the other ranks' acknowledgements (or the store's timeout).
ACK_TIMEOUT = datetime.timedelta(seconds=60)
#: The longest the end of a run waits for its watcher thread to leave.
WATCHER_EXIT = datetime.timedelta(seconds=10)

# runs started per group on this rank: the n of each run's keys (the same on every rank)
_runs: dict[str, int] = {}


class RanksError(RuntimeError):
    """The ranks of a group cannot agree on a stop: raised on a rank instead of waiting forever."""


class RankLost(RanksError):
    """A rank of the group, or the group's store, is gone (a process died or was killed)."""


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def group_of(target: Any) -> Any:
    """The process group ``target``'s model is sharded over, or None (not sharded, or no process
    group initialised): transformers' ``tp_plan`` device mesh (a model, or a pipeline's ``model``),
    diffusers' parallel config (``enable_parallelism``) on any model of a pipeline."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")  # not imported: nothing is sharded
    if c10d is None or not c10d.is_initialized():
        return None
    models = [target, getattr(target, "model", None), getattr(target, "__self__", None)]
    components = getattr(target, "components", None)
    if isinstance(components, dict):
        models += components.values()
    for model in models:
        mesh = getattr(model, "_device_mesh", None)  # transformers' tensor parallelism
        config = getattr(model, "_parallel_config", None)  # diffusers' context or tensor parallelism
        if mesh is None and config is not None:
            cp = getattr(config, "context_parallel_config", None)
            mesh = getattr(cp, "_flattened_mesh", None) or getattr(config, "_mesh", None)
        if mesh is not None:
            return _mesh_group(mesh, model)  # (None for a mesh of one rank)
    return None


def _mesh_group(mesh: Any, model: Any) -> Any:
    """The group of the ranks that step together over ``mesh``: all of them (the whole world, or
    the one dimension of size > 1), or None for a mesh of one rank."""
    dist = _dist()
    if mesh.size() <= 1:
        return None
    if mesh.size() == dist.get_world_size():
        return dist.group.WORLD
    sharded = [i for i, n in enumerate(mesh.shape) if n > 1]
    if len(sharded) == 1:
        return mesh.get_group(sharded[0])
    raise RanksError(
        f"the {type(model).__name__} is sharded over a device mesh {tuple(mesh.shape)} that is not the whole"
        " world: pass the process group whose ranks step together, e.g. stopcock.run(..., group=pg)"
    )


def _store_of(group: Any) -> Any:
    dist = _dist()
    if group is None or group is dist.group.WORLD:
        return dist.distributed_c10d._get_default_store()
    return dist.distributed_c10d._get_process_group_store(group)


class Agreement(Condition):
    """One run's stop, agreed across the ranks of ``group`` (see the module docstring).

    ``inner`` is the run's own stop (checked on this rank, on this rank's clock); the agreement
    fires at the step announced by whichever rank decided first, with that rank's reason. Enter
    :meth:`guard` around the run: it starts the watcher thread and ends it.
    """

    reason = "agreed"
    fires_in_forward = False  # it fires at step boundaries only: a forward is never left half-way

    def __init__(self, inner: Condition | None, group: Any) -> None:
        dist = _dist()
        if not dist.is_available() or not dist.is_initialized():
            raise RanksError(
                "group= needs torch.distributed initialised on every rank:"
                " call torch.distributed.init_process_group() first (torchrun sets up its environment)"
            )
        self.inner = inner
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self._store = _store_of(group)
        name = dist.distributed_c10d._get_process_group_name(group) if group is not None else ""
        n = _runs[name] = _runs.get(name, 0) + 1
        self.key = f"{PREFIX}/{name or 'world'}/{n}"
        self._stop_key = f"{self.key}/stop"
        #: the announced step and reason, once known (set by the watcher thread, or by the announcer)
        self.agreed: tuple[int, str] | None = None
        self._decided_at: float | None = None  # this rank's own stop request, when its stop decided
        self._heard_at: float | None = None  # when this rank's watcher read an announcement
        self._known = False  # the run's thread has seen ``agreed``
        self._last: int | None = None  # the step of this rank's last boundary
        self._watcher: threading.Thread | None = None
        self._closed = False  # the run has ended on this rank
        #: stopped once this rank knows of an announcement: the run's control watches it (see parts)
        self.announced = StopSignal()
        self._announced = Signalled(self.announced)

    def parts(self) -> Iterator[Condition]:
        """What the run's control watches to know when a step must be checked: the parts of the
        run's own stop (its signals, time limits, ``max_steps``) and :attr:`announced`, not the
        agreement itself, so a step where none of them can fire takes the control's fast path
        (no check at all) and a step check that can wait (transformers' criterion) stays out of
        the loop until one of them arms it."""
        if self.inner is not None:
            yield from self.inner.parts()
        yield self._announced

    def __repr__(self) -> str:
        return f"Agreement({self.inner!r}, rank {self.rank} of {self.world})"

    # -- the store ------------------------------------------------------------------------------------
    def _store_call(self, fn: Callable[..., _R], *args: Any) -> _R:
        dist = _dist()
        try:
            return fn(*args)
        except dist.DistError as exc:
            raise RankLost(
                f"rank {self.rank}: the process group's store did not answer ({exc}); a rank has died (the"
                " store lives in rank 0's process, or in torchrun's agent), or a rank is not running the"
                " agreement (pass the same group= to stopcock.run on every rank), or the group's timeout"
                " passed: every rank of the run must be restarted"
            ) from exc

    def _watch(self, store: Any) -> None:
        """The watcher thread: wait for the run's key; an announcement is kept (``agreed``), then
        acknowledged, so the announcer knows this rank will stop at its step."""
        dist = _dist()
        while True:
            try:
                store.wait([self._stop_key])
                raw = store.get(self._stop_key)
                if raw != _END:
                    # known and armed (the run's step checks are in its loop) before the acknowledgement
                    self._heard_at = time.monotonic()
                    self.agreed = self._parse(raw)
                    self.announced.stop("announced")
                    store.set(f"{self.key}/ack/{self.rank}", b"1")
                return
            except dist.DistNetworkError:
                return  # the store is gone: the run's own collectives and store calls report it
            except dist.DistStoreError:
                if self._closed:
                    return
                continue  # the store's timeout passed with no announcement and the run goes on: wait on

    def _announce(self, step: int, reason: str) -> tuple[int, str] | None:
        """Announce a stop at ``step`` (unless a rank did first) and wait until every other rank's
        watcher has it; None if the run has ended on another rank."""
        won = self._store_call(self._store.compare_set, self._stop_key, "", f"{step} {reason}")
        if won == _END:
            return None
        others = [f"{self.key}/ack/{r}" for r in range(self.world) if r != self.rank]
        if others:  # a watcher acknowledges even while its rank waits in a collective
            self._store_call(self._store.wait, others, min(self._store.timeout, ACK_TIMEOUT))
        return self._parse(won)

    @staticmethod
    def _request_time(inner: Condition) -> float:
        """When this rank's own stop was requested, as on one process: the first stop of a signal at
        the top level of its stop (a run's token takes it at once), else now (a condition fired)."""
        times = [
            c.signal.stopped_at for c in top_level(inner)
            if isinstance(c, Signalled) and c.signal.stopped_at is not None
        ]
        return min(times, default=time.monotonic())

    @property
    def known_at(self) -> float | None:
        """When this rank first knew that the run will stop (``time.monotonic()``, this rank's
        clock), or None: on the rank that decided, its own stop request (a signal's stop, or the
        check at which its condition fired); on any other rank, the moment its watcher read the
        announcement from the store (before it acknowledged it). A rank that decided too, but
        whose announcement lost to another's, knew at the first of the two. The run's
        ``Outcome.stop_latency`` counts from here."""
        times = [t for t in (self._decided_at, self._heard_at) if t is not None]
        return min(times, default=None)

    @staticmethod
    def _parse(raw: bytes) -> tuple[int, str]:
        step, _, reason = raw.decode().partition(" ")
        return int(step), reason

    # -- the check ------------------------------------------------------------------------------------
    def check(self, state: StepState) -> str | None:
        if state.block:
            return None
        step, last = state.step, self._last
        self._last = step
        agreed = self.agreed
        if agreed is None and self.inner is not None:
            reason = self.inner.check(state)
            if reason is not None:
                self._decided_at = self._request_time(self.inner)
                agreed = self.agreed = self._announce(step + 1, reason)
                self.announced.stop("announced")
        if agreed is None:
            return None
        target, reason = agreed
        if not self._known:
            self._known = True
            if last is not None and last >= target:
                raise RanksError(
                    f"rank {self.rank} passed step {target}, where another rank announced a stop, before it"
                    " saw the announcement: the ranks do not step in lockstep (a rank runs a different"
                    " loop, or a step has no collective); run the same call on every rank"
                )
        return reason if step >= target else None

    @contextmanager
    def guard(self) -> Iterator[None]:
        """Around the run: the watcher thread runs, and a collective that fails because a peer is
        gone raises :class:`RankLost` (from the library's error); any other error passes unchanged.
        At the end the run's key is closed (an announcement, or the end), which ends every watcher."""
        dist = _dist()
        watching = self._store_call(self._store.clone)
        self._watcher = threading.Thread(
            target=self._watch, args=(watching,), name="stopcock-ranks", daemon=True
        )
        self._watcher.start()
        try:
            yield
        except RuntimeError as exc:
            text = str(exc)
            # gloo reports a peer gone as a plain RuntimeError; NCCL and the store as a DistError
            lost = isinstance(exc, dist.DistError) or any(
                mark in text for mark in ("Connection closed by peer", "Connection reset by peer")
            )
            if not lost or isinstance(exc, RanksError):
                raise
            raise RankLost(
                f"rank {self.rank}: a collective of the run failed, a rank of the group has died or left"
                f" ({text.splitlines()[0] if text else type(exc).__name__}); every rank of the run must be"
                " restarted"
            ) from exc
        finally:
            self._close()

    def _close(self) -> None:
        """End the run's key, unless a rank announced a stop in it: every rank's watcher wakes; wait
        for this rank's to leave."""
        dist = _dist()
        self._closed = True
        try:
            self._store.compare_set(self._stop_key, "", _END)
        except dist.DistError:
            pass  # the store is gone: the watchers end on their own (their wait fails)
        watcher = self._watcher
        if watcher is not None:
            # it wakes at once (the key is written, or its wait fails); joined so that no thread is
            # left inside the store's client when the process tears the group or itself down
            watcher.join(WATCHER_EXIT.total_seconds())


def agreement(
    target: Any, stop: StopLike | None, group: Any, *, escalate_after: float | None = None
) -> Agreement | None:
    """The run's stop agreed over ``group`` (a process group or a device mesh, given, or found with
    :func:`group_of`), or None for a run that is not sharded: ``group=False`` turns the detection off."""
    if group is False:
        return None
    if group is None:
        group = group_of(target)
        if group is None:
            return None
    elif hasattr(group, "get_group") and hasattr(group, "mesh_dim_names"):  # a DeviceMesh
        group = _mesh_group(group, target)
        if group is None:  # a mesh of one rank: nothing to agree with
            return None
    condition = None if stop is None else as_condition(stop)
    per_row = [] if condition is None else [c for c in condition.parts() if c.per_row]
    if per_row:
        raise ValueError(
            f"{per_row[0]!r} ends rows one by one, which is not agreed across ranks: drop it for a run"
            " over a process group; for stop strings, pass transformers' own stop_strings=[...] and"
            " tokenizer= to the call instead (it ends the same rows on every rank)"
        )
    if escalate_after is not None:
        raise ValueError(
            "escalate_after= aborts one rank inside a forward while the other ranks wait in a collective:"
            " drop it for a run over a process group (mode='abort' leaves every rank at the agreed step)"
        )
    return Agreement(condition, group)
