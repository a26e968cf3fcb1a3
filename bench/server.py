"""The server under concurrent clients: batched text jobs against one at a time, over HTTP.

``run(quick)`` serves a text model with a real uvicorn server on loopback twice in the same run:
``batch_size=1`` (one job at a time, as before batching) and ``batch_size=16`` (greedy text jobs
queued together run as the rows of one ``generate``). At 1, 4 and 16 concurrent clients it measures

- throughput: each client submits greedy jobs of 64 tokens one after another; new tokens per second
  over the whole run (the median of two rounds, the arms in the order A B then B A);
- stop acknowledgement: each client submits a long job, waits for its 8th token on the event stream,
  and stops it by id; the time from the stop request to its answer (the answer comes once the job's
  run, or its row, has ended), p50 and p99.

A second table measures whether batching image jobs of equal settings would pay: one pipeline call
with several prompts against the same prompts one call each, in process.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import torch

from stopcock.server.testing import serving

from .common import CPU, Device, Section, Table, interleaved, median, quantile

CLIENTS = (1, 4, 16)
TOKENS = 64
STOP_AFTER = 8
ARMS = {"one at a time": {"batch_size": 1}, "batched": {"batch_size": 16, "batch_wait": 0.01}}


def _text_backend(device: Device) -> Any:
    from stopcock.server.backends import TextBackend, load_backends

    backend = load_backends(None, None)["text"] if device == CPU else None
    if backend is None:  # on a GPU: a ~0.5B random-weight causal LM (bench.gpu_check builds it)
        from transformers import pipeline

        from .gpu_check import causal_lm

        model, tokenizer = causal_lm(device)
        backend = TextBackend(pipeline("text-generation", model=model, tokenizer=tokenizer), "random-0.5b")
    return backend


def _job(prompt: str, tokens: int) -> dict[str, Any]:
    return {"kind": "text", "prompt": prompt, "parameters": {"max_tokens": tokens, "temperature": 0}}


def _submit(client: httpx.Client, body: dict[str, Any]) -> str:
    response = client.post("/v1/jobs", json=body)
    response.raise_for_status()
    return str(response.json()["id"])


def _throughput_client(url: str, client_no: int, jobs: int) -> int:
    """Run ``jobs`` jobs one after another; the new tokens they made."""
    tokens = 0
    with httpx.Client(base_url=url, timeout=600) as client:
        for j in range(jobs):
            job = _submit(client, _job(f"Client {client_no} job {j}: Beautiful is", TOKENS))
            result = client.get(f"/v1/jobs/{job}/result", params={"wait": "true"}).json()
            tokens += int(result["result"]["completion_tokens"])
    return tokens


def _stop_client(url: str, client_no: int) -> float:
    """Start a long job, stop it by id at its STOP_AFTER-th token; seconds from request to answer."""
    with httpx.Client(base_url=url, timeout=600) as client:
        job = _submit(client, _job(f"Client {client_no}: Errors should", 512))
        with client.stream("GET", f"/v1/jobs/{job}/events") as stream:
            for line in stream.iter_lines():
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[6:])
                if event["type"] == "done":
                    raise RuntimeError(f"job {job} ended before its stop: {event}")
                if event["type"] == "progress" and event["step"] >= STOP_AFTER:
                    break
        start = time.perf_counter()
        answer = client.post(f"/v1/jobs/{job}/stop").json()
        elapsed = time.perf_counter() - start
        if answer["state"] != "stopped":
            raise RuntimeError(f"job {job} was not stopped when the stop answered: {answer}")
        return elapsed


def _measure(backend: Any, options: dict[str, Any], clients: int, jobs: int) -> tuple[float, list[float]]:
    with serving({"text": backend}, queue_size=64, **options) as (url, _):
        with ThreadPoolExecutor(clients) as pool:
            start = time.perf_counter()
            tokens = sum(pool.map(lambda c: _throughput_client(url, c, jobs), range(clients)))
            seconds = time.perf_counter() - start
            acks = list(pool.map(lambda c: _stop_client(url, c), range(clients)))
    return tokens / seconds, acks


def _images(quick: bool) -> tuple[Table, float]:
    """One call with ``n`` prompts against ``n`` calls (demo image model, equal settings)."""
    from stopcock.loading import load_image_pipeline, resolve_model

    pipe = load_image_pipeline(resolve_model(None, "image"))
    pipe.set_progress_bar_config(disable=True)
    n, steps = (2, 2) if quick else (4, 10)
    prompts = [f"a red circle {i}" for i in range(n)]

    def apart() -> None:
        for p in prompts:
            pipe(prompt=p, num_inference_steps=steps, generator=torch.Generator().manual_seed(0))

    def together() -> None:
        pipe(prompt=prompts, num_inference_steps=steps, generator=torch.Generator().manual_seed(0))

    times = interleaved({"apart": lambda: _clock(apart), "together": lambda: _clock(together)},
                        1 if quick else 5)
    ratio = median(times["apart"]) / median(times["together"])
    table = Table(f"Image jobs: {n} prompts in one call against one call each ({steps} steps, demo model)",
                  ["one call each (s)", "one call (s)", "speed-up of one call"])
    table.add(f"{median(times['apart']):.3f}", f"{median(times['together']):.3f}", f"{ratio:.2f}x")
    return table, ratio


def _clock(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(quick: bool = False, device: Device = CPU, images: bool = True) -> Section:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the server's threads share the cores; each forward is small
    try:
        return _run(quick, device, images)
    finally:
        torch.set_num_threads(threads)


def _run(quick: bool, device: Device, images: bool) -> Section:
    backend = _text_backend(device)
    clients = CLIENTS[:2] if quick else CLIENTS
    jobs = 1 if quick else 2
    table = Table(
        f"Text jobs over HTTP ({TOKENS} new tokens each, greedy): batched (`--batch-size 16`) against one"
        " at a time (`--batch-size 1`)",
        ["clients", "tokens/s one at a time", "tokens/s batched", "batched / one at a time",
         "stop ack p50 / p99 one at a time", "stop ack p50 / p99 batched"],
    )
    data: dict[str, Any] = {}
    rounds = 1 if quick else 2
    for n in clients:
        speeds: dict[str, list[float]] = {arm: [] for arm in ARMS}
        acks: dict[str, list[float]] = {arm: [] for arm in ARMS}
        for order in [list(ARMS), list(ARMS)[::-1]][:rounds]:  # A B, then B A: load drifts alike
            for arm in order:
                speed, arm_acks = _measure(backend, ARMS[arm], n, jobs)
                speeds[arm].append(speed)
                acks[arm] += arm_acks
        single, batched = median(speeds["one at a time"]), median(speeds["batched"])
        single_acks, batched_acks = acks["one at a time"], acks["batched"]
        data[n] = {"single": single, "batched": batched, "ratio": batched / single,
                   "acks": {"single": single_acks, "batched": batched_acks}}
        table.add(n, f"{single:.0f}", f"{batched:.0f}", f"{batched / single:.2f}x",
                  _p50_p99(single_acks), _p50_p99(batched_acks))
    tables = [table]
    headline = [f"Server, {clients[-1]} concurrent text clients: batched jobs make"
                f" {data[clients[-1]]['ratio']:.1f}x the tokens/s of one at a time"]
    notes = [
        "A stop ack is the time from `POST /v1/jobs/{id}/stop` to its answer, which comes once the job's"
        " run (or its row of the batch) has ended; each client stops its own job at its"
        f" {STOP_AFTER}th token, all clients at about the same time.",
        "Both arms serve the same model in the same run with one worker; jobs that arrive while a batch"
        " runs wait for the next batch.",
    ]
    if images:
        image_table, ratio = _images(quick)
        tables.append(image_table)
        data["image_ratio"] = ratio
        notes.append(
            "The server does not batch image jobs (each runs alone, stoppable on its own); the second"
            " table measures what one call with several prompts would gain on this device."
        )
    return Section(
        "7. Server: batched text jobs",
        "Concurrent clients over HTTP against a real uvicorn server (`stopcock.server.testing.serving`),"
        f" the demo text model on {device.describe()}.",
        tables=tables, notes=notes, data=data, headline=headline,
    )


def _p50_p99(seconds: list[float]) -> str:
    return f"{quantile(seconds, 0.5) * 1000:.1f} / {quantile(seconds, 0.99) * 1000:.1f} ms"
