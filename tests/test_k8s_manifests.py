"""deploy/k8s checked without a cluster: every built-in resource against the Kubernetes schema of a
pinned version (kubernetes-validate, strict), the custom resources (PodMonitor, PrometheusRule,
prometheus-adapter's rule) for the fields that matter, the overlays' patches against the base,
and the autoscaler's signal against the metrics a live server really exports."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import kubernetes_validate
import pytest
import requests
import yaml

K8S = Path(__file__).resolve().parents[1] / "deploy" / "k8s"
KUBERNETES_VERSION = "1.33.0"
CUSTOM_KINDS = {"PodMonitor", "PrometheusRule", "Kustomization"}


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _kustomization(directory: Path) -> dict:
    return _docs(directory / "kustomization.yaml")[0]


def _base() -> dict[tuple[str, str], dict]:
    """(kind, name) -> resource, for every resource the base kustomization lists."""
    resources = {}
    for name in _kustomization(K8S / "base")["resources"]:
        for doc in _docs(K8S / "base" / name):
            resources[(doc["kind"], doc["metadata"]["name"])] = doc
    return resources


def _merge(base: dict, patch: dict) -> dict:
    """A strategic-merge patch as kustomize applies it to these files: maps merge, lists of
    named items (containers) merge by name, other lists replace."""
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        elif isinstance(value, list) and value and all(isinstance(v, dict) and "name" in v for v in value) \
                and isinstance(out.get(key), list):
            by_name = {item["name"]: item for item in out[key]}
            for item in value:
                assert item["name"] in by_name, f"patch names {item['name']!r}, which the base lacks"
                by_name[item["name"]].update(_merge(by_name[item["name"]], item))
        else:
            out[key] = value
    return out


def _validate(doc: dict) -> None:
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_every_builtin_resource_validates_against_the_kubernetes_schema():
    resources = _base()
    assert {kind for kind, _ in resources} >= {"Deployment", "Service", "HorizontalPodAutoscaler", "ConfigMap",
                                               "PodMonitor", "PrometheusRule"}
    for (kind, name), doc in resources.items():
        if kind not in CUSTOM_KINDS:
            _validate(doc)
    with pytest.raises(kubernetes_validate.ValidationError):  # the check can fail
        broken = copy.deepcopy(resources[("Deployment", "tritonllm-server")])
        broken["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "eight thousand"
        _validate(broken)


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_overlays_patch_what_the_base_has_and_pin_every_image(overlay):
    kustomization = _kustomization(K8S / "overlays" / overlay)
    assert kustomization["resources"] == ["../../base"]
    resources = _base()
    for patch_file in kustomization.get("patches", []):
        for patch in _docs(K8S / "overlays" / overlay / patch_file["path"]):
            key = (patch["kind"], patch["metadata"]["name"])
            assert key in resources, f"{patch_file['path']} patches {key}, which the base lacks"
            resources[key] = _merge(resources[key], patch)
            _validate(resources[key])
    tags = {i["name"]: i["newTag"] for i in _kustomization(K8S / "base")["images"]}
    tags.update({i["name"]: i["newTag"] for i in kustomization.get("images", [])})
    assert all(tag and tag != "latest" for tag in tags.values()), tags
    for doc in resources.values():
        if doc["kind"] == "Deployment":
            for container in doc["spec"]["template"]["spec"]["containers"]:
                assert ":" not in container["image"] and container["image"] in tags, container["image"]
    if overlay == "gpu":
        server = resources[("Deployment", "tritonllm-server")]["spec"]["template"]["spec"]["containers"][0]
        assert server["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_server_probes_service_and_scrape_point_at_real_ports():
    resources = _base()
    deployment = resources[("Deployment", "tritonllm-server")]
    pod = deployment["spec"]["template"]
    container, front = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for c in (container, front) for p in c["ports"]}
    assert ports == {"http": 8000, "grpc": 8001, "metrics": 8002, "openai": 9000}
    # The OpenAI front beside the server: Triton's gRPC on the pod's loopback, its own port, probes on
    # its readiness; the server does not start a second front on the same port.
    assert front["command"][0] == "tritonllm-openai" and "127.0.0.1:8001" in front["command"]
    assert front["command"][front["command"].index("--port") + 1] == "9000"
    assert front["readinessProbe"]["httpGet"] == {"path": "/health/ready", "port": "openai"}
    assert container["command"][-2:] == ["--openai-port", "0"]
    assert container["startupProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert container["startupProbe"]["periodSeconds"] * container["startupProbe"]["failureThreshold"] >= 300
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    # The drain (10 s) and Triton's exit timeout (30 s) fit in the grace period.
    assert pod["spec"]["terminationGracePeriodSeconds"] >= 40
    labels = pod["metadata"]["labels"]
    service = resources[("Service", "tritonllm-server")]
    assert service["spec"]["selector"].items() <= labels.items()
    assert {p["targetPort"] for p in service["spec"]["ports"]} == set(ports)
    monitor = resources[("PodMonitor", "tritonllm-server")]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["metrics", "openai"]
    assert monitor["spec"]["podMetricsEndpoints"][0]["path"] == "/metrics"


def _saturation_rule() -> dict:
    rule_doc = _base()[("PrometheusRule", "tritonllm-saturation")]
    rules = [r for g in rule_doc["spec"]["groups"] for r in g["rules"]]
    assert len(rules) == 1 and rules[0]["record"] == "tritonllm:saturation:ratio"
    return rules[0]


def test_hpa_reads_the_metric_the_adapter_serves_from_the_recorded_rule():
    resources = _base()
    rule = _saturation_rule()
    adapter = yaml.safe_load(resources[("ConfigMap", "tritonllm-adapter-config")]["data"]["config.yaml"])
    [adapter_rule] = adapter["rules"]
    assert adapter_rule["seriesQuery"].startswith(rule["record"] + "{")
    assert re.fullmatch(adapter_rule["name"]["matches"], rule["record"])
    assert adapter_rule["resources"]["overrides"]["pod"]["resource"] == "pod"
    hpa = resources[("HorizontalPodAutoscaler", "tritonllm-server")]
    [metric] = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == adapter_rule["name"]["as"]
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) in resources
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 60


def test_saturation_rule_reads_metrics_a_live_server_exports(triton_server):
    """The rule's inputs, read from the real server's metrics page (not a list typed twice), and
    the rule's arithmetic on those values: an idle server is at 0."""
    rule = _saturation_rule()
    page = requests.get(triton_server.metrics_url, timeout=10).text
    used = set(re.findall(r"\b(tritonllm_[a-z_]+)\{", rule["expr"]))
    assert used == {"tritonllm_num_requests_running", "tritonllm_num_requests_waiting", "tritonllm_num_slots"}
    values = {}
    for name in used:
        match = re.search(rf'^{name}{{[^}}]*model="llm_inflight"[^}}]*}} (\S+)$', page, re.M)
        assert match, f"{name} is not on the live server's metrics page"
        values[name] = float(match.group(1))
    assert values["tritonllm_num_slots"] >= 1
    saturation = (values["tritonllm_num_requests_running"] + values["tritonllm_num_requests_waiting"]) \
        / values["tritonllm_num_slots"]
    assert saturation >= 0
