"""One rank of the cross-rank stop tests (tests/test_ranks.py): ``python tests/ranks_worker.py
SCENARIO[,SCENARIO...] MODEL_DIR OUT_DIR``, under ``torchrun`` or started with torchrun's environment
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT). Runs the scenarios one after the other in
one process group (so successive runs of the group are covered too) and writes
``OUT_DIR/<scenario>.rank<r>.json``: the Outcome's fields and the tokens (or the image's digest),
the same on every rank; and for the ``text-*`` runs ``OUT_DIR/<scenario>.rank<r>.clock.json``, what
differs from rank to rank: each step's ``elapsed`` (read at its on_step), the Outcome's ``elapsed``
and ``stop_latency``.

Scenarios (``text-*``: a tiny Llama loaded with ``tp_plan="auto"``; ``image-*``: a tiny Stable
Diffusion pipeline whose UNet all-reduces its output over the group each step, a hand-sharded loop):
  text-rank0, text-rank1        a StopSignal stopped on that rank only, by on_step at token 3
  text-rank0-abort              the same in abort mode
  text-timeout                  timeout(0) on rank 1 only (it has expired at the first check)
  text-thread                   rank 0's signal stopped by another thread once token 3 is done
  text-none                     no stop: both ranks run to max_new_tokens
  text-wait, text-wait-abort    no on_step (so no step is checked until a stop is possible): rank 0's
                                signal is stopped inside its forward of token 4, rank 1 has no stop
  text-kill, text-kill0          rank 1 (rank 0, which holds the store) dies (os._exit) after token 3;
                                the other must raise RankLost
  text-unagreed                 rank 1 runs with group=False; rank 0 stops at token 3 and must raise
                                RankLost once its wait for rank 1's acknowledgement times out
  image-rank1                   a StopSignal stopped on rank 1 at step 2 of 8, group= given
  image-detected                the same with no group=: the UNet carries the context-parallel config
                                diffusers records (``_parallel_config``), from which the group is found
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import sys
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import stopcock
from stopcock.ranks import RankLost

STOP_AT = 3
NEW_TOKENS = 24


def _text(scenario: str, model: Any, rank: int) -> dict[str, Any]:
    signal = stopcock.StopSignal()
    done_3 = threading.Event()
    stop: Any = signal
    mode = "abort" if scenario.endswith("-abort") else "finish"
    who = 1 if scenario == "text-rank1" else 0
    elapsed: dict[int, float] = {}

    def on_step(state: stopcock.StepState) -> None:
        elapsed[state.step] = state.elapsed
        if state.step >= STOP_AT:
            if scenario.startswith(("text-rank0", "text-rank1", "text-unagreed")) and rank == who:
                signal.stop("user")
            done_3.set()
            if (scenario, rank) in (("text-kill", 1), ("text-kill0", 0)):
                os._exit(7)

    if scenario.startswith("text-wait"):
        return _waiting(model, rank, mode, signal)
    if scenario == "text-timeout":
        stop = stopcock.timeout(0) if rank == 1 else None
    if scenario == "text-thread" and rank == 0:
        def stopper() -> None:
            if done_3.wait(120):
                signal.stop("from-thread")

        threading.Thread(target=stopper, daemon=True).start()
    ids = torch.tensor([[1, 5, 6, 7]])
    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    group = False if scenario == "text-unagreed" and rank == 1 else None
    try:
        outcome = stopcock.run(model, ids, stop=stop, mode=mode, on_step=on_step, group=group, **kwargs)
    except RankLost as exc:
        return {"error": "RankLost", "message": str(exc)}
    output = outcome.output
    tokens = output.tolist() if isinstance(output, torch.Tensor) else None
    return {
        "stopped": outcome.stopped, "reason": outcome.reason, "steps": outcome.steps,
        "mode": outcome.mode, "tokens": tokens,
        "clock": {"steps": elapsed, "elapsed": outcome.elapsed, "stop_latency": outcome.stop_latency},
    }


def _waiting(model: Any, rank: int, mode: str, signal: stopcock.StopSignal) -> dict[str, Any]:
    """A run whose step checks wait outside generate's loop until a stop is possible (no on_step):
    rank 0 stops inside the forward of token 4, as a stop from a UI lands mid-step."""
    forwards = 0

    def count(_module: Any, _args: Any, _output: Any) -> None:
        nonlocal forwards
        forwards += 1
        if forwards == STOP_AT + 1:
            signal.stop("user")

    hook = model.register_forward_hook(count) if rank == 0 else None
    ids = torch.tensor([[1, 5, 6, 7]])
    try:
        outcome = stopcock.run(
            model, ids, stop=signal if rank == 0 else None, mode=mode, max_new_tokens=NEW_TOKENS,
            do_sample=False, eos_token_id=None, pad_token_id=0,
        )
    finally:
        if hook is not None:
            hook.remove()
    return {
        "stopped": outcome.stopped, "reason": outcome.reason, "steps": outcome.steps,
        "mode": outcome.mode, "tokens": outcome.output.tolist(),
    }


def _image(scenario: str, rank: int) -> dict[str, Any]:
    from tiny import image as tiny

    pipe = tiny.stable_diffusion_pipeline()
    # the hand-sharded loop: each UNet forward meets the other ranks in an all_reduce, as a sharded
    # denoiser does (the mean of equal outputs leaves them unchanged)
    def exchange(_module: Any, _args: Any, output: Any) -> Any:
        sample = output[0] if isinstance(output, tuple) else output.sample
        dist.all_reduce(sample)
        sample /= dist.get_world_size()
        return output

    pipe.unet.register_forward_hook(exchange)
    group: Any = dist.group.WORLD
    if scenario == "image-detected":
        group = None
        _record_context_parallelism(pipe.unet, rank)
    signal = stopcock.StopSignal()

    def on_step(state: stopcock.StepState) -> None:
        if state.step >= 2 and rank == 1:
            signal.stop("user")

    outcome = stopcock.run(
        pipe, "a cat", num_inference_steps=8, output_type="np", stop=signal, on_step=on_step,
        group=group, generator=torch.Generator().manual_seed(0),
    )
    images = outcome.output.images
    return {
        "stopped": outcome.stopped, "reason": outcome.reason, "steps": outcome.steps, "mode": outcome.mode,
        "digest": hashlib.sha256(images.tobytes()).hexdigest(),
    }


def _record_context_parallelism(model: Any, rank: int) -> None:
    """What diffusers' ``enable_parallelism`` records on a model for Ulysses context parallelism over
    every rank, built as ``ModelMixin._resolve_parallel_config`` builds it. That method itself cannot
    run on a CPU-only torch: it places each rank on ``rank % torch.accelerator.device_count()``, a
    division by zero here. (The denoiser's forward stays the hand-sharded one above.)"""
    from diffusers import ContextParallelConfig
    from diffusers.models._modeling_parallel import ParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    cp = ContextParallelConfig(ulysses_degree=dist.get_world_size())
    config = ParallelConfig(context_parallel_config=cp)
    mesh = init_device_mesh("cpu", cp.mesh_shape, mesh_dim_names=cp.mesh_dim_names)
    config.setup(rank, dist.get_world_size(), torch.device("cpu"), mesh=mesh)
    model._parallel_config = config


def main() -> None:
    scenarios, model_dir, out = sys.argv[1:4]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    seconds = float(os.environ.get("RANKS_TEST_GROUP_TIMEOUT", "60"))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=seconds))
    rank = dist.get_rank()
    model = None
    for scenario in scenarios.split(","):
        if scenario.startswith("image"):
            result = _image(scenario, rank)
        else:
            if model is None:
                from transformers import AutoModelForCausalLM

                model = AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto").eval()
            result = _text(scenario, model, rank)
        clock = result.pop("clock", None)
        if clock is not None:
            Path(out, f"{scenario}.rank{rank}.clock.json").write_text(json.dumps(clock))
        Path(out, f"{scenario}.rank{rank}.json").write_text(json.dumps(result))
        if "error" in result:
            os._exit(0)  # the group is broken: leave without its teardown
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
