"""The server's load check: concurrent streaming clients that stop or disconnect at random.

``python -m bench.load_server [--clients N] [--requests R] [--concurrency C] [--seed S] [--quick]``
serves the tiny text and image models on 127.0.0.1 (loopback only; a free port) and runs ``N``
clients at once, each making ``R`` streaming requests: an OpenAI-style streamed completion, or an
image job followed over its event stream. After a random number of chunks each client either
stops its job (``POST /v1/jobs/{id}/stop``), disconnects (text only: closing the stream stops the
job), or lets it finish. It reports the stop latency, in steps (steps done after the stop request:
the job's ``step - stop_step``) and in milliseconds (stop: request to acknowledged answer;
disconnect: the client closing to the job's end), p50 and p99, and checks that no job is left
running or queued, that every job ended in a final state with the right reason, that every
stopped job ran at most one step after its stop, and that no worker thread leaked. Exit status 1
if a check fails.

A second case serves an image model with a slow step (a :class:`tiny.slow.SlowLayer` that keeps
every denoiser call busy for ``--block`` seconds) and a stop grace of ``--grace`` seconds: a stop
that lands during a step escalates to abort once the grace has passed, so its latency is at most
the grace plus one block (the module call in flight), and the job still returns the partial image
of the last finished step. It checks both.

``run(quick)`` returns a :class:`bench.common.Section`, so it can join ``python -m bench``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from stopcock.server.contract import FINAL_STATES
from stopcock.server.testing import serving, sse_data

from .common import Section, Table


@dataclass
class Record:
    kind: str
    action: str  # stop | disconnect | finish
    job: str
    requested_at: float | None = None  # wall clock, when the client stopped or went away
    ack_ms: float | None = None
    view: dict[str, Any] = field(default_factory=dict)


def _models(folder: Path) -> dict[str, Any]:
    from diffusers import DiffusionPipeline
    from transformers import pipeline

    from stopcock.server.backends import ImageBackend, TextBackend
    from tiny.image import build_image_model
    from tiny.text import build_text_model

    text = pipeline("text-generation", model=str(build_text_model(folder / "text")))
    image = DiffusionPipeline.from_pretrained(build_image_model(folder / "image"))
    image.set_progress_bar_config(disable=True)
    return {"text": TextBackend(text, "tiny-text"), "image": ImageBackend(image, "tiny-sd")}


async def _sse(response: httpx.Response) -> Any:
    """The JSON ``data:`` payloads of a streamed response, as :func:`sse_data` reads them."""
    async for line in response.aiter_lines():
        for data in sse_data((line,)):
            yield data


async def _text(client: httpx.AsyncClient, rng: random.Random, records: list[Record]) -> None:
    action = rng.choice(["stop", "stop", "disconnect", "disconnect", "finish"])
    after = rng.randint(1, 30)
    tokens = 40 if action == "finish" else 600
    body = {
        "model": "tiny-text",
        "prompt": "Once upon a time",
        "max_tokens": tokens,
        "stream": True,
        "temperature": 0,
    }
    record: Record | None = None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code == 429:  # the queue is full: a correct answer under load
            return
        chunks = 0
        async for chunk in _sse(response):
            if record is None:
                record = Record("text", action, chunk["id"].removeprefix("cmpl-"))
                records.append(record)
            chunks += 1
            if chunks >= after and action == "stop":
                record.requested_at = time.time()
                start = time.perf_counter()
                await client.post(f"/v1/jobs/{record.job}/stop")
                record.ack_ms = (time.perf_counter() - start) * 1000
                action = "finish"  # read the stream to its end
            elif chunks >= after and action == "disconnect":
                record.requested_at = time.time()
                break  # leaving the block closes the connection


async def _image(client: httpx.AsyncClient, rng: random.Random, records: list[Record]) -> None:
    action = rng.choice(["stop", "stop", "finish"])
    steps = 4 if action == "finish" else 100
    response = await client.post(
        "/v1/jobs",
        json={"kind": "image", "prompt": "a red square", "parameters": {"steps": steps, "previews": False}},
    )
    if response.status_code == 429:
        return
    record = Record("image", action, response.json()["id"])
    records.append(record)
    after = rng.randint(1, 10)
    async with client.stream("GET", f"/v1/jobs/{record.job}/events") as events:
        async for event in _sse(events):
            if action == "stop" and event["type"] == "progress" and event["step"] >= after:
                record.requested_at = time.time()
                start = time.perf_counter()
                await client.post(f"/v1/jobs/{record.job}/stop")
                record.ack_ms = (time.perf_counter() - start) * 1000
                action = "finish"
            if event["type"] == "done":
                break


async def _client(url: str, rng: random.Random, requests: int, records: list[Record]) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        for _ in range(requests):
            await (_image if rng.random() < 0.25 else _text)(client, rng, records)


async def _final_views(url: str, records: list[Record]) -> None:
    """Each job's final view, read from its event stream (which ends with ``done``)."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        for record in records:
            async with client.stream("GET", f"/v1/jobs/{record.job}/events") as events:
                async for event in _sse(events):
                    if event["type"] == "done":
                        record.view = event


