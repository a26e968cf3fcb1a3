"""The KubeRay ``RayService`` of the multi-node guide (``docs/how-to/ray-cluster.md``) is on paper: no
Kubernetes here. What can be checked without one is: its Serve config is one that Serve's schema
takes, with exactly one registry replica, and stopcock's application builder takes its ``args``
(the paths replaced by this machine's)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray.serve")

from test_docs import ROOT, blocks_of  # tests/ is on sys.path under pytest

GUIDE = ROOT / "docs" / "how-to" / "ray-cluster.md"


def serve_config() -> dict[str, Any]:
    import yaml

    manifests = [b for b in blocks_of(GUIDE) if b.language == "yaml"]
    assert len(manifests) == 1, "the guide has one YAML block: the RayService"
    service = yaml.safe_load(manifests[0].code)
    assert (service["apiVersion"], service["kind"]) == ("ray.io/v1", "RayService")
    config: dict[str, Any] = yaml.safe_load(service["spec"]["serveConfigV2"])
    return config


def test_the_guides_serve_config_is_one_serve_takes():
    from ray.serve.schema import ServeDeploySchema

    config = serve_config()
    ServeDeploySchema.model_validate(config)
    (application,) = config["applications"]
    assert application["import_path"] == "stopcock.server.ray_deploy:app"
    deployments = {d["name"]: d for d in application["deployments"]}
    assert set(deployments) <= {"Ingress", "JobRegistry", "TextModel", "ImageModel"}
    assert deployments["JobRegistry"]["num_replicas"] == 1


def test_the_application_builder_takes_the_guides_args(text_model_dir, tmp_path: Path):
    from ray.serve import Application

    from stopcock.server.ray_deploy import app

    keys = tmp_path / "keys.txt"
    keys.write_text("a-key\n", "utf-8")
    args = dict(serve_config()["applications"][0]["args"])
    here = {"text_model": str(text_model_dir), "api_keys_file": str(keys), "journal_dir": str(tmp_path)}
    assert set(here) <= set(args)  # the paths the guide names, replaced
    # the resources given: with none left to fit to a cluster, no cluster is needed to build it
    assert isinstance(app({**args, **here, "replica_cpus": 1, "replica_gpus": 0}), Application)
