"""Ranks on this machine: one sharded model run by a process group of local processes.

``stopcock text --tp N`` and ``stopcock serve --tp N`` run a model sharded with transformers'
tensor parallelism over ``N`` processes of this machine (gloo, on CPU). Rank 0 is the caller's own
process (the command, or the server's worker thread); :class:`LocalGroup` starts ranks 1..N-1 as
worker processes (``python -m MODULE ARGS``), which join the group through the TCP store rank 0
holds. Rank 0 tells them each run to make: :meth:`LocalGroup.post` writes the run's description (a
JSON object) under a key of the store numbered by the order of the runs; each worker waits for that
key (:func:`follow`), makes the same ``stopcock.run`` call on the model it holds, and writes back
how its run ended, which rank 0 reads (:meth:`LocalGroup.results`) and compares with its own. The
stop of each run is the agreement of :mod:`stopcock.ranks` (the model's device mesh names the
group): rank 0 holds the stop signal and the conditions, and every rank stops at the same step.

Never a hang. A worker that exits is seen by rank 0 at its next collective (gloo reports the
closed connection: :class:`~stopcock.ranks.RankLost`), and while rank 0 waits for it on the store
(it looks at the workers' processes meanwhile); a worker whose rank 0 is gone fails its next
collective or store call and leaves. The end of the group tells the workers to leave, or, after a
run that did not end on every rank (an error, a second Ctrl+C), terminates them; either way a
worker still there after :data:`EXIT_TIMEOUT` is killed.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from . import ranks
from .errors import UserError
from .outcome import Outcome
from .ranks import RankLost, RanksError

__all__ = [
    "EXIT_TIMEOUT",
    "GROUP_TIMEOUT",
    "JOIN_TIMEOUT",
    "LocalGroup",
    "check_shardable",
    "follow",
    "join",
    "report_of",
]

#: Where the runs' descriptions and the workers' reports live in the group's store.
PREFIX = "stopcock/local"
_END = b"end"  # a run's key once the group ends: the workers leave
#: The longest rank 0 waits for a worker to start and join the group (it imports torch first).
JOIN_TIMEOUT = datetime.timedelta(seconds=180)
#: The group's timeout: the longest a collective of a step, or a store call, waits for a rank
#: (``STOPCOCK_GROUP_TIMEOUT``, in seconds, sets another).
GROUP_TIMEOUT = datetime.timedelta(seconds=float(os.environ.get("STOPCOCK_GROUP_TIMEOUT", "300")))
#: Seconds the end of the group waits for each worker to leave before it kills it.
EXIT_TIMEOUT = 30.0
_LOOK = 0.02  # seconds between two looks of rank 0, waiting for the workers, at the store and them


def check_shardable(spec: str, world: int, option: str) -> None:
    """A one-line :class:`UserError` naming the fix, before any process starts, for a model that
    transformers cannot shard over ``world`` ranks: no tensor-parallel plan, or heads that do not
    split evenly. A folder or id whose config cannot be read is left to the load, which says why."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(spec)
    except (OSError, ValueError):
        return
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    name = (getattr(config, "architectures", None) or [type(config).__name__])[0]
    if not getattr(text, "base_model_tp_plan", None):
        raise UserError(
            f"{option} {world}: {name} has no tensor-parallel plan in transformers, so it cannot be sharded:"
            f" run it without {option}, or pick a model that has one (Llama, Mistral, Qwen2, Gemma, ...)"
        )
    for field in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(text, field, None)
        if isinstance(heads, int) and heads % world:
            raise UserError(
                f"{option} {world}: {name} has {heads} {field.removeprefix('num_').replace('_', ' ')}, which"
                f" do not split over {world} ranks: pass a number of ranks that divides {heads}"
            )


def report_of(outcome: Outcome, tokens: Any = None) -> dict[str, Any]:
    """What a rank reports of its run, compared across ranks: how it ended and its tokens (or None)."""
    if tokens is None:
        tokens = outcome.output if outcome.output is not None else outcome.extra.get("input_ids")
    listed = tokens.tolist() if hasattr(tokens, "tolist") else tokens
    return {"stopped": outcome.stopped, "reason": outcome.reason, "steps": outcome.steps, "tokens": listed}


