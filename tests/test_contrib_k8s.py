"""contrib/k8s: every manifest validates against the Kubernetes API schemas; the KubeRay RayService's
pod templates validate as pods and its Serve config builds pagoda's replica application."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate")

K8S = Path(__file__).resolve().parents[1] / "contrib" / "k8s"
KUBERNETES_VERSION = "1.30"
BUILT_IN_GROUPS = ("v1", "apps/", "autoscaling/", "policy/")


def documents() -> list[tuple[str, dict]]:
    return [(f"{path.relative_to(K8S)}#{i}", doc) for path in sorted(K8S.rglob("*.yaml"))
            for i, doc in enumerate(yaml.safe_load_all(path.read_text())) if doc]


@pytest.mark.parametrize("name,doc", [d for d in documents() if d[1]["apiVersion"].startswith(BUILT_IN_GROUPS)],
                         ids=lambda v: v if isinstance(v, str) else "")
def test_every_built_in_manifest_validates_against_the_kubernetes_schema(name, doc):
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_an_invalid_manifest_is_caught():
    _, deployment = documents()[0]
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    broken["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "eight thousand"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


@pytest.fixture(scope="module")
def rayservice() -> dict:
    (doc,) = [d for _, d in documents() if d["kind"] == "RayService"]
    return doc


def test_the_rayservice_pod_templates_are_valid_pods(rayservice):
    cluster = rayservice["spec"]["rayClusterConfig"]
    templates = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    for template in templates:
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "t", **template.get("metadata", {})},
               "spec": template["spec"]}
        kubernetes_validate.validate(pod, KUBERNETES_VERSION, strict=True)
    for group in cluster["workerGroupSpecs"]:
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]


def test_the_rayservice_serve_config_builds_the_replica_application(rayservice, monkeypatch):
    pytest.importorskip("ray.serve")
    import importlib

    import ray
    from ray.serve.schema import ServeDeploySchema

    config = ServeDeploySchema.model_validate(yaml.safe_load(rayservice["spec"]["serveConfigV2"]))
    (app,) = config.applications
    module, attr = app.import_path.split(":")
    monkeypatch.setenv("PAGODA_API_KEY", "sk-test")
    application = getattr(importlib.import_module(module), attr)(app.args)
    assert type(application).__name__ == "Application"
    args = app.args["replicas"]
    workers = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    # every replica fits a worker pod, and the workers can hold the most replicas autoscaling asks for
    assert args["cpus_per_replica"] <= int(workers["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"])
    assert workers["maxReplicas"] >= args["max_replicas"]
    installed = tuple(int(p) for p in ray.__version__.split(".")[:2])
    assert tuple(int(p) for p in rayservice["spec"]["rayClusterConfig"]["rayVersion"].split(".")[:2]) <= installed


def test_the_application_builder_names_unknown_options():
    pytest.importorskip("ray.serve")
    from pagoda.plugins.entrypoints.replicas.deployments import app_builder

    with pytest.raises(ValueError, match="unknown replica options \\['replica_count'\\]"):
        app_builder({"replicas": {"replica_count": 2}})
    with pytest.raises(ValueError, match="unknown keys \\['engines'\\]"):
        app_builder({"engines": {}})