def _pct(values: list[float], q: float) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    return f"{ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]:.1f}"


@dataclass
class SlowStop:
    """One stop of a job held in a slow step."""

    ack_ms: float
    view: dict[str, Any]
    image: bool


async def _slow_jobs(url: str, jobs: int) -> list[SlowStop]:
    """Each job: wait for its first step, then stop it during the next (slow) one."""
    found = []
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        for i in range(jobs):
            body = {"kind": "image", "prompt": "a red square", "parameters": {"steps": 50, "seed": i,
                                                                              "previews": False}}
            job = (await client.post("/v1/jobs", json=body)).json()["id"]
            async with client.stream("GET", f"/v1/jobs/{job}/events") as events:
                async for event in _sse(events):
                    if event["type"] == "progress":  # the next step has begun: its denoiser call is slow
                        break
            start = time.perf_counter()
            view = (await client.post(f"/v1/jobs/{job}/stop")).json()
            ack_ms = (time.perf_counter() - start) * 1000
            result = (await client.get(f"/v1/jobs/{job}/result")).json()["result"]
            found.append(SlowStop(ack_ms, view, bool(result and result.get("image"))))
    return found


def slow_step(jobs: int, grace: float, block: float) -> tuple[Table, list[str], dict[str, Any]]:
    """Stop ``jobs`` image jobs during a step whose denoiser call takes ``block`` seconds, on a
    server with a stop grace of ``grace`` seconds; the table row, the problems found, the numbers."""
    from diffusers import DiffusionPipeline

    from stopcock.server.backends import ImageBackend
    from tiny.image import build_image_model
    from tiny.slow import SlowLayer, slow_down

    with tempfile.TemporaryDirectory() as folder:
        pipe = DiffusionPipeline.from_pretrained(build_image_model(Path(folder) / "image"))
    pipe.set_progress_bar_config(disable=True)
    slow_down(pipe.unet, "mid_block.resnets.0.conv1", SlowLayer(seconds=block))
    with serving({"image": ImageBackend(pipe, "slow-sd")}, stop_grace=grace) as (url, _):
        stops = asyncio.run(_slow_jobs(url, jobs))
    bound = grace + block
    problems = []
    latency = [s.view["outcome"]["stop_latency"] for s in stops]
    for s, seconds in zip(stops, latency, strict=True):
        outcome = s.view["outcome"]
        escalated = outcome["mode"] == "abort" and "escalated" in (outcome["detail"] or "")
        if s.view["state"] != "stopped" or not escalated:
            problems.append(f"slow job {s.view['id']} did not escalate: {s.view['state']}, {outcome}")
        elif seconds > bound:
            problems.append(f"slow job {s.view['id']} took {seconds:.3f} s to stop, over grace + one block")
        if not s.image:
            problems.append(f"slow job {s.view['id']} returned no partial image")
    table = Table(
        f"A stop during a slow step: grace {grace:g} s, one block (the slow denoiser layer) {block:g} s",
        ["jobs", "escalated", "steps after the stop", "run's stop_latency ms, p50 / p99",
         "bound: grace + one block, ms", "stop request to answer ms (partial image decoded), p50 / p99"],
    )
    after = [float(s.view["step"] - s.view["stop_step"]) for s in stops if s.view["stop_step"] is not None]
    latency_ms, ack_ms = [x * 1000 for x in latency], [s.ack_ms for s in stops]
    table.add(
        len(stops), sum(s.view["outcome"]["mode"] == "abort" for s in stops),
        f"{_pct(after, 0.5)} / {_pct(after, 0.99)}", f"{_pct(latency_ms, 0.5)} / {_pct(latency_ms, 0.99)}",
        f"{bound * 1000:.0f}", f"{_pct(ack_ms, 0.5)} / {_pct(ack_ms, 0.99)}",
    )
    return table, problems, {"latency_s": latency, "bound_s": bound}


