"""The per-step cost of the cross-rank stop agreement: 2 ranks on gloo, before any stop.

``python -m bench.ranks [--quick] [--out PATH]`` (or ``python -m bench --only ranks``) builds a tiny
Llama, starts 2 rank processes (torchrun's environment, one torch thread each) that load it with
``tp_plan="auto"``, and times greedy generation on both, the arms interleaved in the same order on
every rank (they must call the same collectives):

- *plain*: ``model.generate`` without stopcock;
- *one process's checks* (``group=False``): ``stopcock.run`` with a ``StopSignal`` and the agreement
  turned off, stopcock's own cost (which would hang the other rank on a stop);
- *every-step check*: ``group=False`` with a condition that sees every step and reads nothing,
  the step check the agreement makes (without its watcher thread);
- *agreed*: ``stopcock.run`` with a ``StopSignal``, the group found on the model: no step check
  until a stop is possible, a watcher thread per run waiting on the store.

Tokens per second (rank 0's wall clock; the ranks wait for each other each step) per arm, the ratio
to *plain*, and the agreed arm's cost per token over *one process's checks*, with 95% intervals of
the medians. Then the store round trip alone, and inside a lockstep loop of one ``all_reduce`` per
step with and without it: what a design that read the store at every step boundary would add. Then one stopped
run: rank 0's signal stops at token 3; both ranks must stop at token 4.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .common import Section, Table, interleaved, median_ci

PROMPT = [1, 5, 6, 7]
STOP_AT = 3
PLAIN, LOCAL, FLAG, AGREED = "plain", "one process's checks", "every-step check", "agreed"
ARMS = (PLAIN, LOCAL, FLAG, AGREED)
LOOP = 100  # steps of the lockstep loop per measurement
LAUNCH_TIMEOUT = 600  # seconds: the ranks are bounded, a hang ends the benchmark with an error


@dataclass(frozen=True)
class Config:
    tokens: int
    rounds: int


QUICK, FULL = Config(tokens=12, rounds=4), Config(tokens=48, rounds=16)


def build_model(folder: Path) -> Path:
    """A tiny random Llama (4 heads, 2 key-value heads: shardable over 2 ranks), saved to ``folder``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


# -- one rank ------------------------------------------------------------------------------------


