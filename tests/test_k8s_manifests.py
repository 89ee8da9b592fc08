"""The Kubernetes manifests in deploy/k8s: valid for the API server, and consistent with Parrot.

No cluster runs on the project's machines, so the manifests are validated offline:

- parrot.yaml (Deployment, Service, HorizontalPodAutoscaler) against the strict JSON schemas of
  Kubernetes that kubernetes-validate ships (PyPI; strict: an unknown field is an error, as with
  ``kubectl apply --validate=strict``), then against the server's own config and endpoints.
- rayservice.yaml: no schema of KubeRay's RayService CRD ships with a validator on PyPI, so what
  can be checked for real is: each pod template, wrapped as a core ``PodTemplate``, against the
  same strict schemas; ``serveConfigV2`` against Ray's own ``ServeDeploySchema``; and the
  RayService's structure by hand. The CRD's own fields (``rayStartParams``,
  ``enableInTreeAutoscaling``, ...) are checked only for presence and type, never by KubeRay.

Each validator also rejects a broken copy (a misspelt field, a wrong type), so no test here can
pass because a validator accepts anything.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from parrot.config import load_config

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # Ray 2.60's pydantic-v1-style Field(...) arguments
    import ray
    from ray.serve.schema import HTTPOptionsSchema, ServeApplicationSchema, ServeDeploySchema

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
# The newest Kubernetes whose schemas kubernetes-validate 1.37 ships.
KUBERNETES_VERSION = "1.37"
# parrot.server.ray_app.build(args) takes these keys (the interface rayservice.yaml is written against).
RAY_APP_ARGS = {"replicas", "max_replicas", "model", "threads", "config"}
# uvicorn's timeout_graceful_shutdown after the drain (parrot/server/app.py).
UVICORN_GRACEFUL_S = 5

Manifest = dict[str, Any]


def load(name: str) -> list[Manifest]:
    return [doc for doc in yaml.safe_load_all((K8S / name).read_text()) if doc]


def single_process() -> dict[str, Manifest]:
    """parrot.yaml by kind; exactly one of each of the three."""
    docs = load("parrot.yaml")
    by_kind = {doc["kind"]: doc for doc in docs}
    assert len(by_kind) == len(docs) == 3, [doc["kind"] for doc in docs]
    return by_kind


def rayservice() -> Manifest:
    (doc,) = load("rayservice.yaml")
    return doc


def validate_k8s(doc: Manifest) -> None:
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def as_pod_template(name: str, template: Manifest) -> Manifest:
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": template}


def ray_pod_templates(doc: Manifest) -> dict[str, Manifest]:
    cluster = doc["spec"]["rayClusterConfig"]
    templates = {"head": cluster["headGroupSpec"]["template"]}
    for group in cluster["workerGroupSpecs"]:
        templates[group["groupName"]] = group["template"]
    return templates


def unknown_serve_keys(config: Manifest) -> list[str]:
    """Keys that Ray's schema does not define. ServeDeploySchema, its applications and its
    http_options accept unknown keys (forward compatibility) and drop them, so a misspelt
    ``route_prefx`` would deploy with the default route: this catches it."""
    unknown = [f"{key}" for key in config if key not in ServeDeploySchema.model_fields]
    unknown += [f"http_options.{key}" for key in config.get("http_options", {}) if key not in HTTPOptionsSchema.model_fields]
    for app in config.get("applications", []):
        unknown += [f"applications[{app.get('name')}].{key}" for key in app if key not in ServeApplicationSchema.model_fields]
    return unknown


def check_serve_config(text: str) -> ServeDeploySchema:
    config = yaml.safe_load(text)
    assert not unknown_serve_keys(config), unknown_serve_keys(config)
    return ServeDeploySchema.model_validate(config)


def check_rayservice_structure(doc: Manifest) -> None:
    """What the RayService CRD requires of the fields used here (KubeRay 1.x, ray.io/v1)."""
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayService"
    assert doc["metadata"]["name"]
    spec = doc["spec"]
    assert isinstance(spec["serveConfigV2"], str), "serveConfigV2 is a YAML string, not a mapping"
    cluster = spec["rayClusterConfig"]
    assert isinstance(cluster["rayVersion"], str)
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    assert len(groups) >= 2, "a head group and at least one worker group"
    for group in groups:
        # map[string]string in the CRD: `num-cpus: 4` (an int) is refused by the API server.
        params = group.get("rayStartParams", {})
        assert all(isinstance(value, str) for value in params.values()), params
        assert isinstance(group["template"]["spec"]["containers"], list)
    for group in cluster["workerGroupSpecs"]:
        assert group["groupName"]
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], group["groupName"]


# -- parrot.yaml ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["Deployment", "Service", "HorizontalPodAutoscaler"])
def test_single_process_manifest_is_a_valid_kubernetes_object(kind):
    validate_k8s(single_process()[kind])


@pytest.mark.parametrize(
    ("kind", "mutate"),
    [
        ("Deployment", lambda doc: doc["spec"].update(replica=2)),  # misspelt: strict schemas refuse it
        ("Deployment", lambda doc: doc["spec"]["template"]["spec"]["containers"][0]["ports"][0].update(containerPort="http")),
        ("Deployment", lambda doc: doc["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"].update(pth="/")),
        ("Deployment", lambda doc: doc["spec"]["template"]["metadata"]["annotations"].update({"prometheus.io/port": 8000})),
        ("Service", lambda doc: doc["spec"]["ports"][0].update(port="8000")),  # an integer wanted
        ("HorizontalPodAutoscaler", lambda doc: doc["spec"].update(maxReplica=4)),
        ("HorizontalPodAutoscaler", lambda doc: doc["spec"]["metrics"][0]["pods"]["target"].update(averageValue={"value": 2})),
    ],
)
def test_validator_rejects_a_broken_single_process_manifest(kind, mutate):
    doc = copy.deepcopy(single_process()[kind])
    mutate(doc)
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_k8s(doc)


def test_deployment_probes_health_and_the_service_routes_to_the_server_port():
    manifests = single_process()
    pod = manifests["Deployment"]["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports == {"http": 8000}  # the image's CMD: parrot serve --host 0.0.0.0 --port 8000
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    # Liveness must not restart a pod that is still loading: the startup probe covers minutes.
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120

    service = manifests["Service"]
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]
    labels = pod["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert manifests["Deployment"]["spec"]["selector"]["matchLabels"].items() <= labels.items()

    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(ports["http"]) and annotations["prometheus.io/path"] == "/metrics"


def test_deployment_env_is_parrot_config_with_threads_matching_the_cpu_limit_and_drain_within_the_grace_period():
    pod = single_process()["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {var["name"]: var["value"] for var in container["env"] if "value" in var}
    secrets = {var["name"]: var["valueFrom"]["secretKeyRef"] for var in container["env"] if "valueFrom" in var}
    assert secrets.keys() <= {"PARROT_SERVER_API_KEY"} and all(ref["optional"] for ref in secrets.values())
    defaults = load_config(env={})
    known = {f"PARROT_{section.name}_{key.name}".upper()
             for section in dataclasses.fields(defaults) for key in dataclasses.fields(getattr(defaults, section.name))}
    assert set(env) | set(secrets) <= known, f"not a config setting (ignored by the server): {sorted(set(env) - known)}"
    config = load_config(env=env)  # parses and range-checks the values as the server does

    limits, requests = container["resources"]["limits"], container["resources"]["requests"]
    assert limits == requests, "Guaranteed QoS: requests equal limits"
    assert config.model.threads == int(limits["cpu"])

    pre_stop_s = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    needed_s = pre_stop_s + config.server.drain_timeout_s + UVICORN_GRACEFUL_S
    assert pod["terminationGracePeriodSeconds"] > needed_s


def test_hpa_scales_the_deployment_on_queue_depth_and_on_cpu_without_the_adapter():
    manifests = single_process()
    hpa = manifests["HorizontalPodAutoscaler"]["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": manifests["Deployment"]["metadata"]["name"]}
    assert 1 <= hpa["minReplicas"] < hpa["maxReplicas"]
    by_type = {metric["type"]: metric for metric in hpa["metrics"]}
    assert by_type.keys() == {"Pods", "Resource"}
    # prometheus-adapter's rule renames parrot:num_requests_waiting (the colon is not allowed).
    assert by_type["Pods"]["pods"]["metric"]["name"] == "parrot_num_requests_waiting"
    assert by_type["Pods"]["pods"]["target"]["type"] == "AverageValue"
    assert by_type["Resource"]["resource"]["name"] == "cpu"


# -- rayservice.yaml ------------------------------------------------------------------------------


def test_rayservice_has_the_structure_kuberay_expects():
    doc = rayservice()
    check_rayservice_structure(doc)
    assert doc["spec"]["rayClusterConfig"]["rayVersion"] == ray.__version__  # the image's Ray


@pytest.mark.parametrize("group", ["head", "cpu-workers"])
def test_rayservice_pod_template_is_a_valid_pod_template(group):
    templates = ray_pod_templates(rayservice())
    assert templates.keys() == {"head", "cpu-workers"}
    validate_k8s(as_pod_template(f"parrot-{group}", templates[group]))


def test_serve_config_is_valid_for_ray_serve_and_calls_the_parrot_builder():
    doc = rayservice()
    config = check_serve_config(doc["spec"]["serveConfigV2"])
    assert config.http_options.host == "0.0.0.0" and config.http_options.port == 8000
    (app,) = config.applications
    assert app.import_path == "parrot.server.ray_app:build" and app.route_prefix == "/"
    assert set(app.args) <= RAY_APP_ARGS, set(app.args) - RAY_APP_ARGS
    assert app.args["model"] == "embedded"
    assert 1 <= app.args["replicas"] <= app.args["max_replicas"]

    # The worker groups at their largest hold max_replicas replicas of `threads` CPUs each.
    cluster = doc["spec"]["rayClusterConfig"]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # no replica on the head
    worker_cpus = sum(int(group["rayStartParams"]["num-cpus"]) * group["maxReplicas"] for group in cluster["workerGroupSpecs"])
    assert worker_cpus >= app.args["max_replicas"] * app.args["threads"]


@pytest.mark.parametrize(
    "mutate",
    [
        lambda config: config["applications"][0].update(route_prefx="/v1"),  # misspelt: Ray drops it
        lambda config: config.update(http_option={"port": 8000}),
        lambda config: config["http_options"].update(port="eight thousand"),  # wrong type
        lambda config: config["applications"][0].update(deployments={"name": "x"}),  # a list wanted
        lambda config: config["applications"][0].pop("import_path"),  # required
    ],
)
def test_serve_config_check_rejects_a_broken_config(mutate):
    config = yaml.safe_load(rayservice()["spec"]["serveConfigV2"])
    mutate(config)
    with pytest.raises((AssertionError, ValueError)):  # pydantic's ValidationError is a ValueError
        check_serve_config(yaml.safe_dump(config))


@pytest.mark.parametrize(
    "mutate",
    [
        lambda doc: doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["rayStartParams"].update({"num-cpus": 4}),
        lambda doc: doc["spec"].update(serveConfigV2=yaml.safe_load(doc["spec"]["serveConfigV2"])),
        lambda doc: doc["spec"]["rayClusterConfig"].update(workerGroupSpecs=[]),
        lambda doc: doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0].update(maxReplicas=0),
    ],
)
def test_rayservice_structure_check_rejects_a_broken_rayservice(mutate):
    doc = copy.deepcopy(rayservice())
    mutate(doc)
    with pytest.raises((AssertionError, KeyError)):
        check_rayservice_structure(doc)


def test_validator_rejects_a_broken_ray_pod_template():
    template = copy.deepcopy(ray_pod_templates(rayservice())["cpu-workers"])
    template["spec"]["containers"][0]["resource"] = template["spec"]["containers"][0].pop("resources")
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_k8s(as_pod_template("parrot-cpu-workers", template))
