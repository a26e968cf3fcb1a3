"""Stop latency on the Ray Serve engine against ``LocalEngine``: the same clients, in one run.

``python -m bench.ray_stop [--clients 12] [--requests 6] [--rounds 2] [--seed 0] [--quick] [--out PATH]``
serves the tiny text model two ways at once on 127.0.0.1: ``LocalEngine`` with 2 workers (in this
process, on uvicorn) and the Ray engine with 2 model replicas of one pipeline each, 1 ingress
replica and the job registry (a local Ray cluster started here). Rounds alternate between them (L,
R, L, R...), each round ``clients`` concurrent clients making ``requests`` jobs each: submit a text
job of 600 tokens, follow its events, and after a random number of progress events (1 to 30, the
same draws for both engines) ``POST /v1/jobs/{id}/stop``.

It reports, p50 / p99 per engine: the stop request to its acknowledged answer (ms: the answer
comes once the run has returned, with its final state and step); the steps the job ran after its
``stop_step`` (the step its run had reached when the stop reached it: 1 is the step in flight);
the steps after the last progress event the client had seen when it sent the stop (what a client
sees, the transit of the stop and of the events included); the run's own ``stop_latency``. And
the extra latency the Ray engine adds, p50 and p99, in ms and as a ratio. Checks: every job
stopped by the user, none more than one step after its ``stop_step``, no Ray replica ever above its
concurrency, nothing left running or queued. Exit status 1 if a check fails.

The tiny model's steps take about a millisecond: ``--step-ms`` (default 10) makes each last at
least that long with the test-only throttle, as a served model's would; ``--step-ms 0`` measures
the model's own pace, where the event streams of 12 clients become a firehose that the Ray
engine's extra hops (ingress, registry, replica, each a process) compete with on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from stopcock.server.testing import serving

from .common import Section, Table
from .load_server import _pct, _sse

STOP_AFTER = (1, 30)  # progress events the client waits for before it stops the job
TOKENS = 600


@dataclass
class Stop:
    engine: str
    job: str
    seen: int = 0  # the last step the client had seen
    ack_ms: float = 0.0
    noop_ms: float = 0.0  # the same client's request that does no work, right after the stop's answer
    view: dict[str, Any] = field(default_factory=dict)


async def _job(client: httpx.AsyncClient, engine: str, after: int, stops: list[Stop]) -> None:
    body = {"kind": "text", "prompt": "Once upon a time", "parameters": {"max_tokens": TOKENS}}
    while True:
        response = await client.post("/v1/jobs", json=body)
        if response.status_code != 429:
            break
        await asyncio.sleep(float(response.headers.get("retry-after", "1")) / 10)  # back off, then again
    record = Stop(engine, response.json()["id"])
    progress = 0
    async with client.stream("GET", f"/v1/jobs/{record.job}/events") as events:
        async for event in _sse(events):  # the stream stays open meanwhile, as the web page's does
            if event["type"] == "progress":
                progress += 1
                if progress == after:
                    record.seen = event["step"]
                    start = time.perf_counter()
                    answer = await client.post(f"/v1/jobs/{record.job}/stop")
                    record.ack_ms = (time.perf_counter() - start) * 1000
                    record.view = answer.json()
                    start = time.perf_counter()
                    await client.get("/v1/models")  # answered by the app alone: the transport's share
                    record.noop_ms = (time.perf_counter() - start) * 1000
            if event["type"] == "done":
                if not record.view:
                    record.view = event
                break
    stops.append(record)


async def _round(url: str, engine: str, plan: list[list[int]], stops: list[Stop]) -> None:
    async def client_(afters: list[int]) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            for after in afters:
                await _job(client, engine, after, stops)

    await asyncio.gather(*(client_(afters) for afters in plan))


@contextlib.contextmanager
def _ray(model: Path, replicas: int, step_delay: float) -> Iterator[tuple[str, Any]]:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray import serve

    from stopcock.server.ray_deploy import REGISTRY, RayOptions, build
    from stopcock.server.ray_engine.wire import ModelSpec

    ray.init(address="local", include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        with contextlib.closing(__import__("socket").socket()) as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        options = RayOptions(
            models=[ModelSpec("text", str(model), "tiny-text", "")],
            replicas=replicas,
            model_actor_options={"num_cpus": 0},
            queue_size=64,
            torch_threads=1,
            step_delay=step_delay,
            journal_dir=str(model.parent / "journal"),  # in the run's temporary folder
        )
        serve.run(build(options), name="stopcock-bench", route_prefix="/")
        yield f"http://127.0.0.1:{port}", serve.get_deployment_handle(REGISTRY, "stopcock-bench")
    finally:
        serve.shutdown()
        ray.shutdown()


def run(
    quick: bool = False,
    *,
    clients: int = 12,
    requests: int = 6,
    rounds: int = 2,
    seed: int = 0,
    step_ms: float = 10.0,
) -> Section:
    import torch
    from transformers import pipeline

    from stopcock.server.backends import TextBackend
    from tiny.text import build_text_model

    if quick:
        clients, requests, rounds = 3, 2, 1
    torch.set_num_threads(1)
    rng = random.Random(seed)
    plans = [
        [[rng.randint(*STOP_AFTER) for _ in range(requests)] for _ in range(clients)] for _ in range(rounds)
    ]
    stops: list[Stop] = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        model = build_text_model(Path(folder) / "text")
        backends = {"text": TextBackend(pipeline("text-generation", model=str(model)), "tiny-text")}
        with (
            serving(backends, concurrency=2, queue_size=64, step_delay=step_ms / 1000) as (local_url, local),
            _ray(model, replicas=2, step_delay=step_ms / 1000) as (ray_url, registry),
        ):
            for plan in plans:  # interleaved: L, R, L, R...
                asyncio.run(_round(local_url, "local", plan, stops))
                asyncio.run(_round(ray_url, "ray", plan, stops))
            left = {"local": local.stats(), "ray": registry.stats.remote().result()}
    seconds = time.perf_counter() - started

    problems = []
    for s in stops:
        view = s.view
        if (view.get("state"), view.get("reason")) != ("stopped", "user"):
            if view.get("state") != "completed":  # a job may end before its stop arrives
                problems.append(
                    f"{s.engine} job {s.job} ended {view.get('state')!r} ({view.get('reason')!r})"
                )
        elif not view["stop_step"] <= view["step"] <= view["stop_step"] + 1:
            problems.append(
                f"{s.engine} job {s.job} ran {view['step'] - view['stop_step']} steps after its stop"
            )
    for engine, counts in left.items():
        if counts["running"] or counts["queued"]:
            problems.append(f"{engine}: jobs left {counts}")
    ray_counts = left["ray"]
    if ray_counts["pipelines_peak"] > ray_counts["concurrency"]:
        problems.append(f"a Ray replica ran {ray_counts['pipelines_peak']} pipelines at once")

    table = Table(
        "Stop request to acknowledged answer, 2 pipelines each (p50 / p99)",
        [
            "engine",
            "jobs stopped mid-run",
            "ack ms",
            "no-op request ms",
            "ack minus no-op ms",
            "steps after stop_step",
            "steps after the client's view",
            "run's stop_latency ms",
        ],
    )
    figures: dict[str, dict[str, float]] = {}
    for engine, label in (("local", "LocalEngine, 2 workers"), ("ray", "Ray Serve, 2 replicas")):
        mid = [s for s in stops if s.engine == engine and s.view.get("state") == "stopped"]
        ack = [s.ack_ms for s in mid]
        noop = [s.noop_ms for s in mid]
        beyond = [s.ack_ms - s.noop_ms for s in mid]
        after_stop = [float(s.view["step"] - s.view["stop_step"]) for s in mid]
        after_seen = [float(s.view["step"] - s.seen) for s in mid]
        core = [
            s.view["outcome"]["stop_latency"] * 1000 for s in mid if s.view["outcome"].get("stop_latency")
        ]
        figures[engine] = {"p50": float(_pct(ack, 0.5)), "p99": float(_pct(ack, 0.99))}
        figures[engine + "-beyond"] = {"p50": float(_pct(beyond, 0.5)), "p99": float(_pct(beyond, 0.99))}
        table.add(
            label,
            len(mid),
            f"{_pct(ack, 0.5)} / {_pct(ack, 0.99)}",
            f"{_pct(noop, 0.5)} / {_pct(noop, 0.99)}",
            f"{_pct(beyond, 0.5)} / {_pct(beyond, 0.99)}",
            f"{_pct(after_stop, 0.5)} / {_pct(after_stop, 0.99)} (max {max(after_stop, default=0):.0f})",
            f"{_pct(after_seen, 0.5)} / {_pct(after_seen, 0.99)}",
            f"{_pct(core, 0.5)} / {_pct(core, 0.99)}",
        )
    extra = {q: figures["ray"][q] - figures["local"][q] for q in ("p50", "p99")}
    ratio = {
        q: figures["ray"][q] / figures["local"][q] if figures["local"][q] else float("nan") for q in extra
    }
    checks = "all checks passed" if not problems else "FAILED: " + "; ".join(problems)
    throttle = (
        f"each step made to last at least {step_ms:g} ms by the test-only throttle, as a served model's"
        " step would (a stop cuts the wait short)"
        if step_ms
        else "no step throttle: about a millisecond a step"
    )
    options = "--quick" if quick else f"--clients {clients} --requests {requests} --rounds {rounds}"
    options += f" --step-ms {step_ms:g}"
    section = Section(
        title="Stop latency: Ray Serve engine vs LocalEngine",
        intro=f"`python -m bench.ray_stop {options} --seed {seed}`: {clients} concurrent clients x {requests}"
        f" text jobs ({TOKENS} tokens, tiny random-weight GPT-2, {throttle}) per round, {rounds}"
        f" round(s) per engine, alternating, {seconds:.0f} s in all. Each client stops its job after a"
        f" random number of progress events ({STOP_AFTER[0]} to {STOP_AFTER[1]}, the same draws for both"
        " engines). LocalEngine runs in this process (the clients share its GIL); the Ray engine's"
        " ingress, registry and 2 model replicas are processes of a local cluster on the same cores."
        " *Steps after stop_step*: the steps a job completed after the step its run had reached when"
        " the stop reached it (1: the step in flight). *Steps after the client's view*: after the last"
        " progress event the client had seen when it sent the stop (event and stop transit included).",
        tables=[table],
        notes=[
            f"Ray adds {extra['p50']:+.1f} ms at p50 ({ratio['p50']:.2f}x LocalEngine's) and"
            f" {extra['p99']:+.1f} ms at p99 ({ratio['p99']:.2f}x): the stop goes ingress -> registry ->"
            " the replica (its pending stop poll answered at once), and the answer waits for the replica's"
            " report of the end.",
            "*No-op request*: `GET /v1/models`, sent by the same client right after the stop's answer and"
            " answered by the app alone (no engine call): the share of the HTTP path, which on Ray goes"
            " through Serve's proxy to an ingress replica. *Ack minus no-op*, p50 / p99: LocalEngine"
            f" {figures['local-beyond']['p50']:.1f} / {figures['local-beyond']['p99']:.1f} ms, Ray"
            f" {figures['ray-beyond']['p50']:.1f} / {figures['ray-beyond']['p99']:.1f} ms.",
            f"{len(stops)} jobs. Checks (every job stopped by the user, none more than one step past its"
            f" stop_step, no Ray replica above its concurrency of 1, nothing left): {checks}.",
        ],
        data={"problems": problems, "stops": len(stops), "extra_ms": extra, "ratio": ratio},
    )
    section.headline = [
        f"stop to acknowledged answer, p50 / p99: LocalEngine {figures['local']['p50']:.1f} /"
        f" {figures['local']['p99']:.1f} ms, Ray Serve (2 replicas) {figures['ray']['p50']:.1f} /"
        f" {figures['ray']['p99']:.1f} ms (+{extra['p50']:.1f} ms, {ratio['p50']:.2f}x at p50); {checks}"
    ]
    return section


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ray_stop", description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=12)
    parser.add_argument("--requests", type=int, default=6, help="jobs per client and round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per engine (alternating)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step-ms", type=float, default=10.0, help="least ms per step (0: the model's own)")
    parser.add_argument("--quick", action="store_true", help="3 clients x 2 jobs, 1 round")
    parser.add_argument("--out", type=Path, help="also write the report there (markdown)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import ray
    import torch

    from .common import machine_info, standalone_report

    torch.set_num_threads(1)  # as run() does, before the machine's description records it
    info = {**machine_info(), "ray": ray.__version__}
    section = run(
        args.quick, clients=args.clients, requests=args.requests, rounds=args.rounds, seed=args.seed
    )
    command = f"python -m bench.ray_stop {' '.join(argv or sys.argv[1:])}"
    title = "stopcock: stop latency on the Ray Serve engine vs LocalEngine"
    return standalone_report(title, command, info, section, args.out)


if __name__ == "__main__":
    sys.exit(main())