def _worker(model_dir: str, out: str, tokens: int, rounds: int) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import stopcock

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    model = AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto").eval()
    ids = torch.tensor([PROMPT])
    kwargs: dict[str, Any] = dict(max_new_tokens=tokens, do_sample=False, eos_token_id=None, pad_token_id=0)

    class Reads(stopcock.Condition):
        """Sees every step, reads nothing: what a boundary costs that reads a watcher's flag."""

        fires_in_forward = False

        def check(self, state: stopcock.StepState) -> str | None:
            return None

    def timed(fn: Any) -> Any:
        def arm() -> float:
            start = time.perf_counter()
            fn()
            return tokens / (time.perf_counter() - start)

        return arm

    arms = {
        PLAIN: timed(lambda: model.generate(ids, **kwargs)),
        LOCAL: timed(lambda: stopcock.run(model, ids, stop=stopcock.StopSignal(), group=False, **kwargs)),
        FLAG: timed(lambda: stopcock.run(model, ids, stop=Reads(), group=False, **kwargs)),
        AGREED: timed(lambda: stopcock.run(model, ids, stop=stopcock.StopSignal(), **kwargs)),
    }
    found = interleaved(arms, rounds)
    signal = stopcock.StopSignal()

    def on_step(state: stopcock.StepState) -> None:
        if rank == 0 and state.step >= STOP_AT:
            signal.stop("user")

    stopped = stopcock.run(model, ids, stop=signal, on_step=on_step, **kwargs)
    store = dist.distributed_c10d._get_default_store()
    start, n = time.perf_counter(), 200
    for _ in range(n):
        store.check(["stopcock/bench/absent"])
    check_us = (time.perf_counter() - start) / n * 1e6
    # the round trip inside a lockstep loop: an all_reduce per step, with and without the check
    x = torch.ones(64)

    def loop(check: bool) -> Any:
        def arm() -> float:
            start = time.perf_counter()
            for _ in range(LOOP):
                dist.all_reduce(x)
                if check:
                    store.check(["stopcock/bench/absent"])
            return (time.perf_counter() - start) / LOOP * 1e6

        return arm

    lockstep = interleaved({"all_reduce": loop(False), "all_reduce + store.check": loop(True)}, rounds)
    result = {
        "tps": found, "stopped": [stopped.stopped, stopped.reason, stopped.steps],
        "tokens": stopped.output.tolist(), "store_check_us": check_us, "lockstep": lockstep,
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


# -- the launch ----------------------------------------------------------------------------------


def _launch(model_dir: Path, out: Path, c: Config) -> list[dict[str, Any]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    args = [sys.executable, "-m", "bench.ranks", "--worker", str(model_dir), str(out)]
    args += [str(c.tokens), str(c.rounds)]
    procs = [
        subprocess.Popen(args, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, cwd=root,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        for r in range(2)
    ]
    try:
        errors = [p.communicate(timeout=LAUNCH_TIMEOUT)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, err in zip(procs, errors, strict=True):
        if p.returncode != 0:
            raise RuntimeError(f"a rank failed ({p.returncode}): {err.decode()[-2000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def run(quick: bool = False) -> Section:
    c = QUICK if quick else FULL
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp, "llama"))
        ranks = _launch(model_dir, Path(tmp), c)
    tps = ranks[0]["tps"]
    table = Table(
        f"2 ranks (gloo, CPU), tiny Llama with tp_plan=\"auto\", {c.tokens} tokens, {c.rounds} rounds",
        ["arm", "tokens/s (median, 95% CI)", "ratio to plain", "µs per token over one process's checks"],
    )
    data: dict[str, Any] = {"arms": {}, "config": {"tokens": c.tokens, "rounds": c.rounds}}
    plain = sorted(tps[PLAIN])[len(tps[PLAIN]) // 2]
    local = tps[LOCAL]
    for arm in ARMS:
        values = tps[arm]
        med = sorted(values)[len(values) // 2]
        lo, hi = median_ci(values)
        ratios = [v / p for v, p in zip(values, tps[PLAIN], strict=True)]  # paired by round
        rmed = sorted(ratios)[len(ratios) // 2]
        rlo, rhi = median_ci(ratios)
        added = [(1 / v - 1 / w) * 1e6 for v, w in zip(values, local, strict=True)]
        amed = sorted(added)[len(added) // 2]
        alo, ahi = median_ci(added)
        table.add(
            arm, f"{med:.0f} [{lo:.0f}, {hi:.0f}]", f"{rmed:.3f} [{rlo:.3f}, {rhi:.3f}]",
            "" if arm in (PLAIN, LOCAL) else f"{amed:.0f} [{alo:.0f}, {ahi:.0f}]",
        )
        data["arms"][arm] = {"tps": med, "ratio": rmed, "added_us": amed}
    lockstep = ranks[0]["lockstep"]
    loop = Table(
        f"A lockstep loop: one all_reduce per step, {LOOP} steps per measurement, {c.rounds} rounds",
        ["loop", "µs per step (median, 95% CI)"],
    )
    for name, values in lockstep.items():
        lo, hi = median_ci(values)
        loop.add(name, f"{sorted(values)[len(values) // 2]:.0f} [{lo:.0f}, {hi:.0f}]")
    plain_loop, checked_loop = lockstep["all_reduce"], lockstep["all_reduce + store.check"]
    paired = [b - a for a, b in zip(plain_loop, checked_loop, strict=True)]
    lo, hi = median_ci(paired)
    data["lockstep_added_us"] = sorted(paired)[len(paired) // 2]
    loop.add("added by the check (paired by round)", f"{data['lockstep_added_us']:.0f} [{lo:.0f}, {hi:.0f}]")
    data["stopped"] = [r["stopped"] for r in ranks]
    data["equal_outputs"] = ranks[0]["tokens"] == ranks[1]["tokens"]
    data["store_check_us"] = ranks[0]["store_check_us"]
    stop = Table("One stop from rank 0 at token 3 (agreed)", ["rank", "stopped", "reason", "tokens"])
    for r, rank in enumerate(ranks):
        stop.add(r, *rank["stopped"])
    agreed = data["arms"][AGREED]
    notes = [
        f"A store round trip alone (`store.check`, rank 0, the store in rank 0's process):"
        f" {data['store_check_us']:.0f} µs; inside the lockstep loop it adds"
        f" {data['lockstep_added_us']:.0f} µs per step (the store's thread must be scheduled at every"
        " step): the cost a design reading the store at each boundary would pay, which the agreement's"
        " watcher thread avoids (it pays one acknowledgement per rank at a stop).",
        f"Plain tokens/s {plain:.0f}: each token of the sharded model exchanges activations over gloo"
        " several times, so the agreement's share shrinks as the model grows.",
    ]
    return Section(
        title="Stop agreement across ranks",
        intro=(
            "The cost per token of agreeing on the stop step across 2 tensor-parallel ranks, before any"
            " stop (`stopcock.run` on each rank; see `stopcock/ranks.py`)."
        ),
        tables=[table, loop, stop],
        notes=notes,
        data=data,
        headline=[
            f"2 TP ranks on gloo: the stop agreement runs at {agreed['ratio']:.3f}x plain generate's"
            f" tokens/s, {agreed['added_us']:.0f} µs per token over one process's checks."
        ],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ranks", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--worker", nargs=4, metavar=("MODEL", "OUT", "TOKENS", "ROUNDS"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.worker:
        model_dir, out, tokens, rounds = args.worker
        _worker(model_dir, out, int(tokens), int(rounds))
        return 0
    section = run(quick=args.quick)
    text = section.markdown()
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