def run(
    quick: bool = False,
    *,
    clients: int = 8,
    requests: int = 6,
    concurrency: int = 2,
    seed: int = 0,
    grace: float = 0.5,
    block: float = 1.0,
) -> Section:
    import torch

    if quick:
        clients, requests = 3, 2
    torch.set_num_threads(1)
    rng = random.Random(seed)
    records: list[Record] = []
    with tempfile.TemporaryDirectory() as folder:
        backends = _models(Path(folder))
        baseline = {t.ident for t in threading.enumerate()}
        started = time.perf_counter()
        with serving(backends, concurrency=concurrency, queue_size=clients) as (url, engine):
            workers = [t for t in threading.enumerate() if t.name.startswith("stopcock-worker")]

            async def main() -> None:
                seeds = [rng.randrange(2**32) for _ in range(clients)]
                await asyncio.gather(*(_client(url, random.Random(s), requests, records) for s in seeds))
                await _final_views(url, records)

            asyncio.run(main())
            stats = engine.stats()
        seconds = time.perf_counter() - started
    leaked = [t for t in threading.enumerate() if t.ident not in baseline and t.is_alive()]

    problems = []
    if stats["running"] or stats["queued"]:
        problems.append(f"jobs left: {stats}")
    for r in records:
        state, reason = r.view.get("state"), r.view.get("reason")
        if state not in FINAL_STATES:
            problems.append(f"job {r.job} ({r.kind}, {r.action}) ended {state!r}")
        expected = {"stop": "user", "disconnect": "disconnected"}.get(r.action)
        if expected and state == "stopped" and reason != expected:
            problems.append(f"job {r.job} stopped for {reason!r}, expected {expected!r}")
        if state == "stopped" and r.view.get("stop_step") is not None:
            late = r.view["step"] - r.view["stop_step"]
            if not 0 <= late <= 1:
                problems.append(f"job {r.job} ({r.kind}, {r.action}) ran {late} steps after its stop")
    if any(w.is_alive() for w in workers) or leaked:
        problems.append(f"threads left after shutdown: {[t.name for t in leaked or workers]}")

    table = Table(
        "Stop latency under load (p50 / p99)",
        [
            "action",
            "jobs",
            "stopped mid-run",
            "steps after the stop",
            "ms",
            "ms measures",
            "run's stop_latency ms",
        ],
    )
    for action, kind, measure in [
        ("stop", "text", "stop request to acknowledged answer"),
        ("stop", "image", "stop request to acknowledged answer"),
        ("disconnect", "text", "client gone to job ended (server clock)"),
    ]:
        rows = [r for r in records if r.action == action and r.kind == kind]
        mid = [
            r
            for r in rows
            if r.view.get("state") == "stopped"
            and r.view.get("stop_step") is not None
            and r.view.get("started")
        ]
        steps = [float(r.view["step"] - r.view["stop_step"]) for r in mid]
        if action == "stop":
            ms = [r.ack_ms for r in mid if r.ack_ms is not None]
        else:
            ms = [(r.view["finished"] - r.requested_at) * 1000 for r in mid if r.requested_at is not None]
        core = [
            r.view["outcome"]["stop_latency"] * 1000
            for r in mid
            if r.view["outcome"].get("stop_latency") is not None
        ]
        table.add(
            f"{action} ({kind})",
            len(rows),
            len(mid),
            f"{_pct(steps, 0.5)} / {_pct(steps, 0.99)}",
            f"{_pct(ms, 0.5)} / {_pct(ms, 0.99)}",
            measure,
            f"{_pct(core, 0.5)} / {_pct(core, 0.99)}",
        )
    slow_jobs = 1 if quick else 5
    slow_table, slow_problems, slow = slow_step(slow_jobs, grace, block)
    problems += slow_problems
    finished = sum(r.view.get("state") == "completed" for r in records)
    checks = "all checks passed" if not problems else "FAILED: " + "; ".join(problems)
    options = "--quick" if quick else f"--clients {clients} --requests {requests} --concurrency {concurrency}"
    options += f" --seed {seed} --grace {grace:g} --block {block:g}"
    section = Section(
        title="Server under load",
        intro=f"`python -m bench.load_server {options}`: {clients} concurrent streaming"
        f" clients x {requests} requests on 127.0.0.1, concurrency {concurrency}, tiny random-weight models,"
        f" seed {seed}, {seconds:.1f} s. 'Steps after the stop' counts the steps a job completed after the"
        " step its run had reached when the stop arrived (`step - stop_step`: 1 for the step in flight)."
        " The run's stop_latency is stopcock's own (stop signal to the run's return)."
        " Clients and server share one Python process (and its GIL), so the ms include contention.",
        tables=[table, slow_table],
        notes=[
            f"{len(records)} jobs ({finished} ran to completion). Checks: no job left running or queued,"
            f" every job in a final state with the expected reason, at most one step after a stop, no"
            f" worker thread left, every stop during a slow step escalated within grace + one block and"
            f" returned a partial image: {checks}.",
            f"The slow step: {slow_jobs} image job(s) on a server of their own, each stopped just after a"
            " step began (the first progress event); the run's stop_latency is from the stop request to"
            " the pipeline's return, the answer adds the VAE decode of the last finished step's latents.",
        ],
        data={"problems": problems, "records": len(records), "slow": slow},
    )
    section.headline = [f"server under load: {table.rows[0][3]} steps after a stop (p50 / p99), {checks}"]
    return section


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.load_server", description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=6, help="requests per client")
    parser.add_argument("--concurrency", type=int, default=2, help="jobs running at once on the server")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--grace", type=float, default=0.5, help="the slow-step server's stop grace, s")
    parser.add_argument("--block", type=float, default=1.0, help="seconds of the slow denoiser layer")
    parser.add_argument("--quick", action="store_true", help="3 clients x 2 requests, one slow job")
    args = parser.parse_args(argv)
    section = run(
        args.quick, clients=args.clients, requests=args.requests, concurrency=args.concurrency,
        seed=args.seed, grace=args.grace, block=args.block,
    )
    print(section.markdown())
    return 1 if section.data["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
