"""What the model replicas ask of a Ray cluster, and whether the cluster can place them.

:func:`replica_needs` picks each model replica's CPUs and GPUs (flags and config fields first, else
defaults that fit the cluster: a GPU each where there are GPUs, and at most one CPU each, shared out
when there are more replicas than CPUs). :func:`unplaceable` packs the replicas onto the nodes' free
resources (first fit, largest first) and names what does not fit: which deployment, what one
replica needs, what the cluster has. :func:`cluster_nodes` reads the alive nodes from Ray.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Demand", "actor_options", "cluster_nodes", "describe", "replica_needs", "unplaceable"]

#: The resources a model replica may ask for, as Ray names them.
KINDS = ("CPU", "GPU")


@dataclass(frozen=True)
class Demand:
    """``count`` replicas of the deployment ``deployment``, each needing ``each`` (``{"CPU": 0.5}``)."""

    deployment: str
    count: int
    each: Mapping[str, float]


def cluster_nodes() -> list[dict[str, float]]:
    """Each alive node's CPUs and GPUs, in all (what other work uses of them is not subtracted)."""
    import ray

    return [{k: float(n["Resources"].get(k, 0.0)) for k in KINDS} for n in ray.nodes() if n.get("Alive")]


def replica_needs(
    replicas: int, cpus: float | None, gpus: float | None, nodes: Sequence[Mapping[str, float]]
) -> dict[str, float]:
    """One model replica's Ray resources: ``cpus``/``gpus`` as given, else fitted to ``nodes`` for
    ``replicas`` model replicas in all (a GPU each when the cluster has GPUs; one CPU each, or an
    equal share of the CPUs when there are fewer CPUs than replicas)."""
    total_cpus = sum(n.get("CPU", 0.0) for n in nodes)
    total_gpus = sum(n.get("GPU", 0.0) for n in nodes)
    if gpus is None:
        gpus = 1.0 if total_gpus >= 1 else 0.0
    if cpus is None:
        share = int(total_cpus / max(replicas, 1) * 100) / 100  # Ray's resolution: 1/10000, kept coarse
        cpus = min(1.0, share) if share > 0 else 0.0
    if cpus < 0 or gpus < 0:
        raise ValueError("a replica's CPUs and GPUs must be >= 0")
    return {"CPU": float(cpus), "GPU": float(gpus)}


def describe(resources: Mapping[str, float]) -> str:
    """``{"CPU": 0.5, "GPU": 1}`` as ``0.5 CPU, 1 GPU`` (what is asked for)."""
    parts = [f"{resources.get(k, 0.0):g} {k}" for k in KINDS if resources.get(k, 0.0)]
    return ", ".join(parts) or "no CPU or GPU"


def unplaceable(demands: Sequence[Demand], nodes: Sequence[Mapping[str, float]]) -> str | None:
    """None when every replica fits on the nodes' resources; else what does not: the deployment, what
    one replica needs, how many of its replicas fit, and what the cluster has."""
    free = [{k: float(n.get(k, 0.0)) for k in KINDS} for n in nodes]
    order = sorted(demands, key=lambda d: (d.each.get("GPU", 0.0), d.each.get("CPU", 0.0)), reverse=True)
    problems = []
    for demand in order:
        placed = 0
        for _ in range(demand.count):
            node = next((n for n in free if all(n[k] + 1e-9 >= demand.each.get(k, 0.0) for k in KINDS)), None)
            if node is None:
                break
            for k in KINDS:
                node[k] -= demand.each.get(k, 0.0)
            placed += 1
        if placed < demand.count:
            problems.append(
                f"{demand.deployment} asks for {demand.count} replica(s) of {describe(demand.each)} each;"
                f" only {placed} fit"
            )
    if not problems:
        return None
    have = "; ".join(f"node {i}: {describe(n)}" for i, n in enumerate(nodes)) or "no alive node"
    return f"{'; '.join(problems)} (the cluster has {have})"


def actor_options(needs: Mapping[str, float], extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Ray's ``ray_actor_options`` for a replica needing ``needs``."""
    return {**(extra or {}), "num_cpus": needs.get("CPU", 0.0), "num_gpus": needs.get("GPU", 0.0)}
