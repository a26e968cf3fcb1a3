"""``stopcock serve``: the generation service on uvicorn.

``add_parser(subparsers)`` registers the subcommand in the ``stopcock`` CLI; ``main(argv)`` runs it
on its own. Importing this module is cheap: FastAPI, uvicorn and the models load on ``serve``.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import sys
from collections.abc import Sequence
from typing import Any

from ..errors import UserError

__all__ = ["STEP_DELAY_ENV", "add_parser", "main", "read_keys", "serve"]

#: Test-only throttle: seconds to wait after each step of every job (so a browser test can click
#: Stop before a tiny model finishes). A stop cuts the wait short. Never set it in production.
STEP_DELAY_ENV = "STOPCOCK_SERVER_STEP_DELAY"


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text}")
    return value


def _amount(text: str) -> float:
    value = float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number >= 0 (fractions allowed), got {text}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0..65535, got {value}")
    return value


def configure(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--text-model", metavar="PATH_OR_ID", help="a text-generation model (default: demo)")
    parser.add_argument("--image-model", metavar="PATH_OR_ID", help="a diffusers text-to-image pipeline")
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: %(default)s, loopback)"
    )
    parser.add_argument("--port", type=_port, default=8000, help="default: %(default)s")
    keys = parser.add_mutually_exclusive_group()
    keys.add_argument("--api-key", action="append", metavar="KEY", help="require this key (repeatable)")
    keys.add_argument("--api-keys-file", metavar="FILE", help="require one of the keys in FILE, one per line")
    parser.add_argument("--concurrency", type=_positive, default=1, metavar="N", help="jobs running at once")
    parser.add_argument(
        "--queue-size", type=_count, default=16, metavar="M", help="jobs waiting at most (429 beyond)"
    )
    parser.add_argument(
        "--stop-grace", type=_seconds, default=5.0, metavar="SECONDS",
        help="a stop waits this long for the running step to end, then aborts it at the next module"
        " call, keeping the last finished step's result (default: %(default)s)",
    )
    parser.add_argument(
        "--threads", type=_positive, metavar="N",
        help="torch threads (default: 1 when serving the built-in demo models, which are tiny: more threads"
        " only add synchronisation; torch's default for models you pass). The local engine only: a Ray"
        " replica runs on 1",
    )
    parser.add_argument(
        "--batch-size", type=_positive, default=16, metavar="N",
        help="greedy text jobs queued together run as the rows of one generate, up to N (1: one at a"
        " time; default: %(default)s; on Ray: per model replica pipeline)",
    )
    parser.add_argument(
        "--batch-wait-ms", type=_seconds, default=10.0, metavar="MS",
        help="how long a batch waits for more jobs to arrive before it starts (default: %(default)s)",
    )
    parser.add_argument(
        "--tp", type=_positive, default=1, metavar="N",
        help="shard the text model over N processes on this machine (transformers' tensor parallelism, gloo,"
        " 1 torch thread each unless --threads; the local engine, one job at a time): a stop ends every rank"
        " at the same step",
    )
    ray = parser.add_argument_group("scale-out on Ray Serve (pip install 'stopcock[ray]')")
    ray.add_argument(
        "--engine", choices=("local", "ray"), default="local",
        help="local: one process (default); ray: Ray Serve replicas (--concurrency is then per replica)",
    )
    ray.add_argument(
        "--ray-address", metavar="ADDR", help="join this Ray cluster (e.g. auto); default: start a local one"
    )
    ray.add_argument("--replicas", type=_positive, default=1, metavar="N", help="model replicas per kind")
    ray.add_argument("--ingress-replicas", type=_positive, default=1, metavar="N", help="HTTP replicas")
    ray.add_argument(
        "--replica-cpus", type=_amount, metavar="N",
        help="CPUs each model replica asks Ray for (default: 1, or an equal share when there are fewer CPUs"
        " than replicas)",
    )
    ray.add_argument(
        "--replica-gpus", type=_amount, metavar="N",
        help="GPUs each model replica asks Ray for (default: 1 where the cluster has GPUs, else 0)",
    )
    ray.add_argument(
        "--wait-for-resources", action="store_true",
        help="serve even when the cluster cannot place every model replica yet, and wait for them (default:"
        " exit at once with what is missing)",
    )
    ray.add_argument(
        "--checkpoint-dir", metavar="DIR",
        help="keep paused and preempted jobs' checkpoints in this folder, which every model replica must be"
        " able to read (default: the Ray object store)",
    )
    ray.add_argument(
        "--on-replica-loss", choices=("fail", "rerun"), default="fail",
        help="what becomes of the running jobs of a model replica that dies or whose node is removed: fail"
        " (they end failed, with the reason; default) or rerun (queued and run again, from their checkpoint"
        " if they were paused or preempted before, else from the start)",
    )
    ray.add_argument(
        "--max-reruns", type=_count, metavar="N",
        help="with --on-replica-loss rerun: how often a job runs again at most, after which it fails"
        " (default: 1)",
    )
    parser.set_defaults(func=serve)
    return parser


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    """Register ``serve`` in the ``stopcock`` command line."""
    return configure(
        subparsers.add_parser(
            "serve",
            help="serve the job API, an OpenAI-compatible API and a web page",
            description="With no model arguments, serves the built-in demo models. Without keys, anyone who"
            " reaches the address can use it: keep the default 127.0.0.1 or set --api-key.",
        )
    )


def read_keys(args: argparse.Namespace) -> list[str]:
    """The keys of ``--api-key`` or ``--api-keys-file``."""
    from .keyfile import read_key_file

    return list(args.api_key or []) if args.api_keys_file is None else read_key_file(args.api_keys_file)


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port``, before anything loads: a port in use is a one-line error."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as exc:
        raise UserError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}; stop what uses it or pass another --port"
        ) from None


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def serve(args: argparse.Namespace) -> int:
    """Run the service until Ctrl+C; running jobs are then stopped with reason ``"shutdown"``.

    A model or key file that cannot be used is a one-line error and exit status 1 (handled here,
    so that it holds however the command was started).
    """
    try:
        keys = read_keys(args)
        sock = listen(args.host, args.port)  # before the models load: a port in use fails at once
    except UserError as exc:
        print(f"stopcock serve: error: {exc}", file=sys.stderr)
        return 1
    with sock:
        try:
            if getattr(args, "engine", "local") == "ray":
                if getattr(args, "tp", 1) > 1:
                    raise UserError("--tp serves a sharded model on the local engine: drop --engine ray")
                if args.max_reruns is not None and args.on_replica_loss != "rerun":
                    raise UserError(
                        "--max-reruns bounds the re-runs of --on-replica-loss rerun: add that, or drop it"
                    )
                _check(args, keys)
                sock.close()  # Ray Serve's proxy binds the port itself: it was free a moment ago
                from .ray_deploy import serve_forever

                serve_forever(args, keys, step_delay=_step_delay())
                return 0
            _no_ray_options(args)
            backends = _load(args, keys)
            _run(args, keys, backends, sock)
        except UserError as exc:
            print(f"stopcock serve: error: {exc}", file=sys.stderr)
            return 1
    return 0


def _no_ray_options(args: argparse.Namespace) -> None:
    """A Ray option given to the local engine is an error that names the fix, not a silent no-op."""
    given = [
        flag
        for flag, value, default in (
            ("--ray-address", args.ray_address, None),
            ("--replicas", args.replicas, 1),
            ("--ingress-replicas", args.ingress_replicas, 1),
            ("--replica-cpus", args.replica_cpus, None),
            ("--replica-gpus", args.replica_gpus, None),
            ("--wait-for-resources", args.wait_for_resources, False),
            ("--checkpoint-dir", args.checkpoint_dir, None),
            ("--on-replica-loss", args.on_replica_loss, "fail"),
            ("--max-reruns", args.max_reruns, None),
        )
        if value != default
    ]
    if given:
        raise UserError(f"{', '.join(given)}: Ray Serve options; add --engine ray, or drop them")


def _step_delay() -> float:
    return float(os.environ.get(STEP_DELAY_ENV, "0") or 0)


def _load(args: argparse.Namespace, keys: list[str]) -> dict[str, Any]:
    from .backends import load_backends

    _check(args, keys)
    if getattr(args, "tp", 1) > 1:  # the text model sharded over local ranks (stopcock.server.ranked)
        from .ranked import load_ranked_backends

        return load_ranked_backends(args.text_model, args.image_model, args.tp, threads=args.threads,
                                    concurrency=args.concurrency)
    backends = load_backends(args.text_model, args.image_model)
    threads = getattr(args, "threads", None)
    if threads is None and args.text_model is None and args.image_model is None:
        from ..loading import DEMO_THREADS

        threads = DEMO_THREADS  # the demo models, as `stopcock demo` runs them
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    return backends


def _check(args: argparse.Namespace, keys: list[str]) -> None:
    if any(not k.strip() for k in keys):
        raise UserError("an API key cannot be empty or blank")
    if not keys and not _loopback(args.host):
        print(
            f"stopcock serve: warning: {args.host} is not loopback and no --api-key is set: anyone who"
            " reaches it can run and stop jobs",
            file=sys.stderr,
        )


def _run(args: argparse.Namespace, keys: list[str], backends: dict[str, Any], sock: socket.socket) -> None:
    import uvicorn

    from .app import create_app
    from .engine import LocalEngine

    engine = LocalEngine(
        backends,
        concurrency=args.concurrency,
        queue_size=args.queue_size,
        stop_grace=args.stop_grace,
        step_delay=_step_delay(),
        batch_size=args.batch_size,
        batch_wait=args.batch_wait_ms / 1000,
    )

    class Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started:  # uvicorn says nothing when given its socket
                host, port = sock.getsockname()[:2]
                url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
                print(f"stopcock serve: running on {url} (Ctrl+C to stop)", file=sys.stderr, flush=True)

        async def shutdown(self, sockets: Any = None) -> None:
            await engine.aclose()  # stop every job first ("shutdown"): open streams end with their outcome
            await super().shutdown(sockets)

    try:
        app = create_app(engine, api_keys=keys)
        Server(uvicorn.Config(app, host=args.host, port=args.port, timeout_graceful_shutdown=5)).run([sock])
    except SystemExit as exc:  # uvicorn's own exit when it cannot start (its status 3 is not ours)
        raise UserError(f"the server could not start (uvicorn exit status {exc.code})") from None
    finally:
        engine.close()
        for backend in backends.values():
            if hasattr(backend, "close"):
                backend.close()  # a sharded model's other ranks (stopcock.server.ranked)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m stopcock.server.serve``: the ``serve`` command alone."""
    return serve(configure(argparse.ArgumentParser(prog="stopcock serve")).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