class LocalGroup:
    """Rank 0's side of a group of ``world`` local ranks: starts ranks 1..world-1 (``python -m
    module *argv``, ``threads`` torch threads each), joins the process group with them, tells
    them each run (:meth:`post`) and reads how each ended (:meth:`results`); :meth:`close` ends them.
    This process must not be in a process group already."""

    def __init__(
        self, world: int, module: str, argv: Sequence[str], *, threads: int = 1,
        timeout: datetime.timedelta = GROUP_TIMEOUT,
    ) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            raise UserError("this process is in a process group already: run the sharded model from a process"
                            " that is not (or use stopcock.run(..., group=) there)")
        self.world = world
        self.timeout = timeout
        self.runs = 0
        #: per run of the group, in order: the reports of ranks 1..world-1
        self.reports: list[list[dict[str, Any]]] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        self.store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                                   timeout=timeout)
        env = {
            **os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.store.port),
            "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "OMP_NUM_THREADS": str(threads),
            "STOPCOCK_RANK_THREADS": str(threads), "STOPCOCK_GROUP_TIMEOUT": str(timeout.total_seconds()),
        }
        try:
            for rank in range(1, world):
                # a session of its own: a Ctrl+C at the terminal is rank 0's alone (it stops every rank)
                ranked = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", module, *argv], env=ranked, stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL, start_new_session=True,
                ))
            self._wait([f"{PREFIX}/joined/{r}" for r in range(1, world)], JOIN_TIMEOUT, "join the group")
            dist.init_process_group("gloo", store=self.store, rank=0, world_size=world, timeout=timeout)
            # the agreement names each run's key by counting the group's runs on each rank: the workers are
            # new, so this rank counts from the start too (a group of an earlier LocalGroup had the same name)
            c10d = dist.distributed_c10d
            ranks._runs.pop(c10d._get_process_group_name(c10d._get_default_group()), None)
        except BaseException:
            self.close(abandon=True)
            raise

    def pids(self) -> list[int]:
        """The process ids of ranks 1..world-1."""
        return [p.pid for p in self.procs]

    def post(self, message: Mapping[str, Any]) -> int:
        """Tell every worker the next run (a JSON-able ``message``); returns the run's number."""
        self.runs += 1
        self.store.set(f"{PREFIX}/{self.runs}/call", json.dumps(message))
        return self.runs

    def results(self, n: int) -> list[dict[str, Any]]:
        """The reports of ranks 1..world-1 on run ``n``, once each has written its own;
        :class:`RankLost` if a worker exits or the group's timeout passes first."""
        keys = [f"{PREFIX}/{n}/rank{r}" for r in range(1, self.world)]
        self._wait(keys, self.timeout, f"report the end of run {n}")
        found = [json.loads(self.store.get(key)) for key in keys]
        self.reports.append(found)
        return found

    def _wait(self, keys: list[str], timeout: datetime.timedelta, what: str) -> None:
        """Until every key of ``keys`` is in the store, looking at the workers' processes meanwhile (a
        store's ``wait`` would sleep through a worker's exit)."""
        deadline = time.monotonic() + timeout.total_seconds()
        while not self.store.check(keys):
            for rank, proc in enumerate(self.procs, 1):
                code = proc.poll()
                if code is not None:
                    raise RankLost(f"rank {rank} of {self.world} exited (status {code}) before it could"
                                   f" {what} (its error is above): every rank must be started again")
            if time.monotonic() > deadline:
                raise RankLost(f"the ranks did not {what} within {timeout.total_seconds():.0f} s: a rank"
                               " hangs; every rank must be started again")
            time.sleep(_LOOK)

    def close(self, *, abandon: bool = False) -> None:
        """End the workers, told to leave after the last run or, ``abandon`` (a run that did not end
        on every rank), terminated; each still there after :data:`EXIT_TIMEOUT` is killed. Then this
        process leaves the group. Idempotent."""
        import torch.distributed as dist

        if abandon:
            for proc in self.procs:
                if proc.poll() is None:
                    proc.terminate()
        else:
            with contextlib.suppress(dist.DistError):
                self.store.set(f"{PREFIX}/{self.runs + 1}/call", _END.decode())
        for proc in self.procs:
            try:
                proc.wait(EXIT_TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs = []
        if dist.is_initialized():
            dist.destroy_process_group()


# -- a worker -----------------------------------------------------------------------------------------


def join() -> tuple[Any, int]:
    """In a worker process: join the group rank 0 started (from the environment it set); returns the
    group's store and this rank. Ctrl+C is rank 0's to handle: a worker ignores SIGINT."""
    import torch
    import torch.distributed as dist

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(int(os.environ.get("STOPCOCK_RANK_THREADS", "1")))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=float(os.environ.get("STOPCOCK_GROUP_TIMEOUT", "300")))
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timeout)
    store.set(f"{PREFIX}/joined/{rank}", "1")
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    return store, rank


def worker_main(
    argv: Sequence[str] | None,
    command: str,
    executor: Callable[[Any, Any], Callable[[dict[str, Any]], dict[str, Any]]],
) -> int:
    """A worker rank's life (``python -m MODULE MODEL``, started by rank 0): join the group, load its
    shard of MODEL quietly (rank 0 says what needs saying), then make each run rank 0 posts with
    ``executor(model, tokenizer)``. A model that cannot load is a one-line error naming ``command``
    and the rank (exit status 1)."""
    from transformers.utils import logging

    from .loading import load_text_model

    (spec,) = sys.argv[1:] if argv is None else argv
    store, rank = join()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        model, tokenizer = load_text_model(spec, sharded=True)
    except UserError as exc:
        print(f"{command}: rank {rank}: error: {exc}", file=sys.stderr)
        return 1
    return follow(store, rank, executor(model, tokenizer))


def follow(store: Any, rank: int, execute: Callable[[dict[str, Any]], dict[str, Any]]) -> int:
    """A worker's loop: make each run rank 0 posts (``execute(message)`` returns the report) until
    the group ends; returns the process's exit status (1: the group broke, said on stderr)."""
    import torch.distributed as dist

    n = 0
    while True:
        n += 1
        try:
            raw = _next_run(store, f"{PREFIX}/{n}/call")
            if raw == _END:
                dist.destroy_process_group()
                return 0
            report = execute(json.loads(raw))
        except RanksError as exc:  # the group is broken: this rank leaves, saying why
            print(f"stopcock: rank {rank}: error: {exc}", file=sys.stderr, flush=True)
            return 1
        store.set(f"{PREFIX}/{n}/rank{rank}", json.dumps(report))


def _next_run(store: Any, key: str) -> bytes:
    import torch.distributed as dist

    while True:
        try:
            store.wait([key])
            return bytes(store.get(key))
        except dist.DistNetworkError as exc:
            raise RankLost("rank 0 is gone (its process holds the group's store): every rank must be started"
                           " again") from exc
        except dist.DistStoreError:
            continue  # the store's timeout passed with no run: wait on
