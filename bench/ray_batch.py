"""Batched text jobs on the Ray Serve engine: concurrent greedy jobs batched against one at a time.

``python -m bench.ray_batch [--jobs 16] [--tokens 64] [--out PATH]`` starts a local Ray cluster
and deploys the stopcock application twice in turn (one text model replica of one pipeline, the
demo text model, 1 ingress replica, the job registry): ``batch_size=1`` (one job at a time) then
``batch_size=jobs`` (greedy text jobs run as the rows of one ``generate``, ``batch_wait`` 10 ms).
Each arm: ``jobs`` clients submit one greedy text job of ``tokens`` tokens each, at once, over HTTP
through Serve's proxy, and wait for its result; new tokens per second from the first submission to
the last result. One run per arm, no repetition. Checks: every job completed with the same text in
both arms, and the batched arm ran them in batches (the registry's counts). Exit status 1 if a
check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from .common import Section, Table

APP = "stopcock-bench-batch"


@contextlib.contextmanager
def _cluster() -> Iterator[int]:
    """A local Ray cluster started here with Serve's proxy on 127.0.0.1; yields the proxy's port."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import socket

    import ray
    from ray import serve

    ray.init(address="local", include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield port
    finally:
        serve.shutdown()
        ray.shutdown()


def _arm(port: int, batch_size: int, jobs: int, tokens: int) -> tuple[float, list[str], dict[str, Any]]:
    """Deploy with ``batch_size``, run ``jobs`` concurrent jobs: tokens/s, their texts, the counts."""
    from ray import serve

    from stopcock.server.ray_deploy import RayOptions, build
    from stopcock.server.ray_engine.wire import ModelSpec

    options = RayOptions(
        models=[ModelSpec("text")],
        model_actor_options={"num_cpus": 0},
        queue_size=2 * jobs,
        torch_threads=1,
        journal_dir=None,
        batch_size=batch_size,
        batch_wait=0.01,
    )
    serve.run(build(options), name=APP, route_prefix="/")
    try:
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=url, timeout=600) as client, ThreadPoolExecutor(jobs) as pool:
            def one(i: int) -> dict[str, Any]:
                body = {"kind": "text", "prompt": f"Client {i}: Beautiful is",
                        "parameters": {"max_tokens": tokens, "temperature": 0}}
                job = client.post("/v1/jobs", json=body)
                job.raise_for_status()
                answer = client.get(f"/v1/jobs/{job.json()['id']}/result", params={"wait": "true"})
                answer.raise_for_status()
                return dict(answer.json())

            client.get("/v1/health").raise_for_status()  # the ingress is up before the clock starts
            one(jobs)  # a warm-up job (its first forward), not counted
            start = time.perf_counter()
            results = list(pool.map(one, range(jobs)))
            seconds = time.perf_counter() - start
            health = client.get("/v1/health").json()
    finally:
        serve.delete(APP)
    made = sum(int(r["result"]["completion_tokens"]) for r in results if r["result"])
    if any(r["job"]["state"] != "completed" for r in results):
        raise RuntimeError(f"a job did not complete: {[r['job']['state'] for r in results]}")
    return made / seconds, [r["result"]["text"] for r in results], health


def run(jobs: int = 16, tokens: int = 64) -> Section:
    with _cluster() as port:
        single, single_texts, _ = _arm(port, 1, jobs, tokens)
        batched, batched_texts, health = _arm(port, jobs, jobs, tokens)
    problems = []
    if single_texts != batched_texts:
        problems.append("a batched job's text differs from its text one at a time")
    if health.get("batched_jobs", 0) < jobs:
        rows = health.get("batched_jobs")
        problems.append(f"the batched arm ran {rows} of its {jobs} jobs (and 1 warm-up job) as rows")
    table = Table(
        f"{jobs} concurrent greedy text jobs ({tokens} new tokens each) on the Ray engine, over HTTP",
        ["arm", "tokens/s", "batches (rows)"],
    )
    table.add("one at a time (`batch_size=1`)", f"{single:.0f}", "-")
    table.add(f"batched (`batch_size={jobs}`)", f"{batched:.0f}",
              f"{health.get('batches_run')} ({health.get('batched_jobs')})")
    ratio = batched / single
    notes = [
        f"Batched / one at a time: **{ratio:.2f}x** the tokens/s.",
        "Counts include the warm-up job of the arm (a batch of one).",
        *(f"CHECK FAILED: {p}" for p in problems),
    ]
    return Section(
        "Ray Serve: batched text jobs",
        "One text model replica (one pipeline, 1 torch thread), the demo text model, a local Ray cluster"
        " on this machine; each arm deployed in turn in the same run, one run each.",
        tables=[table], notes=notes, data={"single": single, "batched": batched, "ratio": ratio,
                                           "problems": problems},
        headline=[f"Ray engine, {jobs} concurrent text jobs: batched {ratio:.1f}x the tokens/s, one by one"],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ray_batch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=16, help="concurrent jobs (and the batch size)")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per job")
    parser.add_argument("--out", help="also write the report there (markdown)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import ray

    from .common import machine_info, standalone_report

    info = {**machine_info(), "ray": ray.__version__}
    section = run(args.jobs, args.tokens)
    command = f"python -m bench.ray_batch {' '.join(argv or sys.argv[1:])}"
    title = "stopcock: batched text jobs on the Ray Serve engine"
    return standalone_report(title, command, info, section, args.out)


if __name__ == "__main__":
    sys.exit(main())
