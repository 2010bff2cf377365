"""deploy/k8s/base and deploy/Dockerfile: the rendered kustomization validates against the Kubernetes schemas,
and every value that must match the server (ports, health service, grace period, metric names, CLI flags)
does; the image's health probe answers like the server's health service."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from typing import Any

import kubernetes_validate
import pytest
from deploy_facts import exported_sample_names, parse_sluice_args
from kustomize_render import render
from service_harness import ServerThread, tiny_engine_config
from toolchains import REPO

from sluice.engine.frontend.core_client import CORE_EXIT_TIMEOUT_S
from sluice.service.server import ABORT_MARGIN_S, GOAWAY_SETTLE_S, INFERENCE_SERVICE

K8S_DIR = os.path.join(REPO, "deploy", "k8s", "base")
DOCKERFILE = os.path.join(REPO, "deploy", "Dockerfile")
HEALTH_PROBE = os.path.join(REPO, "deploy", "grpc_health_probe.py")
# kube-apiserver SIGKILLs at terminationGracePeriodSeconds: after the grace period the drain aborts the
# leftovers (their streams end within ABORT_MARGIN_S), lets the GOAWAY settle, then asks the core to exit
# and kills it after CORE_EXIT_TIMEOUT_S; a second to spare for the process to end.
MIN_STOP_MARGIN_SECONDS = ABORT_MARGIN_S + GOAWAY_SETTLE_S + CORE_EXIT_TIMEOUT_S + 1


@pytest.fixture(scope="module")
def resources() -> dict[str, dict[str, Any]]:
    docs = render(K8S_DIR)
    by_kind = {doc["kind"]: doc for doc in docs}
    assert len(by_kind) == len(docs), "one resource of each kind"
    return by_kind


@pytest.fixture(scope="module")
def container(resources) -> dict[str, Any]:
    (only,) = resources["Deployment"]["spec"]["template"]["spec"]["containers"]
    return only


def test_manifests_validate_strictly_against_the_kubernetes_schemas(resources) -> None:
    version = kubernetes_validate.latest_version()
    assert sorted(resources) == ["Deployment", "HorizontalPodAutoscaler", "PodDisruptionBudget", "Service"]
    for doc in resources.values():
        kubernetes_validate.validate(doc, version, strict=True)


def test_renderer_applies_the_image_override(container) -> None:
    assert container["image"] == "sluice:latest"


def test_probes_are_grpc_health_checks_on_the_serving_port(container) -> None:
    args = parse_sluice_args(container["args"])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": args.port, "metrics": args.metrics_port}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"] == {"port": args.port, "service": INFERENCE_SERVICE}, probe
        assert not {"httpGet", "tcpSocket", "exec"} & set(container[probe]), probe


def test_termination_grace_outlasts_the_server_drain(resources, container) -> None:
    """preStop keeps the pod serving while it leaves the endpoints; then SIGTERM starts the drain
    (NOT_SERVING, GOAWAY, --grace-period); the kubelet's SIGKILL must come after all of it."""
    args = parse_sluice_args(container["args"])
    grace = resources["Deployment"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pre_stop >= 1
    assert grace >= pre_stop + args.grace_period + MIN_STOP_MARGIN_SECONDS
    liveness = container["livenessProbe"]
    # Liveness must not kill a draining (NOT_SERVING) pod before its drain ends.
    assert liveness["periodSeconds"] * liveness["failureThreshold"] > pre_stop + args.grace_period


def test_connections_age_out_so_new_pods_get_traffic(container) -> None:
    args = parse_sluice_args(container["args"])
    assert 0 < args.max_connection_age <= 600
    assert args.max_connection_age_grace >= 0


def test_gpu_and_read_only_model_volume(resources, container) -> None:
    pod = resources["Deployment"]["spec"]["template"]["spec"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    args = parse_sluice_args(container["args"])
    (mount,) = container["volumeMounts"]
    assert (mount["mountPath"], mount["readOnly"]) == (args.model, True)
    assert args.served_model_name == "llm"  # not the mount's name, "models", which SMG would route by
    (volume,) = pod["volumes"]
    assert volume["name"] == mount["name"] and volume["persistentVolumeClaim"]["readOnly"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True


def test_service_is_headless_and_selects_the_pods(resources, container) -> None:
    service, deployment = resources["Service"], resources["Deployment"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"].items() <= pod_labels.items()
    container_ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for port in service["spec"]["ports"]:
        assert container_ports[port["targetPort"]] == port["port"]


def test_disruption_budget_and_autoscaler_target_the_deployment(resources) -> None:
    deployment, pdb, hpa = (
        resources[k] for k in ("Deployment", "PodDisruptionBudget", "HorizontalPodAutoscaler")
    )
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pdb["spec"]["maxUnavailable"] == 1
    assert hpa["apiVersion"] == "autoscaling/v2"
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == "sluice_num_requests_waiting"
    assert "sluice_num_requests_waiting" in exported_sample_names()


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) pairs with line continuations joined and comments dropped."""
    with open(DOCKERFILE) as f:
        text = re.sub(r"\\\n", " ", f.read())
    lines = [line.strip() for line in text.splitlines()]
    return [tuple(line.split(None, 1)) for line in lines if line and not line.startswith("#")]


def test_dockerfile_runs_the_cli_as_non_root_with_a_grpc_healthcheck() -> None:
    instructions = dockerfile_instructions()
    values = {name: rest for name, rest in instructions}
    froms = [rest for name, rest in instructions if name == "FROM"]
    build_args = dict(rest.split("=", 1) for name, rest in instructions if name == "ARG" and "=" in rest)
    assert froms == ["${CUDA_IMAGE}"] and build_args["CUDA_IMAGE"].startswith("nvidia/cuda:")
    assert build_args["CUDA_IMAGE"].endswith("-runtime-ubuntu24.04")
    assert json.loads(values["ENTRYPOINT"]) == ["sluice"]
    args = parse_sluice_args(json.loads(values["CMD"]))
    assert (args.model, args.port, args.metrics_port) == ("/models", 50051, 9400)
    assert values["EXPOSE"].split() == [str(args.port), str(args.metrics_port)]
    assert values["USER"].split(":")[0] not in ("0", "root")
    # that user builds the C++ CPU kernels in its own home (the installed package's directory is root's)
    envs = [rest for name, rest in instructions if name == "ENV"]
    assert f"SLUICE_CPU_BUILD_DIR={values['WORKDIR']}/.cache/sluice/cpu_extensions" in envs
    healthcheck = json.loads(values["HEALTHCHECK"].split("CMD", 1)[1])
    assert healthcheck == [
        "python",
        "/opt/sluice/bin/grpc_health_probe.py",
        "--addr",
        f"localhost:{args.port}",
    ]


def test_dockerfile_copies_only_what_the_dockerignore_lets_through() -> None:
    with open(DOCKERFILE + ".dockerignore") as f:
        allowed = {line[1:].removesuffix("/**") for line in f.read().split() if line.startswith("!")}
    copied = []
    for name, rest in dockerfile_instructions():
        if name == "COPY":
            copied += rest.split()[:-1]
    assert copied and set(copied) <= allowed
    for path in copied:
        assert os.path.exists(os.path.join(REPO, path)) or path == "README.md", path


def probe(target: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, HEALTH_PROBE, "--addr", target], capture_output=True, text=True, timeout=60
    )


def test_health_probe_follows_the_server_lifecycle(llama_dir: str) -> None:
    server = ServerThread(tiny_engine_config(llama_dir)).start(attach=False)
    try:
        loading = probe(server.target)
        assert (loading.returncode, loading.stdout) == (
            1,
            f"{server.target} {INFERENCE_SERVICE}: NOT_SERVING\n",
        )
        server.attach()
        ready = probe(server.target)
        assert (ready.returncode, ready.stdout) == (0, f"{server.target} {INFERENCE_SERVICE}: SERVING\n")
    finally:
        server.stop()
    gone = probe(server.target)
    assert (gone.returncode, gone.stdout) == (1, f"{server.target} {INFERENCE_SERVICE}: UNAVAILABLE\n")
