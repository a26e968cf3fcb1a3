"""The Ray Serve application: :func:`build` puts the deployments together, :func:`app` is the builder
that ``serve run`` and Serve config files name, and :func:`serve_forever` is ``stopcock serve --engine ray``.

The application's deployments (names as a Serve config file overrides them):

- ``Ingress``: the FastAPI app (job API, OpenAI-compatible API, web page) over a
  :class:`~stopcock.server.ray_engine.RayEngine`; any number of replicas.
- ``JobRegistry``: the job registry, **one** replica (it is the one place where stops and starts are
  ordered; see :mod:`stopcock.server.ray_engine`).
- ``TextModel``, ``ImageModel``: one deployment per served kind; ``num_replicas`` or
  ``autoscaling_config``, and ``ray_actor_options`` (``{"num_gpus": 1}`` for a GPU each).
  ``max_ongoing_requests`` is the number of jobs a replica takes at once: ``concurrency`` pipelines,
  times ``batch_size`` for a text model (a pipeline runs up to that many greedy text jobs as one batch).

Ray is imported when an application is built, never when this module is imported.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UserError
from .ray_engine.journal import EVENTS_KEPT
from .ray_engine.reruns import OnReplicaLoss, checked_loss_policy
from .ray_engine.wire import ModelSpec

__all__ = ["APP_NAME", "REGISTRY", "RayOptions", "app", "build", "model_deployment", "serve_forever"]

APP_NAME = "stopcock"
REGISTRY = "JobRegistry"
INGRESS = "Ingress"
#: Long polls (event streams, waits, the replicas' stop polls) each hold a request of the registry.
REGISTRY_MAX_ONGOING = 100_000
INGRESS_MAX_ONGOING = 1_000
#: The registry's and model replicas' calls are internal (reports, long polls: thousands a second
#: under load): no access log line for each. The ingress keeps Serve's access log of HTTP requests.
QUIET = {"enable_access_log": False}


def model_deployment(kind: str) -> str:
    """The name of the model deployment of ``kind`` (``TextModel``, ``ImageModel``)."""
    return f"{kind.capitalize()}Model"


@dataclass
class RayOptions:
    """What :func:`build` deploys.

    ``models``: the kinds to serve. ``concurrency``: pipelines per model replica (its lease, and
    Serve's ``max_ongoing_requests``). ``replicas``: model replicas of each kind (a number, or one per
    kind: ``{"text": 2, "image": 1}``), or ``autoscaling``
    (Serve's ``autoscaling_config``, for every model deployment). ``replica_cpus``, ``replica_gpus``:
    what each model replica asks Ray for (None: fitted to the cluster, see
    :func:`~stopcock.server.ray_engine.resources.replica_needs`: a GPU each where there are GPUs, at
    most one CPU each). ``model_actor_options``: other Ray options of the model replicas (a
    ``num_cpus``/``num_gpus`` there is taken as the CPUs/GPUs asked for). ``queue_size``,
    ``retain``, ``stop_wait``: as for ``LocalEngine``, and ``stop_grace`` (seconds a stop waits
    for a slow step before it aborts it; None: never). ``journal_dir``: where the registry keeps
    its journal (``APP.jsonl``, after the application's name), on the registry's node: a restarted
    or redeployed registry of the same application reads it back (a shared or node-pinned folder
    survives the registry moving to another node); None: no journal. ``journal_events``: the
    latest events of each unfinished job that the journal keeps (0: none; a restarted registry
    then has only the later ones). ``registry_actor_options``, ``ingress_actor_options``: Ray
    options of the registry and ingress replicas (e.g. ``{"resources":
    {"node:__internal_head__": 0.001}}`` keeps the registry on the head node, beside its journal).
    ``step_delay``: the test-only per-step throttle. ``torch_threads``: torch threads per model
    replica (None: torch's default). ``batch_size``, ``batch_wait`` (seconds): each text model
    replica runs up to ``batch_size`` concurrent greedy text jobs as the rows of one ``generate``,
    waiting up to ``batch_wait`` for them (as ``LocalEngine``'s; 1: one job per pipeline).
    ``checkpoint_dir``: where a paused or preempted job's
    checkpoint is kept, a folder every model replica can read (shared across machines); None: the
    Ray object store, owned by the registry (see :mod:`~stopcock.server.ray_engine.checkpoints`).
    ``on_replica_loss``: what becomes of the unfinished jobs of a model replica that dies or whose
    node is removed: ``"fail"`` (they end ``failed``, with the reason), or ``"rerun"`` (queued and
    run again, from their checkpoint if they have one, else from their start; see
    :mod:`~stopcock.server.ray_engine.reruns`), at most ``max_reruns`` times each (past it: failed).
    """

    models: list[ModelSpec]
    api_keys: list[str] = field(default_factory=list)
    concurrency: int = 1
    replicas: int | Mapping[str, int] = 1
    autoscaling: Mapping[str, Any] | None = None
    model_actor_options: Mapping[str, Any] = field(default_factory=dict)
    replica_cpus: float | None = None
    replica_gpus: float | None = None
    ingress_replicas: int = 1
    queue_size: int = 16
    retain: int = 256
    stop_wait: float = 30.0
    stop_grace: float | None = 5.0
    journal_dir: str | None = field(default_factory=lambda: str(Path(tempfile.gettempdir()) / "stopcock-ray"))
    fsync: bool = False
    journal_events: int = EVENTS_KEPT
    registry_actor_options: Mapping[str, Any] = field(default_factory=dict)
    ingress_actor_options: Mapping[str, Any] = field(default_factory=dict)
    step_delay: float = 0.0
    torch_threads: int | None = None
    batch_size: int = 1
    batch_wait: float = 0.0
    checkpoint_dir: str | None = None
    on_replica_loss: OnReplicaLoss = "fail"
    max_reruns: int = 1

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("serve at least one kind of model")
        checked_loss_policy(self.on_replica_loss, self.max_reruns)
        counts = self.replicas.values() if isinstance(self.replicas, Mapping) else [self.replicas]
        if self.concurrency < 1 or min(counts) < 1 or self.ingress_replicas < 1:
            raise ValueError("concurrency, replicas and ingress_replicas must be >= 1")
        if self.batch_size < 1 or not 0 <= self.batch_wait < float("inf"):
            raise ValueError(f"batch_size must be >= 1 and batch_wait seconds >= 0, got {self.batch_size!r},"
                             f" {self.batch_wait!r}")

    def max_ongoing(self, kind: str) -> int:
        """The jobs Serve hands a model replica of ``kind`` at once: a batch per pipeline for text."""
        return self.concurrency * (self.batch_size if kind == "text" else 1)

    def replicas_of(self, kind: str) -> int:
        """The model replicas asked for of ``kind`` (with autoscaling: its ``min_replicas``)."""
        if self.autoscaling:
            return int(self.autoscaling.get("min_replicas", 1))
        return self.replicas.get(kind, 1) if isinstance(self.replicas, Mapping) else self.replicas

    def needs(self, nodes: Sequence[Mapping[str, float]] | None = None) -> dict[str, float]:
        """What one model replica asks Ray for, ``{"CPU": c, "GPU": g}``: as given, else fitted to
        ``nodes`` (the cluster's, read from Ray when None)."""
        from .ray_engine.resources import cluster_nodes, replica_needs

        cpus = self.model_actor_options.get("num_cpus", self.replica_cpus)
        gpus = self.model_actor_options.get("num_gpus", self.replica_gpus)
        if (cpus is None or gpus is None) and nodes is None:
            nodes = cluster_nodes()
        total = sum(self.replicas_of(spec.kind) for spec in self.models)
        return replica_needs(total, cpus, gpus, nodes or [])

    def demands(self, needs: Mapping[str, float]) -> list[Any]:
        """What the model deployments ask of the cluster (for :func:`~.ray_engine.resources.unplaceable`)."""
        from .ray_engine.resources import Demand

        return [Demand(model_deployment(s.kind), self.replicas_of(s.kind), needs) for s in self.models]


def build(options: RayOptions) -> Any:
    """The Serve application (a bound ``Ingress`` deployment, with everything it needs) for ``options``."""
    from ray import serve

    from .ray_engine.registry import JobRegistry
    from .ray_engine.replica import ModelReplica
    from .ray_engine.resources import actor_options, describe

    models = {s.kind: {"id": s.served_name, "description": s.served_description} for s in options.models}
    needs = options.needs()
    kinds = {
        s.kind: {
            "deployment": model_deployment(s.kind),
            "asked": options.replicas_of(s.kind),
            "needs": describe(needs),
        }
        for s in options.models
    }
    handles = {}
    for spec in options.models:
        scaling: dict[str, Any] = (
            {"autoscaling_config": dict(options.autoscaling)}
            if options.autoscaling
            else {"num_replicas": options.replicas_of(spec.kind)}
        )
        deployment = serve.deployment(
            name=model_deployment(spec.kind),
            max_ongoing_requests=options.max_ongoing(spec.kind),
            ray_actor_options=actor_options(needs, options.model_actor_options),
            logging_config=QUIET,
            **scaling,
        )(ModelReplica)
        handles[spec.kind] = deployment.bind(
            spec,
            concurrency=options.concurrency,
            step_delay=options.step_delay,
            stop_grace=options.stop_grace,
            torch_threads=options.torch_threads,
            registry_name=REGISTRY,
            batch_size=options.batch_size,
            batch_wait=options.batch_wait,
            checkpoint_dir=options.checkpoint_dir,
        )
    registry = serve.deployment(
        name=REGISTRY,
        num_replicas=1,
        max_ongoing_requests=REGISTRY_MAX_ONGOING,
        ray_actor_options={"num_cpus": 0, **options.registry_actor_options},
        logging_config=QUIET,
    )(JobRegistry).bind(
        handles,
        queue_size=options.queue_size,
        retain=options.retain,
        stop_wait=options.stop_wait,
        journal_dir=options.journal_dir,
        fsync=options.fsync,
        journal_events=options.journal_events,
        kinds=kinds,
        checkpoint_dir=options.checkpoint_dir,
        on_replica_loss=options.on_replica_loss,
        max_reruns=options.max_reruns,
    )
    ingress = serve.deployment(
        name=INGRESS,
        num_replicas=options.ingress_replicas,
        max_ongoing_requests=INGRESS_MAX_ONGOING,
        ray_actor_options={"num_cpus": 0, **options.ingress_actor_options},
    )(_ingress(list(options.api_keys), models))
    return ingress.bind(registry)


def _ingress(keys: list[str], models: Mapping[str, Mapping[str, str]]) -> Any:
    """The ingress deployment's class: the FastAPI app, built on each replica over its own engine."""
    from ray import serve

    def build_app() -> Any:
        from .app import create_app
        from .ray_engine.ingress import RayEngine

        context = serve.get_replica_context()
        registry = serve.get_deployment_handle(REGISTRY, context.app_name)
        engine = RayEngine(registry, models)
        engine.warm()  # Serve builds the app in the replica's event loop, as it starts
        return _Tagged(create_app(engine, api_keys=keys), context.replica_tag)

    class Ingress:
        def __init__(self, registry: Any) -> None:
            self.registry = registry  # bound, so that the registry is deployed with the application

    return serve.ingress(build_app)(Ingress)


class _Tagged:
    """The app, with an ``x-stopcock-replica`` header on every answer: which ingress replica answered."""

    def __init__(self, app: Any, tag: str) -> None:
        self.app, self.tag = app, tag.encode()
        self.state = getattr(app, "state", None)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def tagged(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", []), (b"x-stopcock-replica", self.tag)]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, tagged)


# -- serve run / serve deploy ------------------------------------------------------------------------
def app(args: Mapping[str, Any]) -> Any:
    """The application builder named in a Serve config file (``import_path:
    stopcock.server.ray_deploy:app``) or on the command line (``serve run
    stopcock.server.ray_deploy:app text_model=PATH``). ``args``: ``text_model``, ``image_model`` (a
    folder or hub id; neither: both demo models), ``text_name``, ``image_name``, ``api_keys`` (a list)
    or ``api_keys_file``, ``concurrency``, ``queue_size``, ``retain``, ``stop_wait``, ``stop_grace``,
    ``journal_dir``, ``journal_events``, ``checkpoint_dir`` (where held jobs' checkpoints go; unset: the
    object store),
    ``fsync``, ``torch_threads``, ``device`` (``auto``: a GPU when the replica has one),
    ``replica_cpus``, ``replica_gpus`` (what each model replica asks for; unset: fitted to the
    cluster), ``batch_size``, ``batch_wait_ms`` (batches of greedy text jobs), ``on_replica_loss``
    (``fail`` or ``rerun``), ``max_reruns``. Replicas and autoscaling go in the config's
    ``deployments``."""
    known = {
        "text_model",
        "image_model",
        "text_name",
        "image_name",
        "api_keys",
        "api_keys_file",
        "concurrency",
        "queue_size",
        "retain",
        "stop_wait",
        "stop_grace",
        "journal_dir",
        "checkpoint_dir",
        "journal_events",
        "fsync",
        "torch_threads",
        "device",
        "replica_cpus",
        "replica_gpus",
        "batch_size",
        "batch_wait_ms",
        "on_replica_loss",
        "max_reruns",
    }
    unknown = set(args) - known
    if unknown:
        raise ValueError(f"unknown stopcock application args: {sorted(unknown)}; known: {sorted(known)}")
    keys = list(args.get("api_keys") or [])
    if args.get("api_keys_file"):
        from .keyfile import read_key_file

        keys = read_key_file(args["api_keys_file"])
    options: dict[str, Any] = {
        name: type_(args[name])
        for name, type_ in [
            ("concurrency", int),
            ("queue_size", int),
            ("retain", int),
            ("stop_wait", float),
            ("stop_grace", float),
            ("fsync", bool),
            ("journal_events", int),
            ("replica_cpus", float),
            ("replica_gpus", float),
            ("batch_size", int),
            ("on_replica_loss", str),
            ("max_reruns", int),
        ]
        if name in args
    }
    if "batch_wait_ms" in args:
        options["batch_wait"] = float(args["batch_wait_ms"]) / 1000
    if "journal_dir" in args:
        options["journal_dir"] = args["journal_dir"]
    if args.get("checkpoint_dir") is not None:
        options["checkpoint_dir"] = str(args["checkpoint_dir"])
    if args.get("torch_threads") is not None:
        options["torch_threads"] = int(args["torch_threads"])
    specs = model_specs(
        args.get("text_model"),
        args.get("image_model"),
        args.get("text_name"),
        args.get("image_name"),
        device=str(args.get("device", "auto")),
    )
    return build(RayOptions(models=specs, api_keys=keys, **options))


def model_specs(
    text_model: str | None,
    image_model: str | None,
    text_name: str | None = None,
    image_name: str | None = None,
    *,
    device: str = "auto",
) -> list[ModelSpec]:
    """The kinds to serve, as ``stopcock serve`` picks them: the models given, or both demo models."""
    from ..loading import resolve_model

    demo = text_model is None and image_model is None
    specs = []
    for kind, model, name in (("text", text_model, text_name), ("image", image_model, image_name)):
        if demo or model is not None:
            if model is not None:
                resolve_model(model, kind)  # a missing folder is a clear error here, not a failed replica
            specs.append(ModelSpec(kind, model, name, device=device))
    return specs


# -- stopcock serve --engine ray -----------------------------------------------------------------------
def _free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def _check_resources(options: RayOptions, *, wait: bool) -> None:
    """Refuse, within seconds, model replicas the cluster cannot place (or, with ``wait``, say so and
    go on: Serve places them once the cluster has the resources)."""
    from .ray_engine.resources import cluster_nodes, unplaceable

    nodes = cluster_nodes()
    problem = unplaceable(options.demands(options.needs(nodes)), nodes)
    if problem is None:
        return
    if not wait:
        raise UserError(
            f"the cluster cannot place the model replicas: {problem}. Ask for less (--replicas,"
            " --replica-cpus, --replica-gpus), add nodes, or pass --wait-for-resources to serve anyway"
            " and wait for them (/v1/health shows the ready replicas of each kind)"
        )
    print(
        f"stopcock serve: waiting for resources: {problem}; /v1/health shows the ready replicas",
        file=sys.stderr,
        flush=True,
    )


def _max_reruns(args: argparse.Namespace) -> int:
    """``--max-reruns`` (1 unless given; ``serve`` allows it only with ``--on-replica-loss rerun``)."""
    given = getattr(args, "max_reruns", None)
    return 1 if given is None else int(given)


def serve_forever(args: argparse.Namespace, keys: Sequence[str], step_delay: float = 0.0) -> None:
    """Deploy on a local Ray cluster (started here) or the one at ``--ray-address``, then serve until
    Ctrl+C: every job is then stopped (reason ``"shutdown"``) and the application deleted."""
    import ray
    from ray import serve

    specs = model_specs(args.text_model, args.image_model)  # UserError before any cluster is started
    options = RayOptions(
        models=specs,
        api_keys=list(keys),
        concurrency=args.concurrency,
        replicas=args.replicas,
        queue_size=args.queue_size,
        stop_grace=args.stop_grace,
        step_delay=step_delay,
        ingress_replicas=args.ingress_replicas,
        replica_cpus=args.replica_cpus,
        replica_gpus=args.replica_gpus,
        batch_size=getattr(args, "batch_size", 1),
        batch_wait=getattr(args, "batch_wait_ms", 0.0) / 1000,
        checkpoint_dir=getattr(args, "checkpoint_dir", None),
        on_replica_loss=getattr(args, "on_replica_loss", "fail"),
        max_reruns=_max_reruns(args),
    )
    port = args.port or _free_port(args.host)
    started_here = args.ray_address is None
    if started_here:  # the cluster lives as long as this command: so does its registry's journal
        options.journal_dir = tempfile.mkdtemp(prefix="stopcock-ray-journal-")
    if started_here:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private cluster on this machine
        # address="local": a cluster of its own, never one that a plain ray.init() would join (another
        # local cluster's address file), whose Serve this command would replace and shut down
        ray.init(address="local", include_dashboard=False, log_to_driver=False, configure_logging=False)
    else:
        ray.init(address=args.ray_address, log_to_driver=False, configure_logging=False)
    serving = False
    try:
        _check_resources(options, wait=args.wait_for_resources)  # before Serve starts: refused in seconds
        serve.start(http_options={"host": args.host, "port": port})
        serving = True
        try:
            if args.wait_for_resources:  # wait for the ingress only: /v1/health shows the model replicas
                from ray.serve.api import _run

                _run(build(options), name=APP_NAME, route_prefix="/", _blocking=False)
            else:
                serve.run(build(options), name=APP_NAME, route_prefix="/")
        except RuntimeError as exc:
            raise UserError(f"the Ray Serve application did not start: {exc}") from None
        where = "a local Ray cluster" if started_here else f"the Ray cluster at {args.ray_address}"
        print(
            f"stopcock serve: running on http://{args.host}:{port} (Ray Serve on {where}; {args.replicas}"
            f" replica(s) per model; Ctrl+C to stop)",
            file=sys.stderr,
            flush=True,
        )
        try:
            threading.Event().wait()  # until Ctrl+C (KeyboardInterrupt)
        finally:
            registry: Any = serve.get_deployment_handle(REGISTRY, APP_NAME)
            stopped = registry.stop_all.remote("shutdown").result(timeout_s=120)
            print(f"stopcock serve: stopped {stopped} job(s); removing the application", file=sys.stderr)
            serve.delete(APP_NAME)
    finally:
        if started_here and serving:
            serve.shutdown()
        ray.shutdown()
        if started_here and options.journal_dir is not None:
            shutil.rmtree(options.journal_dir, ignore_errors=True)
