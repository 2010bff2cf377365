"""deploy/k8s/overlays/fleet: the base plus an SMG gateway in front of the Sluice pods. The rendered
overlay validates strictly against the Kubernetes schemas, and the gateway's command line (parsed by
smg's own parser) finds the Sluice pods (label, namespace, gRPC port) with the routing, health checks
and retries docs/FLEET.md promises; its probes and Service use the ports it listens on."""

from __future__ import annotations

import os
from typing import Any

import kubernetes_validate
import pytest
from deploy_facts import parse_sluice_args
from kustomize_render import render
from smg.launch_router import parse_router_args
from toolchains import REPO

OVERLAY = os.path.join(REPO, "deploy", "k8s", "overlays", "fleet")
DOCKERFILE = os.path.join(REPO, "deploy", "Dockerfile.smg")


@pytest.fixture(scope="module")
def resources() -> dict[tuple[str, str], dict[str, Any]]:
    docs = render(OVERLAY)
    by_name = {(doc["kind"], doc["metadata"]["name"]): doc for doc in docs}
    assert len(by_name) == len(docs), "one resource of each kind and name"
    return by_name


def _container(resources, name: str) -> dict[str, Any]:
    (only,) = resources[("Deployment", name)]["spec"]["template"]["spec"]["containers"]
    return only


def _smg_args(container: dict[str, Any]) -> Any:
    args = container["args"]
    assert args[0] == "launch"
    # Kubernetes expands $(POD_NAMESPACE) from the container's env before smg sees it.
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    return parse_router_args([a.replace("$(POD_NAMESPACE)", "default") for a in args[1:]])


def test_the_overlay_validates_strictly_and_keeps_the_base(resources) -> None:
    version = kubernetes_validate.latest_version()
    assert sorted(resources) == [
        ("Deployment", "sluice"),
        ("Deployment", "smg"),
        ("HorizontalPodAutoscaler", "sluice"),
        ("PodDisruptionBudget", "sluice"),
        ("Role", "smg-pod-discovery"),
        ("RoleBinding", "smg-pod-discovery"),
        ("Service", "sluice"),
        ("Service", "smg"),
        ("ServiceAccount", "smg"),
    ]
    for doc in resources.values():
        kubernetes_validate.validate(doc, version, strict=True)
    assert _container(resources, "smg")["image"] == "sluice-smg:1.13.0"
    assert _container(resources, "sluice")["image"] == "sluice:latest"


def test_the_gateway_discovers_the_sluice_pods_on_their_grpc_port(resources) -> None:
    args = _smg_args(_container(resources, "smg"))
    sluice = _container(resources, "sluice")
    sluice_args = parse_sluice_args(sluice["args"])
    pod_labels = resources[("Deployment", "sluice")]["spec"]["template"]["metadata"]["labels"]
    assert args.service_discovery
    assert args.selector and args.selector.items() <= pod_labels.items()
    assert args.service_discovery_port == sluice_args.port
    assert args.service_discovery_namespace == "default"
    assert not args.worker_urls


def test_the_gateway_routes_cache_aware_and_leaves_a_draining_pod_fast(resources) -> None:
    args = _smg_args(_container(resources, "smg"))
    sluice_args = parse_sluice_args(_container(resources, "sluice")["args"])
    assert args.policy == "cache_aware"
    assert sluice_args.kv_events  # the pods' prefix-cache events: what cache_aware routes on
    assert args.health_failure_threshold == 1
    # SMG notices a draining pod within one health interval, far within the drain's grace period.
    assert args.health_check_interval_secs * args.health_failure_threshold < sluice_args.grace_period / 5
    # Retries of calls refused (UNAVAILABLE) by a draining pod outlast the health interval.
    backoff_ms, total_ms = args.retry_initial_backoff_ms, 0.0
    for _ in range(args.retry_max_retries - 1):
        total_ms += backoff_ms
        backoff_ms = min(backoff_ms * args.retry_backoff_multiplier, args.retry_max_backoff_ms)
    assert total_ms * (1 - args.retry_jitter_factor) > args.health_check_interval_secs * 1000
    assert not args.disable_retries


def test_the_gateway_can_list_pods_and_serves_its_ports(resources) -> None:
    smg = resources[("Deployment", "smg")]
    container = _container(resources, "smg")
    args = _smg_args(container)
    pod_spec = smg["spec"]["template"]["spec"]
    assert pod_spec["serviceAccountName"] == "smg"
    binding = resources[("RoleBinding", "smg-pod-discovery")]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "smg"}]
    assert binding["roleRef"]["name"] == "smg-pod-discovery"
    (rule,) = resources[("Role", "smg-pod-discovery")]["rules"]
    assert rule["resources"] == ["pods"] and {"list", "watch"} <= set(rule["verbs"])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": args.port, "metrics": args.prometheus_port}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readiness", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/liveness", "port": "http"}
    service = resources[("Service", "smg")]
    assert service["spec"]["selector"].items() <= smg["spec"]["template"]["metadata"]["labels"].items()
    assert {p["targetPort"] for p in service["spec"]["ports"]} == set(ports)
    # The gateway's own drain fits in the pod's termination grace period.
    assert pod_spec["terminationGracePeriodSeconds"] > args.shutdown_grace_period_secs


def test_the_gateway_image_installs_the_pinned_smg() -> None:
    with open(os.path.join(REPO, "pyproject.toml")) as f:
        pinned = [line for line in f if line.startswith("fleet = ")]
    assert pinned == ['fleet = ["smg==1.13.0"]\n']
    with open(DOCKERFILE) as f:
        text = f.read()
    assert "ARG SMG_VERSION=1.13.0" in text
    assert 'RUN pip install --no-cache-dir "smg==${SMG_VERSION}"' in text
    assert "USER 10001" in text


def test_the_renderer_refuses_a_base_that_holds_its_overlay(tmp_path) -> None:
    """As kustomize does ("cycle detected"): the fleet overlay once sat inside its base, deploy/k8s, and
    `kubectl apply -k` refused it while this renderer rendered it."""
    overlay = tmp_path / "k8s" / "overlays" / "fleet"
    overlay.mkdir(parents=True)
    (tmp_path / "k8s" / "kustomization.yaml").write_text("resources: []\n")
    (overlay / "kustomization.yaml").write_text("resources:\n  - ../..\n")
    with pytest.raises(ValueError, match=r"^\.\./\.\.: a base may not contain the kustomization"):
        render(str(overlay))
